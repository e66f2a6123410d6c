"""Load backbone weights (ours or the official insightface files) safely and with one clear error.

Weight files are plain state_dicts; they are read with ``torch.load(weights_only=True)``, so a file crafted
to run code when unpickled is refused instead of executed.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn


def load_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """The state_dict in ``path``; a checkpoint dict holding it under "backbone" is accepted too."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"weights file not found: {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle.UnpicklingError for hostile or foreign files, RuntimeError for bad zips
        raise ValueError(f"{path}: not a loadable weights file ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else ''})") from exc
    if isinstance(state, dict) and "backbone" in state and isinstance(state["backbone"], dict):
        state = state["backbone"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{path}: expected a state_dict (a dict of tensors), got {type(state).__name__}")
    # Weights saved from a DDP-wrapped model carry a "module." prefix on every key.
    if state and all(k.startswith("module.") for k in state):
        state = {k[len("module."):]: v for k, v in state.items()}
    return state


def load_weights(model: nn.Module, path: str | Path, network: str = "") -> nn.Module:
    """Load ``path`` into ``model`` with ``strict=True``; a mismatch raises one ``ValueError`` line."""
    state = load_state_dict(path)
    expected = model.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    wrong = [f"{k} {tuple(state[k].shape)} != {tuple(v.shape)}" for k, v in expected.items()
             if k in state and state[k].shape != v.shape]
    if missing or unexpected or wrong:
        parts = []
        for label, items in (("missing keys", missing), ("unexpected keys", unexpected), ("shape mismatch", wrong)):
            if items:
                parts.append(f"{len(items)} {label} (e.g. {', '.join(items[:3])})")
        raise ValueError(f"{path} does not match network {network or type(model).__name__}: " + "; ".join(parts))
    model.load_state_dict(state, strict=True)
    return model
