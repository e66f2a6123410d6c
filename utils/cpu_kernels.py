"""Compiled CPU loops: the head's optimizer row updates, fused margin-softmax passes, class sampling, gather of
the sampled rows and row scaling; the backbones' PReLU backward and narrow convolutions.

Optimizers (``sgd_rows``, ``adamw_rows``): torch updates the rows of an SGD or AdamW step with several
whole-tensor operations (and, for sampled rows, a gather before and a scatter after), so each row of weight and
optimizer state crosses the memory bus several times; on a CPU that traffic, not arithmetic, is what the
update costs. ``utils/cpu_kernels.c`` does the same arithmetic, operation for operation, in one pass per row: at
50k sampled rows of 500k × 512 it takes a quarter of the torch operations' time, with the same bits for SGD (see
the C file; ``tests/test_cpu_kernels``).

Margin-softmax (``softmax_forward``, ``softmax_backward``; ``partial_fc._MarginSoftmax``): torch runs each row
block of the ``(B, C)`` cosines through about ten operations per direction (scale, logits, target column, max,
shift, exp, sum; softmax, gradient, column and row sums, ``G``), each a pass over the block and a call from
Python. Here each row takes two passes forward and one backward, with a vectorised ``exp`` accurate to ~1.3
units in the last place (torch's: ~0.5), so the values agree with the torch operations to rounding, not to the
bit. Sums run in 16 fixed lanes, so they do not depend on the CPU's vector width; the backward's column sums
do depend on the number of threads (each thread sums its rows, then the threads' sums are added). The backward
runs with flush-to-zero on x86 (set for the loop, put back after it): softmax values below FLT_MIN, from logits
~87 or more below their row's largest, are 0 rather than subnormal numbers, which x86 computes with in microcode.

Class sampling (``sample_rows``; ``partial_fc.PartialFC._sample``): every sampled step
hashes each of the shard's class ids with the step's seed, about thirty whole-array integer operations in torch
(~15–20 ms a step for 500k classes here), then takes the top k of the keys and sorts them (~4 ms alone, 12–27
ms beside another rank's products). The loop computes the same exact integer arithmetic in one pass, and finds
the same k rows by counting the keys in buckets instead of a top-k, writing them in row order: the same rows,
in ~3 ms.

Gathering the sampled rows (``gather_rows``; ``partial_fc._cosine_products``): a copy loop that prefetches the
row after next, since the sampled rows lie scattered over the shard: ~11 ms for 50k rows × 512 here against
~20 ms for ``torch.index_select``, the same values. It writes with streaming stores, which do not read the
destination's cache lines before writing them (the rows are read again only after ~100 MB more): ~20 → 15–18
ms on an Intel Xeon where a plain copy runs at ~12 GB/s. The same stores write ``scale_rows``'s rows, the first
half of the head's weight gradient at R = 1 (``−coef · W`` over the whole shard, ``partial_fc._scaled_rows``):
124–137 ms for 500k × 512 there, against 176–198 ms for ``torch.mul``, the same values. The gather can also
return the centres' norms, read from each row while it is in cache and summed as ``torch.linalg.vector_norm``
sums an fp32 row (8 float lanes, then the lanes in order: the same bits, which ``norms_like_torch`` checks on a
probe once per width before the head relies on it), so the head makes no pass over the gathered rows for their
norms; ``row_norms`` does the same over a whole shard (R = 1), prefetching ahead: ~89 ms against torch's ~101
ms for 500k × 512 on an Intel Xeon.

PReLU backward (``prelu_backward``; ``backbones.prelu.PReLU``): torch's CPU kernel for the input's and the
slope's gradients makes several passes and a reduction over a broadcast, ~5 ns per value here, about as long as
the convolution around it at the demo's widths; the loop here reads the input and the gradient once and writes
the input's gradient once (fp32 and bf16). The input's gradient is torch's, to the bit; the slope's gradient is
summed in another order (float lanes, double totals), so it agrees to rounding.

Narrow convolutions (``conv2d_forward``, ``conv2d_backward``; ``backbones.conv.Conv2d``): oneDNN blocks channels in
8s or 16s, so a convolution with two or three channels at 112x112 costs 20-30 ms backward and 2-4 ms forward for
32 images. The loops widen one image into zero-padded float rows (split by phase for stride 2, so every row loop
reads consecutive values); the forward and the input's gradient are float sums over the taps in a fixed order,
an output row at a time, rounded once; the weight's gradient is summed an output row at a time in 16 fixed float
lanes, added to doubles per image: 1-2 ms forward, 2-5 ms backward. The values agree with torch's to rounding.

The C file is compiled on first use with the system's C compiler (``$CC``, else ``cc``) into
``$XDG_CACHE_HOME/partial_fc/cpu_kernels/`` (``~/.cache`` by default), named by a hash of the source, the
compiler and the machine, written atomically (ranks that start together may both build it), and loaded with
ctypes. Where there is no compiler, the build fails, or ``PFC_CPU_KERNELS=0`` is set in the environment,
``library()`` is None (said once in the log) and the head runs the torch operations instead, with the same
results (to rounding). Only fp32 CPU tensors go through the head's and the optimizers' kernels (``usable``);
PReLU's backward and the narrow convolutions also take bf16 ones. An update is split into
``torch.get_num_threads()`` ranges of rows, run side by side on a thread pool (ctypes releases the GIL), so a
rank with several intra-op threads updates as torch's operations would, in parallel.

Each loop is built in three versions, AVX-512 (F, BW, VL), AVX2 with FMA and baseline x86-64 (one elsewhere), and
runs the highest the CPU has. They give the same bits (the loops fix their order of summation, not the vector width).
``PFC_CPU_KERNELS_ISA=avx2`` or ``baseline`` caps the version (``limit_isa``; ``isa`` says which runs): a way
round a compiler that builds one version wrong, and how the tests compare them.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import Tensor

__all__ = ["ENV_ISA", "ENV_SWITCH", "ISA_VERSIONS", "SOURCE", "adamw_rows", "cache_dir", "conv2d_backward",
           "conv2d_forward", "gather_rows", "isa", "library", "limit_isa", "norms_like_torch", "prelu_backward",
           "row_norms", "sample_rows", "scale_rows", "sgd_rows", "softmax_backward", "softmax_forward", "usable"]

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_suffix(".c")
ENV_SWITCH = "PFC_CPU_KERNELS"  # "0": never use the compiled kernels (the torch operations run instead)
ENV_ISA = "PFC_CPU_KERNELS_ISA"  # the highest version of the loops to run: one of ISA_VERSIONS
ISA_VERSIONS = ("baseline", "avx2", "avx512")  # pfc_isa()'s 0, 1 and 2
_ABI = 11  # pfc_kernels_abi() of the C file this module speaks to
_FLAGS = ("-O3", "-shared", "-fPIC", "-ffp-contract=off", "-fno-math-errno", "-std=c11")

_MIN_ROWS_PER_THREAD = 256  # smaller updates run on the calling thread
_loaded: dict[str | tuple, ctypes.CDLL | None] = {}  # library path (or environment) -> the library, or None
_pool: tuple[ThreadPoolExecutor, int] | None = None  # the pool and its number of threads
_norms_checked: dict[int, bool] = {}  # d -> whether row_norms gives torch's bits for d-value rows (norms_like_torch)


def cache_dir() -> Path:
    """Where built libraries are kept: ``$XDG_CACHE_HOME/partial_fc/cpu_kernels`` (``~/.cache/...``)."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "partial_fc" / "cpu_kernels"


def _compiler() -> str | None:
    name = os.environ.get("CC") or "cc"
    return shutil.which(name)


def _build(compiler: str, target: Path) -> None:
    """Compile ``SOURCE`` into ``target`` atomically (a temporary file in the same folder, then a rename)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run([compiler, *_FLAGS, str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True,
                              timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{compiler} exited with {proc.returncode}: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _target(compiler: str, folder: Path) -> Path:
    """The library's path in ``folder``: named by a hash of the source, the compiler, its flags and the machine
    (read and hashed once per environment: ``library`` keeps what it resolved)."""
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join((compiler, *_FLAGS, platform.machine(),
                                                            platform.system())).encode()).hexdigest()[:16]
    return folder / f"cpu_kernels_{digest}.so"


def library() -> ctypes.CDLL | None:
    """The loaded kernels (built first if needed), or None when they are switched off or cannot be built."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        if "switched off" not in _loaded:
            logger.info("CPU kernels: switched off (%s=0); the head, PReLU and narrow convolutions use torch "
                        "operations", ENV_SWITCH)
            _loaded["switched off"] = None
        return None
    # Called on every PReLU and head call: once resolved for this environment, no file-system lookups.
    environment = ("environment", os.environ.get("CC"), os.environ.get("PATH"), os.environ.get("XDG_CACHE_HOME"),
                   os.environ.get("HOME"))
    if environment not in _loaded:
        _loaded[environment] = _resolve()
    return _loaded[environment]


def _resolve() -> ctypes.CDLL | None:
    compiler = _compiler()
    if compiler is None:
        key = "no compiler"
        if key not in _loaded:
            logger.info("CPU kernels: no C compiler (%s); the head, PReLU and narrow convolutions use torch operations",
                        os.environ.get("CC") or "cc")
            _loaded[key] = None
        return None
    target = _target(compiler, cache_dir())
    key = str(target)
    if key in _loaded:
        return _loaded[key]
    lib = None
    try:
        if not target.exists():
            _build(compiler, target)
        lib = ctypes.CDLL(str(target))
        if lib.pfc_kernels_abi() != _ABI:
            raise RuntimeError(f"{target} speaks ABI {lib.pfc_kernels_abi()}, expected {_ABI}")
        _declare(lib)
        limit = os.environ.get(ENV_ISA)
        if limit is not None:
            lib.pfc_limit_isa(_isa_level(limit, ENV_ISA))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning("CPU kernels unavailable (%s); the head, PReLU and narrow convolutions use torch operations", exc)
        lib = None
    _loaded[key] = lib
    return lib


def _isa_level(name: str, where: str) -> int:
    if name not in ISA_VERSIONS:
        raise ValueError(f"{where}={name!r}: the CPU loops' versions are {', '.join(ISA_VERSIONS)}")
    return ISA_VERSIONS.index(name)


def isa() -> str | None:
    """The version of the loops that runs now (one of ``ISA_VERSIONS``), or None without the kernels."""
    lib = library()
    return None if lib is None else ISA_VERSIONS[lib.pfc_isa()]


def limit_isa(name: str) -> str:
    """Run no version above ``name`` (one of ``ISA_VERSIONS``; ``"avx512"`` lifts the cap) from now on in this
    process; returns the version that runs now. Not while a loop runs on another thread."""
    level = _isa_level(name, "limit_isa")
    return ISA_VERSIONS[_required().pfc_limit_isa(level)]


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    lib.pfc_kernels_abi.restype = i64
    lib.pfc_isa.restype = i64
    lib.pfc_limit_isa.argtypes = [i64]
    lib.pfc_limit_isa.restype = i64
    lib.pfc_sgd_rows.argtypes = [p, p, p, p, i64, i64, i64, f32, f32, f32, i32]
    lib.pfc_sgd_rows.restype = None
    lib.pfc_adamw_rows.argtypes = [p, p, p, p, p, i64, i64, i64, p, p, f32, f32, f32, f32, f32]
    lib.pfc_adamw_rows.restype = None
    lib.pfc_softmax_forward.argtypes = [p, p, i64, f32, p, p, p, p, i64, i64]
    lib.pfc_softmax_forward.restype = None
    lib.pfc_softmax_backward.argtypes = [p, p, i64, f32, f32, p, p, p, p, p, p, p, i64, i64]
    lib.pfc_softmax_backward.restype = None
    lib.pfc_gather_rows.argtypes = [p, p, i64, p, p, i64, i64, i64]
    lib.pfc_gather_rows.restype = None
    lib.pfc_row_norms.argtypes = [p, i64, p, i64, i64]
    lib.pfc_row_norms.restype = None
    lib.pfc_scale_rows.argtypes = [p, p, i64, p, i64, i64]
    lib.pfc_scale_rows.restype = None
    lib.pfc_sample_rows.argtypes = [i64, i64, i64, p, i64, i64, p]
    lib.pfc_sample_rows.restype = i64
    lib.pfc_conv_backward.argtypes = [p, p, p, i32, i64, i64, i64, i64, i64, i64, i64, i64, i64, p, p, i64, i64]
    lib.pfc_conv_backward.restype = i32
    lib.pfc_conv_forward.argtypes = [p, p, i32, i64, i64, i64, i64, i64, i64, i64, i64, i64, p, i64, i64]
    lib.pfc_conv_forward.restype = i32
    for name in ("pfc_prelu_backward", "pfc_prelu_backward_bf16"):
        getattr(lib, name).argtypes = [p, p, p, i64, i64, p, p, i64, i64]
        getattr(lib, name).restype = None


def usable(*tensors: Tensor) -> bool:
    """Whether the kernels can update these tensors: all fp32, on the CPU, contiguous, and the kernels built."""
    return (all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in tensors)
            and library() is not None)


def _check_rows(name: str, t: Tensor, n: int, dtype: torch.dtype = torch.float32) -> None:
    if t.shape != (n,) or t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"cpu_kernels: {name} must be a contiguous {dtype} CPU tensor of shape ({n},), got "
                         f"{t.dtype} {tuple(t.shape)} on {t.device}")


def _check_fp32(*tensors: Tensor) -> None:
    for t in tensors:
        if t.device.type != "cpu" or t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"cpu_kernels: expected contiguous fp32 CPU tensors, got {t.dtype} on {t.device} "
                             f"(contiguous: {t.is_contiguous()})")


def _check_index(name: str, index: Tensor, limit: int, n: int | None = None, what: str = "row indices") -> None:
    """``index`` a contiguous int64 CPU vector (of ``n`` values when given) whose values lie in ``[0, limit)``: a
    wrong one here would make a kernel read or write outside its tensors."""
    n = index.numel() if n is None else n
    _check_rows(name, index, n, torch.int64)
    if n and not (int(index.min()) >= 0 and int(index.max()) < limit):
        raise ValueError(f"cpu_kernels: {what} in [{int(index.min())}, {int(index.max())}] outside [0, {limit})")


def _check(weight: Tensor, grad: Tensor, rows: Tensor | None, states: tuple[Tensor, ...]) -> int:
    """Shapes, dtypes and row bounds: a wrong index here would write outside the tensors. Returns ``n``."""
    if weight.dim() != 2 or grad.dim() != 2 or grad.shape[1] != weight.shape[1]:
        raise ValueError(f"cpu_kernels: weight {tuple(weight.shape)} and gradient {tuple(grad.shape)} must be "
                         f"(rows, D) with the same D")
    _check_fp32(weight, grad, *states)
    for t in states:
        if t.shape != weight.shape:
            raise ValueError(f"cpu_kernels: state {tuple(t.shape)} must have the weight's shape {tuple(weight.shape)}")
    n = grad.shape[0]
    if rows is None:
        if n != weight.shape[0]:
            raise ValueError(f"cpu_kernels: a dense gradient of {n} rows for a weight of {weight.shape[0]}")
    else:
        _check_index("rows", rows, weight.shape[0], n)
    return n


def _parts(n: int, min_rows: int = _MIN_ROWS_PER_THREAD) -> int:
    """How many threads share ``n`` rows: ``torch.get_num_threads()``, fewer when there are few rows."""
    return max(1, min(torch.get_num_threads(), n // min_rows))


def _over_rows(kernel: Callable[[int, int, int], None], n: int, parts: int) -> None:
    """``kernel(begin, end, part)`` for ``parts`` ranges of ``[0, n)``, side by side on a thread pool (on the
    calling thread when ``parts`` is 1)."""
    global _pool
    if parts == 1:
        kernel(0, n, 0)
        return
    if _pool is None or _pool[1] < parts:
        if _pool is not None:
            _pool[0].shutdown(wait=False)
        _pool = (ThreadPoolExecutor(max_workers=parts, thread_name_prefix="cpu_kernels"), parts)
    bounds = [n * k // parts for k in range(parts + 1)]
    for future in [_pool[0].submit(kernel, bounds[k], bounds[k + 1], k) for k in range(parts)]:
        future.result()


def _required() -> ctypes.CDLL:
    lib = library()
    if lib is None:
        raise RuntimeError("cpu_kernels: the kernels are unavailable (see usable())")
    return lib


def sgd_rows(weight: Tensor, momentum_buffer: Tensor, grad: Tensor, rows: Tensor | None, lr: float,
             momentum: float, weight_decay: float) -> None:
    """``optimizers.RowSparseSGD``'s update of ``weight (N, D)`` and ``momentum_buffer (N, D)`` in place, from
    ``grad (n, D)`` for rows ``rows (n,)`` (unique; all N rows in order when None)."""
    lib = _required()
    n = _check(weight, grad, rows, (momentum_buffer,))
    args = (weight.data_ptr(), momentum_buffer.data_ptr(), grad.data_ptr(), None if rows is None else rows.data_ptr())
    _over_rows(lambda begin, end, _: lib.pfc_sgd_rows(*args, begin, end, weight.shape[1], lr, momentum,
                                                      weight_decay, int(weight_decay != 0)), n, _parts(n))


def adamw_rows(weight: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, grad: Tensor, rows: Tensor | None,
               step_size: Tensor, bias2_sqrt: Tensor, lr: float, betas: tuple[float, float], eps: float,
               weight_decay: float) -> None:
    """``optimizers.RowSparseAdamW``'s update of ``weight`` and its moments (each ``(N, D)``) in place, from
    ``grad (n, D)`` for rows ``rows (n,)`` (all rows when None), with the rows' bias corrections
    ``step_size = -lr / (1 - beta1^t)`` and ``bias2_sqrt = sqrt(1 - beta2^t)`` (each ``(n,)`` fp32)."""
    lib = _required()
    n = _check(weight, grad, rows, (exp_avg, exp_avg_sq))
    _check_rows("step_size", step_size, n)
    _check_rows("bias2_sqrt", bias2_sqrt, n)
    beta1, beta2 = betas
    args = (weight.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(), grad.data_ptr(),
            None if rows is None else rows.data_ptr())
    _over_rows(lambda begin, end, _: lib.pfc_adamw_rows(*args, begin, end, weight.shape[1], step_size.data_ptr(),
                                                        bias2_sqrt.data_ptr(), 1.0 - lr * weight_decay, 1.0 - beta1,
                                                        beta2, 1.0 - beta2, eps), n, _parts(n))


def _check_cosines(cos: Tensor, inv_w: Tensor) -> tuple[int, int]:
    if cos.dim() != 2 or cos.dtype != torch.float32 or cos.device.type != "cpu" or not cos.is_contiguous():
        raise ValueError(f"cpu_kernels: cosines must be a contiguous (B, C) fp32 CPU tensor, got {cos.dtype} "
                         f"{tuple(cos.shape)} on {cos.device}")
    batch, classes = cos.shape
    _check_rows("inv_w", inv_w, classes)
    return batch, classes


def softmax_forward(cos: Tensor, inv_w: Tensor, s: float, target_logit: Tensor, target: Tensor, row_max: Tensor,
                    row_sum: Tensor) -> None:
    """The fused margin-softmax's forward over ``cos (B, C)`` (the products ``ê·Wᵀ``, scaled in place by ``inv_w
    (C,)`` into the cosines): logits ``s·cos`` but ``target_logit[b]`` in column ``target[b]`` (none where it is
    negative); fills ``row_max (B,)`` with each row's largest logit and ``row_sum (B,)`` with Σ exp(logit − max).
    ``target`` is int64; the other vectors fp32; nothing is indexed by ``target``, so no value of it is unsafe."""
    lib = _required()
    batch, classes = _check_cosines(cos, inv_w)
    for name, t in (("target_logit", target_logit), ("row_max", row_max), ("row_sum", row_sum)):
        _check_rows(name, t, batch)
    _check_rows("target", target, batch, torch.int64)
    args = (cos.data_ptr(), inv_w.data_ptr(), classes, s, target_logit.data_ptr(), target.data_ptr(),
            row_max.data_ptr(), row_sum.data_ptr())
    _over_rows(lambda begin, end, _: lib.pfc_softmax_forward(*args, begin, end), batch, _parts(batch, 1))


def softmax_backward(cos: Tensor, inv_w: Tensor, s: float, scale: float, target_logit: Tensor, slope: Tensor,
                     target: Tensor, row_max: Tensor, coef: Tensor, dot_w: Tensor, dot_e: Tensor) -> None:
    """The fused margin-softmax's backward over the cosines ``cos (B, C)``: with ``p = exp(logit − row_max)·coef``,
    ``g`` is ``s·p`` off the target and ``slope·(p − scale)`` on it; adds ``Σ_b g⊙cos`` to ``dot_w (C,)``, writes
    ``Σ_c g⊙cos`` into ``dot_e (B,)`` and overwrites ``cos`` with ``G = g·inv_w``."""
    lib = _required()
    batch, classes = _check_cosines(cos, inv_w)
    for name, t in (("target_logit", target_logit), ("slope", slope), ("row_max", row_max), ("coef", coef),
                    ("dot_e", dot_e)):
        _check_rows(name, t, batch)
    _check_rows("target", target, batch, torch.int64)
    _check_rows("dot_w", dot_w, classes)
    parts = _parts(batch, 1)
    # Each thread sums its rows' columns into its own vector; the first is dot_w itself.
    sums = [dot_w] + [torch.zeros_like(dot_w) for _ in range(parts - 1)]
    args = (cos.data_ptr(), inv_w.data_ptr(), classes, s, scale, target_logit.data_ptr(), slope.data_ptr(),
            target.data_ptr(), row_max.data_ptr(), coef.data_ptr())
    _over_rows(lambda begin, end, part: lib.pfc_softmax_backward(*args, sums[part].data_ptr(), dot_e.data_ptr(),
                                                                 begin, end), batch, parts)
    for extra in sums[1:]:
        dot_w.add_(extra)


def gather_rows(weight: Tensor, index: Tensor, out: Tensor, norms: Tensor | None = None) -> None:
    """Rows ``index (C,)`` of ``weight (N, R)`` copied into ``out (C, R)``: ``torch.index_select(weight, 0, index,
    out=out)``, the same values, in half to two thirds of its time (each row after next is prefetched, and ``out``
    is written by streaming stores, which do not read its lines first). With ``norms (C, K)`` (``R = K·d``, ``d`` a
    multiple of 8), also the norms of each copied row's K pieces of d values, ``torch.linalg.vector_norm(out.view(-1,
    d), dim=1)`` in the sum order of ``row_norms``, from the row while it is in cache: no second pass over ``out``."""
    lib = _required()
    if weight.dim() != 2 or out.dim() != 2 or out.shape != (index.numel(), weight.shape[1]):
        raise ValueError(f"cpu_kernels: gathering {index.numel()} rows of a {tuple(weight.shape)} weight into "
                         f"{tuple(out.shape)}; expected ({index.numel()}, {weight.shape[1] if weight.dim() else '?'})")
    _check_fp32(weight, out)
    _check_index("index", index, weight.shape[0])
    n, width, pieces = index.numel(), weight.shape[1], 1
    if norms is not None:
        pieces = norms.shape[1] if norms.dim() == 2 else 0
        if (norms.dim() != 2 or norms.shape[0] != n or pieces < 1 or width % pieces or (width // pieces) % 8
                or not norms.is_contiguous() or norms.dtype != torch.float32 or norms.device.type != "cpu"):
            raise ValueError(f"cpu_kernels: norms {norms.dtype} {tuple(norms.shape)} of {n} gathered rows of {width} "
                             f"values: expected a contiguous fp32 CPU (rows, K) tensor, K pieces of a multiple of 8 "
                             f"values a row")
    args = (weight.data_ptr(), index.data_ptr(), width, out.data_ptr(), None if norms is None else norms.data_ptr(),
            width // pieces)
    _over_rows(lambda begin, end, _: lib.pfc_gather_rows(*args, begin, end), n, _parts(n))


def row_norms(x: Tensor, out: Tensor) -> None:
    """The norms of the rows of ``x (n, d)`` (``d`` a multiple of 8) into ``out (n,)``: the squares added into 8
    float lanes in order, the lanes added, the square root, which is how ``torch.linalg.vector_norm(x, dim=1)`` sums
    an fp32 row: the same bits wherever ``norms_like_torch(d)`` is True. Each row is prefetched 8 KB ahead."""
    lib = _required()
    if x.dim() != 2 or x.shape[1] % 8:
        raise ValueError(f"cpu_kernels: row norms of {tuple(x.shape)}: expected (n, d) with d a multiple of 8")
    _check_fp32(x)
    _check_rows("out", out, x.shape[0])
    n = x.shape[0]
    args = (x.data_ptr(), x.shape[1], out.data_ptr())
    _over_rows(lambda begin, end, _: lib.pfc_row_norms(*args, begin, end), n, _parts(n))


def norms_like_torch(d: int) -> bool:
    """Whether ``row_norms`` (and ``gather_rows``' norms) of d-value rows give ``torch.linalg.vector_norm``'s bits
    in this process: ``d`` a multiple of 8, the kernels built, and 256 probe rows of d values (magnitudes 1e-3 to
    1e3, a zero row, NaN and infinities) agreeing bit for bit, once per ``d``. False sends the head to torch's norm:
    a torch that sums the squares in another order (another version, another CPU) changes nothing but the speed."""
    if d % 8 or d < 8 or library() is None:
        return False
    if d not in _norms_checked:
        g = torch.Generator().manual_seed(d)
        probe = torch.randn(256, d, generator=g) * torch.logspace(-3, 3, 256)[:, None]
        probe[0] = 0.0
        probe[1, d // 2] = float("nan")
        probe[2, 3] = float("inf")
        probe[3] = 3e19  # squares overflow to infinity, as torch's do
        want = torch.linalg.vector_norm(probe, dim=1)
        got = torch.empty(256)
        row_norms(probe, got)
        same = bool(torch.equal(got.view(torch.int32), want.view(torch.int32)))
        if not same:
            logger.info("CPU kernels: torch.linalg.vector_norm sums %d-value rows in another order here; the head "
                        "computes the centres' norms with torch", d)
        _norms_checked[d] = same
    return _norms_checked[d]


def scale_rows(src: Tensor, coef: Tensor, out: Tensor) -> None:
    """``out = src · coef[:, None]`` for ``src`` and ``out (n, R)`` and ``coef (n,)``: ``torch.mul(src, coef[:, None],
    out=out)``, the same values, with ``out`` written by streaming stores (a third less memory traffic than torch's
    mul, which reads each line of ``out`` before writing it)."""
    lib = _required()
    if src.dim() != 2 or out.shape != src.shape:
        raise ValueError(f"cpu_kernels: scaling the rows of {tuple(src.shape)} into {tuple(out.shape)}; expected "
                         f"two (n, R) tensors of one shape")
    _check_fp32(src, out)
    _check_rows("coef", coef, src.shape[0])
    n = src.shape[0]
    args = (src.data_ptr(), coef.data_ptr(), src.shape[1], out.data_ptr())
    _over_rows(lambda begin, end, _: lib.pfc_scale_rows(*args, begin, end), n, _parts(n))


def sample_rows(class_start: int, num_local: int, seed: int, positives: Tensor, k_base: int) -> Tensor:
    """``partial_fc.PartialFC._sample``'s rows for the class ids ``class_start … class_start + num_local − 1``
    (below 2^32): every row in ``positives`` (int64, repeats allowed) and the negatives with the largest keys
    (``partial_fc._sampling_keys``, the same bits), ``min(num_local, max(k_base, distinct positives))`` rows in
    all, sorted: the rows of the torch operations (lift, ``topk``, ``sort``), without a top-k over the shard."""
    lib = _required()
    if num_local < 1 or class_start < 0 or class_start + num_local > 2**32 or not 0 <= seed < 2**31 or k_base < 0:
        raise ValueError(f"cpu_kernels: sampling needs 0 <= class_start, 1 <= num_local, class ids below 2^32, a "
                         f"seed in [0, 2^31) and k_base >= 0; got {class_start}, {num_local}, {seed}, {k_base}")
    positives = positives.reshape(-1)
    _check_index("positives", positives, num_local, what="positive rows")
    out = torch.empty(min(num_local, max(k_base, positives.numel())), dtype=torch.int64)
    written = lib.pfc_sample_rows(class_start, num_local, seed, positives.data_ptr(), positives.numel(), k_base,
                                  out.data_ptr())
    if written < 0:
        raise MemoryError(f"cpu_kernels: no memory for the sampling keys of {num_local} classes")
    return out[:written]


def prelu_backward(x: Tensor, grad: Tensor, slopes: Tensor) -> tuple[Tensor, Tensor]:
    """PReLU's gradients for ``x (N, C, ...)`` and the upstream ``grad`` (same shape and dtype: contiguous fp32
    or bf16 CPU tensors) with the forward's slopes ``slopes`` (``(C,)`` or ``(1,)`` fp32, holding the values the
    forward used: bf16-rounded for a bf16 forward). Returns the input's gradient (like ``x``) and the slopes'
    (fp32, shaped like ``slopes``). bf16 values are widened to fp32 inside the loop, and the input's gradient is
    rounded to bf16 as torch rounds it."""
    lib = _required()
    if x.dim() < 2 or x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"cpu_kernels: PReLU input must be (N, C, ...) fp32 or bf16, got {x.dtype} {tuple(x.shape)}")
    for name, t in (("input", x), ("gradient", grad)):
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"cpu_kernels: the PReLU {name} must be a contiguous CPU tensor, got {t.device} "
                             f"(contiguous: {t.is_contiguous()})")
    if grad.shape != x.shape or grad.dtype != x.dtype:
        raise ValueError(f"cpu_kernels: PReLU gradient {grad.dtype} {tuple(grad.shape)} must match the input "
                         f"{x.dtype} {tuple(x.shape)}")
    n, c = x.shape[0], x.shape[1]
    if slopes.numel() not in (1, c):
        raise ValueError(f"cpu_kernels: {slopes.numel()} PReLU slopes for {c} channels (1 or {c} allowed)")
    per_channel = slopes.detach().float().reshape(-1).expand(c).contiguous()
    gx = torch.empty_like(x)
    parts = _parts(n, 1)
    sums = torch.zeros(parts, c, dtype=torch.float64)  # each thread's per-channel sums, added in order below
    kernel = lib.pfc_prelu_backward_bf16 if x.dtype == torch.bfloat16 else lib.pfc_prelu_backward
    args = (x.data_ptr(), grad.data_ptr(), per_channel.data_ptr(), c, x[0, 0].numel(), gx.data_ptr())
    _over_rows(lambda begin, end, part: kernel(*args, sums[part].data_ptr(), begin, end), n, parts)
    total = sums.sum(0)
    return gx, (total.sum() if slopes.numel() == 1 else total).float().reshape(slopes.shape)


def _conv_shapes(x: Tensor, weight: Tensor, stride: int, padding: int) -> tuple[int, ...]:
    """``(n, ci, h, w, co, k, ho, wo)`` of a convolution the loops take, after checking its input and weight."""
    if x.dim() != 4 or x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"cpu_kernels: convolution input must be (N, C, H, W) fp32 or bf16, got {x.dtype} "
                         f"{tuple(x.shape)}")
    if x.device.type != "cpu" or not x.is_contiguous():
        raise ValueError(f"cpu_kernels: the convolution input must be a contiguous CPU tensor, got {x.device} "
                         f"(contiguous: {x.is_contiguous()})")
    n, ci, h, w = x.shape
    if weight.dim() != 4 or weight.shape[1] != ci or weight.shape[2] != weight.shape[3]:
        raise ValueError(f"cpu_kernels: convolution weight {tuple(weight.shape)} must be (Co, {ci}, k, k)")
    co, k = weight.shape[0], weight.shape[2]
    ho, wo = (h + 2 * padding - k) // stride + 1, (w + 2 * padding - k) // stride + 1
    if stride not in (1, 2) or not 0 <= padding < k or ho < 1 or wo < 1:
        raise ValueError(f"cpu_kernels: convolution stride {stride} (1 or 2 allowed) or padding {padding} (0 to "
                         f"{k - 1} allowed for a {k}x{k} kernel, leaving an output) on a {h}x{w} input")
    return n, ci, h, w, co, k, ho, wo


def conv2d_forward(x: Tensor, weight: Tensor, stride: int, padding: int) -> Tensor:
    """``conv2d(x, weight, stride=stride, padding=padding)`` (square kernel, one group, no dilation, zero padding,
    no bias) for a contiguous fp32 or bf16 CPU ``x (N, Ci, H, W)`` and ``weight (Co, Ci, k, k)`` (any float dtype,
    read as fp32: pass the values to use, bf16-rounded for a bf16 convolution). The output is like ``x``: each
    value a float sum over the taps in a fixed order, rounded once (see the C file); torch's agree to rounding."""
    lib = _required()
    n, ci, h, w, co, k, ho, wo = _conv_shapes(x, weight, stride, padding)
    values = weight.detach().float().contiguous()
    out = torch.empty(n, co, ho, wo, dtype=x.dtype)
    _run_conv(lambda begin, end, part: lib.pfc_conv_forward(
        x.data_ptr(), values.data_ptr(), int(x.dtype == torch.bfloat16), ci, co, h, w, ho, wo, k, stride, padding,
        out.data_ptr(), begin, end), n, x.shape, _parts(n, 1))
    return out


def conv2d_backward(x: Tensor, grad: Tensor, weight: Tensor, stride: int, padding: int,
                    input_grad: bool = True) -> tuple[Tensor | None, Tensor]:
    """The gradients of ``conv2d(x, weight, stride=stride, padding=padding)`` (as ``conv2d_forward``) for its
    upstream ``grad (N, Co, Ho, Wo)``, a contiguous CPU tensor of ``x``'s dtype; ``weight`` holds the values the
    forward used. Returns the input's gradient (like ``x``; None unless ``input_grad``) and the weight's (fp32).
    The input's gradient is a float sum over the taps in a fixed order rounded once (to bf16 for bf16), the
    weight's is summed in float lanes and doubles per image (see the C file)."""
    lib = _required()
    n, ci, h, w, co, k, ho, wo = _conv_shapes(x, weight, stride, padding)
    if grad.device.type != "cpu" or not grad.is_contiguous():
        raise ValueError(f"cpu_kernels: the convolution gradient must be a contiguous CPU tensor, got {grad.device} "
                         f"(contiguous: {grad.is_contiguous()})")
    if grad.shape != (n, co, ho, wo) or grad.dtype != x.dtype:
        raise ValueError(f"cpu_kernels: convolution gradient {grad.dtype} {tuple(grad.shape)} must be {x.dtype} "
                         f"{(n, co, ho, wo)}")
    values = weight.detach().float().contiguous()
    gx = torch.empty_like(x) if input_grad else None
    parts = _parts(n, 1)
    sums = torch.zeros(parts, co, ci, k, k, dtype=torch.float64)  # each thread's sums, added in order below
    _run_conv(lambda begin, end, part: lib.pfc_conv_backward(
        x.data_ptr(), grad.data_ptr(), values.data_ptr(), int(x.dtype == torch.bfloat16), ci, co, h, w, ho, wo, k,
        stride, padding, gx.data_ptr() if gx is not None else None, sums[part].data_ptr(), begin, end), n, x.shape,
        parts)
    return gx, sums.sum(0).float()


def _run_conv(kernel: Callable[[int, int, int], int], n: int, shape: torch.Size, parts: int) -> None:
    """A convolution loop over ``n`` images split into ``parts`` ranges on threads (``_over_rows``: part ``k`` gets
    the ``k``-th range); MemoryError when a thread could not allocate its planes."""
    failed = []

    def run(begin: int, end: int, part: int) -> None:
        if kernel(begin, end, part) != 0:
            failed.append(part)

    _over_rows(run, n, parts)
    if failed:
        raise MemoryError(f"cpu_kernels: no memory for the convolution planes of a {tuple(shape)} input")
