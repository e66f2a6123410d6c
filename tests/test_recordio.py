"""dataset.recordio against files written by the real MXNet 1.9.1 (shared/fixtures/rec_*)."""
from __future__ import annotations

import hashlib
import json
import os
import struct

import numpy as np
import pytest

from dataset.recordio import (
    MAGIC,
    IndexedRecordIO,
    IRHeader,
    RecordIOError,
    encode_record,
    pack,
    unpack,
    write_insightface_rec,
)
from tests.helpers import FIXTURES

LAYOUTS = ["rec_insightface", "rec_insightface_vector_label", "rec_im2rec"]
MAGIC_BYTES = struct.pack("<I", MAGIC)


def _open(d):
    return IndexedRecordIO(FIXTURES / d / "train.idx", FIXTURES / d / "train.rec", "r")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fixture_reads_back_exactly(layout):
    manifest = json.loads((FIXTURES / layout / "manifest.json").read_text())
    with _open(layout) as rec:
        for entry in manifest["records"]:
            header, image = unpack(rec.read_idx(entry["key"]))
            label = header.label if header.flag == 0 else header.label[0]
            assert label == entry["label"]
            assert len(image) == entry["payload_len"]
            assert hashlib.sha256(image).hexdigest() == entry["payload_sha256"]
        if manifest["layout"] == "im2rec":
            assert rec.keys == [e["key"] for e in manifest["records"]]
        else:
            header, image = unpack(rec.read_idx(0))
            n, c = manifest["num_images"], manifest["num_classes"]
            assert header.flag == 2 and image == b""
            assert header.label.tolist() == [n + 1, n + 1 + c]
            assert rec.keys == list(range(n + c + 1))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_rewrite_is_byte_identical_to_mxnet(layout, tmp_path):
    with _open(layout) as rec, IndexedRecordIO(tmp_path / "a.idx", tmp_path / "a.rec", "w") as out:
        for key in rec.keys:
            out.write_idx(key, rec.read_idx(key))
    assert (tmp_path / "a.rec").read_bytes() == (FIXTURES / layout / "train.rec").read_bytes()
    assert (tmp_path / "a.idx").read_bytes() == (FIXTURES / layout / "train.idx").read_bytes()


def test_write_insightface_rec_is_byte_identical_to_mxnet(tmp_path):
    with _open("rec_insightface") as rec:
        n = int(unpack(rec.read_idx(0))[0].label[0]) - 1
        items = [(int(h.label), img) for h, img in (unpack(rec.read_idx(k)) for k in range(1, n + 1))]
    assert write_insightface_rec(tmp_path, iter(items), num_classes=6) == n
    for name in ("train.rec", "train.idx", "property"):
        assert (tmp_path / name).read_bytes() == (FIXTURES / "rec_insightface" / name).read_bytes(), name


def test_a_failed_write_leaves_the_folder_as_it_was(tmp_path):
    write_insightface_rec(tmp_path, [(0, b"a"), (1, b"b")], num_classes=2)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(ValueError, match="ascending"):
        write_insightface_rec(tmp_path, [(1, b"c"), (0, b"d")], num_classes=2)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # no .tmp, the old rec intact


def test_write_insightface_rec_empty_classes_and_order(tmp_path):
    write_insightface_rec(tmp_path, [(1, b"a"), (1, b"b"), (3, b"c")], num_classes=5)
    with IndexedRecordIO(tmp_path / "train.idx", tmp_path / "train.rec", "r") as rec:
        assert unpack(rec.read_idx(0))[0].label.tolist() == [4, 9]
        ranges = [unpack(rec.read_idx(k))[0].label.tolist() for k in range(4, 9)]
    assert ranges == [[1, 1], [1, 3], [3, 3], [3, 4], [4, 4]]
    with pytest.raises(ValueError, match="ascending"):
        write_insightface_rec(tmp_path / "x", [(2, b"a"), (1, b"b")], num_classes=3)
    with pytest.raises(ValueError, match=r"label 3 is outside \[0, 3\)"):
        write_insightface_rec(tmp_path / "y", [(3, b"a")], num_classes=3)


@pytest.mark.parametrize("payload", [
    b"",
    b"abc",
    MAGIC_BYTES,                                        # the whole payload is the magic
    b"abcd" + MAGIC_BYTES + b"efghij",                  # one magic at a 4-aligned offset
    b"abcd" + MAGIC_BYTES + MAGIC_BYTES + b"xy",        # two adjacent
    MAGIC_BYTES + b"12345678" + MAGIC_BYTES,            # first and last word
    b"a" + MAGIC_BYTES + b"bcd",                        # unaligned: not split
])
def test_round_trip_with_magic_in_payload(payload, tmp_path):
    with IndexedRecordIO(tmp_path / "t.idx", tmp_path / "t.rec", "w") as w:
        w.write_idx(7, b"before")
        w.write_idx(3, payload)
        w.write_idx(9, b"after")
    with IndexedRecordIO(tmp_path / "t.idx", tmp_path / "t.rec", "r") as r:
        assert r.keys == [7, 3, 9]
        assert r.read_idx(3) == payload
        assert r.read_idx(9) == b"after"
    n_aligned = sum(payload[i:i + 4] == MAGIC_BYTES for i in range(0, len(payload) - 3, 4))
    # Every aligned magic becomes a part boundary: its 4 bytes go, and one 8-byte part header comes.
    assert len(encode_record(payload)) == 8 * (1 + n_aligned) + len(payload) - 4 * n_aligned + (-len(payload) % 4)


def test_split_flags_match_dmlc():
    data = encode_record(b"abcd" + MAGIC_BYTES + MAGIC_BYTES + b"xy")
    heads = []
    pos = 0
    while pos < len(data):
        magic, lrec = struct.unpack_from("<II", data, pos)
        assert magic == MAGIC
        length = lrec & ((1 << 29) - 1)
        heads.append((lrec >> 29, length))
        pos += 8 + (length + 3) // 4 * 4
    assert heads == [(1, 4), (2, 0), (3, 2)]


def test_pack_unpack_labels():
    h, img = unpack(pack(IRHeader(0, 3.0, 5, 0), b"img"))
    assert (h.flag, h.label, h.id, img) == (0, 3.0, 5, b"img")
    h, img = unpack(pack(IRHeader(0, [2.0, 1.0, 7.5], 1, 2), b"img"))
    assert h.flag == 3 and h.label.dtype == np.float32 and h.label.tolist() == [2.0, 1.0, 7.5]
    assert img == b"img"
    with pytest.raises(RecordIOError, match="announces 3 label floats"):
        unpack(pack(IRHeader(0, [1.0, 2.0, 3.0], 0, 0), b"")[:30])


def _small_rec(tmp_path, payloads=(b"x" * 10, b"y" * 20, b"z" * 30)):
    with IndexedRecordIO(tmp_path / "s.idx", tmp_path / "s.rec", "w") as w:
        for k, p in enumerate(payloads):
            w.write_idx(k, p)
    return tmp_path / "s.idx", tmp_path / "s.rec"


def test_missing_files(tmp_path):
    idx, rec = _small_rec(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"index \(.idx\) not found: .*nope.idx"):
        IndexedRecordIO(tmp_path / "nope.idx", rec, "r")
    with pytest.raises(FileNotFoundError, match=r"record file \(.rec\) not found: .*nope.rec"):
        IndexedRecordIO(idx, tmp_path / "nope.rec", "r")
    with pytest.raises(ValueError, match="mode must be"):
        IndexedRecordIO(idx, rec, "a")


def test_bad_magic_names_file_key_offset(tmp_path):
    idx, rec = _small_rec(tmp_path)
    data = bytearray(rec.read_bytes())
    data[20:24] = b"\0\0\0\0"  # record 1 starts at 8 + 12 = 20
    rec.write_bytes(bytes(data))
    with IndexedRecordIO(idx, rec, "r") as r:
        assert r.read_idx(0) == b"x" * 10
        with pytest.raises(RecordIOError, match=r"s.rec \(key 1\): bad magic 0x00000000 at byte 20"):
            r.read_idx(1)


def test_truncated_record(tmp_path):
    idx, rec = _small_rec(tmp_path)
    os.truncate(rec, rec.stat().st_size - 10)
    with IndexedRecordIO(idx, rec, "r") as r:
        with pytest.raises(RecordIOError, match=r"key 2\): record at byte 48 announces 30 bytes .* truncated"):
            r.read_idx(2)


def test_offset_past_end_and_missing_key(tmp_path):
    idx, rec = _small_rec(tmp_path)
    idx.write_text(idx.read_text() + "5\t999999\n")
    with IndexedRecordIO(idx, rec, "r") as r:
        assert r.offsets_past_end() == [(5, 999999)]
        with pytest.raises(RecordIOError, match=r"key 5\): index offset 999999 is past the end"):
            r.read_idx(5)
        with pytest.raises(KeyError, match=r"key 4 is not in .*s.idx"):
            r.read_idx(4)


@pytest.mark.parametrize("bad", ["1 40", "1\tforty", "1\t2\t3", "x"])
def test_bad_index_line_names_line_number(tmp_path, bad):
    idx, rec = _small_rec(tmp_path)
    idx.write_text("0\t0\n" + bad + "\n2\t48\n")
    with pytest.raises(RecordIOError, match=r"s.idx: line 2 is"):
        IndexedRecordIO(idx, rec, "r")


def test_duplicate_key(tmp_path):
    idx, rec = _small_rec(tmp_path)
    idx.write_text("0\t0\n1\t20\n0\t48\n")
    with pytest.raises(RecordIOError, match=r"key 0 appears more than once \(lines \[1, 3\]\)"):
        IndexedRecordIO(idx, rec, "r")


def test_open_large_index_does_not_read_rec(tmp_path):
    n = 200_000
    (tmp_path / "big.idx").write_text("".join(f"{k}\t{k * 8}\n" for k in range(n)))
    (tmp_path / "big.rec").write_bytes(b"")  # every offset is past the end: opening must not care
    with IndexedRecordIO(tmp_path / "big.idx", tmp_path / "big.rec", "r") as r:
        assert len(r) == n and r.offset(n - 1) == (n - 1) * 8
        assert r._fd is None  # the .rec was never opened


def test_fork_safe_reads(tmp_path):
    """A forked child opens its own descriptor: parent and child reads never share an offset."""
    idx, rec = _small_rec(tmp_path)
    r = IndexedRecordIO(idx, rec, "r")
    assert r.read_idx(1) == b"y" * 20
    parent_fd = r._fd
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        ok = r.read_idx(2) == b"z" * 30 and r._pid == os.getpid()  # reopened in this process
        os.write(wfd, b"1" if ok else b"0")
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(rfd, 1) == b"1"
    assert r._fd == parent_fd and r.read_idx(0) == b"x" * 10
    r.close()
