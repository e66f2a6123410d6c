"""Optimizers: the row-sparse ones of the Partial FC head, and the one table that picks both of a run.

``build_optimizers(name, ...)`` returns the backbone's torch optimizer and the head's row-sparse one for the
config's ``optimizer`` ("sgd" | "adamw"), with the same hyper-parameters (``momentum`` is SGD's momentum and
AdamW's beta1). An unknown name is a ``ValueError`` listing the table.

Row-sparse update (the original Partial FC method): with ``sample_rate < 1`` the head's gradient is a sparse
tensor whose rows are the sampled classes; ``RowSparseSGD`` and ``RowSparseAdamW`` update only those rows
and their optimizer state (momentum, Adam moments with per-row step counts): unsampled rows keep their
values and state and get no weight decay. Dense gradients (``sample_rate == 1``) update every row, where
``RowSparseSGD`` performs exactly ``torch.optim.SGD``'s update. Every state tensor has one row per class
(first dimension ``num_local``), so checkpoints re-partition it row by row to another world size.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal

import torch
from torch import Tensor, nn

from utils import cpu_kernels
from utils.distributed import Tactic, resolve_tactic

__all__ = ["OPTIMIZERS", "ROW_CHUNK", "RowSparseAdamW", "RowSparseSGD", "build_head_optimizer", "build_optimizers"]

ROW_CHUNK = 1024  # rows per optimizer update with the row_blocks tactic: (chunk, D) work buffers stay in cache


def _rows_of(grad: Tensor) -> tuple[Tensor | None, Tensor]:
    """``(row indices, values)`` of a sparse row gradient with unique rows; ``(None, grad)`` if dense.

    The head's own gradients arrive coalesced. A sum of several (gradient accumulation) is coalesced
    here, which reads its row count on the host: one synchronisation per step, only with accumulation.
    """
    if not grad.is_sparse:
        return None, grad
    if not grad.is_coalesced():
        grad = grad.coalesce()
    if grad.sparse_dim() != 1 or grad.dense_dim() != 1:
        raise ValueError(f"row-sparse optimizer: expected a sparse gradient of (rows, D), got sparse_dim "
                         f"{grad.sparse_dim()} dense_dim {grad.dense_dim()}")
    return grad.indices()[0], grad.values()


class _RowSparseOptimizer(torch.optim.Optimizer):
    """Base: eager row-wise state, and ``step`` routing dense and row-sparse gradients to ``_update``.

    ``tactic`` (see ``utils.distributed.resolve_tactic``, default by the parameter's device): with
    ``row_blocks`` (the CPU's) fp32 rows go through ``utils.cpu_kernels`` when it is built
    (``_kernel_update``: one pass over each row), else the torch operations run over chunks of ``ROW_CHUNK``
    rows whose operands stay in cache; with ``fixed_ops`` over all present rows at once (a fixed number of
    operations per step). All give SGD's update to the bit; AdamW's kernel rounds its square root correctly,
    where torch's CPU ``sqrt`` is sometimes one unit in the last place off, so they agree to rounding.
    """

    _state_keys: tuple[str, ...] = ()

    def __init__(self, params: Iterable[Tensor], defaults: dict[str, Any], tactic: Tactic = "auto") -> None:
        super().__init__(params, defaults)
        resolve_tactic(tactic, "cpu")  # validates the name
        self.tactic: Tactic = tactic
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p] = self._init_state(p)

    def _init_state(self, p: Tensor) -> dict[str, Tensor]:
        raise NotImplementedError

    def _update(self, group: dict[str, Any], grad: Tensor, param_rows: Tensor, state_rows: dict[str, Tensor],
                scratch: Tensor) -> None:
        """Update ``param_rows`` and ``state_rows`` (row slices or gathered copies) in place.

        ``scratch`` is a work buffer of ``param_rows``' shape and dtype that the update may overwrite.
        """
        raise NotImplementedError

    def _kernel_update(self, group: dict[str, Any], p: Tensor, state: dict[str, Tensor], rows: Tensor | None,
                       grad: Tensor) -> None:
        """The same update through ``utils.cpu_kernels``: rows ``rows (n,)`` (all rows when None) of ``p`` and
        its state, from ``grad (n, D)``. Called only when ``cpu_kernels.usable`` holds for every tensor."""
        raise NotImplementedError

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's ``load_state_dict``, then every row-wise state tensor on its parameter's device and checked
        to have one row per parameter row (torch leaves a ``step`` tensor where it was loaded from)."""
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                for key in self._state_keys:
                    if key not in state or state[key].shape[0] != p.shape[0]:
                        got = tuple(state[key].shape) if key in state else "missing"
                        raise ValueError(f"{type(self).__name__}.load_state_dict: state {key!r} is {got}; "
                                         f"expected first dimension {p.shape[0]} (the parameter's rows)")
                    state[key] = state[key].to(p.device)

    @torch.no_grad()
    def step(self, closure: Callable[[], Tensor] | None = None) -> Tensor | None:
        """One update of the rows present in each parameter's gradient (all rows for a dense gradient)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                rows, values = _rows_of(p.grad)
                tactic = resolve_tactic(self.tactic, p.device)
                if tactic == "row_blocks" and cpu_kernels.usable(p, values, *(state[k] for k in self._state_keys)):
                    self._kernel_update(group, p, state, rows, values)
                    continue
                count = p.shape[0] if rows is None else rows.shape[0]
                if tactic == "fixed_ops":
                    chunk = max(count, 1)
                else:
                    chunk = min(ROW_CHUNK, max(count, 1))
                # The work buffers are allocated once per step (sliced for the last chunk).
                scratch = p.new_empty((chunk, *p.shape[1:]))  # (chunk, D)
                for start in range(0, count, chunk):
                    end = min(start + chunk, count)
                    if rows is None:  # dense: update row slices in place
                        self._update(group, values[start:end], p[start:end],
                                     {k: state[k][start:end] for k in self._state_keys}, scratch[:end - start])
                        continue
                    self._update_rows(group, p, state, rows[start:end], values[start:end], scratch[:end - start])
        return loss

    def _update_rows(self, group: dict[str, Any], p: Tensor, state: dict[str, Tensor], idx: Tensor, grad: Tensor,
                     scratch: Tensor) -> None:
        """Update rows ``idx (n,)`` of ``p`` and its state from their gradient ``grad (n, D)``: gather, ``_update``,
        scatter back."""
        param_rows = p.index_select(0, idx)  # (n, D)
        state_rows = {k: state[k].index_select(0, idx) for k in self._state_keys}
        self._update(group, grad, param_rows, state_rows, scratch)
        p.index_copy_(0, idx, param_rows)
        for k in self._state_keys:
            state[k].index_copy_(0, idx, state_rows[k])


class RowSparseSGD(_RowSparseOptimizer):
    """SGD with momentum and weight decay that only touches the rows present in the gradient.

    On those rows the update is ``torch.optim.SGD``'s (dampening 0, no Nesterov):
    ``d = g + wd·w; buf = momentum·buf + d; w -= lr·buf``; other rows, their momentum and their decay
    are left alone. State: ``momentum_buffer`` (rows, D), allocated as zeros at construction.
    """

    _state_keys = ("momentum_buffer",)

    def __init__(self, params: Iterable[Tensor], lr: float, momentum: float = 0.9, weight_decay: float = 5e-4,
                 *, tactic: Tactic = "auto") -> None:
        for name, value in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay)):
            if not value >= 0.0:
                raise ValueError(f"RowSparseSGD: {name}={value} must be >= 0")
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay), tactic)

    def _init_state(self, p: Tensor) -> dict[str, Tensor]:
        return {"momentum_buffer": torch.zeros_like(p, memory_format=torch.contiguous_format)}

    def _update(self, group, grad, param_rows, state_rows, scratch) -> None:
        # The same operations, in the same order, as torch.optim.SGD's single-tensor path.
        d = torch.add(grad, param_rows, alpha=group["weight_decay"], out=scratch) if group["weight_decay"] != 0 \
            else grad
        buf = state_rows["momentum_buffer"]
        buf.mul_(group["momentum"]).add_(d)
        param_rows.add_(buf, alpha=-group["lr"])

    def _update_rows(self, group, p, state, idx, grad, scratch) -> None:
        # The same update with one pass over the weight rows fewer: the decay reads them gathered, the step
        # is added in place (index_add_) instead of gathering, updating and scattering them back.
        wd = group["weight_decay"]
        d = torch.add(grad, torch.index_select(p, 0, idx, out=scratch), alpha=wd, out=scratch) if wd != 0 else grad
        buf = state["momentum_buffer"].index_select(0, idx).mul_(group["momentum"]).add_(d)  # (n, D)
        state["momentum_buffer"].index_copy_(0, idx, buf)
        p.index_add_(0, idx, buf, alpha=-group["lr"])

    def _kernel_update(self, group, p, state, rows, grad) -> None:
        cpu_kernels.sgd_rows(p.data, state["momentum_buffer"], grad, rows, group["lr"], group["momentum"],
                             group["weight_decay"])


def _bias_corrections(step: Tensor, lr: float, betas: tuple[float, float]) -> tuple[Tensor, Tensor]:
    """AdamW's per-row bias corrections at step counts ``step (rows,)``: ``(−lr / (1 − β1^t), sqrt(1 − β2^t))``."""
    beta1, beta2 = betas
    return -lr / (1.0 - torch.pow(beta1, step)), (1.0 - torch.pow(beta2, step)).sqrt_()


class RowSparseAdamW(_RowSparseOptimizer):
    """AdamW (decoupled weight decay) with per-row step counts, touching only the rows present.

    A "lazy Adam": a row's moments, its decay and its bias correction advance only in steps where the
    row is sampled, so ``step`` is a (rows,) fp32 count. On present rows, as ``torch.optim.AdamW``:
    ``w *= 1 − lr·wd; m = β1·m + (1−β1)·g; v = β2·v + (1−β2)·g²;
    w -= lr/(1−β1^t) · m / (sqrt(v)/sqrt(1−β2^t) + eps)``. State: ``exp_avg``, ``exp_avg_sq`` (rows, D)
    and ``step`` (rows,), allocated as zeros at construction.
    """

    _state_keys = ("exp_avg", "exp_avg_sq", "step")

    def __init__(self, params: Iterable[Tensor], lr: float, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 5e-4, *, tactic: Tactic = "auto") -> None:
        if not (lr >= 0.0 and eps >= 0.0 and weight_decay >= 0.0 and all(0.0 <= b < 1.0 for b in betas)):
            raise ValueError(f"RowSparseAdamW: lr={lr} eps={eps} weight_decay={weight_decay} betas={betas}; "
                             f"need lr, eps, weight_decay >= 0 and betas in [0, 1)")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay), tactic)

    def _init_state(self, p: Tensor) -> dict[str, Tensor]:
        return {
            "exp_avg": torch.zeros_like(p, memory_format=torch.contiguous_format),
            "exp_avg_sq": torch.zeros_like(p, memory_format=torch.contiguous_format),
            "step": torch.zeros(p.shape[0], dtype=torch.float32, device=p.device),
        }

    def _update(self, group, grad, param_rows, state_rows, scratch) -> None:
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        step = state_rows["step"]
        step.add_(1.0)
        param_rows.mul_(1.0 - lr * wd)
        exp_avg, exp_avg_sq = state_rows["exp_avg"], state_rows["exp_avg_sq"]
        exp_avg.lerp_(grad, 1.0 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        step_size, bias2_sqrt = _bias_corrections(step, lr, group["betas"])  # (rows,) each
        denom = torch.sqrt(exp_avg_sq, out=scratch).div_(bias2_sqrt[:, None].to(exp_avg_sq.dtype)).add_(eps)  # (rows, D)
        param_rows.addcdiv_(exp_avg * step_size[:, None].to(exp_avg.dtype), denom)

    def _kernel_update(self, group, p, state, rows, grad) -> None:
        if rows is None:
            step = state["step"].add_(1.0)  # (N,)
        else:
            step = state["step"].index_select(0, rows).add_(1.0)  # (n,)
            state["step"].index_copy_(0, rows, step)
        step_size, bias2_sqrt = _bias_corrections(step, group["lr"], group["betas"])  # (n,) each
        cpu_kernels.adamw_rows(p.data, state["exp_avg"], state["exp_avg_sq"], grad, rows, step_size, bias2_sqrt,
                               group["lr"], group["betas"], group["eps"], group["weight_decay"])


# name -> (the backbone's torch optimizer, the head's row-sparse one); momentum is SGD's momentum or AdamW's beta1.
# The backbone's updates one operation per step over all its tensors (foreach): torch's default on CUDA, and on the
# CPU, where torch would loop over the tensors one by one, the same bits in half the time for a small network.
OPTIMIZERS: dict[str, tuple[Callable[..., torch.optim.Optimizer], Callable[..., torch.optim.Optimizer]]] = {
    "sgd": (lambda params, lr, momentum, weight_decay: torch.optim.SGD(
                params, lr=lr, momentum=momentum, weight_decay=weight_decay, foreach=True),
            lambda params, lr, momentum, weight_decay, tactic: RowSparseSGD(
                params, lr=lr, momentum=momentum, weight_decay=weight_decay, tactic=tactic)),
    "adamw": (lambda params, lr, momentum, weight_decay: torch.optim.AdamW(
                  params, lr=lr, betas=(momentum, 0.999), weight_decay=weight_decay, foreach=True),
              lambda params, lr, momentum, weight_decay, tactic: RowSparseAdamW(
                  params, lr=lr, betas=(momentum, 0.999), weight_decay=weight_decay, tactic=tactic)),
}


def _check(name: str, caller: str) -> None:
    if name not in OPTIMIZERS:
        raise ValueError(f"{caller}: unknown optimizer {name!r}; expected one of {sorted(OPTIMIZERS)}")


def build_head_optimizer(head: Any, name: Literal["sgd", "adamw"], lr: float, momentum: float = 0.9,
                         weight_decay: float = 5e-4) -> torch.optim.Optimizer:
    """Row-sparse optimizer over ``head.weight`` (a ``partial_fc.PartialFC``): ``RowSparseSGD`` or
    ``RowSparseAdamW``, with the head's tactic. ``state[head.weight]`` holds tensors whose first dimension
    is ``head.num_local``. Raises ``ValueError`` for an unknown name."""
    _check(name, "build_head_optimizer")
    return OPTIMIZERS[name][1]([head.weight], lr, momentum, weight_decay, head.tactic)


def build_optimizers(name: Literal["sgd", "adamw"], backbone_params: Iterator[nn.Parameter], head: Any, lr: float,
                     momentum: float, weight_decay: float) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    """``(backbone optimizer, head optimizer)`` of the run, from the one table ``OPTIMIZERS``."""
    _check(name, "build_optimizers")
    return (OPTIMIZERS[name][0](backbone_params, lr, momentum, weight_decay),
            build_head_optimizer(head, name, lr, momentum, weight_decay))
