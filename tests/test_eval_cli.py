"""scripts/verify.py (also as ``python -m eval.verify``) and scripts/make_bin.py on generated data and a briefly
trained tiny network; the model options every tool shares."""
from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn
from torchvision.io import encode_jpeg, encode_png

from backbones.onnx_export import export
from eval.verification import load_bin, save_bin, unpickle_bin
from scripts import make_bin, verify
from tests.helpers import ROOT, UNWRITABLE, run_main

pytest.importorskip("backbones")
from backbones import get_model, list_models  # noqa: E402

TINY = {"widths": [4, 8, 8, 16]}
MODEL_ARGS = ["--network", "tiny", "--embedding-size", "16", "--network-kwargs", json.dumps(TINY)]
PAIRS = 40


def _faces(labels: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Two "identities" a CE step can tell apart but an untrained network cannot: the identity is which
    half (top or bottom: a horizontal flip keeps it) is brighter; a strong random colour cast per image
    dominates the raw pixels."""
    n = labels.numel()
    x = 127.5 + torch.rand(n, 3, 1, 1, generator=g) * 200 - 100 + 10 * torch.randn(n, 3, 112, 112, generator=g)
    sign = (2 * labels.float() - 1).view(n, 1, 1, 1)
    x[:, :, :56] += 30 * sign
    x[:, :, 56:] -= 30 * sign
    return x.clamp(0, 255).round().to(torch.uint8)  # (n, 3, 112, 112)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A .bin of 40 pairs, the weights of a tiny network trained 25 CE steps, and its ONNX export."""
    out = tmp_path_factory.mktemp("cli")
    g = torch.Generator().manual_seed(0)
    issame = [i % 2 == 0 for i in range(PAIRS)]
    labels = torch.tensor([[i % 4 < 2, (i % 4 < 2) == same] for i, same in enumerate(issame)]).flatten().long()
    images = _faces(labels, g)
    save_bin(out / "synth.bin", [encode_jpeg(im, quality=95).numpy().tobytes() for im in images], issame)

    torch.manual_seed(0)
    net = get_model("tiny", num_features=16, widths=(4, 8, 8, 16))
    head = nn.Linear(16, 2)
    opt = torch.optim.SGD([*net.parameters(), *head.parameters()], lr=0.1, momentum=0.9)
    for _ in range(25):
        y = torch.randint(0, 2, (16,), generator=g)
        loss = nn.functional.cross_entropy(head(net((_faces(y, g).float() - 127.5) * (1 / 127.5))), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.save(net.state_dict(), out / "model.pt")
    net.eval()
    export(net, out / "model.onnx")  # as scripts/torch2onnx.py writes it
    return out


def _run(capsys, *argv) -> tuple[int, str, str]:
    rc = verify.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


@pytest.mark.timeout(120)
def test_trained_network_beats_untrained_baseline(trained, capsys):
    rc, out, _ = _run(capsys, *MODEL_ARGS, "--weights", trained / "model.pt", "--data-dir", trained,
                      "--targets", "synth", "--batch-size", "32", "--json", trained / "trained.json",
                      "--roc", trained / "roc.png")
    assert rc == 0
    assert out.splitlines()[0].startswith("target") and out.splitlines()[1].startswith("synth")
    # 20 different pairs cannot reach FAR = 1e-3: the row says which FAR its VAL is at.
    far = json.loads((trained / "trained.json").read_text())["synth"]["far"]
    assert "FAR reached" in out.splitlines()[0] and out.splitlines()[1].split()[-3] == f"{far:.5f}"
    rc, _, _ = _run(capsys, *MODEL_ARGS, "--random-init", "0", "--data-dir", trained, "--targets", "synth",
                    "--json", trained / "random.json")
    assert rc == 0
    ours = json.loads((trained / "trained.json").read_text())["synth"]
    baseline = json.loads((trained / "random.json").read_text())["synth"]
    assert set(ours) == set(verify.JSON_KEYS) and ours["pairs"] == PAIRS
    # measured: 0.925 trained, 0.525 untrained; the bounds leave room for other CPUs' rounding
    assert ours["acc"] >= 0.8 and baseline["acc"] <= 0.65, (ours["acc"], baseline["acc"])
    assert (trained / "roc.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # The exported model gives the same table through onnxruntime.
    rc, _, _ = _run(capsys, "--onnx", trained / "model.onnx", "--data-dir", trained, "--targets", "synth",
                    "--json", trained / "onnx.json")
    assert rc == 0
    via_onnx = json.loads((trained / "onnx.json").read_text())["synth"]
    assert via_onnx["acc"] == ours["acc"] and via_onnx["xnorm"] == pytest.approx(ours["xnorm"], rel=1e-4)


@pytest.mark.timeout(120)
def test_precision_bf16_runs_the_body_under_autocast(trained, capsys):
    rows = {}
    for precision in ("fp32", "bf16"):
        rc, _, _ = _run(capsys, *MODEL_ARGS, "--weights", trained / "model.pt", "--data-dir", trained,
                        "--targets", "synth", "--precision", precision, "--json", trained / f"{precision}.json")
        assert rc == 0
        rows[precision] = json.loads((trained / f"{precision}.json").read_text())["synth"]
    # bf16 rounds the body's activations (~3 significant digits): the embeddings move a little, not the verdict.
    assert rows["bf16"]["xnorm"] != rows["fp32"]["xnorm"]
    assert rows["bf16"]["xnorm"] == pytest.approx(rows["fp32"]["xnorm"], rel=0.05)
    assert rows["bf16"]["acc"] >= 0.8
    # An exported model runs as it was exported: --precision is refused with --onnx, at parse time.
    with pytest.raises(SystemExit) as exc:
        verify.parse_args(["--onnx", str(trained / "model.onnx"), "--data-dir", str(trained), "--precision", "bf16"])
    assert exc.value.code == 2 and "--precision bf16 applies to torch models" in capsys.readouterr().err


def test_mismatched_weights_exit_with_one_line(trained):
    # As from a process of its own (tests.helpers.run_main): the exit status and the whole of stderr a user sees.
    cmd = ["--network", "tiny", "--embedding-size", "16", "--network-kwargs", '{"widths": [4, 8, 8, 32]}',
           "--weights", str(trained / "model.pt"), "--data-dir", str(trained), "--targets", "synth"]
    proc = run_main(verify.main, cmd, "scripts/verify.py")
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "does not match network tiny" in lines[0] and "shape mismatch" in lines[0], proc.stderr


def test_missing_files_and_exclusive_sources(trained, capsys):
    rc, _, err = _run(capsys, *MODEL_ARGS, "--weights", trained / "nope.pt", "--data-dir", trained,
                      "--targets", "synth")
    assert rc == 2 and err.strip().splitlines() == [
        f"verify: error: --weights {trained / 'nope.pt'}: no such file or folder; did you mean {trained / 'model.pt'}?"]
    rc, _, err = _run(capsys, *MODEL_ARGS, "--random-init", "0", "--data-dir", trained, "--targets", "synth,lfw")
    assert rc == 2 and "lfw.bin" in err and len(err.strip().splitlines()) == 1
    with pytest.raises(SystemExit):
        verify.main([*MODEL_ARGS, "--random-init", "0", "--weights", str(trained / "model.pt"),
                     "--data-dir", str(trained)])
    assert "not allowed with argument" in capsys.readouterr().err


def test_make_bin_round_trip(tmp_path):
    g = torch.Generator().manual_seed(3)
    (tmp_path / "imgs").mkdir()
    for i in range(4):
        (tmp_path / "imgs" / f"{i}.jpg").write_bytes(
            encode_jpeg(torch.randint(0, 256, (3, 112, 112), generator=g, dtype=torch.uint8)).numpy().tobytes())
    (tmp_path / "pairs.txt").write_text("# a comment\nimgs/0.jpg imgs/1.jpg 1\n\nimgs/2.jpg imgs/3.jpg 0\n")
    assert make_bin.main(["--pairs", str(tmp_path / "pairs.txt"), "--out", str(tmp_path / "out.bin")]) == 0
    images, issame = load_bin(tmp_path / "out.bin")
    assert issame == [True, False] and images.shape == (4, 3, 112, 112)
    stored, _ = unpickle_bin(tmp_path / "out.bin")  # the files' bytes, unchanged and in pair order
    assert stored == [(tmp_path / "imgs" / f"{i}.jpg").read_bytes() for i in range(4)]

    (tmp_path / "bad.txt").write_text("imgs/0.jpg imgs/1.jpg 1\nimgs/2.jpg imgs/9.jpg 0\n")
    assert make_bin.main(["--pairs", str(tmp_path / "bad.txt"), "--out", str(tmp_path / "bad.bin")]) == 2
    (tmp_path / "bad.txt").write_text("imgs/0.jpg imgs/1.jpg yes\n")
    with pytest.raises(ValueError, match=r"bad\.txt:1: expected 'path1 path2 0\|1'"):
        make_bin.read_pairs(tmp_path / "bad.txt", tmp_path)
    assert not (tmp_path / "bad.bin").exists()



def _numbers(line: str) -> list[str]:
    return re.findall(r"\d+\.\d+", line)


@pytest.mark.timeout(120)
def test_training_log_and_cli_print_the_same_table_in_the_same_units(trained, capsys, caplog):
    from eval.callback import CallbackVerification
    from utils.files import load_weights

    rc, out, _ = _run(capsys, *MODEL_ARGS, "--weights", trained / "model.pt", "--data-dir", trained,
                      "--targets", "synth.bin", "--batch-size", "16")  # the name with its .bin works too
    assert rc == 0
    cli_row = out.splitlines()[1]
    net = get_model("tiny", num_features=16, widths=(4, 8, 8, 16))
    load_weights(net, trained / "model.pt", network="tiny")
    callback = CallbackVerification(["synth"], trained, batch_size=16)
    with caplog.at_level("INFO", logger="eval.callback"):
        result = callback(3, net)["synth"]
    log_rows = [line for line in caplog.text.splitlines() if line.startswith("synth")]
    assert len(log_rows) == 1
    # Same numbers, same formatting; the log adds the best accuracy so far after no-flip.
    log_numbers = _numbers(log_rows[0])
    assert log_numbers[:3] + log_numbers[4:] == _numbers(cli_row) and log_numbers[3] == log_numbers[0]
    assert _numbers(cli_row)[0] == f"{result['acc']:.5f}" and 0.5 < result["acc"] <= 1  # a fraction
    assert "%" not in out + caplog.text


def test_targets_with_and_without_bin_and_twice(trained, capsys):
    args = verify.parse_args([*MODEL_ARGS, "--random-init", "0", "--data-dir", str(trained),
                              "--targets", "synth.bin,other, third"])
    assert args.targets == {"synth": trained / "synth.bin", "other": trained / "other.bin",
                            "third": trained / "third.bin"}
    with pytest.raises(SystemExit) as exc:
        verify.parse_args([*MODEL_ARGS, "--random-init", "0", "--data-dir", str(trained),
                           "--targets", "synth,synth.bin"])
    assert exc.value.code == 2 and "--targets names 'synth' twice" in capsys.readouterr().err


def test_bad_bin_exits_1_with_one_line_naming_the_file(tmp_path):
    """What a user sees for a damaged download (the exit status and the whole of stderr: tests.helpers.run_main).
    Exit 1 = bad data, 2 = usage."""
    save_bin(tmp_path / "lfw.bin", [encode_jpeg(torch.zeros(3, 112, 112, dtype=torch.uint8)).numpy().tobytes()] * 4,
             [True, False])
    data = (tmp_path / "lfw.bin").read_bytes()
    (tmp_path / "lfw.bin").write_bytes(data[: len(data) // 2])
    (tmp_path / "cfp_fp.bin").write_bytes(b"<html>404 Not Found</html>")
    for target, message in (("lfw", "truncated pickle"), ("cfp_fp.bin", "not a verification file")):
        proc = run_main(verify.main, [*MODEL_ARGS, "--random-init", "0", "--device", "cpu", "--data-dir",
                                      str(tmp_path), "--targets", target], "scripts/verify.py")
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 1 and len(lines) == 1, proc.stderr
        assert lines[0].startswith(f"verify: error: {tmp_path / target.removesuffix('.bin')}.bin: {message}"), lines


def _jpeg(seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    return encode_jpeg(torch.randint(0, 256, (3, 112, 112), generator=g, dtype=torch.uint8)).numpy().tobytes()


def test_make_bin_decodes_every_image_first(tmp_path, capsys):
    (tmp_path / "imgs").mkdir()
    for i in range(4):
        (tmp_path / "imgs" / f"{i}.jpg").write_bytes(_jpeg(i))
    (tmp_path / "imgs" / "cut.jpg").write_bytes(_jpeg(9)[:1500])
    (tmp_path / "imgs" / "text.png").write_text("not a png")
    (tmp_path / "pairs.txt").write_text("imgs/0.jpg imgs/cut.jpg 1\nimgs/2.jpg imgs/3.jpg 0\n"
                                        "imgs/text.png imgs/cut.jpg 0\n")
    assert make_bin.main(["--pairs", str(tmp_path / "pairs.txt"), "--out", str(tmp_path / "out.bin")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert [line.split(": cannot decode image")[0] for line in err[:-1]] == [
        f"make_bin: bad image {tmp_path / 'imgs' / 'cut.jpg'}", f"make_bin: bad image {tmp_path / 'imgs' / 'text.png'}"]
    assert err[-1] == ("make_bin: error: 2 of 5 images cannot be decoded (listed above); "
                       f"{tmp_path / 'out.bin'} not written")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["imgs", "pairs.txt"]  # no .bin, no temporary


@pytest.mark.process
@pytest.mark.timeout(60)
def test_make_bin_file_mode_follows_the_umask(tmp_path):
    """As a user types it, under a umask other than the default."""
    for i in range(2):
        (tmp_path / f"{i}.jpg").write_bytes(_jpeg(i))
    (tmp_path / "pairs.txt").write_text("0.jpg 1.jpg 1\n")
    proc = subprocess.run(["bash", "-c", f"umask 027 && {sys.executable} scripts/make_bin.py --pairs "
                           f"{tmp_path / 'pairs.txt'} --out {tmp_path / 'set.bin'} && touch {tmp_path / 'plain'}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr
    assert "wrote" in proc.stdout and "1 pairs (1 same)" in proc.stdout
    mode = (tmp_path / "set.bin").stat().st_mode & 0o777
    assert mode == 0o640 == (tmp_path / "plain").stat().st_mode & 0o777, oct(mode)
    assert load_bin(tmp_path / "set.bin").issame == [True]


# ---------------------------------------------------------------------------------------- model options
# scripts/verify.py, ijb.py, torch2onnx.py and inference.py take the same model options and read
# model.json beside --weights when --network is not given.

@pytest.fixture(scope="module")
def carded(trained):
    """``trained``'s weights in a folder of their own, with the model.json the trainer writes beside them."""
    from eval.model_card import MODEL_CARD, model_card

    folder = trained / "run"
    folder.mkdir()
    (folder / "model.pt").write_bytes((trained / "model.pt").read_bytes())
    card = model_card("tiny", TINY, 16, fingerprint="0" * 16, step=25)
    (folder / MODEL_CARD).write_text(json.dumps(card))
    return folder


def _tools(trained, tmp_path):
    """Each tool's ``main`` and the arguments it needs besides the model options (ijb and inference fail or
    finish after the model is built; the model errors tested here come first)."""
    from scripts import ijb, inference, torch2onnx

    image = tmp_path / "face.jpg"
    image.write_bytes(encode_jpeg(torch.full((3, 112, 112), 128, dtype=torch.uint8)).numpy().tobytes())
    return {
        "verify": (verify.main, ["--data-dir", str(trained), "--targets", "synth", "--device", "cpu"]),
        "ijb": (ijb.main, ["--data-dir", str(tmp_path / "ijb"), "--device", "cpu"]),
        "torch2onnx": (torch2onnx.main, ["--output", str(tmp_path / "x.onnx")]),
        "inference": (inference.main, ["--image", str(image), "--device", "cpu"]),
    }


TOOLS = ["verify", "ijb", "torch2onnx", "inference"]


@pytest.mark.process
@pytest.mark.timeout(120)
def test_verify_reads_model_json_when_network_is_not_given(trained, carded, tmp_path):
    """As a user types it: the trained run's model.pt alone, and the same numbers as with every flag; the first
    through ``python -m eval.verify``, the name the tool had, which runs scripts/verify.py."""
    common = ["--data-dir", str(trained), "--targets", "synth", "--device", "cpu", "--batch-size", "40"]
    for name, command, model in (("card", ["-m", "eval.verify"], ["--weights", str(carded / "model.pt")]),
                                 ("flags", ["scripts/verify.py"], [*MODEL_ARGS, "--weights", trained / "model.pt"])):
        proc = subprocess.run([sys.executable, *command, *map(str, model), *common, "--json", str(tmp_path / name)],
                              cwd=ROOT, capture_output=True, text=True, timeout=100)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.splitlines()[1].startswith("synth"), proc.stdout
    assert json.loads((tmp_path / "card").read_text()) == json.loads((tmp_path / "flags").read_text())


def test_no_model_json_and_no_network_is_one_line_saying_what_to_pass(trained):
    proc = run_main(verify.main, ["--weights", str(trained / "model.pt"), "--data-dir", str(trained), "--targets",
                                  "synth", "--device", "cpu"], "scripts/verify.py")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"verify: error: --network is required: {trained / 'model.json'} does not exist (the trainer writes it "
        f"beside model.pt); pass --network, --network-kwargs and --embedding-size as in the training config, "
        f"e.g. --network r50"], proc.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("tool", TOOLS)
def test_a_mistyped_weights_path_is_said_first(tool, trained, carded, tmp_path, capsys):
    """`inference.py --weights work_dirs/fces2 ...` (a run folder mistyped, no --network): the path does not exist,
    said first, with the nearest name; not that a model.json beside it is missing."""
    main, rest = _tools(trained, tmp_path)[tool]
    typo = carded.with_name("rnu")
    rc = main(["--weights", str(typo), *rest])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == [f"{err[0].split(': error: ')[0]}: error: --weights {typo}: no such file or folder; "
                               f"did you mean {carded}?"], err
    rc = main(["--weights", str(tmp_path / "no_folder" / "model.pt"), *rest])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[0].endswith(f"--weights {tmp_path / 'no_folder' / 'model.pt'}: no such file or folder "
                                       f"({tmp_path / 'no_folder'} does not exist either)"), err


@pytest.mark.timeout(120)
def test_an_onnx_file_given_as_weights_runs_as_onnx(trained, tmp_path, capsys):
    """`inference.py --weights model.onnx` runs the exported model (the embedding --onnx gives); torch2onnx, which
    needs torch weights, says so in one line."""
    from scripts import inference, torch2onnx

    image = tmp_path / "face.jpg"
    image.write_bytes(encode_jpeg(torch.full((3, 112, 112), 128, dtype=torch.uint8)).numpy().tobytes())
    outputs = {}
    for flag in ("--weights", "--onnx"):
        proc = run_main(inference.main, [flag, str(trained / "model.onnx"), "--image", str(image), "--device", "cpu",
                                         "--output", str(tmp_path / f"{flag[2:]}.npy")], "scripts/inference.py")
        assert proc.returncode == 0, proc.stderr
        outputs[flag] = np.load(tmp_path / f"{flag[2:]}.npy")
    np.testing.assert_array_equal(outputs["--weights"], outputs["--onnx"])
    with pytest.raises(SystemExit):
        torch2onnx.main([str(trained / "model.onnx"), "--output", str(tmp_path / "again.onnx")])
    assert "is an exported ONNX model already; pass the torch weights (model.pt)" in capsys.readouterr().err


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tool", TOOLS)
def test_every_tool_reads_model_json_and_says_what_to_pass(tool, trained, carded, tmp_path, capsys):
    main, rest = _tools(trained, tmp_path)[tool]
    wrong = ["--network", "tiny", "--embedding-size", "16", "--network-kwargs", '{"widths": [4, 8, 8, 32]}']

    def run(*model: str) -> tuple[int, list[str]]:
        rc = main([*model, *rest])
        return rc, capsys.readouterr().err.strip().splitlines()

    # No --network and no model.json.
    rc, err = run("--weights", str(trained / "model.pt"))
    assert rc == 2 and len(err) == 1 and "--network is required" in err[0] and str(trained / "model.json") in err[0]
    # Flags that do not fit, with a model.json beside the weights: it names model.json's flags.
    rc, err = run(*wrong, "--weights", str(carded / "model.pt"))
    assert rc == 2 and len(err) == 1, err
    assert "does not match network tiny" in err[0] and (
        f"{carded / 'model.json'} says --network tiny --network-kwargs '{{\"widths\": [4, 8, 8, 16]}}' "
        f"--embedding-size 16: leave out --network, --network-kwargs and --embedding-size to use it") in err[0]
    # Flags that do not fit and no model.json: what to pass, and the size of the file's embeddings.
    rc, err = run(*wrong, "--weights", str(trained / "model.pt"))
    assert rc == 2 and len(err) == 1 and err[0].endswith(
        "pass --network, --network-kwargs and --embedding-size as in the training config (the file's embeddings are "
        "16-dimensional)"), err
    # A model.json that describes other weights: pass the flags.
    other = tmp_path / "other"
    other.mkdir()
    (other / "model.pt").write_bytes((carded / "model.pt").read_bytes())
    card = json.loads((carded / "model.json").read_text())
    (other / "model.json").write_text(json.dumps({**card, "embedding_size": 8}))
    rc, err = run("--weights", str(other / "model.pt"))
    assert rc == 2 and len(err) == 1 and "does not match network tiny" in err[0] and (
        f"{other / 'model.json'} says --network tiny --network-kwargs '{{\"widths\": [4, 8, 8, 16]}}' "
        f"--embedding-size 8, which does not describe these weights: pass --network, --network-kwargs and "
        f"--embedding-size as in the training config") in err[0], err
    # The weights with their model.json, named by the file or by the run's folder (as arcface_torch's tools take
    # it): the model is built (ijb then stops at its missing data folder).
    for weights in (carded / "model.pt", carded):
        rc, err = run("--weights", str(weights))
        if tool == "ijb":
            assert rc == 2 and err == [f"ijb: error: IJB protocol file not found: "
                                       f"{tmp_path / 'ijb' / 'meta' / 'ijbc_face_tid_mid.txt'}"]
        else:
            assert rc == 0, (weights, err)


def test_inference_with_model_json_gives_the_network_s_flip_embedding(trained, carded, tmp_path, capsys):
    """Without a calibrated threshold in model.json, --output is the flip embedding (the crop's plus its mirror
    image's), a (D,) float32 array."""
    from scripts import inference
    from utils.files import load_weights

    g = torch.Generator().manual_seed(5)
    face = torch.randint(0, 256, (3, 112, 112), dtype=torch.uint8, generator=g)
    (tmp_path / "face.png").write_bytes(encode_png(face).numpy().tobytes())
    assert inference.main(["--weights", str(carded / "model.pt"), "--image", str(tmp_path / "face.png"),
                           "--device", "cpu", "--output", str(tmp_path / "emb.npy")]) == 0
    net = load_weights(get_model("tiny", num_features=16, **TINY), trained / "model.pt").eval()
    with torch.no_grad():
        both = net((torch.stack([face, face.flip(2)]).float() - 127.5) * (1 / 127.5)).double()  # (2, 16)
    written = np.load(tmp_path / "emb.npy")
    assert written.shape == (16,) and written.dtype == np.float32
    np.testing.assert_allclose(written, (both[0] + both[1]).numpy(), rtol=0, atol=1e-6)
    assert "embedding of size 16" in capsys.readouterr().out


@pytest.mark.parametrize("content, message", [
    ("{not json", "not a readable model card"),
    ('{"format": 1, "network": "tiny", "embedding_size": 16}', "no 'network_kwargs'"),
    ('{"format": 1, "network": "tiny", "network_kwargs": [], "embedding_size": 16}',
     "network_kwargs is []; expected a dict"),
    ('{"format": 1, "network": "tiny", "network_kwargs": {}, "embedding_size": 16, "normalisation": "BGR, x / 255"}',
     "normalisation 'BGR, x / 255'; these tools feed 'RGB, (x - 127.5) / 127.5'"),
    ('{"format": 1, "network": "tiny", "network_kwargs": {}, "embedding_size": 16, "input_size": [96, 96]}',
     "input_size [96, 96]; these tools feed 112x112 faces"),
    ('{"format": 2, "network": "tiny", "network_kwargs": {}, "embedding_size": 16}',
     "format 2 is not one this code reads"),
])
def test_a_bad_model_json_is_one_line_naming_it(trained, tmp_path, capsys, content, message):
    (tmp_path / "model.pt").write_bytes((trained / "model.pt").read_bytes())
    (tmp_path / "model.json").write_text(content)
    rc, _, err = _run(capsys, "--weights", tmp_path / "model.pt", "--data-dir", trained, "--targets", "synth")
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, err
    assert lines[0].startswith(f"verify: error: {tmp_path / 'model.json'}: {message}"), err


@pytest.mark.parametrize("argv, message", [
    (["--network-kwargs", "[1, 2]"], "expected a JSON object"),
    (["--network-kwargs", "{widths: 3}"], "expected a JSON object"),
    (["--embedding-size", "16"], "pass --network too"),
    (["--network", "tiny", "--random-init", "0", "--embedding-size", "0"], "--embedding-size must be >= 1"),
])
def test_model_options_refused_at_parse_time(trained, capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        verify.parse_args([*argv, *([] if "--random-init" in argv else ["--weights", str(trained / "model.pt")]),
                           "--data-dir", str(trained)])
    assert exc.value.code == 2 and message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        verify.parse_args(["--random-init", "0", "--data-dir", str(trained)])  # no weights: no model.json to read
    assert "--random-init needs --network" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_device_cuda_without_cuda_is_refused_at_parse_time(trained, capsys):
    with pytest.raises(SystemExit) as exc:
        verify.parse_args([*MODEL_ARGS, "--random-init", "0", "--data-dir", str(trained), "--device", "cuda"])
    assert exc.value.code == 2 and "--device cuda: torch sees no CUDA device here" in capsys.readouterr().err


def test_a_model_json_naming_an_unknown_network_names_the_file(trained, tmp_path, capsys):
    (tmp_path / "model.pt").write_bytes((trained / "model.pt").read_bytes())
    (tmp_path / "model.json").write_text(json.dumps({"format": 1, "network": "tinny", "network_kwargs": {},
                                                     "embedding_size": 16}))
    rc, _, err = _run(capsys, "--weights", tmp_path / "model.pt", "--data-dir", trained, "--targets", "synth")
    assert rc == 2 and err.strip().splitlines() == [
        f"verify: error: {tmp_path / 'model.json'}: unknown backbone 'tinny' (did you mean 'tiny'?); valid names: "
        + ", ".join(list_models())], err


def test_an_input_size_other_than_the_faces_fed_is_one_line(trained, tmp_path, capsys):
    rc, _, err = _run(capsys, *MODEL_ARGS[:4], "--network-kwargs", json.dumps({**TINY, "input_size": 128}),
                      "--random-init", "0", "--data-dir", trained, "--targets", "synth")
    assert rc == 2 and err.strip().splitlines() == [
        "verify: error: --network-kwargs: input_size 128; these tools feed 112x112 faces (leave input_size out "
        "or set it to 112)"], err
    (tmp_path / "model.pt").write_bytes((trained / "model.pt").read_bytes())
    (tmp_path / "model.json").write_text(json.dumps({"format": 1, "network": "tiny", "embedding_size": 16,
                                                     "network_kwargs": {**TINY, "input_size": 96}}))
    rc, _, err = _run(capsys, "--weights", tmp_path / "model.pt", "--data-dir", trained, "--targets", "synth")
    assert rc == 2 and err.strip().splitlines() == [
        f"verify: error: {tmp_path / 'model.json'}: input_size 96; these tools feed 112x112 faces (leave "
        f"input_size out or set it to 112)"], err
    rc, _, err = _run(capsys, *MODEL_ARGS[:4], "--network-kwargs", json.dumps({**TINY, "input_size": 112}),
                      "--random-init", "0", "--data-dir", trained, "--targets", "synth")
    assert rc == 0, err  # the size fed, said explicitly


def test_a_set_too_small_to_score_is_named(tmp_path, capsys):
    g = torch.Generator().manual_seed(5)
    images = _faces(torch.tensor([0, 0, 1, 0]), g)
    save_bin(tmp_path / "two.bin", [encode_jpeg(im, quality=95).numpy().tobytes() for im in images], [True, False])
    rc, _, err = _run(capsys, *MODEL_ARGS, "--random-init", "0", "--data-dir", tmp_path, "--targets", "two")
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.startswith("verify")]
    assert rc == 2 and lines == [f"verify: error: {tmp_path / 'two.bin'}: nrof_folds=10 for 2 pairs; allowed: "
                                 f"2 <= nrof_folds <= pairs (--nfolds sets the folds)"], err
    rc, out, err = _run(capsys, *MODEL_ARGS, "--random-init", "0", "--data-dir", tmp_path, "--targets", "two",
                        "--nfolds", "2")
    assert rc == 0 and out.splitlines()[1].startswith("two"), err


def test_verify_help_shows_the_default_targets_and_the_folds():
    proc = run_main(verify.main, ["--help"], "scripts/verify.py")
    text = " ".join(proc.stdout.split())
    assert proc.returncode == 0 and "(default: lfw,cfp_fp,agedb_30)" in text, proc.stdout
    assert "--nfolds NFOLDS folds of the protocol" in text and "(default: 10)" in text, proc.stdout


@pytest.mark.timeout(120)
def test_outputs_that_cannot_be_written_and_bad_network_arguments_are_one_line(trained, tmp_path, capsys):
    tools = _tools(trained, tmp_path)
    model = [*MODEL_ARGS, "--weights", str(trained / "model.pt")]
    outputs = {"verify": ["--json", str(tmp_path)],  # a folder where the JSON file goes
               "torch2onnx": [],  # _tools' --output is replaced below
               "inference": ["--output", f"{UNWRITABLE}/embedding.npy"]}
    for name, extra in outputs.items():
        main, argv = tools[name]
        if name == "torch2onnx":
            argv = ["--output", f"{UNWRITABLE}/model.onnx"]
        assert main([*model, *argv, *extra]) == 2, name
        err = capsys.readouterr().err
        lines = [line for line in err.replace("\r", "\n").splitlines() if line.startswith(name)]  # no progress bar
        assert len(lines) == 1 and lines[0].startswith(f"{name}: error: ") and "Traceback" not in err, err
        assert (str(tmp_path) if name == "verify" else UNWRITABLE) in lines[0]
    rc, _, err = _run(capsys, "--network", "tiny", "--embedding-size", "16", "--network-kwargs", '{"widths": 16}',
                      "--random-init", "0", "--data-dir", trained, "--targets", "synth")
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith("verify: error: network 'tiny' with {'widths': 16}: "), err
    from scripts import torch2onnx

    with pytest.raises(SystemExit) as stop:
        torch2onnx.main([*model, "--output", str(tmp_path / "m.onnx"), "--batch", "0"])
    assert stop.value.code == 2 and "--batch must be >= 1, got 0" in capsys.readouterr().err
    assert not (tmp_path / "m.onnx").exists()


# ------------------------------------------------------------------------------ arcface_torch's command lines
# torch2onnx.py WEIGHTS [--output] [--simplify], inference.py --weight --img, and a run folder as the weights.

def _run_folder(carded, tmp_path):
    """A copy of ``carded`` (model.pt and model.json) that a test may write into."""
    run = tmp_path / "run"
    run.mkdir()
    for name in ("model.pt", "model.json"):
        (run / name).write_bytes((carded / name).read_bytes())
    return run


def _usage_error(capsys, stop) -> str:
    """The one error line of an argparse usage error (after the usage lines argparse prints first)."""
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if ": error: " in line]
    assert stop.value.code == 2 and errors == err[-1:], err
    return errors[0].split(": error: ", 1)[1]


@pytest.mark.timeout(120)
def test_torch2onnx_takes_the_weights_as_arcface_torch_s_does(carded, tmp_path, capsys):
    from scripts import torch2onnx

    run = _run_folder(carded, tmp_path)
    # The run folder as the first argument, no --output: model.onnx beside model.pt, checked against torch.
    assert torch2onnx.main([str(run)]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert out.startswith(f"wrote {run / 'model.onnx'} (opset 17, dynamic batch); max |torch - onnxruntime| = "), out
    assert sorted(p.name for p in run.iterdir()) == ["model.json", "model.onnx", "model.pt"]
    # The weights given twice, or not at all: one usage error line each, nothing written.
    with pytest.raises(SystemExit) as stop:
        torch2onnx.main([str(run), "--weights", str(run / "model.pt"), "--output", str(tmp_path / "x.onnx")])
    assert _usage_error(capsys, stop) == (f"the weights are given twice, as {run} and as --weights "
                                          f"{run / 'model.pt'}; give one")
    with pytest.raises(SystemExit) as stop:
        torch2onnx.main(["--output", str(tmp_path / "x.onnx")])
    assert _usage_error(capsys, stop) == ("the weights are required: a .pt/.pth file or a run folder holding "
                                          "model.pt, as the first argument or as --weights")
    assert not (tmp_path / "x.onnx").exists()


@pytest.mark.skipif(importlib.util.find_spec("onnxsim") is not None, reason="onnxsim is installed here")
def test_torch2onnx_simplify_without_onnxsim_says_what_to_install(carded, tmp_path, capsys):
    from scripts import torch2onnx

    run = _run_folder(carded, tmp_path)
    assert torch2onnx.main([str(run), "--simplify"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "torch2onnx: error: --simplify needs the onnxsim package, which this Python does not have: pip install onnxsim"]
    assert not (run / "model.onnx").exists()


@pytest.mark.timeout(120)
def test_torch2onnx_simplify_runs_onnxsim_before_the_check(carded, tmp_path, capsys, monkeypatch):
    """onnxsim's plumbing, with a stand-in for onnxsim (not installed here): what it returns is what is written
    and checked; a result its own check refuses is one line, and nothing is written."""
    import importlib.machinery
    import types

    import onnx

    from scripts import torch2onnx

    calls = []

    def simplify(model):
        calls.append(len(model.graph.node))
        model.doc_string = "simplified"
        return model, not refuse

    fake = types.ModuleType("onnxsim")
    fake.__spec__ = importlib.machinery.ModuleSpec("onnxsim", None)
    fake.simplify = simplify
    monkeypatch.setitem(sys.modules, "onnxsim", fake)
    run = _run_folder(carded, tmp_path)
    refuse = False
    assert torch2onnx.main([str(run), "--simplify"]) == 0, capsys.readouterr().err
    assert "dynamic batch, simplified by onnxsim); max |torch - onnxruntime|" in capsys.readouterr().out
    assert len(calls) == 1 and onnx.load(run / "model.onnx").doc_string == "simplified"
    refuse = True
    assert torch2onnx.main([str(run / "model.pt"), "--simplify", "--output", str(tmp_path / "x.onnx")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "torch2onnx: error: --simplify: onnxsim's check found the simplified model's outputs differ from the "
        "exported one's; export without --simplify"]
    assert len(calls) == 2 and not (tmp_path / "x.onnx").exists()


@pytest.mark.timeout(120)
def test_a_run_folder_as_weights_works_like_its_model_pt(trained, carded, tmp_path, capsys):
    from scripts import inference

    g = torch.Generator().manual_seed(6)
    (tmp_path / "face.png").write_bytes(encode_png(torch.randint(0, 256, (3, 112, 112), dtype=torch.uint8,
                                                                 generator=g)).numpy().tobytes())
    # arcface_torch's names: --weight (argparse's abbreviation of --weights) and --img, with the run folder.
    assert inference.main(["--weights", str(carded / "model.pt"), "--image", str(tmp_path / "face.png"),
                           "--device", "cpu", "--output", str(tmp_path / "file.npy")]) == 0
    assert inference.main(["--weight", str(carded), "--img", str(tmp_path / "face.png"), "--device", "cpu",
                           "--output", str(tmp_path / "folder.npy")]) == 0
    np.testing.assert_array_equal(np.load(tmp_path / "folder.npy"), np.load(tmp_path / "file.npy"))
    for name, weights in (("file", carded / "model.pt"), ("folder", carded)):
        rc, _, err = _run(capsys, "--weights", weights, "--data-dir", trained, "--targets", "synth", "--device", "cpu",
                          "--json", tmp_path / f"{name}.json")
        assert rc == 0, err
    assert json.loads((tmp_path / "folder.json").read_text()) == json.loads((tmp_path / "file.json").read_text())


@pytest.mark.timeout(120)
def test_a_folder_as_onnx_means_its_one_onnx_file(trained, carded, tmp_path, capsys):
    exported = tmp_path / "exported"
    exported.mkdir()
    (exported / "model.onnx").write_bytes((trained / "model.onnx").read_bytes())
    (exported / "notes.txt").write_text("r18, 25 steps")
    common = ["--data-dir", trained, "--targets", "synth", "--device", "cpu"]
    for name, onnx in (("file", exported / "model.onnx"), ("folder", exported)):
        rc, _, err = _run(capsys, "--onnx", onnx, *common, "--json", tmp_path / f"{name}.json")
        assert rc == 0, err
    assert json.loads((tmp_path / "folder.json").read_text()) == json.loads((tmp_path / "file.json").read_text())
    (exported / "other.onnx").write_bytes(b"")
    rc, _, err = _run(capsys, "--onnx", exported, *common)
    assert rc == 2 and err.splitlines() == [
        f"verify: error: {exported}: a folder, and it holds model.onnx, other.onnx; --onnx takes an .onnx file "
        f"or a folder holding exactly one"], err
    rc, _, err = _run(capsys, "--onnx", carded, *common)  # a run folder: the weights, not an export
    assert rc == 2 and err.splitlines() == [
        f"verify: error: {carded}: a folder, and it holds no .onnx file, only model.json, model.pt; "
        f"--onnx takes an .onnx file or a folder holding exactly one"], err


def test_a_folder_without_model_pt_names_what_it_holds(trained, tmp_path, capsys):
    official = tmp_path / "ms1mv3_arcface_r18"
    official.mkdir()
    (official / "backbone.pth").write_bytes((trained / "model.pt").read_bytes())
    (official / "training.log").write_text("")
    rc, _, err = _run(capsys, *MODEL_ARGS, "--weights", official, "--data-dir", trained, "--targets", "synth")
    assert rc == 2 and err.splitlines() == [
        f"verify: error: {official}: a folder without model.pt (what the trainer writes); it holds backbone.pth: "
        f"pass the weights file itself"], err
    rc, _, err = _run(capsys, "--weights", tmp_path, "--data-dir", trained, "--targets", "synth")  # no --network
    assert rc == 2 and err.splitlines() == [
        f"verify: error: {tmp_path}: a folder without model.pt (what the trainer writes); it holds no .pt or "
        f".pth file, only ms1mv3_arcface_r18/: pass the weights file itself"], err
