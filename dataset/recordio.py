"""MXNet RecordIO (``.rec`` + ``.idx``) without MXNet: the format, the dataset layouts, and the one checker.

``IRHeader``, ``pack``, ``unpack`` and ``IndexedRecordIO`` keep ``mxnet.recordio``'s names. dmlc-core's byte layout:

    record  = magic (uint32 0xced7230a) | lrec (uint32: cflag << 29 | length) | data | zero pad to 4
    payload = IRHeader ``<IfQQ`` (flag, label, id, id2) | flag float32 label values | image bytes

A payload holding the magic at a 4-aligned offset is split there (cflag 1 first, 2 middle, 3 last, the magic left
out), as dmlc-core's writer splits it: files written here are MXNet's bytes. The ``.rec`` is read with
``os.pread`` from a descriptor opened per process, so DataLoader workers share no file offset. ``detect_layout``
tells insightface's layout (a header record) from im2rec's; ``open_rec_folder``, ``read_image_record`` and
``check_records`` are the one set of checks: the dataset raises the first problem, ``rec_info.py --check`` lists
them all. docs/data.md#the-rec-tools.
"""
from __future__ import annotations

import array
import io
import logging
import numbers
import os
import struct
from collections import Counter, namedtuple
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Literal

import numpy as np
from tqdm import tqdm

from dataset.images import decode
from utils.files import atomic_write, path_problem, unopenable_files

logger = logging.getLogger(__name__)

MAGIC = 0xCED7230A
_MAGIC_BYTES = struct.pack("<I", MAGIC)
_LEN_MASK = (1 << 29) - 1
_IR_FORMAT = "<IfQQ"
_IR_SIZE = struct.calcsize(_IR_FORMAT)  # 24

IRHeader = namedtuple("IRHeader", ["flag", "label", "id", "id2"])
IRHeader.__doc__ = """Image record header: ``flag`` (number of label floats, 0 for a scalar label), ``label``
(float, or float32 array when ``flag > 0``), ``id`` and ``id2`` (uint64, free for the writer)."""


class RecordIOError(ValueError):
    """A ``.rec``/``.idx`` file is malformed; the message names the file, key and byte offset."""


def pack(header: IRHeader | tuple, image_bytes: bytes) -> bytes:
    """Payload bytes for one image record: IRHeader, label vector when the label is not a scalar, image.

    A scalar label is stored in the header with ``flag = 0``; a sequence is stored after the header as
    float32 values with ``flag = len(label)`` and the header's label field 0 (MXNet's convention).
    """
    header = IRHeader(*header)
    if isinstance(header.label, numbers.Number):
        head = struct.pack(_IR_FORMAT, 0, float(header.label), header.id, header.id2)
        return head + bytes(image_bytes)
    label = np.asarray(header.label, dtype="<f4").reshape(-1)
    head = struct.pack(_IR_FORMAT, label.size, 0.0, header.id, header.id2)
    return head + label.tobytes() + bytes(image_bytes)


def unpack(record: bytes) -> tuple[IRHeader, bytes]:
    """Split a payload into ``(IRHeader, image_bytes)``; a vector label becomes a float32 numpy array."""
    if len(record) < _IR_SIZE:
        raise RecordIOError(f"image record payload has {len(record)} bytes, fewer than the {_IR_SIZE}-byte "
                            f"IRHeader")
    flag, label, id_, id2 = struct.unpack_from(_IR_FORMAT, record)
    if flag == 0:
        return IRHeader(flag, label, id_, id2), record[_IR_SIZE:]
    end = _IR_SIZE + 4 * flag
    if len(record) < end:
        raise RecordIOError(f"IRHeader flag {flag} announces {flag} label floats ({4 * flag} bytes) but the "
                            f"payload has only {len(record) - _IR_SIZE} bytes after the header")
    vector = np.frombuffer(record, dtype="<f4", count=flag, offset=_IR_SIZE).astype(np.float32)
    return IRHeader(flag, vector, id_, id2), record[end:]


def encode_record(payload: bytes) -> bytes:
    """The on-disk bytes of one record, split at every 4-aligned magic exactly like dmlc-core's writer."""
    n = len(payload)
    if n >= 1 << 29:
        raise ValueError(f"RecordIO records must be shorter than 2**29 bytes; got {n}")
    # Candidate split points: 4-aligned words of the payload equal to the magic (only whole words count).
    words = np.frombuffer(payload, dtype="<u4", count=n // 4)
    splits = (np.flatnonzero(words == MAGIC) * 4).tolist()
    out = bytearray()
    start = 0
    for pos in splits:
        out += _MAGIC_BYTES + struct.pack("<I", ((1 if start == 0 else 2) << 29) | (pos - start))
        out += payload[start:pos]
        start = pos + 4
    out += _MAGIC_BYTES + struct.pack("<I", ((3 if splits else 0) << 29) | (n - start))
    out += payload[start:]
    out += b"\0" * (-n % 4)
    return bytes(out)


def _parse_idx(idx_path: Path) -> tuple[np.ndarray, np.ndarray]:
    """``(keys, offsets)`` int64 arrays in file order; a bad line raises naming its line number."""
    data = idx_path.read_bytes()
    if not data.strip():
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    try:
        # numpy's C parser reads millions of lines quickly; the slow loop below only runs to explain errors.
        table = np.loadtxt(io.BytesIO(data), dtype=np.int64, delimiter="\t", ndmin=2)
        if table.shape[1] == 2:
            return table[:, 0].copy(), table[:, 1].copy()
    except ValueError:
        pass  # fall through to the line-by-line pass, which names the offending line
    for lineno, line in enumerate(data.split(b"\n"), start=1):
        if not line.strip():
            continue
        fields = line.split(b"\t")
        ok = len(fields) == 2 and all(f.strip().lstrip(b"-").isdigit() for f in fields)
        if not ok:
            raise RecordIOError(f"{idx_path}: line {lineno} is {line[:80]!r}; expected 'key<TAB>offset' "
                                f"with two integers")
    raise RecordIOError(f"{idx_path}: could not be parsed as 'key<TAB>offset' lines")


class IndexedRecordIO:
    """Random access to a ``.rec`` file through its ``.idx`` (MXNet's ``MXIndexedRecordIO``).

    ``mode="r"`` parses the index only (never reads the ``.rec`` at open time); ``mode="w"`` creates both
    files. Use as a context manager or call ``close()``.
    """

    def __init__(self, idx_path: str | os.PathLike, rec_path: str | os.PathLike, mode: Literal["r", "w"]):
        self.idx_path = Path(idx_path)
        self.rec_path = Path(rec_path)
        if mode not in ("r", "w"):
            raise ValueError(f"IndexedRecordIO mode must be 'r' or 'w'; got {mode!r}")
        self.mode = mode
        self._fd: int | None = None
        self._pid: int | None = None
        if mode == "r":
            for path, what in ((self.idx_path, "index (.idx)"), (self.rec_path, "record file (.rec)")):
                if (problem := path_problem(path)) is not None:
                    raise FileNotFoundError(f"RecordIO {what} {problem}: {path}")
            self._keys, self._offsets = _parse_idx(self.idx_path)
            self._rec_size = self.rec_path.stat().st_size
            self._build_lookup()
        else:
            self.rec_path.parent.mkdir(parents=True, exist_ok=True)
            self._wrec = open(self.rec_path, "wb")
            self._widx = open(self.idx_path, "w")
            self._wkeys: list[int] = []
            self._wpos = 0

    # --- reading ---------------------------------------------------------------------------------------
    def _build_lookup(self) -> None:
        """Sorted keys for O(log N) lookup without a 5M-entry Python dict in every worker."""
        order = np.argsort(self._keys, kind="stable")
        sorted_keys = self._keys[order]
        dup = np.flatnonzero(sorted_keys[1:] == sorted_keys[:-1])
        if dup.size:
            key = int(sorted_keys[dup[0]])
            lines = (np.flatnonzero(self._keys == key) + 1).tolist()
            raise RecordIOError(f"{self.idx_path}: key {key} appears more than once (lines {lines})")
        self._sorted_keys = sorted_keys
        self._sorted_offsets = self._offsets[order]

    @property
    def keys(self) -> list[int]:
        """The keys in index-file order (a list, as in MXNet)."""
        if self.mode == "r":
            return self._keys.tolist()
        return list(self._wkeys)

    @property
    def key_array(self) -> np.ndarray:
        """The keys in index-file order as an int64 array (cheap for millions of records)."""
        return self._keys if self.mode == "r" else np.asarray(self._wkeys, dtype=np.int64)

    def __len__(self) -> int:
        return len(self._keys) if self.mode == "r" else len(self._wkeys)

    def __contains__(self, key: int) -> bool:
        return bool(self.has_keys(np.array([key], dtype=np.int64))[0])

    def has_keys(self, keys: np.ndarray) -> np.ndarray:
        """Boolean mask: which of ``keys`` are in the index (vectorised, for millions of keys)."""
        if len(self._sorted_keys) == 0:
            return np.zeros(len(keys), dtype=bool)
        pos = np.minimum(np.searchsorted(self._sorted_keys, keys), len(self._sorted_keys) - 1)
        return self._sorted_keys[pos] == keys

    def offset(self, key: int) -> int:
        """Byte offset of ``key``'s record in the ``.rec``; ``KeyError`` naming the index when absent."""
        i = int(np.searchsorted(self._sorted_keys, key))
        if i >= len(self._sorted_keys) or self._sorted_keys[i] != key:
            raise KeyError(f"key {key} is not in {self.idx_path} ({len(self._keys)} keys)")
        return int(self._sorted_offsets[i])

    def offsets_past_end(self) -> list[tuple[int, int]]:
        """``(key, offset)`` of every index entry pointing at or beyond the end of the ``.rec`` (no reads)."""
        bad = np.flatnonzero((self._offsets < 0) | (self._offsets + 8 > self._rec_size))
        return [(int(self._keys[i]), int(self._offsets[i])) for i in bad]

    def read_last(self) -> bytes:
        """The payload of the record at the largest offset: one read that finds a truncated ``.rec`` at open time."""
        if len(self._offsets) == 0:
            return b""
        i = int(np.argmax(self._offsets))
        return self.read_at(int(self._offsets[i]), int(self._keys[i]))

    def _file(self) -> int:
        # Forked DataLoader workers inherit the parent's descriptor; a per-process one keeps them independent.
        if self._fd is None or self._pid != os.getpid():
            self._fd = os.open(self.rec_path, os.O_RDONLY)
            self._pid = os.getpid()
        return self._fd

    def read_idx(self, key: int) -> bytes:
        """The payload of the record at ``key`` (split parts joined, magic restored)."""
        if self.mode != "r":
            raise ValueError(f"read_idx on {self.rec_path} opened with mode {self.mode!r}; use mode 'r'")
        return self.read_at(self.offset(key), key)

    def read_at(self, offset: int, key: int | None = None) -> bytes:
        """The payload of the record starting at byte ``offset`` (``key`` only names it in errors)."""
        fd = self._file()
        where = f"{self.rec_path} (key {key})" if key is not None else str(self.rec_path)
        if offset < 0 or offset + 8 > self._rec_size:
            raise RecordIOError(f"{where}: index offset {offset} is past the end of the file "
                                f"({self._rec_size} bytes)")
        parts: list[bytes] = []
        pos = offset
        while True:
            head = os.pread(fd, 8, pos)
            if len(head) < 8:
                raise RecordIOError(f"{where}: record part header at byte {pos} runs past the end of the file "
                                    f"({self._rec_size} bytes)")
            magic, lrec = struct.unpack("<II", head)
            if magic != MAGIC:
                raise RecordIOError(f"{where}: bad magic 0x{magic:08x} at byte {pos} (expected 0x{MAGIC:08x}); "
                                    f"the index offset or the file is wrong")
            cflag, length = lrec >> 29, lrec & _LEN_MASK
            data = os.pread(fd, length, pos + 8)
            if len(data) < length:
                raise RecordIOError(f"{where}: record at byte {pos} announces {length} bytes but the file ends "
                                    f"after {len(data)} ({self._rec_size} bytes in all): truncated file")
            parts.append(data)
            if cflag in (0, 3):
                if cflag == 3 and pos == offset:
                    raise RecordIOError(f"{where}: record at byte {pos} starts with a last-part flag (3)")
                break
            if cflag == 2 and pos == offset:
                raise RecordIOError(f"{where}: record at byte {pos} starts with a middle-part flag (2)")
            pos += 8 + length + (-length % 4)
        return _MAGIC_BYTES.join(parts)

    # --- writing ---------------------------------------------------------------------------------------
    def write_idx(self, key: int, buf: bytes) -> None:
        """Append ``buf`` as one record and its ``key<TAB>offset`` index line."""
        if self.mode != "w":
            raise ValueError(f"write_idx on {self.rec_path} opened with mode {self.mode!r}; use mode 'w'")
        record = encode_record(bytes(buf))
        self._wrec.write(record)
        self._widx.write(f"{int(key)}\t{self._wpos}\n")
        self._wkeys.append(int(key))
        self._wpos += len(record)

    def write_at(self, offset: int, buf: bytes) -> None:
        """Overwrite an already written record in place; its encoded size must not change."""
        record = encode_record(bytes(buf))
        self._wrec.flush()
        os.pwrite(self._wrec.fileno(), record, offset)

    # --- lifetime --------------------------------------------------------------------------------------
    def close(self) -> None:
        """Close the files (idempotent)."""
        if self.mode == "w":
            if not self._wrec.closed:
                self._wrec.close()
                self._widx.close()
        elif self._fd is not None and self._pid == os.getpid():
            os.close(self._fd)
        self._fd = None

    def __enter__(self) -> IndexedRecordIO:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __getstate__(self) -> dict:
        # Spawned workers get the parsed index but open their own descriptor.
        if self.mode != "r":
            raise TypeError(f"an IndexedRecordIO open for writing ({self.rec_path}) cannot be pickled")
        state = self.__dict__.copy()
        state["_fd"] = None
        state["_pid"] = None
        return state

    def __del__(self) -> None:
        try:
            self.close()
        except (OSError, AttributeError):  # interpreter shutdown or a failed __init__: nothing left to close
            pass

    def __repr__(self) -> str:
        return f"IndexedRecordIO({str(self.idx_path)!r}, {str(self.rec_path)!r}, mode={self.mode!r})"


def write_insightface_rec(out_dir: str | os.PathLike, items: Iterable[tuple[int, bytes]], num_classes: int,
                          image_size: tuple[int, int] = (112, 112)) -> int:
    """Write ``train.rec``/``train.idx``/``property`` in the insightface layout; return the image count.

    ``items`` yields ``(label, encoded_image_bytes)`` grouped by label in ascending order. Record 0 is
    the header (label ``[N+1, N+1+C]``), records ``1..N`` are images (scalar label, ``id`` = key),
    records ``N+1..N+C`` give each class's ``[first, last+1)`` image key range (empty for a class with
    no images). Each file is written atomically (``utils.files.atomic_write``), the ``.rec`` first: a
    failure while the images are written leaves the folder as it was.
    """
    out = Path(out_dir)
    if num_classes <= 0:
        raise ValueError(f"num_classes must be positive; got {num_classes}")
    out.mkdir(parents=True, exist_ok=True)
    offsets = array.array("q")  # offset of record k at index k: keys are 0..N+C
    count = [0]

    def write_rec(f: BinaryIO) -> None:
        def put(payload: bytes) -> None:
            offsets.append(f.tell())
            f.write(encode_record(payload))

        # The header's size does not depend on N (two float32 labels), so a placeholder is patched at the end.
        put(pack(IRHeader(0, [0.0, 0.0], 0, 0), b""))
        first = np.zeros(num_classes, np.int64)
        last = np.zeros(num_classes, np.int64)  # exclusive end; first == last means no images
        key, prev = 1, -1
        for label, image in items:
            label = int(label)
            if not 0 <= label < num_classes:
                raise ValueError(f"item {key - 1}: label {label} is outside [0, {num_classes})")
            if label < prev:
                raise ValueError(f"item {key - 1}: label {label} after {prev}; items must be grouped by label "
                                 f"in ascending order")
            if label != prev:
                # Classes skipped between prev and label get an empty range at this key.
                first[prev + 1:label + 1] = key
                last[prev + 1:label] = key
            put(pack(IRHeader(0, float(label), key, 0), image))
            last[label] = key + 1
            key, prev = key + 1, label
        n = key - 1
        first[prev + 1:] = key
        last[prev + 1:] = key
        for c in range(num_classes):
            put(pack(IRHeader(0, [float(first[c]), float(last[c])], 0, 0), b""))
        end = f.tell()
        f.seek(0)
        f.write(encode_record(pack(IRHeader(0, [float(n + 1), float(n + 1 + num_classes)], 0, 0), b"")))
        f.seek(end)
        count[0] = n

    def write_idx(f: BinaryIO) -> None:
        for start in range(0, len(offsets), 65536):  # chunks: millions of lines without one huge string
            f.write("".join(f"{k}\t{offsets[k]}\n"
                            for k in range(start, min(start + 65536, len(offsets)))).encode())

    atomic_write(out / "train.rec", write_rec)
    atomic_write(out / "train.idx", write_idx)
    atomic_write(out / "property", lambda f: f.write(f"{num_classes},{image_size[0]},{image_size[1]}".encode()))
    logger.info("wrote %d images of %d classes to %s", count[0], num_classes, out)
    return count[0]


# --- dataset folders: layouts and the checks ------------------------------------------------------------

def read_property(path: str | os.PathLike) -> tuple[int, tuple[int, int]] | None:
    """``(num_classes, (H, W))`` from an insightface ``property`` file, or None when there is none."""
    path = Path(path)
    if not path.is_file():
        return None
    raw = path.read_bytes()
    try:
        text = raw.decode("ascii").strip()
        c, h, w = (int(v) for v in text.split(","))
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not a text file (byte {exc.start} is 0x{raw[exc.start]:02x}); expected "
                         f"'num_classes,height,width' (e.g. '93431,112,112')") from exc
    except ValueError as exc:
        raise ValueError(f"{path}: expected 'num_classes,height,width' (e.g. '93431,112,112'); got "
                         f"{text[:80]!r}") from exc
    return c, (h, w)


def detect_layout(rec: IndexedRecordIO) -> tuple[str, np.ndarray, int | None]:
    """``(layout, image_keys, header_num_classes)`` of an open RecordIO.

    insightface: key 0 is a header record (label vector ``[N+1, N+1+C]``, no image bytes); images are
    keys ``1..N``. im2rec: every key is an image, and the class count is not recorded.
    """
    if 0 in rec:
        header, image = unpack(rec.read_idx(0))
        if header.flag >= 2 and len(image) == 0:
            first, end = int(header.label[0]), int(header.label[1])
            keys = np.arange(1, first, dtype=np.int64)
            missing = keys[~rec.has_keys(keys)][:5].tolist()
            if missing:
                raise RecordIOError(f"{rec.rec_path}: header record (key 0) says images are keys 1..{first - 1} "
                                    f"but {rec.idx_path} lacks keys {missing}")
            return "insightface", keys, end - first
    return "im2rec", rec.key_array.copy(), None


def class_of(header_label: float | np.ndarray, where: str) -> int:
    """The class id of an IRHeader label: the scalar, or the first value of a vector label."""
    value = float(header_label) if np.ndim(header_label) == 0 else float(header_label[0])
    if value != int(value) or value < 0:
        raise ValueError(f"{where}: label {value} is not a non-negative integer class id")
    return int(value)


def is_rec_folder(path: str | os.PathLike) -> bool:
    """Whether ``path`` is meant as a RecordIO dataset: it holds ``train.rec`` or ``train.idx`` (either one, so that
    a folder missing the other is read, and reported, as a damaged rec)."""
    path = Path(path)
    return (path / "train.rec").exists() or (path / "train.idx").exists()


@dataclass
class RecFolder:
    """A RecordIO dataset folder, open, with what its open-time checks found.

    ``num_classes`` and ``image_size`` are what ``property`` and the header record say (None when neither
    says it); ``problems`` holds one error per defect found without reading every record.
    """

    root: Path
    rec: IndexedRecordIO
    layout: str  # "insightface" or "im2rec"
    image_keys: np.ndarray  # (N,) int64, in index order
    num_classes: int | None
    image_size: tuple[int, int] | None
    problems: list[ValueError] = field(default_factory=list)


def open_rec_folder(root: str | os.PathLike, read_last: bool = True) -> RecFolder:
    """Open ``root/train.rec`` + ``train.idx`` and run every check that needs no pass over the records.

    Collected in ``problems`` (in this order): index offsets past the end of the ``.rec``; with
    ``read_last``, the record at the largest offset (one read that finds a ``.rec`` cut short); a damaged
    header record; no image record at all; an unreadable ``property``; ``property`` and the header record
    disagreeing on the class count. A missing file (or a folder in its place) raises ``FileNotFoundError``, an index
    that does not parse ``RecordIOError``: nothing can be checked then.
    """
    root = Path(root)
    rec_path, idx_path = root / "train.rec", root / "train.idx"
    missing, unusable = unopenable_files((rec_path, idx_path))
    if missing or unusable:
        what = ([f"missing {' and '.join(p.name for p in missing)}"] if missing else []) + [
            f"{p.name} {why}" for p, why in unusable]
        raise FileNotFoundError(f"{root}: {'; '.join(what)}; an MXNet RecordIO dataset folder "
                                f"holds train.rec, train.idx and (insightface layout) property")
    rec = IndexedRecordIO(idx_path, rec_path, "r")
    problems: list[ValueError] = []
    past = rec.offsets_past_end()
    if past:
        # One problem for all of them: an index of another file would otherwise give millions of lines.
        problems.append(RecordIOError(
            f"{idx_path}: {len(past)} index offsets are past the end of {rec_path} ({rec_path.stat().st_size} "
            f"bytes), e.g. (key, offset) {past[:3]}; the .rec is truncated or belongs to another index"))
    if read_last and not past:
        try:
            rec.read_last()
        except RecordIOError as exc:
            problems.append(exc)
    try:
        layout, keys, header_classes = detect_layout(rec)
    except RecordIOError as exc:
        problems.append(exc)
        layout, keys, header_classes = "im2rec", rec.key_array[rec.key_array != 0], None
    if len(keys) == 0:
        problems.append(RecordIOError(f"{rec_path}: no image records ({idx_path} lists {len(rec.key_array)} keys); "
                                      f"a dataset needs at least one image"))
    try:
        prop = read_property(root / "property")
    except ValueError as exc:
        problems.append(exc)
        prop = None
    if prop is not None and header_classes is not None and prop[0] != header_classes:
        problems.append(ValueError(f"{root / 'property'} says {prop[0]} classes but the header record (key 0) of "
                                   f"{rec_path} says {header_classes}"))
    return RecFolder(root, rec, layout, keys, prop[0] if prop else header_classes, prop[1] if prop else None,
                     problems)


def read_image_record(rec: IndexedRecordIO, key: int, num_classes: int | None) -> tuple[bytes, int, str]:
    """``(encoded image bytes, class id, "file (key k)")`` of image record ``key``.

    ``RecordIOError``/``ValueError`` naming the file and key for a record that does not read, a payload
    shorter than its header, a label that is not a class id, or one ``>= num_classes``.
    """
    where = f"{rec.rec_path} (key {key})"
    payload = rec.read_idx(key)
    try:
        header, image = unpack(payload)
    except RecordIOError as exc:
        raise RecordIOError(f"{where}: {exc}") from None
    label = class_of(header.label, where)
    if num_classes is not None and label >= num_classes:
        raise ValueError(f"{where}: label {label} is out of range for num_classes={num_classes}")
    return image, label, where


def check_records(folder: RecFolder, image_size: tuple[int, int] | None = None
                  ) -> tuple[Counter[int], list[ValueError]]:
    """Read every record of ``folder``, decode every image and check every label and size.

    Header and identity-range records are read too (they can be damaged as well). Records whose index
    offset is past the end are skipped (``open_rec_folder`` reported them). Returns the number of images
    of every class id and one error per bad record. ``image_size`` defaults to ``property``'s.
    """
    size = image_size or folder.image_size
    past = {key for key, _ in folder.rec.offsets_past_end()}
    labels: Counter[int] = Counter()
    problems: list[ValueError] = []
    all_keys = folder.rec.key_array
    is_image = np.isin(all_keys, folder.image_keys)
    for key, image_record in tqdm(zip(all_keys.tolist(), is_image.tolist()), total=len(all_keys),
                                  desc="checking records", unit="rec", disable=None):
        if key in past:
            continue
        try:
            if not image_record:
                folder.rec.read_idx(key)
                continue
            image, label, where = read_image_record(folder.rec, key, folder.num_classes)
            labels[label] += 1
            decode(image, where, size)
        except (RecordIOError, ValueError) as exc:
            problems.append(exc)
    return labels, problems
