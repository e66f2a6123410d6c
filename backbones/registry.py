"""Name → builder registry for backbones (timm style).

Every variant is registered with :func:`register_model` as a few lines over one shared constructor;
:func:`get_model` builds one by name and checks its keyword arguments before calling the builder, so a
typo or an ``arcface_torch`` habit (``fp16=True``) fails with a message that says what is accepted.
"""
from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

from torch import nn

ModelBuilder = Callable[..., nn.Module]
_B = TypeVar("_B", bound=ModelBuilder)

_REGISTRY: dict[str, ModelBuilder] = {}

# Keyword arguments that arcface_torch's get_model accepts but that have no place inside a model here.
_REJECTED_KWARGS: dict[str, str] = {
    "fp16": (
        "precision is the trainer's choice, not the model's: build the model in fp32 and let the "
        "trainer wrap the forward in torch.autocast (and a GradScaler for float16)"
    ),
}


def register_model(fn: _B) -> _B:
    """Register ``fn`` under its function name; it must accept ``num_features`` and ``dropout``."""
    name = fn.__name__
    if name in _REGISTRY:
        raise ValueError(f"backbone {name!r} is registered twice ({_REGISTRY[name].__module__} and {fn.__module__})")
    params = inspect.signature(fn).parameters
    missing = [p for p in ("num_features", "dropout") if p not in params]
    if missing:
        raise ValueError(f"backbone builder {fn.__module__}.{name} lacks the argument(s) {missing}")
    _REGISTRY[name] = fn
    return fn


def list_models() -> list[str]:
    """Names of every registered backbone, sorted."""
    return sorted(_REGISTRY)


def get_model(name: str, num_features: int = 512, dropout: float = 0.0, **kwargs: Any) -> nn.Module:
    """Build the backbone ``name`` mapping (N, 3, H, W) normalised images to (N, num_features).

    ``kwargs`` go to the variant's builder (e.g. ``widths=`` for ``tiny``,
    ``activation_checkpointing=True`` for every variant). Raises ``ValueError`` for an unknown name,
    an unknown keyword argument, or ``fp16=`` (precision belongs to the trainer).
    """
    for key, why in _REJECTED_KWARGS.items():
        if key in kwargs:
            raise ValueError(f"get_model({name!r}, {key}={kwargs[key]!r}): {key} is not accepted; {why}")
    if name not in _REGISTRY:
        close = difflib.get_close_matches(name, list(_REGISTRY), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown backbone {name!r}{hint}; valid names: {', '.join(list_models())}")
    builder = _REGISTRY[name]
    accepted = [p for p in inspect.signature(builder).parameters if p not in ("num_features", "dropout")]
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise ValueError(
            f"get_model({name!r}): unknown keyword argument(s) {unknown}; "
            f"{name!r} accepts num_features, dropout{''.join(', ' + a for a in accepted)}"
        )
    if num_features < 1:
        raise ValueError(f"get_model({name!r}): num_features must be >= 1, got {num_features}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"get_model({name!r}): dropout must be in [0, 1), got {dropout}")
    return builder(num_features=num_features, dropout=dropout, **kwargs)
