"""One identity-folder rule (``dataset.identity_folders``) behind every reader of "a folder of identity folders":
training's image-folder dataset (and ``overlap``, which opens it through ``build_dataset``), ``make_rec
--images``, ``prepare_faces``' photo listing (``photos.listing``) and ``rec_info``'s folder check see the same
classes and files of a messy folder, and each names what it ignored in one line."""
from __future__ import annotations

import io
import logging
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dataset import ImageFolderDataset, MXFaceDataset, build_dataset
from dataset.identity_folders import identity_folders, is_ignored
from dataset.images import IMAGE_EXTENSIONS
from dataset.inspection import folder_info
from dataset.rec_from_images import list_image_folder
from photos.listing import list_photo_folder
from scripts.make_rec import main as make_rec_main
from scripts.rec_info import main as rec_info_main
from utils.cli import tool_messages

CLASSES = ["alice", "bob"]
FILES = ["alice/0.jpg", "alice/2020/2.jpg", "alice/2020/summer/3.png", "bob/1.jpg"]  # by class, then name
IGNORED = [".DS_Store", ".ipynb_checkpoints", "@eaDir", "Thumbs.db", "__MACOSX", "alice/.hidden.jpg",
           "alice/2020/Thumbs.db", "alice/@eaDir", "bob/desktop.ini"]


def _image(seed: int, fmt: str = "JPEG") -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (112, 112, 3), dtype=np.uint8)).save(out, fmt)
    return out.getvalue()


def messy_tree(root: Path) -> Path:
    """Two identities (alice's photos partly in sub-folders), an empty identity folder, and the junk of
    notebooks, macOS, Windows and Synology NAS boxes, with images inside the junk folders."""
    files = {name: _image(k, "PNG" if name.endswith(".png") else "JPEG") for k, name in enumerate(FILES)}
    files.update({
        ".ipynb_checkpoints/0-checkpoint.jpg": _image(10), "__MACOSX/alice/._0.jpg": b"\0\5\26\7",
        "@eaDir/alice/SYNOPHOTO_THUMB_M.jpg": _image(11), "alice/@eaDir/0.jpg/SYNOFILE_THUMB_S.jpg": _image(12),
        "alice/.hidden.jpg": _image(13), "alice/2020/Thumbs.db": b"thumbs", "bob/desktop.ini": b"[.ShellClassInfo]",
        "Thumbs.db": b"thumbs", ".DS_Store": b"\0\0\0\1Bud1"})
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    (root / "empty").mkdir()
    return root


@pytest.fixture
def messy(tmp_path) -> Path:
    return messy_tree(tmp_path / "faces")


def test_the_rule_lists_identities_with_their_sub_folders_and_names_the_junk(messy):
    listing = identity_folders(messy, IMAGE_EXTENSIONS)
    assert listing.identities == ("alice", "bob", "empty") and listing.classes == CLASSES
    assert listing.empty == ["empty"] and listing.loose == [] and listing.other_files == []
    assert [(p.relative_to(messy).as_posix(), label) for p, label in listing.samples()] == [
        (name, CLASSES.index(name.split("/")[0])) for name in FILES]
    assert listing.ignored == IGNORED
    assert listing.ignored_note() == (f"9 hidden or system entries in {messy} ignored (no identity, no image): "
                                      f".DS_Store, .ipynb_checkpoints, @eaDir ...")
    # The suffixes are the caller's: without .png, alice's PNG is one of her other files.
    assert identity_folders(messy, (".jpg",)).other_files == ["alice/2020/summer/3.png"]
    assert all(is_ignored(n) for n in ("THUMBS.DB", "Desktop.ini", "__macosx", "._x.jpg", "$RECYCLE.BIN"))
    assert not any(is_ignored(n) for n in ("alice", "0.jpg", "eaDir", "MACOSX"))


def _relative(root: Path, paths) -> list[str]:
    return [Path(p).relative_to(root).as_posix() for p in paths]


def test_every_entry_point_sees_the_same_classes_and_files(messy, tmp_path, caplog, capsys):
    expected = [(name, CLASSES.index(name.split("/")[0])) for name in FILES]
    # Training (and overlap, which opens the training set with build_dataset).
    with caplog.at_level(logging.WARNING, logger="dataset"):
        data = build_dataset(str(messy))
    assert isinstance(data, ImageFolderDataset) and data.classes == CLASSES and data.num_classes == 2
    assert [(Path(p).relative_to(messy).as_posix(), label) for p, label in data.samples] == expected
    warnings = [r.getMessage() for r in caplog.records]
    assert sum("hidden or system entries" in w for w in warnings) == 1, warnings
    assert any("1 identity folders without .jpg/.jpeg/.png images are no class: empty" in w for w in warnings)
    assert build_dataset(str(messy), num_classes=2).num_classes == 2

    # make_rec --images: its source listing, and the rec it writes.
    source = list_image_folder(messy)
    assert [(Path(p).relative_to(messy).as_posix(), label) for p, label in source.items] == expected
    assert _relative(messy, source.folders) == CLASSES and _relative(messy, source.empty) == ["empty"]
    assert make_rec_main(["--images", str(messy), "--out", str(tmp_path / "rec")]) == 0
    err = capsys.readouterr().err.splitlines()
    assert sum("hidden or system entries" in line for line in err) == 1, err
    assert f"make_rec: warning: identity folder {messy / 'empty'} left out (no JPEG/PNG files); class ids follow " \
           f"the remaining folders" in err
    rec = MXFaceDataset(tmp_path / "rec")
    assert rec.num_classes == 2 and [rec.raw(i)[1] for i in range(len(rec))] == [0, 0, 0, 1]
    assert [rec.raw(i)[0] for i in range(len(rec))] == [(messy / name).read_bytes() for name in FILES]

    # prepare_faces' photo listing (its suffixes take more formats; the tree holds JPEG/PNG only).
    with caplog.at_level(logging.INFO, logger="photos"):
        caplog.clear()
        photos = list_photo_folder(messy)
    assert [(p.name, p.identity) for p in photos] == [(name, name.split("/")[0]) for name in FILES]
    assert [p.path for p in photos] == [messy / name for name in FILES]
    assert [r.getMessage() for r in caplog.records] == [identity_folders(messy, IMAGE_EXTENSIONS).ignored_note()]

    # rec_info's folder check.
    info = folder_info(messy, check=True)
    assert (info["classes"], info["images"], info["empty"], info["problems"]) == (CLASSES, 4, ["empty"], [])
    assert rec_info_main([str(messy), "--check", "--workers", "0"]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[0] == f"{messy}: image folder, 4 images, 2 identities"
    assert err.splitlines() == [
        f"warning: {identity_folders(messy, IMAGE_EXTENSIONS).ignored_note()}",
        "warning: 1 identity folders have no .jpg/.jpeg/.png images and are no class: empty",
        "warning: 1 of 2 identities have fewer than 2 images: bob (1)"], err


def test_tool_messages_prints_a_package_s_log_as_the_tool_s_lines_and_puts_the_logger_back(capsys):
    logger = logging.getLogger("dataset.rec_from_images")
    before = (logging.getLogger("dataset").handlers[:], logging.getLogger("dataset").propagate)
    with tool_messages("make_rec", "dataset"):
        logger.info("skipped a.jpg")
        logger.warning("2 of 5 classes have no images")
        logger.debug("not shown")
    logger.warning("after the block: not the tool's line")
    assert capsys.readouterr().err.splitlines()[:2] == ["make_rec: skipped a.jpg",
                                                        "make_rec: warning: 2 of 5 classes have no images"]
    assert (logging.getLogger("dataset").handlers, logging.getLogger("dataset").propagate) == before



def test_a_reader_may_decide_by_content_what_its_suffixes_leave_out(messy):
    """``sniff`` is asked about each file without one of the suffixes (never about hidden or system files)."""
    (messy / "bob" / "IMG_0002").write_bytes(_image(20))
    (messy / "bob" / "notes.txt").write_text("not an image")
    asked = []

    def sniff(path: Path) -> bool:
        asked.append(path.relative_to(messy).as_posix())
        return path.read_bytes()[:2] == b"\xff\xd8"  # a JPEG

    listing = identity_folders(messy, (".jpg",), sniff=sniff)
    assert listing.files["bob"] == [messy / "bob" / "1.jpg", messy / "bob" / "IMG_0002"]
    assert listing.other_files == ["alice/2020/summer/3.png", "bob/notes.txt"]
    assert sorted(asked) == ["alice/2020/summer/3.png", "bob/IMG_0002", "bob/notes.txt"]
