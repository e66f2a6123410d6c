"""Every configuration key, declared once: default, type, value rule, meaning, and its roles.

``SECTIONS`` is the one table of keys, in the order and sections of ``configs/base.py``. Everything else that
knows a key is derived from it: the loader's type checks, value rules and "did you mean" hints
(``utils.config``), the fingerprint (``fingerprint=False``: the key does not change what the model learns;
``legacy``: the value at which a key added later trains as the code did before it existed), what a resume may
change (``on_resume``), the secrets kept out of logs and checkpoints, ``configs/base.py`` itself and the key
table of docs/configuration.md (both written by ``python -m utils.config``). Adding a key is one ``Key(...)``
here; docs/configuration.md ("Adding a key") says what else to run.
"""
from __future__ import annotations

import math
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal

__all__ = ["COMMON_NAMES", "FINGERPRINT_EXCLUDED", "FINGERPRINT_LEGACY", "FIXED_KEYS", "KEYS", "SCHEDULE_KEYS",
           "SECRET_KEYS", "SECTIONS", "Key", "Rule", "type_name"]

Rule = tuple[Callable[[Any], bool], str]  # (check of a value of the right type, what is allowed: for the error)
_NO_LEGACY = object()


@dataclass(frozen=True)
class Key:
    """One configuration key.

    ``type``: ``bool``, ``int``, ``float`` (an int is accepted), ``str``, ``dict`` (str keys), ``tuple[T, ...]`` or
    ``list[T]`` (a list or tuple of T, stored as a tuple), ``T | None``, or ``bool | str``. ``rule``: the values
    of that type that are allowed. ``on_resume``: what an explicit resume that changes the key does: "free" (goes
    on with the new value), "schedule" (the learning-rate schedule continues from the saved step), "fixed" (refused:
    the saved state cannot serve another value; ``reason`` says why). ``aliases``: names users type for it (other
    trainers' and tutorials'), suggested before the nearest spelling. ``type_note``: what a ``str`` means where
    the type alone does not say.
    """

    name: str
    default: Any
    type: Any
    doc: str
    rule: Rule | None = None
    fingerprint: bool = True
    legacy: Any = _NO_LEGACY
    on_resume: Literal["free", "schedule", "fixed"] = "free"
    reason: str = ""
    secret: bool = False
    aliases: tuple[str, ...] = ()
    type_note: str = ""

    def __post_init__(self) -> None:
        assert (self.on_resume == "fixed") == bool(self.reason), f"{self.name}: a reason is given iff on_resume = fixed"
        assert self.fingerprint or (self.legacy is _NO_LEGACY and self.on_resume == "free"), (
            f"{self.name}: a key outside the fingerprint has no legacy value and no resume role")

    @property
    def has_legacy(self) -> bool:
        return self.legacy is not _NO_LEGACY

    @property
    def expected(self) -> str:
        """The type as an error says what is expected: "int", "str or None", "bool or str (a checkpoint path)"."""
        return type_name(self.type) + (f" ({self.type_note})" if self.type_note else "")


@dataclass(frozen=True)
class Section:
    """A titled group of keys: a ``# ---- title`` block of configs/base.py."""

    title: str
    keys: tuple[Key, ...]


def type_name(spec: Any) -> str:
    """How a declared type reads in an error: "int", "float (or int)", "list/tuple of str", "str or None", ..."""
    origin, args = typing.get_origin(spec), typing.get_args(spec)
    if origin in (types.UnionType, typing.Union):
        return " or ".join("None" if a is type(None) else type_name(a) for a in args)
    if origin in (list, tuple):
        return f"list/tuple of {type_name(args[0])}"
    return "float (or int)" if spec is float else spec.__name__


def _finite(x: float) -> bool:
    return math.isfinite(x)


def _is_compile_backend(name: str) -> bool:
    import torch

    return name in torch.compiler.list_backends(exclude_tags=())


SECTIONS: tuple[Section, ...] = (
    Section("model", (
        Key("network", "r50", str,
            "Backbone name in the `backbones` registry: r18 | r34 | r50 | r100 | r200 | r2060 | mbf | mbf_large | "
            "vit_t | vit_t_dp005_mask0 | vit_s | vit_s_dp005_mask_0 | vit_b | vit_b_dp005_mask_005 | "
            "vit_l_dp005_mask_005 | vit_h | tiny.",
            rule=(lambda v: bool(v.strip()), "a backbone name such as r50, r100, mbf, tiny"),
            on_resume="fixed", reason="the saved weights are that network's", aliases=("backbone", "arch", "model")),
        Key("network_kwargs", {}, dict,
            'Extra keyword arguments for backbones.get_model (dict), e.g. {"widths": (8, 16, 16, 32)} for `tiny`.',
            on_resume="fixed", reason="the saved weights have that network's shapes"),
        Key("embedding_size", 512, int,
            "Dimension of the face embedding (the backbone output and the Partial FC class centres); >= 1.",
            rule=(lambda v: v >= 1, ">= 1"), on_resume="fixed",
            reason="the saved weights and class centres have that width",
            aliases=("emb_size", "embedding_dim", "feature_dim")),
        Key("init_backbone", None, str | None,
            "Path of a backbone state_dict (.pt/.pth, e.g. an official model.pt) to start from, or None for random "
            "init. Ignored when the run resumes from a checkpoint (the checkpoint's weights win).",
            rule=(lambda v: v is None or bool(v.strip()), "a file path or None")),
        Key("channels_last", False, bool,
            "Store activations in channels-last memory format (faster convolutions on recent GPUs; same results). "
            "Refused on the CPU for backbones with a strided 1x1 convolution of fewer than 16 input channels (narrow "
            "`tiny` widths), whose weight gradient oneDNN's CPU kernel computes out of bounds in that format.",
            fingerprint=False),
        Key("compile", False, bool,
            "Compile the backbone with torch.compile (faster steps on GPUs after a first slow step; same results up "
            "to rounding). The saved weights and model.pt are the plain module's.",
            fingerprint=False),
        Key("compile_backend", "inductor", str,
            'torch.compile backend when compile = True: "inductor" (generated kernels, the fast one) or another of '
            'torch.compiler.list_backends(), e.g. "aot_eager" (traced, not code-generated: for debugging). On the '
            "CPU, inductor lays convolutions out channels-last, so it is refused where channels_last is (see above).",
            rule=(_is_compile_backend, "a torch.compile backend, e.g. 'inductor' or 'aot_eager'"), fingerprint=False),
    )),
    Section("margin loss", (
        Key("margin", "combined", str,
            'Margin: "combined" (the margin_list formula below: ArcFace, CosFace and their combinations) | "adaface" '
            "(AdaFace, CVPR 2022: each sample's margin follows its embedding norm relative to running statistics of "
            "the norms; set by adaface_m, adaface_h, adaface_t_alpha and margin_scale; margin_list does not apply "
            "and interclass filtering is refused). AdaFace's paper differentiates through its margin: "
            'margin_gradient = "exact".',
            rule=(lambda v: v in ("combined", "adaface"), "'combined' (margin_list) or 'adaface'"), legacy="combined",
            on_resume="fixed", reason="the head's saved state is that margin's: AdaFace keeps running norm statistics"),
        Key("margin_list", (1.0, 0.5, 0.0), tuple[float, ...],
            "Combined margin (m1, m2, m3): target logit s * (cos(m1 * theta + m2) - m3). ArcFace: (1.0, 0.5, 0.0); "
            "CosFace: (1.0, 0.0, 0.4). m1 >= 1, 0 <= m2 < pi/2, m3 >= 0.",
            rule=(lambda v: len(v) == 3 and all(_finite(x) for x in v) and v[0] >= 1 and 0 <= v[1] < math.pi / 2
                  and v[2] >= 0, "3 finite numbers (m1, m2, m3) with m1 >= 1, 0 <= m2 < pi/2, m3 >= 0"),
            aliases=("scale",)),
        Key("margin_scale", 64.0, float,
            "Logit scale s (the radius of the hypersphere); > 0.",
            rule=(lambda v: _finite(v) and v > 0, "> 0")),
        Key("margin_gradient", "straight_through", str,
            'Gradient through the margin: "straight_through" (as arcface_torch: the margin is applied without '
            'gradient, so d(target logit)/d(cos theta) is taken as 1) | "exact" (differentiate s * (cos(m1*theta + '
            "m2) - m3), or AdaFace's formula as its authors' code does).",
            rule=(lambda v: v in ("straight_through", "exact"), "'straight_through' or 'exact'")),
        Key("interclass_filtering_threshold", 0.0, float,
            "Inter-class filtering (arcface_torch): a sample's non-target cosines above this threshold are zeroed "
            "(likely label noise: the same person filed under two identities). 0 = off; range [0, 1).",
            rule=(lambda v: 0 <= v < 1, "in [0, 1) (0 = off)")),
        Key("adaface_m", 0.4, float,
            "AdaFace margin m (its paper: 0.4): the target logit is s * (cos(theta + g_angle) - g_add) with g_angle "
            "= -m * q and g_add = m + m * q for a quality q in [-1, 1] from the norm; >= 0.",
            rule=(lambda v: _finite(v) and v >= 0, "a finite value >= 0 (AdaFace's paper: 0.4)"), legacy=0.4),
        Key("adaface_h", 0.333, float,
            "AdaFace h (its paper: 0.333): q = clip(h * (norm - running mean) / running std, -1, 1); >= 0.",
            rule=(lambda v: _finite(v) and v >= 0, "a finite value >= 0 (AdaFace's paper: 0.333)"), legacy=0.333),
        Key("adaface_t_alpha", 0.01, float,
            "AdaFace t_alpha (its paper: 0.01): weight of each global batch in the running mean and std of the "
            "embedding norms; in (0, 1].",
            rule=(lambda v: 0 < v <= 1, "in (0, 1] (AdaFace's paper: 0.01)"), legacy=0.01),
    )),
    Section("Partial FC", (
        Key("sample_rate", 1.0, float,
            "Fraction of class centres sampled per step (all positives + random negatives); range (0, 1]. 1 = full "
            "softmax.",
            rule=(lambda v: 0 < v <= 1, ("in (0, 1] (arcface_torch's 0, which keeps only the class centres of the "
                                         "batch's identities, is written here as a rate below 1 / num_classes, "
                                         "e.g. 1e-7)")),
            aliases=("sample_ratio", "pfc_rate")),
        Key("sub_centers", 1, int,
            "Centres per class (sub-center ArcFace, ECCV 2020): a class's cosine is that of its closest centre, so "
            "noisy images of a class gather at a secondary centre instead of pulling the main one; 1 = one centre; "
            ">= 1.",
            rule=(lambda v: v >= 1, ">= 1 (1 = one centre per class)"), legacy=1,
            on_resume="fixed", reason="the head holds that many saved centres per class"),
        Key("head_update", "sampled", str,
            'What a step updates when sample_rate < 1: "sampled" (the Partial FC paper: only the sampled class '
            'centres and their optimizer state) | "all" (arcface_torch: every centre every step; momentum and weight '
            "decay also move unsampled ones; to reproduce its published numbers exactly). The same at sample_rate = "
            "1.",
            rule=(lambda v: v in ("sampled", "all"), ("'sampled' (only the sampled centres, the Partial FC paper) "
                                                      "or 'all' (every centre every step, arcface_torch)")),
            legacy="sampled"),
        Key("compile_head", False, bool,
            "Run the fused margin-softmax's collective-free parts (cosines -> logits -> each row's max and "
            "exponentials; the local part of the backward) through torch.compile: fused loops with fewer passes over "
            "the (B, C) cosines, C++ on the CPU and Triton on CUDA from the same source; the same results up to "
            "rounding, after a first slow step. Meant for GPUs: on CPUs inductor's loops measured slower than eager "
            "(bench/README.md).",
            fingerprint=False),
    )),
    Section("precision", (
        Key("fp16", False, bool,
            "Mixed precision with float16 autocast and dynamic loss scaling (one skip-or-step decision for backbone "
            "and head on every rank; the scale backs off on a skip and doubles after 100 good steps). Not together "
            "with bf16.",
            aliases=("amp", "mixed_precision")),
        Key("bf16", False, bool,
            "Mixed precision with bfloat16 autocast (no loss scaling needed). Not together with fp16."),
        Key("tf32", True, bool,
            "Let fp32 matrix products and convolutions use TF32 tensor cores on CUDA (faster, ~1e-3 relative "
            "rounding, as most trainers do); False = full fp32. Ignored on the CPU.",
            fingerprint=False),
        Key("cudnn_benchmark", True, bool,
            "cuDNN times its convolution algorithms on the first batches and keeps the fastest for each shape (the "
            "input size is fixed: 112x112), as arcface_torch sets it; False = cuDNN's heuristics. Ignored on the "
            "CPU.",
            fingerprint=False),
    )),
    Section("optimisation", (
        Key("batch_size", 128, int,
            "Images per rank per forward pass (micro-batch); >= 1. Global batch = batch_size * world_size.",
            rule=(lambda v: v >= 1, ">= 1"), aliases=("batchsize", "bs", "batch")),
        Key("optimizer", "sgd", str,
            "Optimizer for backbone and head: \"sgd\" | \"adamw\". arcface_torch's AdamW recipes use lr 0.001, wd 0.1.",
            rule=(lambda v: v in ("sgd", "adamw"), "'sgd' or 'adamw'"),
            on_resume="fixed", reason="the saved optimizer state is that optimizer's"),
        Key("lr", 0.1, float,
            "Peak learning rate (reached at the end of warm-up, then polynomial decay to 0 with power lr_power); > "
            "0.",
            rule=(lambda v: _finite(v) and v > 0, "> 0"), on_resume="schedule",
            aliases=("learning_rate", "lr_rate", "base_lr")),
        Key("lr_power", 1.0, float,
            "Power of the decay after warm-up: lr * (1 - progress) ** lr_power. 1 = linear, as arcface_torch's "
            "current trainer; 2 = its older PolyScheduler and this trainer before the key existed (checkpoints "
            "written then resume with lr_power = 2); finite and > 0.",
            rule=(lambda v: _finite(v) and v > 0, "finite and > 0 (1 = linear decay, 2 = quadratic)"), legacy=2.0,
            on_resume="schedule"),
        Key("momentum", 0.9, float,
            "SGD momentum, or AdamW beta1; range [0, 1).",
            rule=(lambda v: 0 <= v < 1, "in [0, 1)"), aliases=("momentum_sgd",)),
        Key("weight_decay", 0.0005, float,
            "Weight decay (L2 for SGD, decoupled for AdamW); >= 0.",
            rule=(lambda v: _finite(v) and v >= 0, ">= 0"), aliases=("wd", "weightdecay")),
        Key("gradient_acc", 1, int,
            "Micro-batches accumulated per optimizer step; >= 1. The LR schedule counts optimizer steps.",
            rule=(lambda v: v >= 1, ">= 1")),
        Key("clip_grad_norm", 5.0, float,
            "Clip the backbone's gradient norm to this value (arcface_torch clips at 5); 0 = no clipping; >= 0.",
            rule=(lambda v: _finite(v) and v >= 0, ">= 0 (0 = no clipping)"), aliases=("grad_clip", "clip_grad")),
        Key("max_nonfinite_steps", 10, int,
            "Stop the job after this many optimizer steps in a row skipped for a non-finite loss or gradient; >= 1.",
            rule=(lambda v: v >= 1, ">= 1"), fingerprint=False),
        Key("skip_bad_images", False, bool,
            "An image that cannot be read or decoded stops the run with one line naming it (False), or is left out "
            "of its batch and listed in the log (True).",
            legacy=False),
    )),
    Section("fine-tuning (docs/finetuning.md)", (
        Key("backbone_lr_scale", 1.0, float,
            "The backbone's learning rate as a multiple of the head's (the schedule's lr): a backbone that starts "
            "from init_backbone moves less than the fresh head; finite and > 0 (1 = both at lr).",
            rule=(lambda v: _finite(v) and v > 0, ("finite and > 0 (1 = the head's lr; to keep the backbone as it "
                                                   "is, set head_warmup_steps to the run's length instead)")),
            legacy=1.0),
        Key("freeze_bn", False, bool,
            "Keep every batch-norm layer of the backbone in eval mode while training: it normalises with its running "
            "statistics and never updates them (small or one-sided data estimates them worse than the pre-training "
            "did); its affine weights still train unless their stage is frozen.",
            legacy=False),
        Key("freeze_stages", 0, int,
            "Freeze the stem and the first N stages of the backbone (no gradient, no update, batch-norm statistics "
            "kept): IResNet stem = conv1/bn1/prelu, stages layer1..layer4; MobileFaceNet stem = its first two units, "
            "stages = each stride-2 bottleneck with its residual blocks (3); ViT stem = patch_embed and pos_embed, "
            "stages = its blocks (depth). 0 = nothing frozen; >= 0 and at most the network's stage count.",
            rule=(lambda v: v >= 0, ">= 0 (0 = nothing frozen; at most the network's stage count, docs/finetuning.md)"),
            legacy=0),
        Key("head_warmup_steps", 0, int,
            "Train the head alone for this many optimizer steps: the backbone runs as at inference (eval mode, no "
            "gradient) and stays bit for bit as it is, so the fresh class centres settle before their gradients "
            "reach the backbone; then the whole network trains. Counted in optimizer steps from step 0 (a resumed "
            "run inside it continues it); >= 0 (0 = none).",
            rule=(lambda v: v >= 0, ">= 0 (0 = no head-only steps)"), legacy=0),
    )),
    Section("data", (
        Key("rec", "synthetic", str,
            "Training data: a folder holding train.rec/train.idx (insightface RecordIO), a folder of identity "
            'folders, or "synthetic" (random images, for speed tests and CI).',
            rule=(lambda v: bool(v.strip()), "a dataset folder or 'synthetic'"),
            aliases=("data", "data_dir", "data_root", "train_data")),
        Key("num_classes", None, int | None,
            "Number of identities (classes) in the training set; >= 1 and >= world size. None = what the dataset "
            "says (its property file or header record, the identity folders), filled in and logged by the trainer; "
            "synthetic data and the DALI loader need it set.",
            rule=(lambda v: v is None or v >= 1, ">= 1, or None for what the dataset says"),
            on_resume="fixed", reason="the head holds one saved row per class",
            aliases=("classes", "num_class", "n_classes")),
        Key("num_image", None, int | None,
            "Number of training images; it sets the steps per epoch (num_image // (batch_size * world * "
            "gradient_acc)). None = what the dataset holds (its index, the image files; synthetic data: 10 per "
            "class), filled in and logged by the trainer.",
            rule=(lambda v: v is None or v >= 1, ">= 1, or None for what the dataset holds"), aliases=("num_images",)),
        Key("num_epoch", 20, int,
            "Epochs to train; >= 1 unless max_steps > 0.",
            rule=(lambda v: v >= 0, ">= 0 (and >= 1 unless max_steps > 0)"), on_resume="schedule",
            aliases=("epochs", "epoch", "num_epochs", "max_epoch", "max_epochs")),
        Key("warmup_epoch", 0, int,
            "Epochs of linear learning-rate warm-up from 0 (0 = none); >= 0.",
            rule=(lambda v: v >= 0, ">= 0 (arcface_torch's -1 trains as 0 there, with no warm-up: write 0)"),
            on_resume="schedule", aliases=("warmup", "warmup_epochs")),
        Key("max_steps", 0, int,
            "Train for this many optimizer steps instead of num_epoch epochs; 0 = derive from num_epoch; >= 0.",
            rule=(lambda v: v >= 0, ">= 0 (0 = derive from num_epoch)"), on_resume="schedule",
            aliases=("steps", "iterations", "max_iter")),
        Key("dali", False, bool,
            "NVIDIA DALI loader (GPU JPEG decoding; needs the optional nvidia-dali package, e.g. "
            "nvidia-dali-cuda120, a CUDA device and num_classes set). Fed by index: the PyTorch loader's batches and "
            "flips, and a resumed run starts at its step without decoding the batches before it.",
            fingerprint=False),
        Key("dali_aug", False, bool,
            "arcface_torch's extra DALI augmentation (random down-and-up resize, blur, hue/saturation shift, "
            "grayscale). Refused: only False is accepted. Our loaders make every image a function of (seed, epoch, "
            "sample) so that a resumed or resized run sees the same batches, and DALI's GPU operators have no exact "
            "CPU counterpart, so the two loaders would train on different images. Recipes that set it train without "
            "it (their docstring says so).",
            rule=(lambda v: v is False, ("False: arcface_torch's DALI augmentation is not implemented, because our "
                                         "loaders make every image a function of (seed, epoch, sample) and DALI's GPU "
                                         "operators have no exact CPU counterpart; set dali_aug = False to train "
                                         "with flips only")),
            legacy=False),
        Key("num_workers", 2, int,
            "Data-loading worker processes per rank; >= 0 (0 = load in the training process).",
            rule=(lambda v: v >= 0, ">= 0"), fingerprint=False, aliases=("workers", "num_worker")),
        Key("seed", 2048, int,
            "Seed for weights, Partial FC sampling, shuffling and flips; >= 0.",
            rule=(lambda v: v >= 0, ">= 0")),
    )),
    Section("evaluation and logging", (
        Key("val_targets", ["lfw", "cfp_fp", "agedb_30"], list[str],
            "Verification sets evaluated during training, looked up as <rec>/<name>.bin (missing files are skipped).",
            fingerprint=False),
        Key("verbose", 2000, int,
            "Evaluate on val_targets every this many optimizer steps; >= 1.",
            rule=(lambda v: v >= 1, ">= 1"), fingerprint=False),
        Key("frequent", 10, int,
            "Log loss, throughput and learning rate every this many optimizer steps; >= 1.",
            rule=(lambda v: v >= 1, ">= 1"), fingerprint=False),
        Key("using_wandb", False, bool,
            "Weights & Biases (arcface_torch's keys): rank 0 also logs to a wandb run, in <output>/wandb. Needs the "
            "optional wandb package (pip install wandb); WANDB_MODE=offline logs without a network (wandb sync "
            "uploads later). A run that cannot start is one warning and training goes on.",
            fingerprint=False),
        Key("wandb_key", None, str | None,
            "wandb API key; None = the login wandb already has (wandb login, WANDB_API_KEY); arcface_torch's "
            "placeholder of X's counts as None. Never logged, saved in checkpoints or written to ~/.netrc.",
            fingerprint=False, secret=True),
        Key("wandb_entity", None, str | None,
            "Team or user the run belongs to; None = wandb's default entity.",
            fingerprint=False),
        Key("wandb_project", None, str | None,
            "wandb project; None = wandb's default.",
            fingerprint=False),
        Key("suffix_run_name", None, str | None,
            "The run's name is its start time (yymmdd_HHMM), then \"_\" and this suffix when set.",
            fingerprint=False),
        Key("notes", None, str | None,
            "Notes shown with the wandb run; None = none.",
            fingerprint=False),
        Key("wandb_log_all", True, bool,
            "True: the run receives everything TensorBoard does (train/ at every progress line, val/); False: val/ "
            "only.",
            fingerprint=False),
        Key("save_artifacts", False, bool,
            "True: every model.pt written at an epoch end or the last step becomes a new version of the run's model "
            "artifact.",
            fingerprint=False),
        Key("wandb_resume", False, bool,
            "True: a run in an output folder that already logged to wandb continues that wandb run (its id is kept "
            "in <output>/wandb_run.json); False: a new wandb run each time train.py starts.",
            fingerprint=False),
    )),
    Section("output and checkpoints", (
        Key("output", None, str | None,
            "Output folder (logs, model.pt, checkpoints/); None = work_dirs/<config file name without .py>.",
            rule=(lambda v: v is None or bool(v.strip()), "a folder path or None"), fingerprint=False,
            aliases=("output_dir", "out_dir", "work_dir")),
        Key("resume", False, bool | str,
            "Resume: False = start fresh (or auto_resume); True = continue from the newest complete checkpoint under "
            "`output` (error if none); a path = continue from that checkpoint directory.",
            fingerprint=False, type_note="a checkpoint path"),
        Key("auto_resume", True, bool,
            "True: when `output` holds a complete checkpoint whose config fingerprint matches, continue from it.",
            fingerprint=False),
        Key("save_all_states", True, bool,
            "Write resumable checkpoints (backbone, optimizers, scaler, RNG, head shards) at every epoch end and "
            "every save_every_steps. On by default so that a crashed job loses at most an epoch, or save_every_steps "
            "steps when that is set; False = write only the backbone weights (output/model.pt, with its model.json), "
            "as arcface_torch does by default.",
            fingerprint=False),
        Key("save_every_steps", 0, int,
            "Also checkpoint every this many optimizer steps; 0 = only at epoch end; >= 0. Epochs shorter than this "
            "write no checkpoint at their end (a small dataset's epochs of a few steps would write one each).",
            rule=(lambda v: v >= 0, ">= 0 (0 = only at epoch end)"), fingerprint=False),
        Key("archive_checkpoints", False, bool,
            "A folder belongs to one run. True: a run that will not continue the checkpoints already in `output` "
            "(another config's, auto_resume = False, or ones newer than resume = PATH) moves them, with model.pt and "
            "model.json, to output/archive_<time>/ and starts; False: such a run refuses to start (it would delete "
            "or shadow them).",
            fingerprint=False),
        Key("keep_checkpoints", 2, int,
            "Complete checkpoints kept under output/checkpoints (older ones are deleted); >= 1.",
            rule=(lambda v: v >= 1, ">= 1"), fingerprint=False),
    )),
    Section("runtime", (
        Key("device", "auto", str,
            'Where to train: "auto" (CUDA when available, else CPU) | "cpu" | "cuda".',
            rule=(lambda v: v in ("auto", "cpu", "cuda"), "'auto', 'cpu' or 'cuda'"), fingerprint=False),
        Key("dist_timeout_minutes", 30, int,
            "Timeout of collective operations in the process group, in minutes; >= 1.",
            rule=(lambda v: v >= 1, ">= 1"), fingerprint=False),
    )),
)

KEYS: dict[str, Key] = {key.name: key for section in SECTIONS for key in section.keys}
# Derived views, for the modules that ask one question of every key.
FINGERPRINT_EXCLUDED = frozenset(name for name, key in KEYS.items() if not key.fingerprint)
FINGERPRINT_LEGACY = MappingProxyType({name: key.legacy for name, key in KEYS.items() if key.has_legacy})
FIXED_KEYS = MappingProxyType({name: key.reason for name, key in KEYS.items() if key.on_resume == "fixed"})
SCHEDULE_KEYS = tuple(name for name, key in KEYS.items() if key.on_resume == "schedule")
SECRET_KEYS = frozenset(name for name, key in KEYS.items() if key.secret)  # "<hidden>" in logs, never saved
COMMON_NAMES = MappingProxyType({alias: name for name, key in KEYS.items() for alias in key.aliases})
