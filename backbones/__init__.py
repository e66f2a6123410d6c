"""Face-recognition backbones by name: ``get_model("r50")``, ``list_models()``.

Importing the variant modules registers them; state_dict keys follow the official insightface layout.
Parameter / multiply-add counts: ``backbones.flops.count_flops`` or ``python -m backbones.flops NAME``.
"""
from . import iresnet, mobilefacenet, vit  # noqa: F401  (registration side effect)
from .registry import get_model, list_models, register_model

__all__ = ["get_model", "list_models", "register_model"]
