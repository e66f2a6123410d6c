"""Load, check and describe training configurations.

A configuration is ``configs/base.py`` (every key, with its default and meaning) overlaid with an
experiment file that sets only what differs, then with ``--set KEY=VALUE`` overrides::

    cfg = load_config("configs/ms1mv3_r50", overrides=["batch_size=64", "fp16=false"])
    d = derive(cfg, world_size=8)          # steps per epoch, total and warm-up steps, global batch
    print(cfg)                             # the resolved configuration, for the log

Types come from the defaults in ``configs/base.py`` (an int is accepted for a float key, a bool is not
accepted for a number); value rules live in ``_RULES`` below. The returned ``Config`` is read-only:
values computed from it (``Derived``) are never written back.
"""
from __future__ import annotations

import ast
import difflib
import hashlib
import importlib.util
import json
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO_ROOT / "configs"
# Recipes arcface_torch renamed: the old name is answered with the new one (not the closest spelling).
RENAMED_CONFIGS = {"wf42m_pfc02_r50": "wf42m_pfc02_8gpus_r50_bs4k"}
# Keys of arcface_torch's older configs (before train_v2.py), answered with what replaced them.
FORMER_KEYS = {
    "loss": "arcface_torch's older `loss` is margin_list here (m1, m2, m3): 'arcface' = (1.0, 0.5, 0.0), "
            "'cosface' = (1.0, 0.0, 0.4)",
    "decay_epoch": "arcface_torch's older step decay is not used: the LR warms up for warmup_epoch, then decays "
                   "polynomially to 0 (lr_power), as arcface_torch's train_v2.py; remove the key",
    "dataset": "arcface_torch's older `dataset` name is not used: `rec` names the dataset's folder",
}
# Names users type for our keys (other trainers' and tutorials'), checked before the nearest spelling: edit distance
# alone takes learning_rate to sample_rate.
COMMON_NAMES = {
    "learning_rate": "lr", "lr_rate": "lr", "base_lr": "lr", "epochs": "num_epoch", "epoch": "num_epoch",
    "num_epochs": "num_epoch", "max_epoch": "num_epoch", "max_epochs": "num_epoch", "batchsize": "batch_size",
    "bs": "batch_size", "batch": "batch_size", "wd": "weight_decay", "weightdecay": "weight_decay",
    "momentum_sgd": "momentum", "workers": "num_workers", "num_worker": "num_workers", "classes": "num_classes",
    "num_class": "num_classes", "n_classes": "num_classes", "num_images": "num_image", "data": "rec",
    "data_dir": "rec", "data_root": "rec", "train_data": "rec", "output_dir": "output", "out_dir": "output",
    "work_dir": "output", "backbone": "network", "arch": "network", "model": "network", "emb_size": "embedding_size",
    "embedding_dim": "embedding_size", "feature_dim": "embedding_size", "warmup": "warmup_epoch",
    "warmup_epochs": "warmup_epoch", "steps": "max_steps", "iterations": "max_steps", "max_iter": "max_steps",
    "grad_clip": "clip_grad_norm", "clip_grad": "clip_grad_norm", "amp": "fp16", "mixed_precision": "fp16",
    "scale": "margin_list", "sample_ratio": "sample_rate", "pfc_rate": "sample_rate",
}
BASE_CONFIG = CONFIG_DIR / "base.py"

# Keys whose default does not show their type: optional paths (None allowed) and `resume` (bool or a path).
_OPTIONAL_STR = frozenset({"output", "init_backbone", "wandb_key", "wandb_entity", "wandb_project", "suffix_run_name",
                            "notes"})
_OPTIONAL_INT = frozenset({"num_classes", "num_image"})  # None = what the dataset holds (filled in by the trainer)
_BOOL_OR_STR = frozenset({"resume"})
SECRET_KEYS = frozenset({"wandb_key"})  # shown as "<hidden>" in logs and never saved (``redacted``)

# Keys that do not change what the model learns: operational settings (where and how often to write, log,
# evaluate; how many loader workers; how long to wait for peers) and settings that change speed or numerics
# only at rounding level (device, channels_last, compile, compile_head, tf32, dali: DALI decodes the PyTorch loader's
# batches with its own JPEG decoder).
# Every other key enters the fingerprint, so a checkpoint is resumed automatically only by a run that would
# have produced the same training trajectory with the same loader.
FINGERPRINT_EXCLUDED = frozenset({
    "output", "resume", "auto_resume", "archive_checkpoints", "save_all_states", "save_every_steps",
    "keep_checkpoints", "verbose", "frequent", "val_targets", "num_workers", "dali", "device", "channels_last",
    "compile", "compile_backend", "compile_head", "tf32", "cudnn_benchmark", "dist_timeout_minutes", "max_nonfinite_steps",
    "using_wandb", "wandb_key", "wandb_entity", "wandb_project", "suffix_run_name", "notes", "wandb_log_all",
    "save_artifacts", "wandb_resume",
})

# Keys added after checkpoints were first written, each with the value that trains as the code did before the
# key existed. A key at that value is left out of the fingerprint, so those checkpoints still resume (e.g. a run
# started with power-2 decay continues with `--set lr_power=2`); any other value changes the fingerprint.
FINGERPRINT_LEGACY = {"lr_power": 2.0, "dali_aug": False, "margin": "combined", "adaface_m": 0.4, "adaface_h": 0.333,
                      "adaface_t_alpha": 0.01, "sub_centers": 1, "head_update": "sampled", "backbone_lr_scale": 1.0,
                      "freeze_bn": False, "freeze_stages": 0, "head_warmup_steps": 0, "skip_bad_images": False}

_TRUE = frozenset({"true", "1", "yes", "y", "on"})
_FALSE = frozenset({"false", "0", "no", "n", "off"})
_NONE = frozenset({"none", "null"})


class _FrozenDict(dict):
    """A dict that refuses changes (the values of dict-typed keys such as ``network_kwargs``)."""

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("configuration values are read-only; use load_config(..., overrides=[...])")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _refuse  # type: ignore[assignment]

    def __reduce__(self) -> tuple:
        return (_FrozenDict, (dict(self),))


def _freeze(value: Any) -> Any:
    if isinstance(value, dict):
        return _FrozenDict({k: _freeze(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


def _thaw(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _thaw(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_thaw(v) for v in value)
    return value


class Config(Mapping):
    """A resolved, read-only configuration: ``cfg.lr`` or ``cfg["lr"]``; ``to_dict()`` for a plain copy.

    Sequences are stored as tuples and dicts as read-only dicts so that no caller can change a value that
    others already read. Picklable (it crosses ``spawn`` boundaries and is stored in checkpoints as a dict).
    """

    __slots__ = ("_data", "_source", "_name")

    def __init__(self, data: Mapping[str, Any], source: str = "", name: str = "") -> None:
        object.__setattr__(self, "_data", {k: _freeze(v) for k, v in data.items()})
        object.__setattr__(self, "_source", source)
        object.__setattr__(self, "_name", name)

    @property
    def source(self) -> str:
        """The experiment file this configuration was loaded from ("" for base only)."""
        return self._source

    @property
    def name(self) -> str:
        """The experiment's name: its file name without ``.py`` (e.g. ``ms1mv3_r50``)."""
        return self._name

    def __getattr__(self, key: str) -> Any:
        data = object.__getattribute__(self, "_data")
        try:
            return data[key]
        except KeyError:
            raise AttributeError(f"config has no key {key!r}{_suggest(key, data)}") from None

    def __getitem__(self, key: str) -> Any:
        try:
            return self._data[key]
        except KeyError:
            raise KeyError(f"config has no key {key!r}{_suggest(key, self._data)}") from None

    def __setattr__(self, key: str, value: Any) -> None:
        raise AttributeError(f"config is read-only (tried to set {key!r}); pass overrides to load_config "
                             f"or compute derived values with utils.config.derive")

    def __delattr__(self, key: str) -> None:
        raise AttributeError(f"config is read-only (tried to delete {key!r})")

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Config):
            return self._data == other._data
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __reduce__(self) -> tuple:
        return (Config, (self.to_dict(), self._source, self._name))

    def updated(self, **values: Any) -> "Config":
        """A new configuration with ``values`` replaced (keys must exist); this one is left as it is. For values
        only the run can know, such as ``num_classes = None`` filled in from the dataset."""
        unknown = [k for k in values if k not in self._data]
        if unknown:
            raise KeyError(f"config has no keys {unknown}")
        return Config({**self.to_dict(), **values}, self._source, self._name)

    def to_dict(self) -> dict[str, Any]:
        """A plain, mutable deep copy (tuples stay tuples; dicts become plain dicts)."""
        return {k: _thaw(v) for k, v in self._data.items()}

    def __repr__(self) -> str:
        return f"Config(name={self._name!r}, source={self._source!r}, {len(self._data)} keys)"

    def __str__(self) -> str:
        defaults = _base_defaults()
        width = max(len(k) for k in self._data)
        lines = [f"config {self._name or 'base'} ({self._source or BASE_CONFIG}); * = differs from base"]
        for key, value in self._data.items():
            mark = "*" if _freeze(defaults.get(key)) != value else " "
            shown = "<hidden>" if key in SECRET_KEYS and value is not None else repr(_thaw(value))
            lines.append(f" {mark} {key:<{width}} : {shown}")
        return "\n".join(lines)


def redacted(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """``cfg`` as a plain dict with every secret key that is set (``SECRET_KEYS``) written as ``"<hidden>"``: what
    checkpoints and the wandb run receive."""
    return {k: ("<hidden>" if k in SECRET_KEYS and v is not None else v) for k, v in dict(cfg).items()}


@dataclass(frozen=True)
class Derived:
    """Values computed from a configuration and the world size (never written into the config).

    All step counts are optimizer steps (one step = ``gradient_acc`` micro-batches on every rank).
    """

    world_size: int
    global_batch_size: int  # images per micro-step over all ranks: batch_size * world_size
    images_per_step: int  # images per optimizer step: global_batch_size * gradient_acc
    steps_per_epoch: int  # num_image // global_batch_size // gradient_acc
    total_steps: int  # max_steps if > 0 else num_epoch * steps_per_epoch
    warmup_steps: int  # warmup_epoch * steps_per_epoch


# ------------------------------------------------------------------------------------------------ loading

def _load_module_config(path: Path) -> dict[str, Any]:
    """Execute the config file at ``path`` (user-written code, like any training script) and return ``config``."""
    module_name = f"_face_config_{hashlib.sha1(str(path).encode()).hexdigest()[:12]}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"{path}: cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules.pop(module_name, None)
    if not hasattr(module, "config"):
        raise ValueError(f"{path}: defines no `config` (expected `config = edict()` with the keys that differ "
                         f"from configs/base.py)")
    config = module.config
    if not isinstance(config, dict):
        raise ValueError(f"{path}: `config` is a {type(config).__name__}; expected a dict or easydict")
    return dict(config)


_BASE_CACHE: dict[str, Any] = {}


def _base_defaults() -> dict[str, Any]:
    if not _BASE_CACHE:
        _BASE_CACHE.update(_load_module_config(BASE_CONFIG))
        for key, value in _BASE_CACHE.items():
            assert value is not None or key in _OPTIONAL_STR | _OPTIONAL_INT, f"base key {key!r} is None without a type"
    return _BASE_CACHE


def resolve_config_path(path_or_name: str) -> Path:
    """Find the config file for ``configs/NAME``, ``configs/NAME.py``, ``NAME`` or any path to a ``.py`` file.

    Relative paths are tried against the working directory first, then against the repository root.
    """
    raw = Path(path_or_name)
    candidates = [raw] if raw.suffix == ".py" else [raw.with_name(raw.name + ".py"), raw]
    tried: list[Path] = []
    for cand in candidates:
        for base in ((Path.cwd(), REPO_ROOT, CONFIG_DIR) if not cand.is_absolute() else (Path("/"),)):
            full = (base / cand).resolve()
            tried.append(full)
            if full.is_file():
                return full
    known = sorted(p.stem for p in CONFIG_DIR.glob("*.py") if not p.name.startswith("_"))
    hint = ([RENAMED_CONFIGS[raw.stem]] if raw.stem in RENAMED_CONFIGS
            else difflib.get_close_matches(raw.stem, known, n=1))
    raise ValueError(f"config {path_or_name!r} not found (tried {', '.join(map(str, dict.fromkeys(tried)))}); "
                     f"shipped configs: {', '.join(known)}" + (f"; did you mean configs/{hint[0]}?" if hint else ""))


def _suggest(key: str, valid: Mapping[str, Any] | Sequence[str]) -> str:
    """"; did you mean 'lr'?": arcface_torch's former keys, then the names users type for ours (COMMON_NAMES, with
    hyphens and case as typed), then the nearest spelling."""
    if key in FORMER_KEYS:
        return f"; {FORMER_KEYS[key]}"
    plain = key.lower().replace("-", "_")
    if plain in valid and plain != key:
        return f"; did you mean {plain!r}?"
    if COMMON_NAMES.get(plain) in valid:
        return f"; did you mean {COMMON_NAMES[plain]!r}?"
    close = difflib.get_close_matches(plain, list(valid), n=1, cutoff=0.5)
    return f"; did you mean {close[0]!r}?" if close else ""


def _type_name(default: Any, key: str) -> str:
    if key in _OPTIONAL_STR:
        return "str or None"
    if key in _OPTIONAL_INT:
        return "int or None"
    if key in _BOOL_OR_STR:
        return "bool or str (a checkpoint path)"
    if isinstance(default, (list, tuple)):
        inner = _type_name(default[0], "") if default else "any"
        return f"list/tuple of {inner}"
    return {bool: "bool", int: "int", float: "float (or int)", str: "str", dict: "dict"}.get(
        type(default), type(default).__name__)


def _coerce(key: str, value: Any, default: Any, where: str) -> Any:
    """Check ``value`` against the type of ``default``; return it normalised (int -> float, list -> tuple)."""
    def bad() -> ValueError:
        return ValueError(f"{where}: key {key!r} = {value!r} has type {type(value).__name__}; "
                          f"expected {_type_name(default, key)}")

    if key in _OPTIONAL_STR:
        if value is None or isinstance(value, str):
            return value
        raise bad()
    if key in _OPTIONAL_INT:
        if value is None or (isinstance(value, int) and not isinstance(value, bool)):
            return value
        raise bad()
    if key in _BOOL_OR_STR:
        if isinstance(value, (bool, str)):
            return value
        raise bad()
    if isinstance(default, bool):
        if isinstance(value, bool):
            return value
        raise bad()
    if isinstance(default, int):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise bad()
    if isinstance(default, float):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise bad()
    if isinstance(default, str):
        if isinstance(value, str):
            return value
        raise bad()
    if isinstance(default, (list, tuple)):
        if not isinstance(value, (list, tuple)):
            raise bad()
        if not default:
            return tuple(value)
        return tuple(_coerce(f"{key}[{i}]", v, default[0], where) for i, v in enumerate(value))
    if isinstance(default, dict):
        if isinstance(value, dict) and all(isinstance(k, str) for k in value):
            return dict(value)
        raise bad()
    raise AssertionError(f"base key {key!r} has a default of unsupported type {type(default).__name__}")


# ------------------------------------------------------------------------------------------------ value rules

def _rule(check: Callable[[Any], bool], allowed: str) -> tuple[Callable[[Any], bool], str]:
    return check, allowed


def _finite(x: float) -> bool:
    return math.isfinite(x)


def _is_compile_backend(name: str) -> bool:
    import torch

    return name in torch.compiler.list_backends(exclude_tags=())


_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "network": _rule(lambda v: bool(v.strip()), "a backbone name such as r50, r100, mbf, tiny"),
    "embedding_size": _rule(lambda v: v >= 1, ">= 1"),
    "margin_list": _rule(lambda v: len(v) == 3 and all(_finite(x) for x in v) and v[0] >= 1
                         and 0 <= v[1] < math.pi / 2 and v[2] >= 0,
                         "3 finite numbers (m1, m2, m3) with m1 >= 1, 0 <= m2 < pi/2, m3 >= 0"),
    "margin_scale": _rule(lambda v: _finite(v) and v > 0, "> 0"),
    "margin_gradient": _rule(lambda v: v in ("straight_through", "exact"), "'straight_through' or 'exact'"),
    "interclass_filtering_threshold": _rule(lambda v: 0 <= v < 1, "in [0, 1) (0 = off)"),
    "margin": _rule(lambda v: v in ("combined", "adaface"), "'combined' (margin_list) or 'adaface'"),
    "adaface_m": _rule(lambda v: _finite(v) and v >= 0, "a finite value >= 0 (AdaFace's paper: 0.4)"),
    "adaface_h": _rule(lambda v: _finite(v) and v >= 0, "a finite value >= 0 (AdaFace's paper: 0.333)"),
    "adaface_t_alpha": _rule(lambda v: 0 < v <= 1, "in (0, 1] (AdaFace's paper: 0.01)"),
    "sub_centers": _rule(lambda v: v >= 1, ">= 1 (1 = one centre per class)"),
    "head_update": _rule(lambda v: v in ("sampled", "all"), "'sampled' (only the sampled centres, the Partial FC "
                         "paper) or 'all' (every centre every step, arcface_torch)"),
    "sample_rate": _rule(lambda v: 0 < v <= 1, "in (0, 1] (arcface_torch's 0, which keeps only the class centres of "
                         "the batch's identities, is written here as a rate below 1 / num_classes, e.g. 1e-7)"),
    "batch_size": _rule(lambda v: v >= 1, ">= 1"),
    "optimizer": _rule(lambda v: v in ("sgd", "adamw"), "'sgd' or 'adamw'"),
    "lr": _rule(lambda v: _finite(v) and v > 0, "> 0"),
    "lr_power": _rule(lambda v: _finite(v) and v > 0, "finite and > 0 (1 = linear decay, 2 = quadratic)"),
    "momentum": _rule(lambda v: 0 <= v < 1, "in [0, 1)"),
    "weight_decay": _rule(lambda v: _finite(v) and v >= 0, ">= 0"),
    "gradient_acc": _rule(lambda v: v >= 1, ">= 1"),
    "clip_grad_norm": _rule(lambda v: _finite(v) and v >= 0, ">= 0 (0 = no clipping)"),
    "max_nonfinite_steps": _rule(lambda v: v >= 1, ">= 1"),
    "backbone_lr_scale": _rule(lambda v: _finite(v) and v > 0, "finite and > 0 (1 = the head's lr; to keep the "
                               "backbone as it is, set head_warmup_steps to the run's length instead)"),
    "freeze_stages": _rule(lambda v: v >= 0, ">= 0 (0 = nothing frozen; at most the network's stage count, "
                           "docs/finetuning.md)"),
    "head_warmup_steps": _rule(lambda v: v >= 0, ">= 0 (0 = no head-only steps)"),
    "rec": _rule(lambda v: bool(v.strip()), "a dataset folder or 'synthetic'"),
    "num_classes": _rule(lambda v: v is None or v >= 1, ">= 1, or None for what the dataset says"),
    "num_image": _rule(lambda v: v is None or v >= 1, ">= 1, or None for what the dataset holds"),
    "num_epoch": _rule(lambda v: v >= 0, ">= 0 (and >= 1 unless max_steps > 0)"),
    "warmup_epoch": _rule(lambda v: v >= 0, ">= 0 (arcface_torch's -1 trains as 0 there, with no warm-up: write 0)"),
    "dali_aug": _rule(lambda v: v is False, "False: arcface_torch's DALI augmentation is not implemented, because our "
                      "loaders make every image a function of (seed, epoch, sample) and DALI's GPU operators have no "
                      "exact CPU counterpart; set dali_aug = False to train with flips only"),
    "max_steps": _rule(lambda v: v >= 0, ">= 0 (0 = derive from num_epoch)"),
    "num_workers": _rule(lambda v: v >= 0, ">= 0"),
    "seed": _rule(lambda v: v >= 0, ">= 0"),
    "verbose": _rule(lambda v: v >= 1, ">= 1"),
    "frequent": _rule(lambda v: v >= 1, ">= 1"),
    "save_every_steps": _rule(lambda v: v >= 0, ">= 0 (0 = only at epoch end)"),
    "keep_checkpoints": _rule(lambda v: v >= 1, ">= 1"),
    "device": _rule(lambda v: v in ("auto", "cpu", "cuda"), "'auto', 'cpu' or 'cuda'"),
    "compile_backend": _rule(_is_compile_backend, "a torch.compile backend, e.g. 'inductor' or 'aot_eager'"),
    "dist_timeout_minutes": _rule(lambda v: v >= 1, ">= 1"),
    "output": _rule(lambda v: v is None or bool(v.strip()), "a folder path or None"),
    "init_backbone": _rule(lambda v: v is None or bool(v.strip()), "a file path or None"),
}


def _check_values(values: dict[str, Any], where: str) -> None:
    for key, (check, allowed) in _RULES.items():
        if not check(values[key]):
            raise ValueError(f"{where}: {key} = {values[key]!r} is not allowed; expected {allowed}")
    if values["margin"] == "adaface" and values["interclass_filtering_threshold"] > 0:
        raise ValueError(f"{where}: margin = 'adaface' with interclass_filtering_threshold = "
                         f"{values['interclass_filtering_threshold']!r}; inter-class filtering belongs to the combined "
                         f"margin: set it to 0 or use margin = 'combined'")
    if values["fp16"] and values["bf16"]:
        raise ValueError(f"{where}: fp16 = True and bf16 = True; choose at most one mixed-precision mode")
    if values["num_epoch"] < 1 and values["max_steps"] <= 0:
        raise ValueError(f"{where}: num_epoch = {values['num_epoch']} and max_steps = {values['max_steps']}; "
                         f"expected num_epoch >= 1 or max_steps > 0")


# ------------------------------------------------------------------------------------------------ overrides

def _parse_scalar(text: str, default: Any, key: str) -> Any:
    low = text.strip().lower()
    if isinstance(default, bool) or key in _BOOL_OR_STR:
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        if key in _BOOL_OR_STR:
            return text
        raise ValueError(f"expected a bool ({'/'.join(sorted(_TRUE))} or {'/'.join(sorted(_FALSE))})")
    if key in _OPTIONAL_STR | _OPTIONAL_INT and low in _NONE:
        return None
    if isinstance(default, int) or key in _OPTIONAL_INT:
        return int(text.strip())
    if isinstance(default, float):
        return float(text.strip())
    if isinstance(default, str) or key in _OPTIONAL_STR:
        stripped = text.strip()
        if len(stripped) >= 2 and stripped[0] == stripped[-1] and stripped[0] in "'\"":
            return ast.literal_eval(stripped)
        return text
    raise AssertionError(f"no scalar parser for key {key!r}")


def _parse_override(text: str, defaults: Mapping[str, Any]) -> tuple[str, Any]:
    """``"KEY=VALUE"`` -> (key, value parsed to the key's type); errors name the override."""
    if "=" not in text:
        raise ValueError(f"--set {text!r}: expected KEY=VALUE")
    key, raw = text.split("=", 1)
    key = key.strip()
    if key not in defaults:
        raise ValueError(f"--set {text!r}: unknown key {key!r}{_suggest(key, defaults)}")
    default = defaults[key]
    try:
        if isinstance(default, dict):
            value = ast.literal_eval(raw.strip())
        elif isinstance(default, (list, tuple)):
            stripped = raw.strip()
            if not stripped:
                value = ()
            elif stripped[0] in "[(":
                value = ast.literal_eval(stripped)
            else:
                inner = default[0] if default else ""
                value = tuple(_parse_scalar(part, inner, "") for part in stripped.split(","))
        else:
            value = _parse_scalar(raw, default, key)
    except (ValueError, SyntaxError) as exc:
        raise ValueError(f"--set {text!r}: cannot parse {raw!r} as {_type_name(default, key)} for key "
                         f"{key!r} ({exc})") from None
    return key, value


# ------------------------------------------------------------------------------------------------ public API

def load_config(path_or_name: str, overrides: Sequence[str] = ()) -> Config:
    """Load ``configs/base.py`` overlaid with the experiment file and ``--set`` overrides; check everything.

    ``path_or_name``: ``configs/NAME`` (as arcface_torch users type it), ``configs/NAME.py``, ``NAME`` or a
    path to any ``.py`` file defining ``config`` (a dict/easydict with only the keys that differ from base).
    ``overrides``: ``"KEY=VALUE"`` strings, applied in order after the file (a later one wins).
    Raises ``ValueError`` naming the file or override, the key, the value received and what is allowed.
    When ``output`` is None it resolves to ``work_dirs/<NAME>`` as in arcface_torch.
    """
    path = resolve_config_path(path_or_name)
    defaults = _base_defaults()
    where = str(path)
    values: dict[str, Any] = {k: _coerce(k, v, v, str(BASE_CONFIG)) if v is not None else v
                              for k, v in defaults.items()}
    if path != BASE_CONFIG:
        for key, value in _load_module_config(path).items():
            if key not in defaults:
                raise ValueError(f"{where}: unknown key {key!r}{_suggest(key, defaults)} "
                                 f"(every valid key is listed in {BASE_CONFIG})")
            values[key] = _coerce(key, value, defaults[key], where)
    for text in overrides:
        key, value = _parse_override(text, defaults)
        values[key] = _coerce(key, value, defaults[key], f"--set {text!r}")
    _check_values(values, where if not overrides else f"{where} with --set {' '.join(overrides)}")
    name = path.stem
    if values["output"] is None:
        values["output"] = str(Path("work_dirs") / name)
    return Config(values, source=str(path), name=name)


def derive(cfg: Mapping[str, Any], world_size: int) -> Derived:
    """Global batch, optimizer steps per epoch, total and warm-up steps for ``world_size`` ranks."""
    if world_size < 1:
        raise ValueError(f"world_size = {world_size}; expected >= 1")
    if cfg["num_image"] is None:
        raise ValueError("num_image is None: the trainer fills it in from the dataset (Config.updated) before "
                         "deriving steps; set num_image when the dataset cannot tell (e.g. DALI)")
    global_batch = cfg["batch_size"] * world_size
    images_per_step = global_batch * cfg["gradient_acc"]
    steps_per_epoch = cfg["num_image"] // global_batch // cfg["gradient_acc"]
    if steps_per_epoch < 1:
        raise ValueError(f"num_image = {cfg['num_image']} is smaller than one optimizer step of "
                         f"batch_size {cfg['batch_size']} x world_size {world_size} x gradient_acc "
                         f"{cfg['gradient_acc']} = {images_per_step} images; lower batch_size or gradient_acc")
    total = cfg["max_steps"] if cfg["max_steps"] > 0 else cfg["num_epoch"] * steps_per_epoch
    warmup = cfg["warmup_epoch"] * steps_per_epoch
    if warmup > 0 and warmup >= total:
        raise ValueError(f"warm-up of warmup_epoch = {cfg['warmup_epoch']} epochs ({warmup} steps) is not shorter "
                         f"than the whole run ({total} steps: max_steps = {cfg['max_steps']}, num_epoch = "
                         f"{cfg['num_epoch']}, {steps_per_epoch} steps per epoch)")
    return Derived(world_size=world_size, global_batch_size=global_batch, images_per_step=images_per_step,
                   steps_per_epoch=steps_per_epoch, total_steps=total, warmup_steps=warmup)


def check_world(cfg: Mapping[str, Any], world_size: int) -> None:
    """Raise ``ValueError`` when the classes cannot be split over ``world_size`` ranks (every rank needs >= 1)."""
    if cfg["num_classes"] is not None and cfg["num_classes"] < world_size:
        raise ValueError(f"num_classes = {cfg['num_classes']} is smaller than world_size = {world_size}; every rank "
                         f"holds at least one class centre: use at most {cfg['num_classes']} ranks")


def check_paths(cfg: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` when ``rec`` (unless "synthetic") or ``init_backbone`` do not exist."""
    rec = cfg["rec"]
    if rec != "synthetic":
        path = Path(rec)
        if not path.is_dir():
            raise ValueError(f"rec = {rec!r}: no such folder; expected a folder holding train.rec and train.idx "
                             f"(insightface RecordIO), a folder of identity folders, or 'synthetic'")
        if (path / "train.rec").exists() != (path / "train.idx").exists():
            missing = "train.idx" if (path / "train.rec").exists() else "train.rec"
            raise ValueError(f"rec = {rec!r}: holds one of train.rec/train.idx but not {missing}")
    init = cfg["init_backbone"]
    if init is not None and not Path(init).is_file():
        problem = "is a folder, not a file" if Path(init).is_dir() else "no such file"
        raise ValueError(f"init_backbone = {init!r}: {problem}; expected a backbone state_dict (.pt/.pth)")
    resume = cfg["resume"]
    if isinstance(resume, str) and not Path(resume).is_dir():
        raise ValueError(f"resume = {resume!r}: no such checkpoint directory; expected "
                         f"<output>/checkpoints/step_<step>, or True for the newest one under output")


def data_identity(rec: str) -> str:
    """What the training data holds, not where it lies: a hash of ``train.idx`` and the size of ``train.rec``
    (RecordIO), of the sorted relative paths and sizes of the images (an image folder), or ``"synthetic"``.
    A dataset copied or moved to another disk keeps its identity; one with records or images added, removed or
    resized does not. Contents are not read (a dataset may be terabytes): a record rewritten in place at the
    same offset and size (a relabelled header, say) keeps the identity."""
    if rec == "synthetic":
        return "synthetic"
    root, digest = Path(rec), hashlib.sha256()
    if (root / "train.idx").is_file():
        digest.update((root / "train.idx").read_bytes())
        digest.update(str((root / "train.rec").stat().st_size if (root / "train.rec").is_file() else -1).encode())
    elif root.is_dir():
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            digest.update(f"{path.relative_to(root).as_posix()}\t{path.stat().st_size}\n".encode())
    return digest.hexdigest()[:16]


def fingerprint(cfg: Mapping[str, Any], data: str | None = None) -> str:
    """A 16-hex-digit hash of the keys that change training results (all but ``FINGERPRINT_EXCLUDED``); with
    ``data`` (``data_identity(rec)``), the data's identity stands in for the ``rec`` path, so a moved dataset
    keeps the fingerprint.

    Two configurations with the same fingerprint train the same model step for step (with the same loader:
    ``dali`` is left out, see ``FINGERPRINT_EXCLUDED``), so a checkpoint of one may be resumed automatically by
    the other. Keys at their ``FINGERPRINT_LEGACY`` value are left out, so a
    configuration saved before such a key existed hashes as it did then.
    """
    def plain(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: plain(x) for k, x in sorted(v.items())}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        return v

    relevant = {k: plain(v) for k, v in sorted(cfg.items())
                if k not in FINGERPRINT_EXCLUDED and not (k in FINGERPRINT_LEGACY and v == FINGERPRINT_LEGACY[k])}
    if data is not None:
        relevant["rec"] = data
    blob = json.dumps(relevant, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _key_comments() -> dict[str, str]:
    """The comment block right above each ``config.KEY = ...`` line of configs/base.py."""
    comments: dict[str, str] = {}
    block: list[str] = []
    for line in BASE_CONFIG.read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("# ---"):
            block = []
        elif stripped.startswith("#"):
            block.append(stripped.lstrip("#").strip())
        elif stripped.startswith("config.") and "=" in stripped:
            key = stripped[len("config."):].split("=", 1)[0].strip()
            comments[key] = " ".join(block)
            block = []
        else:
            block = []
    return comments


def keys_table() -> str:
    """The configuration keys as a markdown table (key, default, meaning), rendered from configs/base.py."""
    comments = _key_comments()
    rows = ["| key | default | meaning |", "| --- | --- | --- |"]
    for key, value in _base_defaults().items():
        meaning = comments.get(key, "").replace("|", "\\|")
        rows.append(f"| `{key}` | `{value!r}` | {meaning} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(keys_table())
