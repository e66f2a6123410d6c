"""Optimizers: the row-sparse ones of the Partial FC head, and the one table that picks both of a run.

``build_optimizers(name, ...)`` returns the backbone's torch optimizer and the head's row-sparse one for the
config's ``optimizer`` ("sgd" | "adamw", the table ``OPTIMIZERS``), with the same hyper-parameters (``momentum``
is SGD's momentum and AdamW's beta1). ``RowSparseSGD`` and ``RowSparseAdamW`` update only the rows present in a
sparse gradient and their state (the original Partial FC method); a dense gradient updates every row, as torch's
optimizers do. Every state tensor has one row per class, so checkpoints re-partition it row by row.
See docs/partial_fc.md#sampling.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal

import torch
from torch import Tensor, nn

__all__ = ["OPTIMIZERS", "RowSparseAdamW", "RowSparseSGD", "build_head_optimizer", "build_optimizers"]


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
    """Base: eager row-wise state, and ``step`` routing dense and row-sparse gradients to the update.

    Every update is a fixed number of whole-tensor operations over the rows present (all rows for a dense
    gradient). The step consumes the gradient: it writes ``g + wd·w`` (SGD) over the gradient's values instead
    of into a second ``(rows, D)`` tensor, which at sample rate 1 would be a whole shard more memory; read a
    gradient before the step, as the trainer's skip-or-step decision does.
    """

    _state_keys: tuple[str, ...] = ()

    def __init__(self, params: Iterable[Tensor], defaults: dict[str, Any]) -> None:
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p] = self._init_state(p)

    def _init_state(self, p: Tensor) -> dict[str, Tensor]:
        raise NotImplementedError

    def _update(self, group: dict[str, Any], p: Tensor, state: dict[str, Tensor], grad: Tensor) -> None:
        """Update every row of ``p`` and of its state in place from the dense ``grad`` (which it may overwrite)."""
        raise NotImplementedError

    def _update_rows(self, group: dict[str, Any], p: Tensor, state: dict[str, Tensor], rows: Tensor,
                     grad: Tensor) -> None:
        """Update rows ``rows (n,)`` of ``p`` and of its state from their gradient ``grad (n, D)`` (which it may
        overwrite); other rows and their state stay as they are."""
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
                rows, values = _rows_of(p.grad)
                if rows is None:
                    self._update(group, p, self.state[p], values)
                else:
                    self._update_rows(group, p, self.state[p], rows, values)
        return loss


class RowSparseSGD(_RowSparseOptimizer):
    """SGD with momentum and weight decay that only touches the rows present in the gradient.

    On those rows the update is ``torch.optim.SGD``'s (dampening 0, no Nesterov), to the bit:
    ``d = g + wd·w; buf = momentum·buf + d; w -= lr·buf``; other rows, their momentum and their decay
    are left alone. State: ``momentum_buffer`` (rows, D), allocated as zeros at construction.
    """

    _state_keys = ("momentum_buffer",)

    def __init__(self, params: Iterable[Tensor], lr: float, momentum: float = 0.9,
                 weight_decay: float = 5e-4) -> None:
        for name, value in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay)):
            if not value >= 0.0:
                raise ValueError(f"RowSparseSGD: {name}={value} must be >= 0")
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))

    def _init_state(self, p: Tensor) -> dict[str, Tensor]:
        return {"momentum_buffer": torch.zeros_like(p, memory_format=torch.contiguous_format)}

    def _update(self, group, p, state, grad) -> None:
        # torch.optim.SGD's operations, in its order: d = g + wd·w, buf = m·buf + d, w -= lr·buf.
        d = grad.add_(p, alpha=group["weight_decay"]) if group["weight_decay"] != 0 else grad
        buf = state["momentum_buffer"].mul_(group["momentum"]).add_(d)
        p.add_(buf, alpha=-group["lr"])

    def _update_rows(self, group, p, state, rows, grad) -> None:
        # The same on gathered rows, in one (n, D) work tensor: the rows' weights for the decay term, then their
        # momentum; the step is added in place (index_add_) instead of scattering updated weight rows back.
        wd, momentum = group["weight_decay"], state["momentum_buffer"]
        work = torch.index_select(p, 0, rows) if wd != 0 else None  # (n, D)
        d = grad.add_(work, alpha=wd) if wd != 0 else grad  # (n, D)
        buf = torch.index_select(momentum, 0, rows, out=work).mul_(group["momentum"]).add_(d)  # (n, D)
        momentum.index_copy_(0, rows, buf)
        p.index_add_(0, rows, buf, alpha=-group["lr"])


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
                 eps: float = 1e-8, weight_decay: float = 5e-4) -> None:
        if not (lr >= 0.0 and eps >= 0.0 and weight_decay >= 0.0 and all(0.0 <= b < 1.0 for b in betas)):
            raise ValueError(f"RowSparseAdamW: lr={lr} eps={eps} weight_decay={weight_decay} betas={betas}; "
                             f"need lr, eps, weight_decay >= 0 and betas in [0, 1)")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    def _init_state(self, p: Tensor) -> dict[str, Tensor]:
        return {
            "exp_avg": torch.zeros_like(p, memory_format=torch.contiguous_format),
            "exp_avg_sq": torch.zeros_like(p, memory_format=torch.contiguous_format),
            "step": torch.zeros(p.shape[0], dtype=torch.float32, device=p.device),
        }

    def _update(self, group, p, state, grad) -> None:
        self._adamw(group, p, state["exp_avg"], state["exp_avg_sq"], state["step"], grad)

    def _update_rows(self, group, p, state, rows, grad) -> None:
        rows_of = {k: state[k].index_select(0, rows) for k in self._state_keys}  # gathered copies
        weight = p.index_select(0, rows)  # (n, D)
        self._adamw(group, weight, rows_of["exp_avg"], rows_of["exp_avg_sq"], rows_of["step"], grad)
        p.index_copy_(0, rows, weight)
        for key, value in rows_of.items():
            state[key].index_copy_(0, rows, value)

    @staticmethod
    def _adamw(group, weight: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, step: Tensor, grad: Tensor) -> None:
        """torch.optim.AdamW's update of ``weight (n, D)`` and its moments in place, with per-row ``step (n,)``."""
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        step.add_(1.0)
        weight.mul_(1.0 - lr * wd)
        exp_avg.lerp_(grad, 1.0 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        step_size = -lr / (1.0 - torch.pow(beta1, step))  # (n,)
        bias2_sqrt = (1.0 - torch.pow(beta2, step)).sqrt_()  # (n,)
        # The gradient is no longer needed: the denominator is written over it.
        denom = torch.sqrt(exp_avg_sq, out=grad).div_(bias2_sqrt[:, None]).add_(eps)  # (n, D)
        weight.addcdiv_(exp_avg * step_size[:, None], denom)


# name -> (the backbone's torch optimizer, the head's row-sparse one); momentum is SGD's momentum or AdamW's beta1.
# The backbone's updates one operation per step over all its tensors (foreach): torch's default on CUDA, and on the
# CPU, where torch would otherwise loop over the tensors one by one; the same bits either way.
OPTIMIZERS: dict[str, tuple[Callable[..., torch.optim.Optimizer], Callable[..., torch.optim.Optimizer]]] = {
    "sgd": (lambda params, lr, momentum, weight_decay: torch.optim.SGD(
                params, lr=lr, momentum=momentum, weight_decay=weight_decay, foreach=True),
            lambda params, lr, momentum, weight_decay: RowSparseSGD(
                params, lr=lr, momentum=momentum, weight_decay=weight_decay)),
    "adamw": (lambda params, lr, momentum, weight_decay: torch.optim.AdamW(
                  params, lr=lr, betas=(momentum, 0.999), weight_decay=weight_decay, foreach=True),
              lambda params, lr, momentum, weight_decay: RowSparseAdamW(
                  params, lr=lr, betas=(momentum, 0.999), weight_decay=weight_decay)),
}


def _check(name: str, caller: str) -> None:
    if name not in OPTIMIZERS:
        raise ValueError(f"{caller}: unknown optimizer {name!r}; expected one of {sorted(OPTIMIZERS)}")


def build_head_optimizer(head: Any, name: Literal["sgd", "adamw"], lr: float, momentum: float = 0.9,
                         weight_decay: float = 5e-4) -> torch.optim.Optimizer:
    """Row-sparse optimizer over ``head.weight`` (a ``PartialFC``): ``RowSparseSGD`` or
    ``RowSparseAdamW``. ``state[head.weight]`` holds tensors whose first dimension
    is ``head.num_local``. Raises ``ValueError`` for an unknown name."""
    _check(name, "build_head_optimizer")
    return OPTIMIZERS[name][1]([head.weight], lr, momentum, weight_decay)


def build_optimizers(name: Literal["sgd", "adamw"], backbone_params: Iterator[nn.Parameter], head: Any, lr: float,
                     momentum: float, weight_decay: float) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    """``(backbone optimizer, head optimizer)`` of the run, from the one table ``OPTIMIZERS``."""
    _check(name, "build_optimizers")
    return (OPTIMIZERS[name][0](backbone_params, lr, momentum, weight_decay),
            build_head_optimizer(head, name, lr, momentum, weight_decay))
