"""The optional GPU-decode loader (NVIDIA DALI), fed by index, with the trainer's loader interface and bad-data rules.

- ``RecordBatches`` (no DALI): rank ``r``'s batch ``k`` of epoch ``e``, samples and flips from ``FaceSampler``,
  records read by ``MXFaceDataset.raw`` and checked before DALI sees them (the record, and the image's kind and
  size from its JPEG frame header or PNG ``IHDR``);
- ``DaliLoader``: a DALI pipeline fed those batches through ``fn.external_source``, which decodes them on the GPU
  (nvJPEG), mirrors and normalises; a batch that fails the checks or DALI's decoder is read on the host by the
  PyTorch loader's ``read_leaving_out`` instead, its bad samples named in ``take_problems()``.

So a DALI run trains on ``FaceDataLoader``'s batches for the same seed, epoch and ranks, and resumes at any step
without reading the batches before it. ``nvidia.dali`` is imported only when the loader is built or iterated.
docs/data.md#dali says what differs.
"""
from __future__ import annotations

import logging
import os
import struct
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dataset.faces import MXFaceDataset
from dataset.images import PIXEL_MEAN, PIXEL_STD, is_jpeg, is_png, normalise
from dataset.loader import FaceSampler, problem_line, read_leaving_out

logger = logging.getLogger(__name__)

# JPEG start-of-frame markers (baseline, extended, progressive, lossless; Huffman or arithmetic): C0-CF but DHT
# (C4), JPG (C8) and DAC (CC).
_SOF_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}


def header_size(data: bytes) -> tuple[int, int] | None:
    """``(H, W)`` of an encoded image read from its header alone (a JPEG's frame header, a PNG's ``IHDR``), or None
    when the bytes are neither or the header is damaged. Decodes nothing: a few dozen bytes are read."""
    if is_png(data):
        if len(data) < 24 or data[12:16] != b"IHDR":
            return None
        width, height = struct.unpack(">II", data[16:24])
        return height, width
    if not is_jpeg(data):
        return None
    pos = 2
    while pos + 4 <= len(data):  # marker segments up to the frame header: FF, marker, big-endian length
        if data[pos] != 0xFF:
            return None
        marker = data[pos + 1]
        if marker == 0xFF:  # a fill byte before a marker
            pos += 1
        elif 0xD0 <= marker <= 0xD7 or marker == 0x01:  # markers without a length
            pos += 2
        elif marker in _SOF_MARKERS:
            if pos + 9 > len(data):
                return None
            height, width = struct.unpack(">HH", data[pos + 5:pos + 9])
            return height, width
        elif marker in (0xD9, 0xDA):  # end of image, or a scan, before any frame header
            return None
        else:
            pos += 2 + struct.unpack(">H", data[pos + 2:pos + 4])[0]
    return None


@dataclass(frozen=True)
class EncodedBatch:
    """One batch as the DALI pipeline takes it; sample ``j`` is dataset index ``indices[j]``. ``problem`` names the
    first record that failed the checks (file, key, what is wrong) and is None when every record passed; such a
    batch is not fed to DALI, and ``data``/``labels`` hold the records read before it."""

    indices: list[int]
    flips: list[bool]
    data: list[np.ndarray]  # [(n_j,) uint8]: the encoded image (JPEG or PNG) as stored in the record
    labels: np.ndarray  # (B,) int64 class ids
    mirror: np.ndarray  # (B,) int32, 1 = flip left-right (crop_mirror_normalize takes int32)
    problem: str | None = None


class RecordBatches:
    """The batches of one rank, by index, with no DALI in it: what ``DaliLoader`` feeds DALI.

    The sampler is built as ``FaceDataLoader`` builds it (``drop_last``), so batch ``k`` holds ``FaceDataLoader``'s
    batch ``k`` samples, labels and flips; either RecordIO layout reads (the dataset knows the image keys). After
    ``set_epoch(epoch, start_step)`` iteration yields batches ``start_step .. len() - 1``, reading only theirs.
    """

    def __init__(self, dataset: MXFaceDataset, batch_size: int, *, rank: int, world_size: int, seed: int):
        self.dataset = dataset
        self.sampler = FaceSampler(len(dataset), batch_size, rank, world_size, seed)

    def __len__(self) -> int:
        return self.sampler.num_batches

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        """Next iteration yields epoch ``epoch`` from batch ``start_step`` on."""
        self.sampler.set_epoch(epoch, start_step)

    def __iter__(self) -> Iterator[EncodedBatch]:
        for indices, flips in self.sampler.batches():
            yield self.read(indices, flips)

    def read(self, indices: Sequence[int], flips: Sequence[bool]) -> EncodedBatch:
        """The records of dataset ``indices``, in order, with ``flips`` as DALI's mirror flags; reading stops at the
        first record that does not read (``MXFaceDataset.raw``'s checks) or whose header is not a JPEG or PNG of
        the dataset's ``image_size``, and ``problem`` says which and why."""
        data: list[np.ndarray] = []
        labels: list[int] = []
        problem = None
        for index in indices:
            try:
                image, label, where = self.dataset.raw(index)
            except (ValueError, OSError) as exc:  # RecordIOError is a ValueError; it names the file and key
                problem = problem_line(index, exc)
                break
            size = header_size(image)
            if size != tuple(self.dataset.image_size):
                expected = "x".join(map(str, self.dataset.image_size))
                problem = (f"{where}: not a JPEG or PNG image with a readable header ({len(image)} bytes, starts with "
                           f"{image[:8]!r})" if size is None else
                           f"{where}: image is {size[0]}x{size[1]} (HxW) by its header, expected {expected}")
                break
            data.append(np.frombuffer(image, dtype=np.uint8))
            labels.append(label)
        return EncodedBatch(list(indices), list(flips), data, np.array(labels, dtype=np.int64),
                            np.array(flips, dtype=np.int32), problem)


def _import_dali():
    """``(fn, pipeline_def, types, DALIGenericIterator)``; ``ValueError`` saying what to install when absent."""
    try:
        from nvidia.dali import fn, pipeline_def, types
        from nvidia.dali.plugin.pytorch import DALIGenericIterator
    except ImportError as exc:
        raise ValueError("the DALI loader was requested (dali = True) but nvidia.dali is not installed; "
                         "pip install nvidia-dali-cuda120, or set dali = False") from exc
    return fn, pipeline_def, types, DALIGenericIterator


class DaliLoader:
    """Iterates ``(images float32 (B, 3, H, W) normalised, labels int64 (B,))`` on the GPU (``device_id``; None: a
    CPU pipeline on the CPU): ``RecordBatches`` decoded by DALI, with ``FaceDataLoader``'s interface and batches.

    A batch that fails ``RecordBatches``' checks, or that DALI fails to decode, is read by ``read_leaving_out``:
    ``B' < B`` samples (possibly 0), one ``take_problems()`` line per sample left out. Each run of good batches
    gets its own pipeline, so an iteration left early, or a pipeline DALI gave up on, leaves nothing prefetched.
    """

    def __init__(self, batches: RecordBatches, device_id: int | None, num_threads: int = 4):
        self.batches, self.device_id, self.num_threads = batches, device_id, num_threads
        self.num_images = len(batches.dataset)
        self.device = torch.device("cpu") if device_id is None else torch.device("cuda", device_id)
        self.problems: list[str] = []
        self._said_host_decode = False

    def __len__(self) -> int:
        return len(self.batches)

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        """Select the epoch (its order and flips) and the batch to start from."""
        self.batches.set_epoch(epoch, start_step)

    def take_problems(self) -> list[str]:
        """The samples left out of the batches yielded since the last call, a line each naming the file and
        record (``FaceDataLoader.take_problems``'s lines)."""
        problems, self.problems = self.problems, []
        return problems

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self.batches.sampler.start_step == len(self):
            return  # resumed at the epoch's end; DALI refuses a pipeline with no data
        batches = iter(self.batches)
        ahead: deque[EncodedBatch] = deque()  # read, not yet yielded, in the epoch's order
        while True:
            if not ahead:
                batch = next(batches, None)
                if batch is None:
                    return
                ahead.append(batch)
            if ahead[0].problem is not None:
                yield self._read_on_host(ahead.popleft(), None)
                continue
            yield from self._decode(ahead, batches)  # a pipeline from ahead[0], a good batch, to the next bad one

    def _decode(self, ahead: deque[EncodedBatch], batches: Iterator[EncodedBatch]
                ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """DALI's outputs for the good batches from ``ahead[0]`` on, each popped from ``ahead`` as it is yielded. Ends
        where the source meets a batch with a problem (left in ``ahead``), at the epoch's end, or after the batch DALI
        failed on, read on the host instead; the outputs of batches fed after it are dropped with the pipeline (they
        stay in ``ahead``, read already, for the next pipeline)."""
        _, _, _, DALIGenericIterator = _import_dali()

        def source() -> Iterator[tuple[list[np.ndarray], np.ndarray, np.ndarray]]:
            for batch in list(ahead):  # read before this pipeline: a previous one stopped before them
                if batch.problem is not None:
                    return
                yield batch.data, batch.labels, batch.mirror
            for batch in batches:
                ahead.append(batch)
                if batch.problem is not None:
                    return  # DALI's epoch ends here; the caller reads this batch on the host
                yield batch.data, batch.labels, batch.mirror

        pipe = self._pipeline(source())
        try:
            # DALI reports a batch it cannot decode at that batch's output (the iterator's constructor fetches the
            # first one); the pipeline is unusable after it.
            outputs = DALIGenericIterator(pipe, ["images", "labels"])
            for out in outputs:  # ends when the source returns
                ahead.popleft()
                yield out[0]["images"], out[0]["labels"]  # (B, 3, H, W) float32, (B,) int64, on self.device
        except RuntimeError as exc:
            yield self._read_on_host(ahead.popleft(), exc)

    def _read_on_host(self, batch: EncodedBatch, dali_error: RuntimeError | None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """``batch`` read by ``read_leaving_out`` (the PyTorch loader's reader), normalised on the device; its bad
        samples left out and listed for ``take_problems``."""
        images, labels, problems = read_leaving_out(self.batches.dataset, batch.indices, batch.flips)
        self.problems += problems
        if not problems and dali_error is not None:
            # DALI failed on images the host decodes: a failure of DALI's own (memory, an image kind its decoders
            # refuse), said each time; the batch trains as read on the host.
            logger.warning("DALI could not decode a batch that the host decodes without error (%s); it trains as "
                           "decoded on the host", str(dali_error).strip().splitlines()[-1])
        elif not problems and not self._said_host_decode:
            # An image kind the checks do not pass to DALI (neither JPEG nor PNG) that the host decodes at the right
            # size: the run stays correct, only slower. Said once per loader.
            self._said_host_decode = True
            logger.warning("DALI loader: %s; the host decodes it at the right size, so its batch trains as decoded "
                           "there (further such batches are not reported)", batch.problem)
        return normalise(images.to(self.device)), labels.to(self.device)  # (B', 3, H, W) float32, (B',) int64

    def _pipeline(self, source: Iterator[tuple[list[np.ndarray], np.ndarray, np.ndarray]]):
        fn, pipeline_def, types, _ = _import_dali()
        on_gpu = self.device_id is not None

        @pipeline_def(batch_size=self.batches.sampler.batch_size, num_threads=self.num_threads,
                      device_id=self.device_id)
        def pipeline():
            # One source for the three inputs keeps each batch's bytes, labels and flips together in DALI's
            # prefetch queue.
            jpegs, labels, mirror = fn.external_source(
                source=source, num_outputs=3, batch=True, dtype=[types.UINT8, types.INT64, types.INT32],
                ndim=[1, 0, 0])
            images = fn.decoders.image(jpegs, device="mixed" if on_gpu else "cpu",
                                       output_type=types.RGB)  # (H, W, 3) uint8 each
            images = fn.crop_mirror_normalize(images, dtype=types.FLOAT, output_layout="CHW", mean=[PIXEL_MEAN] * 3,
                                              std=[PIXEL_STD] * 3, mirror=mirror)  # (3, H, W) float32 each
            return images, labels.gpu() if on_gpu else labels

        pipe = pipeline()
        pipe.build()
        return pipe


def get_dali_dataloader(rec_dir: str | os.PathLike, batch_size: int, *, rank: int, world_size: int, seed: int,
                        device: torch.device | str, num_threads: int = 4,
                        num_classes: int | None = None) -> DaliLoader:
    """GPU-decoding loader over ``rec_dir/train.rec`` (either layout) with NVIDIA DALI; see ``DaliLoader``.

    The rec is opened as ``MXFaceDataset(rec_dir, num_classes=num_classes)`` opens it (the same checks; with
    ``num_classes`` None the class count comes from ``property`` or the header record, or a pass over the
    records when neither has it). ``ValueError`` when nvidia.dali is not installed or ``device`` is not CUDA.
    """
    _import_dali()
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ValueError(f"the DALI loader needs a CUDA device; got device={device} "
                         f"(cuda available: {torch.cuda.is_available()})")
    dataset = MXFaceDataset(rec_dir, num_classes=num_classes)
    batches = RecordBatches(dataset, batch_size, rank=rank, world_size=world_size, seed=seed)
    device_id = device.index if device.index is not None else torch.cuda.current_device()
    return DaliLoader(batches, device_id, num_threads)
