"""utils.config: loading, rejection of bad keys/types/values, --set parsing, derive, fingerprint, keys table."""
from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from utils.config import (
    BASE_CONFIG,
    CONFIG_DIR,
    FINGERPRINT_EXCLUDED,
    Config,
    _coerce,
    base_file,
    check_paths,
    check_world,
    derive,
    fingerprint,
    load_config,
)
from utils.config_keys import KEYS

SHIPPED = sorted(p.stem for p in CONFIG_DIR.glob("*.py") if p.stem != "__init__")


def write_cfg(tmp_path: Path, body: str, name: str = "exp") -> str:
    path = tmp_path / f"{name}.py"
    path.write_text("from easydict import EasyDict as edict\nconfig = edict()\n" + body)
    return str(path)


# ------------------------------------------------------------------------------ shipped configs

@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_config_loads(name):
    cfg = load_config(f"configs/{name}")
    assert cfg.name == name
    assert list(cfg) == list(KEYS)
    if name in ("base", "image_folder_r50"):  # num_classes/num_image None: the trainer takes them from the dataset
        cfg = cfg.updated(num_classes=1000, num_image=100_000)
    d = derive(cfg, 1 if name == "debug_cpu" else 8)
    assert d.total_steps > d.warmup_steps >= 0


def test_name_forms_resolve_to_same_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # repository-relative lookup must not depend on the working directory
    a = load_config("configs/ms1mv2_r50")
    b = load_config("configs/ms1mv2_r50.py")
    c = load_config("ms1mv2_r50")
    assert a == b == c and a.source == b.source == str(CONFIG_DIR / "ms1mv2_r50.py")


def test_missing_config_suggests_name():
    with pytest.raises(ValueError, match=r"configs/ms1mv3_r50\?"):
        load_config("configs/ms1mv3_r5O")


def test_debug_cpu_is_tiny_and_cpu():
    cfg = load_config("configs/debug_cpu")
    assert cfg.network == "tiny" and cfg.network_kwargs == {"widths": (8, 16, 16, 32)}
    assert cfg.rec == "synthetic" and cfg.device == "cpu" and cfg.batch_size == 8 and cfg.sample_rate == 0.5
    assert cfg.output == "work_dirs/debug_cpu" and cfg.save_every_steps == 5 and 0 < cfg.max_steps <= 60


def test_output_none_resolves_like_arcface_torch(tmp_path):
    cfg = load_config(write_cfg(tmp_path, "config.output = None\n", name="my_exp"))
    assert cfg.output == str(Path("work_dirs") / "my_exp")


def test_base_py_is_written_from_the_declarations():
    """configs/base.py, the file users read and copy, is the declarations' (python -m utils.config --write-base)."""
    assert BASE_CONFIG.read_text() == base_file(), (
        "configs/base.py differs from utils/config_keys.py: edit the declaration, then python -m utils.config "
        "--write-base")


def test_every_declaration_is_complete():
    """Each declared default has its declared type and passes its rule (checked by loading base, whose values are
    the defaults), and each key says what it means."""
    assert load_config("configs/base").to_dict() == {k: _coerce(key, key.default, "") for k, key in KEYS.items()} \
        | {"output": str(Path("work_dirs") / "base")}
    assert [name for name, key in KEYS.items() if len(key.doc) < 20] == []


def test_a_key_missing_from_an_edited_base_py_keeps_its_declared_default(tmp_path, monkeypatch):
    """arcface_torch's users edit base.py: its values are the defaults of every recipe, a key it no longer sets
    keeps the declared default, and a key it sets that is not declared is refused, naming base.py."""
    import utils.config as config

    edited = tmp_path / "base.py"
    edited.write_text(base_file().replace("config.lr = 0.1\n", "config.lr = 0.2\n").replace("config.seed = 2048\n", ""))
    monkeypatch.setattr(config, "BASE_CONFIG", edited)
    monkeypatch.setattr(config, "_BASE_CACHE", {})
    cfg = load_config("configs/debug_cpu")
    assert (cfg.lr, cfg.seed) == (0.2, KEYS["seed"].default)
    edited.write_text(base_file() + "config.learning_rate = 0.2\n")
    monkeypatch.setattr(config, "_BASE_CACHE", {})
    with pytest.raises(ValueError, match=rf"{edited}: unknown key 'learning_rate'; did you mean 'lr'\?"):
        load_config("configs/debug_cpu")


# ------------------------------------------------------------------------------ rejection

def test_unknown_key_names_file_and_suggests(tmp_path):
    path = write_cfg(tmp_path, "config.lerning_rate = 0.1\nconfig.num_clases = 10\n")
    with pytest.raises(ValueError) as err:
        load_config(path)
    msg = str(err.value)
    assert path in msg and "'lerning_rate'" in msg


def test_unknown_key_suggestion(tmp_path):
    with pytest.raises(ValueError, match=r"'num_clases'.*did you mean 'num_classes'"):
        load_config(write_cfg(tmp_path, "config.num_clases = 10\n"))


@pytest.mark.parametrize("key,value,hint", [
    ("loss", "'cosface'", r"older `loss` is margin_list here .*'cosface' = \(1.0, 0.0, 0.4\)"),
    ("decay_epoch", "[10, 16, 22]", r"older step decay is not used: .*polynomially .*remove the key"),
    ("dataset", "'emore'", r"older `dataset` name is not used: `rec` names"),
])
def test_arcface_torch_s_former_keys_say_what_replaced_them(tmp_path, key, value, hint):
    with pytest.raises(ValueError, match=rf"unknown key '{key}'; arcface_torch's {hint}"):
        load_config(write_cfg(tmp_path, f"config.{key} = {value}\n"))
    with pytest.raises(ValueError, match=rf"--set '{key}=x': unknown key '{key}'; arcface_torch's {hint}"):
        load_config("configs/debug_cpu", [f"{key}=x"])


@pytest.mark.parametrize("body,needle", [
    ("config.batch_size = 12.5\n", "batch_size"),
    ("config.batch_size = True\n", "batch_size"),  # bool is not an int here
    ("config.lr = '0.1'\n", "lr"),
    ("config.fp16 = 1\n", "fp16"),
    ("config.margin_list = 0.5\n", "margin_list"),
    ("config.margin_list = (1.0, 'a', 0.0)\n", r"margin_list\[1\]"),
    ("config.network_kwargs = [1, 2]\n", "network_kwargs"),
    ("config.output = 3\n", "output"),
    ("config.resume = 1\n", "resume"),
])
def test_wrong_type(tmp_path, body, needle):
    path = write_cfg(tmp_path, body)
    with pytest.raises(ValueError, match=needle + r".*expected") as err:
        load_config(path)
    assert path in str(err.value)  # README: wrong types are errors naming the file


def test_int_accepted_for_float(tmp_path):
    cfg = load_config(write_cfg(tmp_path, "config.lr = 1\nconfig.sample_rate = 1\n"))
    assert isinstance(cfg.lr, float) and cfg.lr == 1.0 and isinstance(cfg.sample_rate, float)


@pytest.mark.parametrize("body,needle", [
    ("config.sample_rate = 0.0\n", r"sample_rate = 0\.0 .*\(0, 1\]"),
    ("config.sample_rate = 1.5\n", r"sample_rate = 1\.5 .*\(0, 1\]"),
    ("config.batch_size = 0\n", r"batch_size = 0 .*>= 1"),
    ("config.lr = 0\n", r"lr = 0\.0 .*> 0"),
    ("config.lr = -0.1\n", r"lr = -0\.1 .*> 0"),
    ("config.num_classes = 0\n", r"num_classes = 0 .*>= 1"),
    ("config.embedding_size = 0\n", r"embedding_size = 0 .*>= 1"),
    ("config.gradient_acc = 0\n", r"gradient_acc = 0 .*>= 1"),
    ("config.margin_list = (1.0, 0.5)\n", r"margin_list = \(1\.0, 0\.5\) .*3 finite numbers"),
    ("config.margin_list = (1.0, -0.5, 0.0)\n", r"margin_list .*0 <= m2 < pi/2"),
    ("config.margin_list = (1.0, 2.0, 0.0)\n", r"margin_list = \(1\.0, 2\.0, 0\.0\) .*0 <= m2 < pi/2"),
    ("config.margin_list = (0.5, 0.5, 0.0)\n", r"margin_list .*m1 >= 1"),
    ("config.optimizer = 'adam'\n", r"optimizer = 'adam' .*'sgd' or 'adamw'"),
    ("config.fp16 = True\nconfig.bf16 = True\n", r"fp16 = True and bf16 = True"),
    ("config.device = 'gpu'\n", r"device = 'gpu' .*'auto', 'cpu' or 'cuda'"),
    ("config.keep_checkpoints = 0\n", r"keep_checkpoints = 0 .*>= 1"),
    ("config.num_epoch = 0\n", r"num_epoch = 0 and max_steps = 0"),
    ("config.margin_gradient = 'approx'\n", r"margin_gradient = 'approx'"),
    ("config.interclass_filtering_threshold = 1.0\n", r"interclass_filtering_threshold = 1\.0 .*\[0, 1\)"),
    ("config.momentum = 1.0\n", r"momentum = 1\.0"),
    ("config.weight_decay = -1e-4\n", r"weight_decay"),
    ("config.clip_grad_norm = -1\n", r"clip_grad_norm"),
    ("config.max_nonfinite_steps = 0\n", r"max_nonfinite_steps = 0"),
    ("config.warmup_epoch = -1\n", r"warmup_epoch = -1 .*>= 0 \(arcface_torch's -1 trains as 0"),
    ("config.lr_power = 0\n", r"lr_power = 0\.0 .*finite and > 0"),
    ("config.lr_power = -1\n", r"lr_power = -1\.0 .*finite and > 0"),
    ("config.lr_power = float('inf')\n", r"lr_power = inf .*finite and > 0"),
    ("config.dali_aug = True\n", r"dali_aug = True is not allowed; expected False: .*set dali_aug = False"),
    ("config.sample_rate = 0\n", r"sample_rate = 0\.0 .*\(0, 1\] .*below 1 / num_classes"),
    ("config.margin_scale = 0\n", r"margin_scale = 0\.0 is not allowed; expected > 0"),
    ("config.margin_scale = -64.0\n", r"margin_scale = -64\.0 is not allowed; expected > 0"),
    ("config.margin_list = (1.0, 0.5, -0.1)\n", r"margin_list = \(1\.0, 0\.5, -0\.1\) .*m3 >= 0"),
    ("config.margin_list = (1.0, 0.5, float('inf'))\n", r"margin_list = \(1\.0, 0\.5, inf\) .*3 finite numbers"),
    ("config.margin_list = (float('inf'), 0.5, 0.0)\n", r"margin_list = \(inf, 0\.5, 0\.0\) .*3 finite numbers"),
    ("config.margin_list = (1.0, 0.5, float('nan'))\n", r"margin_list = \(1\.0, 0\.5, nan\) .*3 finite numbers"),
    ("config.max_steps = -1\n", r"max_steps = -1 is not allowed; expected >= 0"),
    ("config.num_workers = -1\n", r"num_workers = -1 is not allowed; expected >= 0"),
    ("config.seed = -1\n", r"seed = -1 is not allowed; expected >= 0"),
    ("config.verbose = 0\n", r"verbose = 0 is not allowed; expected >= 1"),
    ("config.frequent = 0\n", r"frequent = 0 is not allowed; expected >= 1"),
    ("config.save_every_steps = -1\n", r"save_every_steps = -1 is not allowed; expected >= 0"),
    ("config.dist_timeout_minutes = 0\n", r"dist_timeout_minutes = 0 is not allowed; expected >= 1"),
    ("config.num_image = 0\n", r"num_image = 0 is not allowed; expected >= 1, or None"),
    ("config.network = ''\n", r"network = '' is not allowed; expected a backbone name"),
    ("config.network = '  '\n", r"network = '  ' is not allowed; expected a backbone name"),
    ("config.rec = ''\n", r"rec = '' is not allowed; expected a dataset folder or 'synthetic'"),
    ("config.rec = '  '\n", r"rec = '  ' is not allowed; expected a dataset folder or 'synthetic'"),
])
def test_impossible_values(tmp_path, body, needle):
    path = write_cfg(tmp_path, body)
    with pytest.raises(ValueError, match=needle) as err:
        load_config(path)
    assert path in str(err.value)


def test_lr_power_and_dali_aug_defaults(tmp_path):
    cfg = load_config("configs/debug_cpu")
    assert cfg.lr_power == 1.0 and cfg.dali_aug is False  # linear decay, as arcface_torch's current trainer
    cfg = load_config(write_cfg(tmp_path, "config.lr_power = 2\nconfig.dali_aug = False\n"))
    assert isinstance(cfg.lr_power, float) and cfg.lr_power == 2.0 and cfg.dali_aug is False
    assert load_config("configs/debug_cpu", ["lr_power=0.5"]).lr_power == 0.5


def test_refusals_are_one_line(tmp_path):
    for body in ("config.dali_aug = True\n", "config.warmup_epoch = -1\n", "config.sample_rate = 0\n"):
        with pytest.raises(ValueError) as err:
            load_config(write_cfg(tmp_path, body))
        assert "\n" not in str(err.value), str(err.value)


def test_max_steps_allows_zero_epochs(tmp_path):
    cfg = load_config(write_cfg(tmp_path, "config.num_epoch = 0\nconfig.max_steps = 7\nconfig.num_image = 1000\n"))
    assert derive(cfg, 1).total_steps == 7


def test_config_without_config_object(tmp_path):
    path = tmp_path / "empty.py"
    path.write_text("x = 1\n")
    with pytest.raises(ValueError, match="defines no `config`"):
        load_config(str(path))


# ------------------------------------------------------------------------------ --set

def test_set_repeated_and_multiple():
    cfg = load_config("configs/debug_cpu", ["lr=0.5", "batch_size=4", "lr=0.25", "seed=7"])
    assert (cfg.lr, cfg.batch_size, cfg.seed) == (0.25, 4, 7)


@pytest.mark.parametrize("text,expected", [
    ("true", True), ("False", False), ("1", True), ("0", False), ("yes", True), ("no", False)])
def test_set_bool(text, expected):
    assert load_config("configs/debug_cpu", [f"fp16={text}"]).fp16 is expected


def test_set_tuple_forms():
    assert load_config("configs/debug_cpu", ["margin_list=1.0,0.0,0.4"]).margin_list == (1.0, 0.0, 0.4)
    assert load_config("configs/debug_cpu", ["margin_list=(1, 0.5, 0)"]).margin_list == (1.0, 0.5, 0.0)
    assert load_config("configs/debug_cpu", ["val_targets=lfw,cfp_fp"]).val_targets == ("lfw", "cfp_fp")
    assert load_config("configs/debug_cpu", ["val_targets=['lfw']"]).val_targets == ("lfw",)
    assert load_config("configs/debug_cpu", ["val_targets="]).val_targets == ()


def test_set_none_dict_and_strings():
    cfg = load_config("configs/debug_cpu", ["init_backbone=/x/model.pt", "init_backbone=none",
                                            "network_kwargs={'widths': (4, 8, 8, 16)}", "rec=/data/ms1m"])
    assert cfg.init_backbone is None and cfg.network_kwargs == {"widths": (4, 8, 8, 16)} and cfg.rec == "/data/ms1m"
    assert load_config("configs/debug_cpu", ["output=null"]).output == str(Path("work_dirs") / "debug_cpu")
    assert load_config("configs/debug_cpu", ["resume=true"]).resume is True
    assert load_config("configs/debug_cpu", ["resume=/ck/step_000000010"]).resume == "/ck/step_000000010"


@pytest.mark.parametrize("text,needle", [
    ("lerning_rate=0.1", r"--set 'lerning_rate=0.1': unknown key 'lerning_rate'"),
    ("batch_size=abc", r"batch_size=abc.*cannot parse 'abc' as int"),
    ("fp16=maybe", r"fp16=maybe.*cannot parse"),
    ("lr", r"expected KEY=VALUE"),
    ("margin_list=(1,", r"margin_list"),
    ("batch_size=0", r"batch_size = 0 .*>= 1"),
    ("batch_size=1.5", r"cannot parse '1.5' as int"),
])
def test_set_errors_name_the_override(text, needle):
    with pytest.raises(ValueError, match=needle):
        load_config("configs/debug_cpu", [text])


def test_set_unknown_key_suggests():
    with pytest.raises(ValueError, match=r"did you mean 'sample_rate'"):
        load_config("configs/debug_cpu", ["sample_rat=0.3"])


# ------------------------------------------------------------------------------ Config object

def test_config_is_read_only_and_picklable():
    cfg = load_config("configs/debug_cpu")
    with pytest.raises(AttributeError, match="read-only"):
        cfg.lr = 1.0
    with pytest.raises(TypeError):
        cfg["lr"] = 1.0  # type: ignore[index]
    with pytest.raises(TypeError, match="read-only"):
        cfg.network_kwargs["widths"] = (1,)
    with pytest.raises(AttributeError, match="did you mean 'batch_size'"):
        _ = cfg.batch_sise
    again = pickle.loads(pickle.dumps(cfg))
    assert again == cfg and again.name == "debug_cpu" and isinstance(again, Config)
    plain = cfg.to_dict()
    plain["network_kwargs"]["widths"] = (1,)  # a copy: the config does not change
    assert cfg.network_kwargs["widths"] == (8, 16, 16, 32)
    assert cfg["lr"] == cfg.lr and "lr" in cfg and len(cfg) == len(KEYS)


def test_str_lists_every_key_and_marks_changes():
    text = str(load_config("configs/debug_cpu"))
    lines = text.splitlines()
    assert len(lines) == len(KEYS) + 1
    assert any(line.startswith(" * network ") and "'tiny'" in line for line in lines)
    assert any(line.startswith("   optimizer ") for line in lines)


# ------------------------------------------------------------------------------ derive / world / paths

def test_derive_counts_optimizer_steps(tmp_path):
    cfg = load_config(write_cfg(tmp_path, "config.num_image = 1000\nconfig.batch_size = 10\nconfig.num_epoch = 3\n"
                                          "config.warmup_epoch = 1\nconfig.gradient_acc = 2\n"))
    d = derive(cfg, 4)
    assert (d.global_batch_size, d.images_per_step, d.steps_per_epoch, d.total_steps, d.warmup_steps) == \
        (40, 80, 12, 36, 12)  # 1000 // 40 = 25 micro-steps -> 12 optimizer steps per epoch
    assert derive(cfg, 1).steps_per_epoch == 50
    with pytest.raises(AttributeError):
        _ = cfg.total_steps  # derived values never appear in the config


def test_derive_max_steps_and_errors(tmp_path):
    cfg = load_config(write_cfg(tmp_path, "config.num_image = 100\nconfig.batch_size = 10\nconfig.max_steps = 4\n"
                                          "config.warmup_epoch = 1\n"))
    with pytest.raises(ValueError, match=r"warm-up .*10 steps.*4 steps"):
        derive(cfg, 1)
    small = load_config(write_cfg(tmp_path, "config.num_image = 100\nconfig.batch_size = 10\n", name="small"))
    with pytest.raises(ValueError, match=r"num_image = 100 .*batch_size 10 x world_size 16"):
        derive(small, 16)


def test_check_world():
    cfg = load_config("configs/debug_cpu")
    check_world(cfg, 64)
    with pytest.raises(ValueError, match=r"num_classes = 64 .*world_size = 65"):
        check_world(cfg, 65)


def test_check_paths(tmp_path):
    check_paths(load_config("configs/debug_cpu"))
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match=r"rec = '.*nope': no such folder; expected a folder holding train.rec"):
        check_paths(load_config("configs/debug_cpu", [f"rec={missing}"]))
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "train.rec").write_bytes(b"")
    with pytest.raises(ValueError, match="not train.idx"):
        check_paths(load_config("configs/debug_cpu", [f"rec={tmp_path / 'half'}"]))
    with pytest.raises(ValueError, match="init_backbone = .*no such file"):
        check_paths(load_config("configs/debug_cpu", [f"init_backbone={missing}.pt"]))


def test_check_paths_refuses_a_missing_resume_directory(tmp_path):
    """README: resume = a path continues from that checkpoint directory; one that is not there is refused, naming it."""
    missing = tmp_path / "work" / "checkpoints" / "step_000000010"
    cfg = load_config("configs/debug_cpu", [f"resume={missing}"])  # a str: accepted by the loader, checked on disk
    assert cfg.resume == str(missing)
    with pytest.raises(ValueError, match=r"resume = '.*step_000000010': no such checkpoint directory; expected "
                                         r"<output>/checkpoints/step_<step>, or True") as err:
        check_paths(cfg)
    assert repr(str(missing)) in str(err.value) and "\n" not in str(err.value)
    missing.parent.mkdir(parents=True)
    missing.write_bytes(b"")  # a file is not a checkpoint directory either
    with pytest.raises(ValueError, match="no such checkpoint directory"):
        check_paths(cfg)
    missing.unlink()
    missing.mkdir()
    check_paths(cfg)  # an existing directory passes (whether it holds a checkpoint is checked at resume)
    check_paths(load_config("configs/debug_cpu", ["resume=true"]))  # True: the newest under output, no path


def test_dali_needs_num_classes():
    """README (`dali`): the DALI loader needs num_classes set; dataset.build_data refuses None before opening DALI
    (so this runs without nvidia-dali or a GPU), in one line naming the keys."""
    import logging

    import torch

    from dataset import build_data

    cfg = load_config("configs/debug_cpu", ["dali=true", "num_classes=none"])
    assert cfg.dali is True and cfg.num_classes is None
    with pytest.raises(ValueError, match=r"^dali = True needs num_classes: the DALI reader does not count classes$"):
        build_data(cfg.rec, cfg.batch_size, num_classes=cfg.num_classes, num_image=cfg.num_image, seed=cfg.seed,
                   num_workers=0, dali=cfg.dali, rank=0, world_size=1, device=torch.device("cpu"),
                   logger=logging.getLogger("test_config"))


# ------------------------------------------------------------------------------ fingerprint

def test_fingerprint_stable_and_selective(tmp_path):
    base = load_config("configs/debug_cpu")
    fp = fingerprint(base)
    assert len(fp) == 16 and fp == fingerprint(load_config("configs/debug_cpu"))
    assert fp == fingerprint(pickle.loads(pickle.dumps(base))) == fingerprint(base.to_dict())
    same = load_config("configs/debug_cpu", ["output=/elsewhere", "frequent=1", "num_workers=3", "verbose=5",
                                             "save_every_steps=0", "keep_checkpoints=9", "val_targets=lfw",
                                             "auto_resume=false", "resume=true"])
    assert fingerprint(same) == fp
    for change in ["lr=0.2", "seed=1", "sample_rate=0.25", "margin_list=1,0,0.4", "max_steps=41", "lr_power=2",
                   "lr_power=3", "network_kwargs={'widths': (8, 16, 16, 16)}", "fp16=true", "batch_size=4"]:
        assert fingerprint(load_config("configs/debug_cpu", [change])) != fp, change
    assert {"output", "resume", "verbose", "frequent", "num_workers", "save_every_steps", "keep_checkpoints",
            "val_targets", "auto_resume"} <= FINGERPRINT_EXCLUDED


def test_fingerprint_of_checkpoints_from_before_the_new_keys():
    """A config saved before `lr_power`/`dali_aug` existed (trained with power 2) hashes as it did then when
    resumed with lr_power = 2; the new default (power 1) trains differently, so it must not match."""
    old = {k: v for k, v in load_config("configs/debug_cpu").to_dict().items() if k not in ("lr_power", "dali_aug")}
    assert fingerprint(load_config("configs/debug_cpu", ["lr_power=2"])) == fingerprint(old)
    assert fingerprint(load_config("configs/debug_cpu")) != fingerprint(old)
    assert "lr_power" not in FINGERPRINT_EXCLUDED and "dali_aug" not in FINGERPRINT_EXCLUDED


def test_compile_backend_must_be_one_torch_knows():
    assert load_config("configs/debug_cpu", ["compile_backend=aot_eager"]).compile_backend == "aot_eager"
    with pytest.raises(ValueError, match="compile_backend = 'inductr' is not allowed; "
                                         "expected a torch.compile backend"):
        load_config("configs/debug_cpu", ["compile_backend=inductr"])


def test_num_classes_and_num_image_may_be_left_to_the_dataset():
    cfg = load_config("configs/debug_cpu", ["num_classes=none", "num_image=None"])
    assert cfg.num_classes is None and cfg.num_image is None
    with pytest.raises(ValueError, match="num_image is None"):
        derive(cfg, 1)
    filled = cfg.updated(num_classes=64, num_image=256)
    assert (filled.num_classes, filled.num_image, cfg.num_classes) == (64, 256, None)  # a new config; cfg unchanged
    assert derive(filled, 2).steps_per_epoch == 16
    with pytest.raises(ValueError, match="num_classes = 0 is not allowed; expected >= 1, or None"):
        load_config("configs/debug_cpu", ["num_classes=0"])


def test_a_moved_dataset_keeps_its_fingerprint(tmp_path):
    from dataset import data_identity

    for where in ("a", "b"):
        (tmp_path / where / "id0").mkdir(parents=True)
        (tmp_path / where / "id0" / "0.jpg").write_bytes(b"x" * 10)
    cfg_a = load_config("configs/debug_cpu", [f"rec={tmp_path / 'a'}"])
    cfg_b = load_config("configs/debug_cpu", [f"rec={tmp_path / 'b'}"])
    assert data_identity(cfg_a.rec) == data_identity(cfg_b.rec)
    assert fingerprint(cfg_a, data_identity(cfg_a.rec)) == fingerprint(cfg_b, data_identity(cfg_b.rec))
    (tmp_path / "b" / "id0" / "1.jpg").write_bytes(b"y")  # other contents: another identity
    assert data_identity(cfg_b.rec) != data_identity(cfg_a.rec)


def test_a_config_that_is_not_there_is_named_with_the_closest_or_its_new_name():
    from utils.config import CONFIG_DIR, RENAMED_CONFIGS

    with pytest.raises(ValueError, match=r"config 'configs/ms1mv3_r5' not found \(tried .*ms1mv3_r5\.py.*\); shipped "
                                         r"configs: .*ms1mv3_r50.*; did you mean configs/ms1mv3_r50\?$"):
        load_config("configs/ms1mv3_r5")
    # README: arcface_torch renamed wf42m_pfc02_r50; the old name is answered with the new one, not a lookalike
    with pytest.raises(ValueError, match=r"did you mean configs/wf42m_pfc02_8gpus_r50_bs4k\?$"):
        load_config("configs/wf42m_pfc02_r50")
    assert all((CONFIG_DIR / f"{new}.py").is_file() and not (CONFIG_DIR / f"{old}.py").exists()
               for old, new in RENAMED_CONFIGS.items())


# ------------------------------------------------------------------------------ recipes on recipes

def test_a_recipe_builds_on_another_by_name_or_beside_it(tmp_path):
    """`base = "NAME"` names a recipe beside the file before one in configs/; `config` sets what differs from it."""
    (tmp_path / "debug_cpu.py").write_text('base = "configs/debug_cpu"\nconfig = {"lr": 0.01, "seed": 3}\n')
    child = tmp_path / "child.py"
    child.write_text('from easydict import EasyDict as edict\nbase = "debug_cpu"\nconfig = edict()\nconfig.seed = 7\n')
    cfg = load_config(str(child))
    assert (cfg.lr, cfg.seed, cfg.network, cfg.name, cfg.source) == (0.01, 7, "tiny", "child", str(child))
    assert cfg.output == "work_dirs/debug_cpu"  # configs/debug_cpu.py's, as written there
    assert cfg.to_dict() == load_config("configs/debug_cpu", ["lr=0.01", "seed=7"]).to_dict()


@pytest.mark.parametrize("base,needle", [
    ('"nowhere"', r"child\.py: base = 'nowhere': config 'nowhere' not found .*$"),
    ('"debug_cpux"', r"child\.py: base = 'debug_cpux': .*did you mean configs/debug_cpu\?$"),
    ("3", r"child\.py: base = 3; expected the name or path of the recipe this one builds on"),
    ('"child"', r"child\.py: its bases make a cycle \(.*child\.py -> .*child\.py\)"),
])
def test_a_base_that_cannot_serve_is_one_line_naming_the_file(tmp_path, base, needle):
    path = tmp_path / "child.py"
    path.write_text(f"from easydict import EasyDict as edict\nbase = {base}\nconfig = edict()\n")
    with pytest.raises(ValueError, match=needle) as err:
        load_config(str(path))
    assert "\n" not in str(err.value)


def test_a_cycle_through_two_recipes_is_refused(tmp_path):
    (tmp_path / "a.py").write_text('base = "b"\nconfig = {}\n')
    (tmp_path / "b.py").write_text('base = "a"\nconfig = {}\n')
    with pytest.raises(ValueError, match=r"a\.py: its bases make a cycle \(.*a\.py -> .*b\.py -> .*a\.py\)"):
        load_config(str(tmp_path / "a.py"))


def test_origins_says_where_every_value_came_from():
    from utils.config import origins

    lines = origins("configs/demo_cpu_adaface", ["lr=0.001", "wandb_key=secret"]).splitlines()
    assert lines[0] == "config demo_cpu_adaface: configs/demo_cpu_adaface.py <- configs/demo_cpu.py <- configs/base.py"
    rows = {line.split()[0]: line.split()[-1] for line in lines[1:]}
    assert list(rows) == list(KEYS)
    assert (rows["margin"], rows["network"], rows["seed"]) == (
        "configs/demo_cpu_adaface.py", "configs/demo_cpu.py", "configs/base.py")
    assert rows["lr"] == "lr=0.001" and " 0.001 " in lines[1 + list(KEYS).index("lr")]
    assert "secret" not in "".join(lines[1:]).replace("wandb_key=secret", "") and "'<hidden>'" in "".join(lines)


def test_the_command_line(tmp_path, monkeypatch, capsys):
    import utils.config as config

    assert config.main(["--set", "lr=0.5", "configs/debug_cpu"]) == 0
    assert "--set lr=0.5" in capsys.readouterr().out
    assert config.main([]) == 0 and capsys.readouterr().out.strip() == config.keys_table()
    assert config.main(["configs/nope"]) == 2
    assert capsys.readouterr().err.startswith("utils.config: error: config 'configs/nope' not found")
    monkeypatch.setattr(config, "BASE_CONFIG", tmp_path / "base.py")
    monkeypatch.setattr(config, "DOCS_PAGE", tmp_path / "configuration.md")
    (tmp_path / "configuration.md").write_text("# Keys\n\n| key | old |\n| --- | --- |\n| `lr` | 1 |\n\nAfter.\n")
    assert config.main(["--write-base", "--write-docs"]) == 0
    assert (tmp_path / "base.py").read_text() == base_file()
    assert (tmp_path / "configuration.md").read_text() == f"# Keys\n\n{config.keys_table()}\n\nAfter.\n"
