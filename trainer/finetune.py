"""Fine-tuning on small data: what of the backbone is frozen, and when.

Each config key is a no-op at its default, so a run that sets none trains bit for bit as without them:

- ``freeze_stages``: the stem and the first N stages (the backbone's ``stages()``) get ``requires_grad = False``
  before DDP wraps the backbone, so DDP never waits for their gradients; their batch-norm layers stay in eval mode.
- ``freeze_bn``: every batch-norm layer of the backbone in eval mode while training; the affine weights learn.
- ``head_warmup_steps``: for the first steps the step calls the plain backbone (not its DDP wrapper) in eval mode
  under ``no_grad``: the backward stops at the head, and the backbone gets no gradient, all-reduce or update.
- ``backbone_lr_scale``: ``train.optimizer_step`` sets the backbone's LR to the schedule's LR times the scale.

``folded_batch_norms_warning`` is the start line for a model imported from ONNX whose folded batch norms lost
their statistics, when ``freeze_bn`` is off. Why each holds under DDP, accumulation and resume: docs/finetuning.md.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from backbones.onnx_import import FOLDED_KEY
from eval.model_card import card_beside, card_with_thresholds
from utils.config_keys import KEYS

_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


@dataclass(frozen=True)
class FineTuning:
    """What the step needs of the fine-tuning settings: the backbone's batch-norm layers kept in eval mode and
    the number of head-only steps. The default freezes nothing."""

    frozen_bn: tuple[nn.Module, ...] = ()
    head_warmup_steps: int = 0

    def head_only(self, step: int) -> bool:
        """Whether optimizer step ``step`` (0-based) trains the head alone."""
        return step < self.head_warmup_steps

    def set_modes(self, backbone: nn.Module, step: int) -> None:
        """Put ``backbone`` in step ``step``'s modes: eval while the head trains alone, else train mode with the
        frozen batch-norm layers in eval. Called before every step, since verification's ``train()`` puts every
        layer back in train mode; nothing when nothing is frozen (the modules keep their own modes)."""
        if not self.frozen_bn and not self.head_warmup_steps:
            return
        backbone.train(not self.head_only(step))
        for module in self.frozen_bn:
            module.eval()


def prepare(backbone: nn.Module, network: str, lr: float, *, freeze_stages: int, freeze_bn: bool,
            head_warmup_steps: int, backbone_lr_scale: float) -> tuple[FineTuning, str | None]:
    """Freeze the first ``freeze_stages`` stages of ``backbone`` (call it before DDP wraps the backbone) and return
    the step's ``FineTuning`` with the one line that says what is frozen and at what LR each part trains (None
    when every fine-tuning setting is its config key's default). ``network`` names the backbone in errors, ``lr``
    is the head's peak LR. ``ValueError`` when the network has fewer stages."""
    stages: list[tuple[str, tuple[str, ...]]] = []  # the frozen ones: (stage, names of its modules)
    if freeze_stages > 0:
        named = getattr(backbone, "stages", None)
        if named is None:
            raise ValueError(f"freeze_stages = {freeze_stages}: network {network!r} does not name its "
                             f"stages; set freeze_stages = 0")
        every = named()
        if freeze_stages >= len(every):
            raise ValueError(f"freeze_stages = {freeze_stages} is not allowed for network {network!r}: it "
                             f"has {len(every) - 1} stages after its stem ({', '.join(n for n, _ in every[1:])}); "
                             f"expected 0..{len(every) - 1}")
        stages = every[: freeze_stages + 1]
    frozen = [name for _, names in stages for name in names]

    def is_frozen(qualified: str) -> bool:
        return any(qualified == name or qualified.startswith(name + ".") for name in frozen)

    for name, param in backbone.named_parameters():
        if is_frozen(name):
            param.requires_grad_(False)
    frozen_bn = tuple(m for name, m in backbone.named_modules()
                      if isinstance(m, _BATCH_NORMS) and (freeze_bn or is_frozen(name)))
    plan = FineTuning(frozen_bn=frozen_bn, head_warmup_steps=head_warmup_steps)
    settings = {"backbone_lr_scale": backbone_lr_scale, "freeze_bn": freeze_bn, "freeze_stages": freeze_stages,
                "head_warmup_steps": head_warmup_steps}
    if all(value == KEYS[key].default for key, value in settings.items()):
        return plan, None
    parts = [f"backbone lr = {backbone_lr_scale:g} x head lr (peak {lr:g} -> {lr * backbone_lr_scale:g})"]
    if freeze_bn:
        parts.append("batch-norm statistics frozen")
    if stages:
        parts.append(f"stages {stages[0][0]}..{stages[-1][0]} frozen (weights and batch-norm statistics)")
    if head_warmup_steps:
        parts.append(f"head alone for the first {head_warmup_steps} steps")
    return plan, "fine-tuning: " + ", ".join(parts)


def folded_batch_norms_warning(init_backbone: str | None, freeze_bn: bool) -> str | None:
    """The start line for a run that would change its starting model at the first step: ``init_backbone``'s
    model.json says the exporter had folded batch norms into convolutions (an ONNX import: they hold identity
    statistics and the bias), and ``freeze_bn`` is off, so those batch norms would normalise with the batch's
    statistics in training mode. None otherwise, or when the weights have no model.json."""
    if not init_backbone or freeze_bn or not card_beside(init_backbone).is_file():
        return None
    folded = card_with_thresholds(card_beside(init_backbone)).get(FOLDED_KEY, 0)
    if not folded:
        return None
    return (f"init_backbone {init_backbone}: {folded} of its batch norms were folded into convolutions by the ONNX "
            f"exporter and have no statistics (model.json); with freeze_bn = False they normalise with each "
            f"batch's and change the model at the first step: set freeze_bn = True (docs/finetuning.md)")
