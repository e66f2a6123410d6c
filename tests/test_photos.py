"""The photo pipeline's library (``photos``) as modules, without a detector: the work folder and the packing of
saved results. The whole flow, with MTCNN, is tests/test_prepare_faces.py."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torchvision.io import encode_jpeg

from dataset import MXFaceDataset
from dataset.verification_set import load_bin
from photos import pack as pack_module
from photos.listing import Photo
from photos.pack import HOLDOUT, OUTPUT_FILES, STAMP, pack
from photos.work import WORK, WorkFolder, read_json
from utils.cli import BadData

SETTINGS = {"multi": "largest", "min_score": 0.9, "min_face_size": 40.0, "detect_size": 640, "batch_size": 2,
            "chunk_size": 2, "device": "cpu"}


def _stamp(**changes) -> dict:
    return {"input": "/photos", "settings": SETTINGS, "photos": 5, "fingerprint": "f", **changes}


def test_the_work_folder_keeps_complete_chunks_of_the_same_work_and_drops_other_work(tmp_path, caplog):
    work = WorkFolder(tmp_path, _stamp())
    work.open()
    assert list(work.chunks()) == [0, 1, 2] and list(work.photo_range(2)) == [4]
    work.save(1, [{"status": "kept"}, {"status": "no_face"}])
    again = WorkFolder(tmp_path, _stamp())
    with caplog.at_level("INFO", logger="photos"):
        again.open()
    assert again.done_chunks() == [1] and again.done_photos() == 2
    assert "continuing: 2 of 5 photos already done" in caplog.text
    other = WorkFolder(tmp_path, _stamp(fingerprint="g"))  # other photos: the saved chunk is not theirs
    other.open()
    assert other.done_chunks() == [] and read_json(tmp_path / WORK / "work.json")["fingerprint"] == "g"
    for chunk in other.chunks():
        other.save(chunk, [{"status": "kept"}] * len(other.photo_range(chunk)))
    assert len(other.load()) == 5
    torch.save({"format": 1, "results": []}, tmp_path / WORK / "chunk-000000.pt")
    with pytest.raises(ValueError, match="chunk-000000.pt: not a chunk of this work"):
        other.load()


def _results(identities: list[str]) -> tuple[list[Photo], list[dict]]:
    """A kept face (given landmarks, no score) per photo, one photo per entry of ``identities``."""
    photos, results = [], []
    for k, identity in enumerate(identities):
        face = torch.full((3, 112, 112), 20 * k, dtype=torch.uint8)
        photos.append(Photo(Path(f"/photos/{identity}/{k}.jpg"), f"{identity}/{k}.jpg", identity))
        fields = {"score": None, "box": None, "points": [1.0] * 10}
        results.append({"status": "kept", "faces": None, "reason": "landmarks from --landmarks",
                        "crops": [{"jpeg": encode_jpeg(face, quality=95), **fields}], **fields})
    return photos, results


def _packed(out: Path) -> dict[str, bytes]:
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def test_pack_writes_the_output_with_its_stamp_and_a_failure_leaves_the_earlier_one(tmp_path, monkeypatch):
    photos, results = _results(["a", "a", "b", "b", "c", "c"])
    (tmp_path / WORK).mkdir()
    summary = pack(tmp_path, photos, results, 2, 3000, 0, {"input": "/photos"})
    assert summary.startswith("prepare_faces: 6 photos: 6 kept") and "1 identity in train.rec (2 faces" in summary
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(OUTPUT_FILES)  # the work folder is gone
    assert read_json(tmp_path / STAMP) == {"input": "/photos", "summary": summary}
    assert len(MXFaceDataset(tmp_path)) == 2 and load_bin(tmp_path / HOLDOUT).issame == [True, False] * 2
    before = _packed(tmp_path)

    # A failure while packing (here the preview) leaves the earlier output, stamp included, and no staging folder.
    def broken(*args, **kwargs):
        raise OSError("disk full")

    (tmp_path / WORK).mkdir()
    monkeypatch.setattr(pack_module, "write_preview", broken)
    with pytest.raises(OSError, match="disk full"):
        pack(tmp_path, photos, results, 0, 3000, 0, {"input": "/photos"})
    assert {k: v for k, v in _packed(tmp_path).items() if not k.startswith(WORK)} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*OUTPUT_FILES, WORK])
    monkeypatch.undo()
    # Without --holdout the earlier holdout.bin goes: it is not of this output.
    pack(tmp_path, photos, results, 0, 3000, 0, {"input": "/photos"})
    assert not (tmp_path / HOLDOUT).exists() and MXFaceDataset(tmp_path).num_classes == 3

    (tmp_path / WORK).mkdir()
    with pytest.raises(BadData, match="--holdout 3: 3 identities kept a face; holding out 3 leaves none"):
        pack(tmp_path, photos, results, 3, 3000, 0, {"input": "/photos"})
