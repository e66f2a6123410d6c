"""The photo pipeline's library (``photos``) as modules, without MTCNN: the work folder of detections, a re-run that
only decides, the policy and the model's matching over faces made up here, copies of one photo, the holdout's pairs,
the packing of outcomes, and the listing of every format Pillow reads. The whole flow, with MTCNN, is
tests/test_prepare_faces.py."""
from __future__ import annotations

import io
import logging
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.io import encode_jpeg

from alignment import FacePolicy, decide
from dataset import MXFaceDataset
from dataset.verification_set import load_bin
from photos import pack as pack_module
from photos import prepare as prepare_module
from photos.duplicates import find_copies, thumbnail
from photos.holdout import form_pairs
from photos.listing import Photo, list_photo_folder, photo_suffixes
from photos.matching import check_identities
from photos.pack import ASIDE, HOLDOUT, OUTPUT_FILES, STAMP, check_out_dir, pack
from photos.pipeline import Settings
from photos.policy import FaceCrop, Outcome
from photos.prepare import prepare
from photos.report import REPORT_COLUMNS
from photos.work import WORK, DetectorSettings, WorkFolder, read_json
from utils.cli import BadData, UsageError

SETTINGS = DetectorSettings(640, 20.0, "cpu")


def _jpeg(value: int, size: int = 112) -> bytes:
    return encode_jpeg(torch.full((3, size, size), value, dtype=torch.uint8), quality=95).numpy().tobytes()


# ------------------------------------------------------------------------------------------------ the work folder

def test_the_work_folder_keeps_each_photo_s_detections_by_content_and_detector_settings(tmp_path, caplog):
    work = WorkFolder(tmp_path, SETTINGS)
    work.open()
    entry = {"size": [10, 20], "thumb": bytes(32 * 32), "faces": []}
    assert not work.has("ab" * 32) and work.load("ab" * 32) is None
    work.save("ab" * 32, entry)
    again = WorkFolder(tmp_path, SETTINGS)
    again.open()
    assert again.load("ab" * 32)["size"] == [10, 20]
    # Other detector settings have their own entries beside these, which stay.
    other = WorkFolder(tmp_path, DetectorSettings(320, 20.0, "cpu"))
    other.open()
    assert other.load("ab" * 32) is None and other.dir != work.dir and work.has("ab" * 32)
    assert read_json(other.dir / "settings.json")["detect_size"] == 320
    # An entry that cannot be read is made again, not an error.
    work.path("cd" * 32).parent.mkdir(parents=True)
    work.path("cd" * 32).write_bytes(b"half a file")
    assert work.load("cd" * 32) is None
    # The work of the earlier format (one run's chunks) is removed.
    old = tmp_path / "old"
    (old / WORK).mkdir(parents=True)
    (old / WORK / "work.json").write_text('{"settings": {}, "photos": 5}')
    (old / WORK / "chunk-000000.pt").write_bytes(b"x")
    with caplog.at_level(logging.INFO, logger="photos"):
        WorkFolder(old, SETTINGS).open()
    assert not (old / WORK / "chunk-000000.pt").exists() and "earlier version" in caplog.text


class _FakeDetector:
    """Stands for FaceDetector: one face at fixed points in every photo, or an error when ``broken``."""

    device = torch.device("cpu")

    def __init__(self, broken: bool = False) -> None:
        self.broken, self.calls = broken, 0

    def detect(self, images):
        from alignment import ARCFACE_TEMPLATE, Face

        if self.broken:
            raise AssertionError("detection ran")
        self.calls += len(images)
        return [[Face((30.0, 40.0, 90.0, 110.0), 0.95, ARCFACE_TEMPLATE * 0.6 + 20)] for _ in images]


def _noise_photos(root: Path, names: list[str]) -> Path:
    for k, name in enumerate(names):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        pixels = np.random.default_rng(k).integers(0, 256, (120, 100, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(root / name)
    return root


def test_a_rerun_with_another_policy_detects_nothing(tmp_path, monkeypatch):
    """The detections are kept: another --min-score, --min-face-size, --multi, holdout or seed only decides and
    packs (the detector raises if it is asked), and an unchanged run gives the same bytes."""
    photos = _noise_photos(tmp_path / "photos", ["a/1.png", "a/2.png", "b/1.png", "b/2.png", "c/1.png"])
    detector = _FakeDetector()
    monkeypatch.setattr(prepare_module, "make_detector", lambda settings, device: detector)
    out = tmp_path / "out"

    def run(**changes) -> str:
        options = {"multi": "match", "min_score": 0.9, "min_face_size": 40.0, "detect_size": 640,
                   "batch_size": 2, "device": "cpu", **changes}
        return prepare(photos, out, Settings(**options), torch.device("cpu"))

    assert run().startswith("prepare_faces: 5 photos: 5 kept") and detector.calls == 5
    first = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    monkeypatch.setattr(prepare_module, "make_detector", lambda settings, device: _FakeDetector(broken=True))
    with pytest.raises(BadData, match="no face kept"):
        run(min_score=0.99)  # the faces score 0.95: none counted, and no detection ran
    assert run(min_face_size=30.0, multi="largest").startswith("prepare_faces: 5 photos: 5 kept")
    assert "held out" in prepare(photos, out, Settings("skip", 0.5, 20.0, 640, 2, "cpu"), torch.device("cpu"),
                                 holdout=2, seed=3)
    run()
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == first
    # A smaller --min-face-size than MTCNN's 20 px enlarges small photos: that is another detection.
    with pytest.raises(AssertionError, match="detection ran"):
        run(min_face_size=10.0)


def test_on_a_gpu_the_main_process_detects_what_the_workers_read(tmp_path, monkeypatch):
    """A detector on a GPU (here one that says so) gets the photos read by the DataLoader, in batches of
    --batch-size, in the main process; the output is the CPU path's."""
    photos = _noise_photos(tmp_path / "photos", ["a/1.png", "a/2.png", "b/1.png", "b/2.png", "c/1.png"])
    class Counted(_FakeDetector):
        def __init__(self, device: str) -> None:
            super().__init__()
            self.device, self.batches = torch.device(device), []

        def detect(self, images):
            self.batches.append(len(images))
            return super().detect(images)

    outputs = {}
    for device in ("cpu", "cuda"):
        detector = Counted(device)
        monkeypatch.setattr(prepare_module, "make_detector", lambda settings, device, made=detector: made)
        out = tmp_path / device
        prepare(photos, out, Settings("match", 0.9, 40.0, 640, 2, device), torch.device("cpu"))
        outputs[device] = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != STAMP}
        assert detector.batches == ([1] * 5 if device == "cpu" else [2, 2, 1]), (device, detector.batches)
    assert outputs["cpu"] == outputs["cuda"]


# ------------------------------------------------------------------------------------------------ the policy

def _face(box, score: float = 0.99):
    from alignment import Face

    return Face(tuple(float(v) for v in box), score, np.zeros((5, 2)))


def test_several_faces_are_left_out_without_a_model_unless_asked():
    size = (400, 600)
    big, small = _face((0, 0, 100, 100)), _face((500, 0, 545, 45))
    status, keep, shown, counted, reason = decide([big, small], size, FacePolicy())  # --multi match, the default
    assert (status, keep, counted) == ("several_faces", [], 2) and shown is big
    assert reason == ("2 faces: telling which is the identity's needs a recognition model (--weights MODEL), or "
                      "--multi largest")
    assert decide([big, small], size, FacePolicy("largest")).keep == [big]
    assert decide([big], size, FacePolicy()).status == "kept"


# --------------------------------------------------------------------------------------- the model's matching

def _crop(person: int, k: int) -> FaceCrop:
    """A face of ``person`` (the crop's grey level encodes it for the fake model below)."""
    return FaceCrop((0.0, 0.0, 60.0, 60.0), 0.99, np.full((5, 2), float(k)), _jpeg(40 * person + 20))


def _fake_embed(jpegs) -> np.ndarray:
    """A deterministic "model": the person is the crop's grey level; each person a direction of its own."""
    people = [int(_grey(j) // 40) for j in jpegs]
    out = np.zeros((len(jpegs), 8))
    for row, person in enumerate(people):
        out[row, person] = 1.0
    return out


def _grey(jpeg: bytes) -> float:
    return float(np.asarray(Image.open(io.BytesIO(jpeg))).mean())


def test_the_model_keeps_the_identity_s_face_of_a_group_photo_and_marks_who_matches_no_one():
    photos = [Photo(Path(f"/p/{name}"), name, name.split("/")[0]) for name in [
        "ann/1.jpg", "ann/2.jpg", "ann/3.jpg", "ann/group.jpg", "ann/strangers.jpg", "ann/wrong.jpg",
        "bob/1.jpg", "bob/party.jpg", "cat/1.jpg", "cat/group.jpg", "dan/group.jpg"]]
    ann, bob, cat, other = 1, 2, 3, 4

    def single(person, k):
        return Outcome("kept", "", 1, kept=[_crop(person, k)])

    def group(*people):
        return Outcome("several_faces", "2 faces", len(people), candidates=[_crop(p, k) for k, p in enumerate(people)])

    largest = group(other, bob)  # --multi largest kept the first face: a stranger
    largest.status, largest.kept = "kept", [largest.candidates[0]]
    outcomes = [single(ann, 0), single(ann, 1), single(ann, 2), group(other, ann, bob), group(other, bob),
                single(other, 3), single(bob, 0), largest, single(cat, 0), group(ann, cat), group(ann, bob)]
    check_identities(photos, outcomes, _fake_embed, threshold=0.3)
    by_name = {p.name: o for p, o in zip(photos, outcomes)}
    # The group photo keeps ann's face, the second of three; its similarity to her photos is in the outcome.
    kept = by_name["ann/group.jpg"]
    assert kept.status == "kept" and _grey(kept.kept[0].jpeg) // 40 == ann
    assert kept.kept[0].similarity == pytest.approx(1.0)  # her three photos that match each other
    assert kept.reason == "the face of 3 that matches ann's 3 photos with one face (similarity 1.000)"
    assert by_name["ann/strangers.jpg"].status == "no_match" and by_name["ann/strangers.jpg"].kept == []
    assert "none of the 2 faces matches ann's 3 photos with one face" in by_name["ann/strangers.jpg"].reason
    # A photo of someone else in ann's folder: far from her other photos, left out; each of hers is near the sum
    # of the others (two of hers and the stranger: 2 / sqrt(5)).
    wrong = by_name["ann/wrong.jpg"]
    assert wrong.status == "no_match" and wrong.shown.similarity == pytest.approx(0.0)
    assert wrong.reason == "far from the other 3 photos of ann: similarity 0.000, below --match-threshold 0.3"
    assert [by_name[f"ann/{k}.jpg"].kept[0].similarity for k in (1, 2, 3)] == [pytest.approx(2 / 5 ** 0.5)] * 3
    # --multi largest kept a stranger's face: the model leaves it out.
    assert by_name["bob/party.jpg"].status == "no_match" and "the face kept" in by_name["bob/party.jpg"].reason
    # One reference photo: nothing to compare it with, but it tells cat's face in her group photo.
    assert by_name["cat/1.jpg"].kept[0].similarity is None and by_name["cat/group.jpg"].status == "kept"
    assert _grey(by_name["cat/group.jpg"].kept[0].jpeg) // 40 == cat
    # No photo of dan with one face: his group photo stays left out, and says why.
    assert by_name["dan/group.jpg"].status == "several_faces"
    assert by_name["dan/group.jpg"].reason == "2 faces, and no photo of dan with one face to tell which is theirs"


# ------------------------------------------------------------------------------------------ copies of a photo

def _photo(**changes) -> Image.Image:
    from skimage.data import astronaut

    options = {"at": (40, 20), "tint": (1.0, 1.0, 1.0), "size": (640, 560)}
    options.update(changes)
    face = Image.fromarray((np.asarray(astronaut(), np.float32) * np.float32(options["tint"])).clip(0, 255)
                           .astype(np.uint8))
    canvas = Image.new("RGB", options["size"], (90, 90, 90))
    canvas.paste(face, options["at"])
    return canvas


def _thumb(image: Image.Image) -> bytes:
    return thumbnail(torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1))


def test_copies_are_the_same_file_or_the_same_picture_re_encoded_resized_or_filtered():
    pytest.importorskip("skimage")
    original = _photo()
    reencoded = Image.open(io.BytesIO(_encoded(original, quality=50)))
    copies = {"original": original, "re-encoded": reencoded, "half size": original.resize((320, 280)),
              "tinted": _photo(tint=(1.15, 0.95, 0.8)),
              "shifted 10 px": _photo(at=(50, 20)), "cropped": original.crop((0, 0, 560, 560)),
              "another": _photo(at=(140, 60), size=(700, 600))}
    names = list(copies)
    thumbs = [_thumb(image) for image in copies.values()]
    sizes = [(image.height, image.width) for image in copies.values()]
    keys = [f"k{i}" for i in range(len(names))]
    found = dict(zip(names, find_copies(keys, thumbs, sizes)))
    assert found == {"original": None, "re-encoded": 0, "half size": 0, "tinted": 0, "shifted 10 px": None,
                     "cropped": None, "another": None}
    # The same content is a copy whatever its thumbnail; photos that could not be read copy nothing.
    assert find_copies(["a", "b", "a", None], [None, None, None, None], [None] * 4) == [None, None, 0, None]


def _encoded(image: Image.Image, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, "JPEG", **options)
    return out.getvalue()


def test_holdout_pairs_are_never_two_copies_of_one_photo():
    groups = [[0, 1, 2], [3, 4], [5, 6]]
    copy_of = [0, 0, 2, 0, 4, 5, 6]  # 1 and 3 copy 0 (3 in another identity)
    pairs = form_pairs(groups, 3000, np.random.default_rng(0), copy_of)
    assert pairs and all(copy_of[a] != copy_of[b] for a, b, _ in pairs)
    assert {(a, b) for a, b, same in pairs if same} == {(0, 2), (1, 2), (3, 4), (5, 6)}
    # Without copies the pairs are what they were.
    assert form_pairs(groups, 3000, np.random.default_rng(0)) == form_pairs(groups, 3000, np.random.default_rng(0),
                                                                            list(range(7)))


# ------------------------------------------------------------------------------------------------ the output

def _outcomes(identities: list[str]) -> tuple[list[Photo], list[Outcome]]:
    """A kept face (given landmarks, no score) per photo, one photo per entry of ``identities``."""
    photos, outcomes = [], []
    for k, identity in enumerate(identities):
        photos.append(Photo(Path(f"/photos/{identity}/{k}.jpg"), f"{identity}/{k}.jpg", identity))
        face = FaceCrop(None, None, np.ones((5, 2)), _jpeg(20 * k))
        outcomes.append(Outcome("kept", "landmarks from --landmarks", None, kept=[face]))
    return photos, outcomes


def _packed(out: Path) -> dict[str, bytes]:
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def test_pack_writes_the_output_with_its_stamp_and_a_failure_leaves_the_earlier_one(tmp_path, monkeypatch):
    photos, outcomes = _outcomes(["a", "a", "b", "b", "c", "c"])
    summary = pack(tmp_path, photos, outcomes, 2, 3000, 0, {"input": "/photos"})
    assert summary.startswith("prepare_faces: 6 photos: 6 kept") and "1 identity in train.rec (2 faces" in summary
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(OUTPUT_FILES)
    assert read_json(tmp_path / STAMP) == {"input": "/photos", "summary": summary}
    assert len(MXFaceDataset(tmp_path)) == 2 and load_bin(tmp_path / HOLDOUT).issame == [True, False] * 2
    assert (tmp_path / "report.csv").read_text().splitlines()[0] == ",".join(REPORT_COLUMNS)
    before = _packed(tmp_path)

    # A failure while packing (here the preview) leaves the earlier output, stamp included, and no staging folder.
    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(pack_module, "write_preview", broken)
    with pytest.raises(OSError, match="disk full"):
        pack(tmp_path, photos, outcomes, 0, 3000, 0, {"input": "/photos"})
    assert _packed(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == sorted(OUTPUT_FILES)
    monkeypatch.undo()
    # Without --holdout the earlier holdout.bin goes: it is not of this output.
    pack(tmp_path, photos, outcomes, 0, 3000, 0, {"input": "/photos"})
    assert not (tmp_path / HOLDOUT).exists() and MXFaceDataset(tmp_path).num_classes == 3
    with pytest.raises(BadData, match="--holdout 3: 3 identities kept a face; holding out 3 leaves none"):
        pack(tmp_path, photos, outcomes, 3, 3000, 0, {"input": "/photos"})
    # Two copies of one photo are one photo for the holdout: b's two faces cannot make a pair.
    outcomes[3].duplicate_of = 2
    with pytest.raises(BadData, match="--holdout 3: only 2 identities kept the 2 or more faces"):
        pack(tmp_path, photos, outcomes, 3, 3000, 0, {"input": "/photos"})


def test_overwrite_moves_another_dataset_s_files_aside(tmp_path, caplog):
    """--overwrite over another dataset: its files (a .bin training would take for a verification set among
    them) go into OUT_DIR/replaced, named in one line; without --overwrite any foreign file is refused."""
    out, source = tmp_path / "out", tmp_path / "photos"
    source.mkdir()
    out.mkdir()
    for name in ("train.rec", "train.idx", "property", "syn_easy.bin", "synthetic.json"):
        (out / name).write_bytes(name.encode())
    with pytest.raises(UsageError, match=r"holds another dataset \(train.rec, train.idx, property, syn_easy.bin, "
                                         r"synthetic.json\) not made by prepare_faces.py"):
        check_out_dir(out, source, overwrite=False)
    aside = check_out_dir(out, source, overwrite=True)
    photos, outcomes = _outcomes(["a", "b"])
    with caplog.at_level(logging.INFO, logger="photos"):
        pack(out, photos, outcomes, 0, 3000, 0, {"input": str(source.resolve())}, aside)
    assert sorted(p.name for p in out.iterdir()) == sorted([n for n in OUTPUT_FILES if n != HOLDOUT] + [ASIDE])
    assert sorted(p.name for p in (out / ASIDE).iterdir()) == sorted(aside)
    assert (out / ASIDE / "syn_easy.bin").read_bytes() == b"syn_easy.bin"
    assert f"--overwrite: 5 entries of another dataset moved from {out} into {out / ASIDE}" in caplog.text
    # Now it is this input's output: no flag needed, and a file the user adds beside it stays.
    (out / "lfw.bin").write_bytes(b"mine")
    assert check_out_dir(out, source, overwrite=False) == []
    # A lone foreign .bin is another dataset's file too.
    lone = tmp_path / "lone"
    lone.mkdir()
    (lone / "syn_hard.bin").write_bytes(b"x")
    with pytest.raises(UsageError, match=r"\(syn_hard.bin\)"):
        check_out_dir(lone, source, overwrite=False)


# ------------------------------------------------------------------------------------------ the listing

def _save(root: Path, name: str, image: Image.Image, fmt: str) -> None:
    (root / name).parent.mkdir(parents=True, exist_ok=True)
    image.save(root / name, fmt)


def test_every_format_pillow_reads_is_a_photo_and_other_suffixes_are_decided_by_content(tmp_path, caplog):
    gray = Image.fromarray(np.random.default_rng(0).integers(0, 256, (112, 92), dtype=np.uint8))
    root = tmp_path / "faces"
    _save(root, "s1/1.pgm", gray, "PPM")  # an academic face set: folders of .pgm
    _save(root, "s1/2.ppm", gray.convert("RGB"), "PPM")
    _save(root, "s2/1.pbm", gray.convert("1"), "PPM")
    _save(root, "s2/IMG_0001", gray.convert("RGB"), "JPEG")  # no suffix: a JPEG by its content
    _save(root, "s2/scan.dat", gray, "PNG")
    (root / "s2" / "notes.txt").write_text("not a photo")
    (root / "s2" / "phone.heic").write_bytes(b"\0\0\0\x18ftypheic" + bytes(64))
    assert {".pgm", ".ppm", ".pbm", ".jpg", ".png", ".webp", ".tif"} <= set(photo_suffixes())
    with caplog.at_level(logging.INFO, logger="photos"):
        photos = list_photo_folder(root)
    assert [p.name for p in photos] == ["s1/1.pgm", "s1/2.ppm", "s2/1.pbm", "s2/IMG_0001", "s2/scan.dat"]
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["2 files ignored, not images Pillow reads (pillow-heif reads some of them: pip install "
                     "pillow-heif): s2/notes.txt, s2/phone.heic"], lines


def test_a_pillow_plugin_such_as_pillow_heif_is_registered_for_listing_and_reading(tmp_path, monkeypatch):
    """pillow-heif is optional; a stand-in that registers a format of its own shows that an installed plug-in's
    suffixes are listed and its files read."""
    from PIL import ImageFile

    from alignment import read_photo, register_plugins

    class Fake(ImageFile.ImageFile):
        format, format_description = "FAKEHEIF", "a stand-in for HEIF"

        def _open(self):
            self._mode, self._size = "L", (4, 3)
            self.tile = [ImageFile._Tile("raw", (0, 0, 4, 3), 8, ("L", 0, 1))]

    def register_heif_opener():
        Image.register_open(Fake.format, Fake, lambda prefix: prefix[:8] == b"FAKEHEIF")
        Image.register_extensions(Fake.format, [".heic"])

    monkeypatch.setitem(sys.modules, "pillow_heif", types.SimpleNamespace(register_heif_opener=register_heif_opener))
    register_plugins.cache_clear()
    try:
        assert register_plugins() == ("pillow-heif",) and ".heic" in photo_suffixes()
        (tmp_path / "a").mkdir()
        (tmp_path / "a" / "phone.heic").write_bytes(b"FAKEHEIF" + bytes(range(12)))
        assert [p.name for p in list_photo_folder(tmp_path)] == ["a/phone.heic"]
        assert read_photo(tmp_path / "a" / "phone.heic")[0].tolist() == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    finally:
        register_plugins.cache_clear()
        Image.OPEN.pop(Fake.format, None)
        Image.ID.remove(Fake.format)
        Image.EXTENSION.pop(".heic", None)
