"""Load, check and describe training configurations.

A configuration is the declared defaults (``utils.config_keys``, written out as ``configs/base.py``), overlaid
with a recipe that sets only what differs (which may build on another recipe: ``base = "demo_cpu"``), then with
``--set KEY=VALUE`` overrides::

    cfg = load_config("configs/ms1mv3_r50", overrides=["batch_size=64", "fp16=false"])
    d = derive(cfg, world_size=8)          # steps per epoch, total and warm-up steps, global batch
    print(cfg)                             # the resolved configuration, for the log

Types, value rules, hints, fingerprint roles and secrets are the declarations'. The returned ``Config`` is
read-only: values computed from it (``Derived``) are never written back. ``python -m utils.config`` prints the
key table, ``python -m utils.config NAME`` where each value of a recipe comes from (docs/configuration.md).
"""
from __future__ import annotations

import argparse
import ast
import difflib
import hashlib
import importlib.util
import json
import sys
import textwrap
import types
import typing
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from utils.config_keys import (
    COMMON_NAMES,
    FINGERPRINT_EXCLUDED,
    FINGERPRINT_LEGACY,
    KEYS,
    SECRET_KEYS,
    SECTIONS,
    Key,
    type_name,
)

__all__ = ["BASE_CONFIG", "COMMON_NAMES", "CONFIG_DIR", "FINGERPRINT_EXCLUDED", "FINGERPRINT_LEGACY",
           "FORMER_KEYS", "RENAMED_CONFIGS", "SECRET_KEYS", "Config", "Derived", "base_file",
           "check_paths", "check_world", "config_from_overrides", "derive", "fingerprint", "keys_table",
           "load_config", "origins", "redacted", "resolve_config_path"]

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO_ROOT / "configs"
BASE_CONFIG = CONFIG_DIR / "base.py"
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

    __slots__ = ("_data", "_name", "_source")

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

    def updated(self, **values: Any) -> Config:
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
        defaults = _base_values()
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

def _load_module_config(path: Path) -> tuple[dict[str, Any], str | None]:
    """Execute the recipe at ``path`` (user-written code, like any training script): its ``config`` and the
    recipe it builds on (its module-level ``base``, or None)."""
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
    config, base = module.config, getattr(module, "base", None)
    if not isinstance(config, dict):
        raise ValueError(f"{path}: `config` is a {type(config).__name__}; expected a dict or easydict")
    if base is not None and not isinstance(base, str):
        raise ValueError(f"{path}: base = {base!r}; expected the name or path of the recipe this one builds on, "
                         f"e.g. base = \"demo_cpu\"")
    return dict(config), base


_BASE_CACHE: dict[str, Any] = {}


def _base_values() -> dict[str, Any]:
    """The declared defaults overlaid with configs/base.py, checked and normalised: the bottom of every recipe.
    The two are the same (tests/test_config.py), unless a user edited base.py to change a default, as
    arcface_torch's users do."""
    if not _BASE_CACHE:
        values = {name: _coerce(key, key.default, "utils/config_keys.py") for name, key in KEYS.items()}
        for name, value in _load_module_config(BASE_CONFIG)[0].items():
            values[name] = _coerce(_declared(name, str(BASE_CONFIG)), value, str(BASE_CONFIG))
        _BASE_CACHE.update(values)
    return dict(_BASE_CACHE)


def resolve_config_path(path_or_name: str, near: Path | None = None) -> Path:
    """Find the config file for ``configs/NAME``, ``configs/NAME.py``, ``NAME`` or any path to a ``.py`` file.

    Relative paths are tried against ``near`` (the folder of the recipe that names it as its ``base``), then
    the working directory, then the repository root and ``configs/``.
    """
    raw = Path(path_or_name)
    candidates = [raw] if raw.suffix == ".py" else [raw.with_name(raw.name + ".py"), raw]
    folders = tuple(p for p in (near, Path.cwd(), REPO_ROOT, CONFIG_DIR) if p is not None)
    tried: list[Path] = []
    for cand in candidates:
        for folder in (folders if not cand.is_absolute() else (Path("/"),)):
            full = (folder / cand).resolve()
            tried.append(full)
            if full.is_file():
                return full
    known = sorted(p.stem for p in CONFIG_DIR.glob("*.py") if not p.name.startswith("_"))
    hint = ([RENAMED_CONFIGS[raw.stem]] if raw.stem in RENAMED_CONFIGS
            else difflib.get_close_matches(raw.stem, known, n=1))
    raise ValueError(f"config {path_or_name!r} not found (tried {', '.join(map(str, dict.fromkeys(tried)))}); "
                     f"shipped configs: {', '.join(known)}" + (f"; did you mean configs/{hint[0]}?" if hint else ""))


def _suggest(key: str, valid: Mapping[str, Any] | Sequence[str]) -> str:
    """"; did you mean 'lr'?": arcface_torch's former keys, then the names users type for ours (the declared
    aliases, with hyphens and case as typed), then the nearest spelling."""
    if key in FORMER_KEYS:
        return f"; {FORMER_KEYS[key]}"
    plain = key.lower().replace("-", "_")
    if plain in valid and plain != key:
        return f"; did you mean {plain!r}?"
    if COMMON_NAMES.get(plain) in valid:
        return f"; did you mean {COMMON_NAMES[plain]!r}?"
    close = difflib.get_close_matches(plain, list(valid), n=1, cutoff=0.5)
    return f"; did you mean {close[0]!r}?" if close else ""


def _declared(name: str, where: str) -> Key:
    if name not in KEYS:
        raise ValueError(f"{where}: unknown key {name!r}{_suggest(name, KEYS)} (every valid key is listed in "
                         f"{BASE_CONFIG})")
    return KEYS[name]


def _shown(path: Path) -> str:
    """``path`` as the origin of a value: relative to the repository when inside it."""
    return str(path.relative_to(REPO_ROOT)) if path.is_relative_to(REPO_ROOT) else str(path)


def _recipes(path: Path) -> list[tuple[Path, dict[str, Any]]]:
    """``(file, its config)`` of the recipe at ``path`` and of the recipes it builds on, the most basic first
    (configs/base.py lies below them all and is not listed)."""
    loaded: list[tuple[Path, dict[str, Any]]] = []  # the recipe, then what it builds on
    while path != BASE_CONFIG:
        if any(path == seen for seen, _ in loaded):
            cycle = " -> ".join(_shown(p) for p in [*(seen for seen, _ in loaded), path])
            raise ValueError(f"{loaded[0][0]}: its bases make a cycle ({cycle}); a recipe cannot build on itself")
        config, base = _load_module_config(path)
        loaded.append((path, config))
        if base is None:
            break
        try:
            path = resolve_config_path(base, near=path.parent)
        except ValueError as exc:
            raise ValueError(f"{path}: base = {base!r}: {exc}") from None
    return loaded[::-1]


def _resolve(path_or_name: str, overrides: Sequence[str]) -> tuple[Config, dict[str, str]]:
    """The configuration and, for every key, where its value came from."""
    path = resolve_config_path(path_or_name)
    values = _base_values()
    origin = dict.fromkeys(values, _shown(BASE_CONFIG))
    for recipe, config in _recipes(path):
        where = str(recipe)
        for name, value in config.items():
            values[name] = _coerce(_declared(name, where), value, where)
            origin[name] = _shown(recipe)
    for text in overrides:
        name, value = _parse_override(text)
        values[name] = _coerce(KEYS[name], value, f"--set {text!r}")
        origin[name] = f"--set {text}"
    _check_values(values, str(path) if not overrides else f"{path} with --set {' '.join(overrides)}")
    if values["output"] is None:
        values["output"] = str(Path("work_dirs") / path.stem)
        origin["output"] = f"{origin['output']} (None: work_dirs/<config name>)"
    return Config(values, source=str(path), name=path.stem), origin


# ------------------------------------------------------------------------------------------------ types

def _coerce(key: Key, value: Any, where: str) -> Any:
    """Check ``value`` against ``key``'s declared type; return it normalised (int -> float, list -> tuple)."""
    return _coerce_to(key.type, value, key.name, key.expected, where)


def _coerce_to(spec: Any, value: Any, name: str, expected: str, where: str) -> Any:
    origin, args = typing.get_origin(spec), typing.get_args(spec)
    if origin in (types.UnionType, typing.Union):
        if value is None and type(None) in args:
            return None
        for option in (a for a in args if a is not type(None)):
            try:
                return _coerce_to(option, value, name, expected, where)
            except ValueError:
                pass
    elif origin in (list, tuple):
        if isinstance(value, (list, tuple)):
            inner = args[0]
            return tuple(_coerce_to(inner, v, f"{name}[{i}]", type_name(inner), where)
                         for i, v in enumerate(value))
    elif spec is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif spec is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif spec is dict:
        if isinstance(value, dict) and all(isinstance(k, str) for k in value):
            return dict(value)
    elif spec in (bool, str):
        if isinstance(value, spec):
            return value
    else:
        raise AssertionError(f"key {name!r} is declared with a type the loader does not know: {spec!r}")
    raise ValueError(f"{where}: key {name!r} = {value!r} has type {type(value).__name__}; expected {expected}")


def _parse(text: str, spec: Any) -> Any:
    """``--set``'s text as a value of type ``spec`` (checked by ``_coerce`` afterwards)."""
    origin, args = typing.get_origin(spec), typing.get_args(spec)
    if origin in (list, tuple):
        stripped = text.strip()
        if not stripped:
            return ()
        if stripped[0] in "[(":
            return ast.literal_eval(stripped)
        return tuple(_parse(part, args[0]) for part in stripped.split(","))
    if spec is dict:
        return ast.literal_eval(text.strip())
    options = [a for a in args if a is not type(None)] if origin in (types.UnionType, typing.Union) else [spec]
    low = text.strip().lower()
    if bool in options:
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        if str not in options:
            raise ValueError(f"expected a bool ({'/'.join(sorted(_TRUE))} or {'/'.join(sorted(_FALSE))})")
        return text
    if len(options) < len(args) and low in _NONE:
        return None
    if options[0] in (int, float):
        return options[0](text.strip())
    stripped = text.strip()
    if len(stripped) >= 2 and stripped[0] == stripped[-1] and stripped[0] in "'\"":
        return ast.literal_eval(stripped)
    return text


def _parse_override(text: str) -> tuple[str, Any]:
    """``"KEY=VALUE"`` -> (key, value parsed to the key's type); errors name the override."""
    if "=" not in text:
        raise ValueError(f"--set {text!r}: expected KEY=VALUE")
    name, raw = text.split("=", 1)
    name = name.strip()
    if name not in KEYS:
        raise ValueError(f"--set {text!r}: unknown key {name!r}{_suggest(name, KEYS)}")
    try:
        return name, _parse(raw, KEYS[name].type)
    except (ValueError, SyntaxError) as exc:
        raise ValueError(f"--set {text!r}: cannot parse {raw!r} as {KEYS[name].expected} for key {name!r} "
                         f"({exc})") from None


# ------------------------------------------------------------------------------------------------ value rules

def _check_values(values: dict[str, Any], where: str) -> None:
    for name, key in KEYS.items():
        if key.rule is not None and not key.rule[0](values[name]):
            raise ValueError(f"{where}: {name} = {values[name]!r} is not allowed; expected {key.rule[1]}")
    if values["margin"] == "adaface" and values["interclass_filtering_threshold"] > 0:
        raise ValueError(f"{where}: margin = 'adaface' with interclass_filtering_threshold = "
                         f"{values['interclass_filtering_threshold']!r}; inter-class filtering belongs to the combined "
                         f"margin: set it to 0 or use margin = 'combined'")
    if values["fp16"] and values["bf16"]:
        raise ValueError(f"{where}: fp16 = True and bf16 = True; choose at most one mixed-precision mode")
    if values["num_epoch"] < 1 and values["max_steps"] <= 0:
        raise ValueError(f"{where}: num_epoch = {values['num_epoch']} and max_steps = {values['max_steps']}; "
                         f"expected num_epoch >= 1 or max_steps > 0")


# ------------------------------------------------------------------------------------------------ public API

def load_config(path_or_name: str, overrides: Sequence[str] = ()) -> Config:
    """Load a recipe over the defaults of ``configs/base.py`` (and over the recipes it builds on), then the
    ``--set`` overrides; check everything.

    ``path_or_name``: ``configs/NAME`` (as arcface_torch users type it), ``configs/NAME.py``, ``NAME`` or a
    path to any ``.py`` file defining ``config`` (a dict/easydict with only the keys that differ from what it
    builds on: configs/base.py, or the recipe its module-level ``base`` names).
    ``overrides``: ``"KEY=VALUE"`` strings, applied in order after the file (a later one wins).
    Raises ``ValueError`` naming the file or override, the key, the value received and what is allowed.
    When ``output`` is None it resolves to ``work_dirs/<NAME>`` as in arcface_torch.
    """
    return _resolve(path_or_name, overrides)[0]


def origins(path_or_name: str, overrides: Sequence[str] = ()) -> str:
    """The resolved values of a recipe and where each came from (configs/base.py, which recipe file, which
    ``--set``), one key a line; secrets hidden. What ``python -m utils.config NAME`` prints."""
    cfg, origin = _resolve(path_or_name, overrides)
    shown = redacted(cfg.to_dict())
    width = max(len(k) for k in shown)
    values = {k: repr(v) for k, v in shown.items()}
    value_width = min(40, max(len(v) for v in values.values()))
    chain = " <- ".join([_shown(p) for p, _ in reversed(_recipes(Path(cfg.source)))] + [_shown(BASE_CONFIG)])
    lines = [f"config {cfg.name}: {chain}"]
    lines += [f"  {k:<{width}}  {values[k]:<{value_width}}  {origin[k]}" for k in shown]
    return "\n".join(lines)


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


def fingerprint(cfg: Mapping[str, Any], data: str | None = None) -> str:
    """A 16-hex-digit hash of the keys that change training results (all but ``FINGERPRINT_EXCLUDED``); with
    ``data`` (``dataset.data_identity(rec)``), the data's identity stands in for the ``rec`` path, so a moved dataset
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


# ------------------------------------------------------------------------------------------------ generated text

_BASE_DOCSTRING = '''"""Every configuration key, its default, and what it means.

Written from the declarations in ``utils/config_keys.py`` by ``python -m utils.config --write-base`` (a test
checks that the two agree): to add a key or change a default, edit its declaration there and run that command.

A recipe (``configs/ms1mv3_r50.py`` or any ``.py`` of yours) defines ``config`` holding only the keys that
differ from these defaults, or from the recipe it names as its ``base`` (``base = "ms1mv3_r50"``);
``utils.config.load_config`` merges them, rejects unknown keys and wrong types, and checks the values. Key
names and meanings follow insightface's ``arcface_torch`` so its configs keep working. The type of each
default is the type the loader accepts (an int is accepted where the default is a float), except for the keys
documented as optional or as taking two types.

Values computed from these (global batch, steps per epoch, total and warm-up steps) are never stored here:
see ``utils.config.derive``.
"""'''


def _literal(value: Any) -> str:
    """``value`` as configs/base.py writes it (arcface_torch's style: double-quoted strings)."""
    if isinstance(value, str):
        return f'"{value}"' if '"' not in value and "\\" not in value else repr(value)
    if isinstance(value, (list, tuple)):
        inner = ", ".join(_literal(v) for v in value) + ("," if isinstance(value, tuple) and len(value) == 1 else "")
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_literal(k)}: {_literal(v)}" for k, v in value.items()) + "}"
    return repr(value)


def base_file() -> str:
    """The text of configs/base.py: every declared key with its meaning as a comment, section by section."""
    lines = [_BASE_DOCSTRING, "from easydict import EasyDict as edict", "", "config = edict()"]
    for section in SECTIONS:
        lines += ["", f"# {'-' * 64} {section.title}"]
        for key in section.keys:
            lines += [f"# {line}" for line in textwrap.wrap(key.doc, 108, break_on_hyphens=False,
                                                             break_long_words=False)]
            lines.append(f"config.{key.name} = {_literal(key.default)}")
    return "\n".join(lines) + "\n"


_ON_RESUME = {"free": "`--resume`", "schedule": "`--resume`, schedule"}


def keys_table() -> str:
    """The configuration keys as a markdown table (key, default, type, what a resume does with a changed value,
    meaning), rendered from the declarations; docs/configuration.md holds it."""
    rows = ["| key | default | type | changed on resume | meaning |", "| --- | --- | --- | --- | --- |"]
    for name, key in KEYS.items():
        if not key.fingerprint:
            resume = "outside the fingerprint"
        elif key.on_resume == "fixed":
            resume = f"refused: {key.reason}"
        else:
            resume = _ON_RESUME[key.on_resume]
        cells = [f"`{name}`", f"`{key.default!r}`", key.expected, resume, key.doc]
        rows.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(rows)


DOCS_PAGE = REPO_ROOT / "docs" / "configuration.md"


def _docs_with_table(page: str) -> str:
    """``page`` (docs/configuration.md) with its key table replaced by ``keys_table()``."""
    lines = page.splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.startswith("| key |"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return "".join(lines[:start]) + keys_table() + "\n" + "".join(lines[end:])


def config_from_overrides(args: argparse.Namespace) -> list[str]:
    """``--set lr=0.1 configs/NAME``: ``--set`` (``nargs="+"``) takes the config name too. With ``args.config``
    unset and one value without ``=`` among ``args.overrides``, that value becomes ``args.config``; returns the
    values without ``=`` (the caller names a missing or ambiguous config its way)."""
    names = [value for value in args.overrides if "=" not in value]
    if args.config is None and len(names) == 1:
        args.config, args.overrides = names[0], [value for value in args.overrides if value != names[0]]
    return names


def main(argv: Sequence[str] | None = None) -> int:
    from utils.cli import run_tool
    from utils.files import atomic_write

    parser = argparse.ArgumentParser(prog="python -m utils.config", description=(
        "Without arguments: the key table of docs/configuration.md. With a recipe: its resolved values and where "
        "each came from (configs/base.py, which recipe file, which --set)."))
    parser.add_argument("config", nargs="?", help="configs/NAME or the path of a .py recipe")
    parser.add_argument("--set", dest="overrides", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                        help="overrides, as train.py takes them")
    parser.add_argument("--write-base", action="store_true", help="write configs/base.py from the declarations")
    parser.add_argument("--write-docs", action="store_true",
                        help="write the key table of docs/configuration.md from the declarations")
    args = parser.parse_args(argv)
    if args.config is None and args.overrides:
        config_from_overrides(args)
        if args.config is None:
            parser.error("--set needs a config: python -m utils.config configs/NAME --set KEY=VALUE")

    def write(path: Path, text: str) -> None:
        atomic_write(path, lambda f: f.write(text.encode()))
        print(f"wrote {path}")

    def work() -> None:
        if args.write_base or args.write_docs:
            if args.write_base:
                write(BASE_CONFIG, base_file())
            if args.write_docs:
                write(DOCS_PAGE, _docs_with_table(DOCS_PAGE.read_text()))
        elif args.config:
            print(origins(args.config, args.overrides))
        else:
            print(keys_table())

    return run_tool("utils.config", work)


if __name__ == "__main__":
    sys.exit(main())
