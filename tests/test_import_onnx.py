"""insightface's ONNX recognition models imported as our backbones (backbones/onnx_import.py, scripts/import_onnx.py).

The ONNX files are written here, from our own backbones with random weights and batch-norm statistics, the way
arcface_torch's torch2onnx.py writes them (TorchScript exporter, opset 11, eval mode, constants folded: the batch
norms after a convolution are folded into it). The import equals onnxruntime for every IResNet depth (narrow, for
speed), r50 and MobileFaceNet at full size, and an older graph with its own input Sub/Mul; torch2onnx gives the
import back; any other file is one line and exit 2; the trainer says that folded batch norms need freeze_bn; and
the fine-tuning recipe from an import starts at the ONNX model's verification and improves it.
"""
from __future__ import annotations

import hashlib
import io
import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from tests.helpers import ROOT

DEBUG_TINY = {"widths": (8, 16, 16, 32)}  # configs/debug_cpu's network: tiny, these widths, 32-d embedding
NARROW = (8, 16, 16, 32)  # the stage widths of the deep IResNets built here: the depth is what is tested
TOLERANCE = 1e-4  # max |onnxruntime - import| / max |onnxruntime|


# ------------------------------------------------------------------------------------------------ helpers
def randomized(model: nn.Module, seed: int) -> nn.Module:
    """``model`` in eval mode with random convolutions (scaled so that 100 residual blocks stay finite), batch-norm
    statistics and affine weights, PReLU slopes and linear layers."""
    g = torch.Generator().manual_seed(seed)

    def rand(shape, low: float, high: float) -> torch.Tensor:
        return torch.rand(shape, generator=g) * (high - low) + low

    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                m.weight.copy_(torch.randn(m.weight.shape, generator=g) * 0.5 / m.weight[0].numel() ** 0.5)
                if m.bias is not None:
                    m.bias.copy_(rand(m.bias.shape, -0.1, 0.1))
            elif isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d)):
                m.running_mean.copy_(rand(m.running_mean.shape, -0.3, 0.3))
                m.running_var.copy_(rand(m.running_var.shape, 0.5, 2.0))
                if m.weight.requires_grad:  # IResNet's features.weight stays 1, as in the official models
                    m.weight.copy_(rand(m.weight.shape, 0.5, 1.5))
                m.bias.copy_(rand(m.bias.shape, -0.3, 0.3))
            elif isinstance(m, nn.PReLU):
                m.weight.copy_(rand(m.weight.shape, 0.0, 0.5))
    return model.eval()


def export_like_arcface_torch(model: nn.Module, path: Path, side: int = 112) -> Path:
    """``model`` written as arcface_torch's torch2onnx.py writes it: the TorchScript exporter, opset 11, eval mode,
    constants folded, input "data" whose batch dimension is renamed "None"."""
    import onnx

    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's notices about its legacy exporter
        torch.onnx.export(model.eval(), (torch.zeros(1, 3, side, side),), buffer, dynamo=False, input_names=["data"],
                          keep_initializers_as_inputs=False, opset_version=11, do_constant_folding=True)
    proto = onnx.load_from_string(buffer.getvalue())
    proto.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "None"
    onnx.save(proto, str(path))
    return path


def onnxruntime_embeddings(path: Path, images: torch.Tensor) -> np.ndarray:
    """The ONNX model's outputs for ``images``, one at a time (the output's batch dimension is 1 in the file)."""
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return np.concatenate([session.run(None, {name: image[None].numpy()})[0] for image in images])


def relative(got: np.ndarray, expected: np.ndarray) -> float:
    return float(np.abs(got - expected).max() / np.abs(expected).max())


def images(n: int = 3, seed: int = 1) -> torch.Tensor:
    return torch.rand(n, 3, 112, 112, generator=torch.Generator().manual_seed(seed)) * 2 - 1  # normalised


def embed(model: nn.Module, x: torch.Tensor) -> np.ndarray:
    with torch.no_grad():
        return model.eval()(x).numpy()


def import_tool(capsys, *argv) -> tuple[int, str, str]:
    """scripts/import_onnx.py's main: (exit status, stdout, stderr)."""
    from scripts import import_onnx

    capsys.readouterr()
    rc = import_onnx.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, nn.Module]:
    """configs/debug_cpu's network with random weights, exported as arcface_torch does: (the .onnx, the module)."""
    from backbones import get_model

    model = randomized(get_model("tiny", num_features=32, **DEBUG_TINY), seed=0)
    return export_like_arcface_torch(model, tmp_path_factory.mktemp("tiny") / "tiny.onnx"), model


@pytest.fixture(scope="module")
def imported(tiny, tmp_path_factory) -> Path:
    """The folder scripts/import_onnx.py wrote for ``tiny``'s ONNX file, run as a user runs it (from elsewhere)."""
    out = tmp_path_factory.mktemp("imported") / "tiny"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "import_onnx.py"), str(tiny[0]), str(out)],
                          capture_output=True, text=True, timeout=120, cwd="/")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout.startswith(f"imported {tiny[0]} as tiny (32-d embedding, 13 folded batch norms put back at "
                                  f"identity statistics) into {out / 'model.pt'} and model.json; max relative "
                                  f"|torch - onnxruntime| = "), proc.stdout
    return out


# ------------------------------------------------------------------------------------------------ equality
DEPTHS = {"r18": (2, 2, 2, 2), "r34": (3, 4, 6, 3), "r50": (3, 4, 14, 3), "r100": (3, 13, 30, 3),
          "r200": (6, 26, 60, 6)}


@pytest.mark.parametrize("depth", sorted(DEPTHS, key=lambda d: int(d[1:])))
def test_every_iresnet_depth_reads_back_equal_to_onnxruntime(depth, tmp_path):
    """Each depth's graph at narrow widths: recognised block by block, filled into that IResNet, the same forward
    as onnxruntime's; the name table then refuses the narrow widths (only the official ones are registered)."""
    import onnx

    from backbones.iresnet import IResNet
    from backbones.onnx_import import fill, recognise, registered_network
    from utils.cli import UsageError

    source = randomized(IResNet(DEPTHS[depth], widths=NARROW, num_features=64), seed=1)
    path = export_like_arcface_torch(source, tmp_path / f"{depth}.onnx")
    recognised = recognise(onnx.load(str(path)), 127.5, 127.5)
    assert recognised.structure == {"layers": DEPTHS[depth], "widths": NARROW}
    assert recognised.folded == 1 + 2 * sum(DEPTHS[depth]) + 4  # the stem, conv1 and conv2 of each block, 4 projections
    model = recognised.build()
    fill(model, recognised.layers)
    x = images()
    expected, got = onnxruntime_embeddings(path, x), embed(model, x)
    print(f"\n{depth} (widths {NARROW}): max relative |onnxruntime - import| = {relative(got, expected):.1e}, "
          f"|torch - import| = {relative(got, embed(source, x)):.1e}")
    assert relative(got, expected) <= TOLERANCE
    with pytest.raises(UsageError, match=rf"an IResNet of layers {re.escape(str(DEPTHS[depth]))}, widths "
                                         rf"{re.escape(str(NARROW))}, which is no registered network"):
        registered_network(recognised)


@pytest.mark.parametrize("network", ["r50", "mbf", "mbf_large"])
def test_the_model_zoo_networks_import_at_full_size_under_their_names(network, tmp_path):
    """w600k_r50's and w600k_mbf's networks (and mbf_large) at full size: the registered network, 512-d, the same
    forward as onnxruntime's."""
    from backbones import get_model
    from backbones.onnx_import import FOLDED_KEY, read_onnx

    source = randomized(get_model(network), seed=2)
    path = export_like_arcface_torch(source, tmp_path / f"w600k_{network}.onnx")
    imported = read_onnx(path, 127.5, 127.5)
    assert (imported.network, imported.network_kwargs, imported.embedding_size) == (network, {}, 512)
    assert imported.facts[FOLDED_KEY] == {"r50": 1 + 2 * 24 + 4, "mbf": 49, "mbf_large": 90}[network]
    model = get_model(network)
    model.load_state_dict(imported.state_dict, strict=True)
    x = images(2)
    expected, got = onnxruntime_embeddings(path, x), embed(model, x)
    print(f"\n{network}: max relative |onnxruntime - import| = {relative(got, expected):.1e}, |torch - import| = "
          f"{relative(got, embed(source, x)):.1e}")
    assert relative(got, expected) <= TOLERANCE


def test_the_name_tables_describe_the_registered_networks():
    """IRESNET_DEPTHS and MOBILEFACENETS against the registry's own modules (built on the meta device)."""
    from backbones import get_model
    from backbones.onnx_import import IRESNET_DEPTHS, MOBILEFACENETS, OFFICIAL_WIDTHS

    with torch.device("meta"):
        for layers, name in IRESNET_DEPTHS.items():
            m = get_model(name)
            stages = [getattr(m, f"layer{i}") for i in range(1, 5)]
            assert tuple(len(s) for s in stages) == layers and tuple(s[0].conv1.out_channels for s in stages) == \
                OFFICIAL_WIDTHS, name
        for (blocks, scale), name in MOBILEFACENETS.items():
            m = get_model(name)
            stem = len(m.layers[1].layers) if hasattr(m.layers[1].layers[0], "residual") else 1
            residual = tuple(len(m.layers[i].layers) for i in (3, 5, 7))
            assert ((stem, *residual), m.layers[0].layers[0].out_channels // 64) == (blocks, scale), name


@pytest.mark.parametrize("mean,scale,text", [
    (127.5, 0.0078125, "(x - 127.5) * 0.0078125"),  # MXNet-era models: raw pixels in, (x - 127.5) / 128 inside
    (torch.full((1, 3, 1, 1), 127.5), torch.tensor([0.01, 0.02, 0.03]).view(1, 3, 1, 1),
     "(x - 127.5) * [0.01, 0.02, 0.03]"),
])
def test_an_older_graph_s_own_input_sub_mul_is_folded_and_recorded(tiny, tmp_path, mean, scale, text):
    """A graph fed raw pixels that normalises them itself: the import takes the tools' (x - 127.5) / 127.5 and
    computes what the graph computes on the raw pixels; model.json records the graph's normalisation."""
    from backbones import get_model
    from backbones.onnx_import import GRAPH_NORMALISATION_KEY, read_onnx

    class RawPixels(nn.Module):
        def __init__(self, net: nn.Module) -> None:
            super().__init__()
            self.net = net

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net((x - mean) * scale)

    path = export_like_arcface_torch(RawPixels(tiny[1]), tmp_path / "older.onnx")
    imported = read_onnx(path, 127.5, 127.5)
    assert imported.facts[GRAPH_NORMALISATION_KEY] == text and imported.onnx_input == (127.5, 127.5)
    model = get_model("tiny", num_features=32, **DEBUG_TINY)
    model.load_state_dict(imported.state_dict, strict=True)
    x = images()
    assert relative(embed(model, x), onnxruntime_embeddings(path, x * 127.5 + 127.5)) <= TOLERANCE


def _variant(source: Path, kind: str, path: Path) -> Path:
    """``source`` (an export of ``tiny``) as another exporter or an optimiser may write it; onnxruntime is the
    reference for what the edited graph computes."""
    import onnx
    from onnx import helper, numpy_helper

    proto = onnx.load(str(source))
    graph, rng = proto.graph, np.random.default_rng(3)
    nodes, arrays = list(graph.node), {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    if kind == "explicit_bn":  # a BatchNormalization after every (biased) convolution, eps 1e-3: nothing folded
        for node in [n for n in nodes if n.op_type == "Conv"]:
            c, out = arrays[node.input[1]].shape[0], node.output[0]
            node.output[0] = f"{out}/conv"
            names = [f"{out}/{k}" for k in ("scale", "bias", "mean", "var")]
            values = [rng.uniform(0.5, 1.5, c), rng.uniform(-0.3, 0.3, c), rng.uniform(-0.3, 0.3, c),
                      rng.uniform(0.5, 2.0, c)]
            graph.initializer.extend(numpy_helper.from_array(v.astype(np.float32), name)
                                     for name, v in zip(names, values, strict=True))
            nodes.insert(nodes.index(node) + 1,
                         helper.make_node("BatchNormalization", [node.output[0], *names], [out], epsilon=1e-3))
    elif kind == "bn1d_in_gemm":  # the embedding's batch norm folded into the Gemm: the graph ends at the Gemm
        bn = next(n for n in nodes if n.output[0] == graph.output[0].name)
        next(n for n in nodes if n.output[0] == bn.input[0]).output[0] = bn.output[0]
        nodes.remove(bn)
    elif kind == "matmul_add":  # the linear layer as MatMul and Add
        gemm = next(n for n in nodes if n.op_type == "Gemm")
        graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(arrays[gemm.input[1]].T), "fc/t"))
        at = nodes.index(gemm)
        nodes[at:at + 1] = [helper.make_node("MatMul", [gemm.input[0], "fc/t"], ["fc/mm"]),
                            helper.make_node("Add", ["fc/mm", gemm.input[2]], [gemm.output[0]])]
    else:  # "reshape": the flatten as Reshape(x, [0, -1])
        flat = next(n for n in nodes if n.op_type == "Flatten")
        graph.initializer.append(numpy_helper.from_array(np.array([0, -1], np.int64), "flat/shape"))
        nodes[nodes.index(flat)] = helper.make_node("Reshape", [flat.input[0], "flat/shape"], [flat.output[0]])
    del graph.node[:]
    graph.node.extend(nodes)
    onnx.save(proto, str(path))
    return path


@pytest.mark.parametrize("kind,folded", [("explicit_bn", 0), ("bn1d_in_gemm", 14), ("matmul_add", 13),
                                         ("reshape", 13)])
def test_graph_variants_read_back_equal_to_onnxruntime(tiny, tmp_path, kind, folded):
    from backbones import get_model
    from backbones.onnx_import import FOLDED_KEY, read_onnx

    path = _variant(tiny[0], kind, tmp_path / f"{kind}.onnx")
    imported = read_onnx(path, 127.5, 127.5)
    assert imported.facts[FOLDED_KEY] == folded
    model = get_model("tiny", num_features=32, **DEBUG_TINY)
    model.load_state_dict(imported.state_dict, strict=True)
    x = images()
    assert relative(embed(model, x), onnxruntime_embeddings(path, x)) <= TOLERANCE


# ------------------------------------------------------------------------------------------------ the command
@pytest.mark.process
def test_the_command_writes_weights_and_card_that_the_tools_take(tiny, imported, tmp_path):
    """model.pt loads strictly as model.json describes it and computes the ONNX model's embeddings; the card holds
    the source's facts; scripts/torch2onnx.py on the import writes a file with the original's outputs."""
    from backbones import get_model
    from dataset.images import NORMALISATION
    from eval.model_card import read_model_card
    from scripts import torch2onnx
    from utils.files import load_weights

    card = json.loads((imported / "model.json").read_text())
    assert {k: card[k] for k in ("network", "network_kwargs", "embedding_size", "normalisation", "source",
                                 "source_sha256", "batch_norms_folded", "graph_normalisation")} == {
        "network": "tiny", "network_kwargs": {"widths": list(DEBUG_TINY["widths"])}, "embedding_size": 32,
        "normalisation": NORMALISATION, "source": "tiny.onnx",
        "source_sha256": hashlib.sha256(tiny[0].read_bytes()).hexdigest(), "batch_norms_folded": 13,
        "graph_normalisation": None}
    model = read_model_card(imported / "model.json").build()
    load_weights(model, imported / "model.pt")
    x = images()
    assert relative(embed(model, x), onnxruntime_embeddings(tiny[0], x)) <= TOLERANCE

    again = tmp_path / "again.onnx"
    assert torch2onnx.main([str(imported), "--output", str(again)]) == 0
    assert relative(onnxruntime_embeddings(again, x), onnxruntime_embeddings(tiny[0], x)) <= TOLERANCE
    assert get_model("tiny", num_features=32, **DEBUG_TINY).load_state_dict(
        torch.load(imported / "model.pt", weights_only=True), strict=True)


@pytest.mark.process
def test_an_out_dir_holding_a_model_is_refused_and_kept(tiny, imported, capsys):
    before = (imported / "model.pt").read_bytes()
    rc, _, stderr = import_tool(capsys, tiny[0], imported)
    assert rc == 2 and stderr.splitlines() == [
        f"import_onnx: error: {imported} already holds model.pt and model.json; import into a new folder, or remove "
        f"them first"]
    assert (imported / "model.pt").read_bytes() == before


def test_an_import_that_does_not_compute_what_the_file_does_exits_1_writing_nothing(tiny, tmp_path, capsys,
                                                                                    monkeypatch):
    """The check against onnxruntime before anything is written (here an import with one weight changed)."""
    import dataclasses

    from scripts import import_onnx

    read = import_onnx.read_onnx

    def off(path, mean, std):
        imported = read(path, mean, std)
        state = dict(imported.state_dict, **{"fc.weight": imported.state_dict["fc.weight"] * 1.01})
        return dataclasses.replace(imported, state_dict=state)

    monkeypatch.setattr(import_onnx, "read_onnx", off)
    rc, stdout, stderr = import_tool(capsys, tiny[0], tmp_path / "out")
    assert rc == 1 and re.fullmatch(rf"import_onnx: error: {re.escape(str(tiny[0]))}: the imported tiny differs from "
                                    rf"onnxruntime by \S+ \(relative\), over 0.001; nothing written\n", stderr), stderr
    assert not (tmp_path / "out").exists() and stdout == ""


class _Detector(nn.Module):
    """A face detector's shape (SCRFD, RetinaFace): scores, boxes and landmarks per anchor."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Conv2d(3, 8, 3, stride=8, padding=1)
        self.heads = nn.ModuleList(nn.Conv2d(8, c, 1) for c in (2, 8, 20))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        f = self.body(x)
        return tuple(head(f) for head in self.heads)


def _unsupported(kind: str, tiny: Path, tmp_path: Path) -> Path:
    """An ONNX file (or not) of ``kind`` that the tool must refuse."""
    from backbones.iresnet import IResNet

    path = tmp_path / f"{kind}.onnx"
    if kind == "detector":
        return export_like_arcface_torch(_Detector(), path, side=640)
    if kind == "landmarks":  # 2d106det's shape: 192x192 in, 106 (x, y) out
        return export_like_arcface_torch(nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.PReLU(8),
                                                       nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 212)),
                                         path, side=192)
    if kind == "unknown":  # 112x112 in, an embedding out, but ReLU where IResNet has PReLU
        return export_like_arcface_torch(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                                       nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 512)), path)
    if kind == "narrow_r50":  # an IResNet-50 at widths no registered network has
        return export_like_arcface_torch(IResNet(DEPTHS["r50"], widths=NARROW), path)
    if kind == "offset":  # its own normalisation subtracts 120, not the 127.5 of the tools
        return export_like_arcface_torch(_Shifted(), path)
    if kind == "truncated":
        path.write_bytes(tiny.read_bytes()[: tiny.stat().st_size // 2])
    else:  # a torch file named .onnx
        torch.save({"weight": torch.zeros(3)}, path)
    return path


class _Shifted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from backbones import get_model

        self.net = get_model("tiny", num_features=32, **DEBUG_TINY)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net((x - 120.0) * 0.0078125)


UNSUPPORTED = {
    "detector": "a graph with 1 input (N, 3, 640, 640) and 3 outputs (1, 2, 80, 80), (1, 8, 80, 80), (1, 20, 80, 80); "
                "a recognition model has one input (N, 3, 112, 112) and one output (N, D) (a face detector has "
                "several outputs)",
    "landmarks": "a graph with input (N, 3, 192, 192); a recognition model takes (N, 3, 112, 112) faces (a landmark, "
                 "attribute or detection model takes another size)",
    "unknown": "a graph with 1 input (N, 3, 112, 112) and 1 output (1, 512) that is not one this tool imports: ",
    "narrow_r50": "an IResNet of layers (3, 4, 14, 3), widths (8, 16, 16, 32), which is no registered network",
    "offset": "the graph's own input normalisation (x - 120) * 0.0078125 leaves an offset of 0.0585938 on the images "
              "these tools feed, normalised (x - 127.5) / 127.5; only a normalisation that subtracts 127.5 folds "
              "exactly into the first convolution (its input is zero-padded)",
    "truncated": "not an ONNX model, or a truncated one (Error parsing message",
    "torch_file": "not an ONNX model, or a truncated one (Error parsing message",
}


@pytest.mark.parametrize("kind", list(UNSUPPORTED))
def test_any_other_file_is_one_line_saying_what_was_found_and_what_is_supported(kind, tiny, tmp_path, capsys):
    path, out = _unsupported(kind, tiny[0], tmp_path), tmp_path / "out"
    rc, stdout, stderr = import_tool(capsys, path, out)
    with capsys.disabled():
        print(f"\n{kind}: {stderr.strip()}")
    lines = stderr.splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith(f"import_onnx: error: {path}: "), stderr
    assert UNSUPPORTED[kind] in lines[0]
    if kind != "offset":
        assert lines[0].endswith("supported: IResNet r18, r34, r50, r100, r200 (and tiny) and MobileFaceNet mbf, "
                                 "mbf_large, as arcface_torch's torch2onnx.py exports them"), lines[0]
    assert not out.exists() and stdout == ""


# ------------------------------------------------------------------------------------------------ fine-tuning
def _job(imported: Path, freeze_bn: bool, logger):
    from trainer.build import build
    from utils.config import load_config

    cfg = load_config("configs/debug_cpu", ["num_classes=16", "sample_rate=1.0",
                                            f"init_backbone={imported / 'model.pt'}", f"freeze_bn={freeze_bn}"])
    return build(cfg, 0, 1, torch.device("cpu"), logger)


@pytest.mark.process
@pytest.mark.parametrize("freeze_bn", [False, True])
def test_the_trainer_says_folded_batch_norms_need_freeze_bn_and_with_it_starts_at_the_onnx_model(
        tiny, imported, caplog, freeze_bn):
    """freeze_bn off: one start line, and the training-mode forward is not the ONNX model's (its folded batch norms
    normalise with the batch's statistics); freeze_bn on: no line, and the first step computes what the ONNX model
    does."""
    import logging

    with caplog.at_level(logging.WARNING, logger="test"):
        job = _job(imported, freeze_bn, logging.getLogger("test"))
    said = [r.getMessage() for r in caplog.records if "freeze_bn" in r.getMessage()]
    assert said == ([] if freeze_bn else [
        f"init_backbone {imported / 'model.pt'}: 13 of its batch norms were folded into convolutions by the ONNX "
        f"exporter and have no statistics (model.json); with freeze_bn = False they normalise with each batch's and "
        f"change the model at the first step: set freeze_bn = True (docs/finetuning.md)"])
    job.backbone.train()
    job.fine_tuning.set_modes(job.backbone, 0)
    x = images(8)
    with torch.no_grad():
        first_step = job.backbone(x).numpy()
    difference = relative(first_step, onnxruntime_embeddings(tiny[0], x))
    assert (difference <= TOLERANCE) if freeze_bn else (difference > 0.1), difference


def _verify(capsys, *model: str, data_dir: Path) -> str:
    """The held-out row of scripts/verify.py's table for ``model`` (its options), without the target name."""
    from scripts import verify

    capsys.readouterr()
    assert verify.main([*model, "--data-dir", str(data_dir), "--targets", "held_out", "--device", "cpu"]) == 0
    return next(line for line in capsys.readouterr().out.splitlines() if line.startswith("held_out")).split(None, 1)[1]


def _logged_accuracy(log: str, step: int) -> str:
    """The held-out flip accuracy of the training log's verification at ``step``, as printed (5 decimals)."""
    table = log.split(f"verification at step {step}\n", 1)[1]
    return next(line for line in table.splitlines() if line.startswith("held_out")).split()[2].split("±")[0]


@pytest.mark.slow
@pytest.mark.timeout(480)  # with the session's finetune_data when this test is the first to ask for it
def test_fine_tuning_an_import_starts_at_the_onnx_model_and_improves_it(finetune_data, tmp_path, capsys):
    """tests/test_finetune.py's data and recipe (6 epochs instead of 10), from an ONNX file of its pre-trained model:
    eval.verify prints the same numbers for the file and for its import; the run's own verification after the head
    warm-up (the backbone as imported) is the ONNX model's; at the end it is better on the held-out identities."""
    import shutil

    from backbones import get_model
    from tests.finetune_data import FINETUNE, RECIPE_SIZE
    from tests.helpers import train

    pretrained, tuning = finetune_data["pretrained"], tmp_path / "finetune"
    shutil.copytree(finetune_data["tuning"], tuning)  # the session's copy stays as it is
    shutil.copy(finetune_data["held_out"], tuning / "held_out.bin")  # where the trainer's verification looks for it
    model = get_model("tiny", num_features=256, widths=(2, 8, 16, 32))
    model.load_state_dict(torch.load(pretrained, weights_only=True), strict=True)
    published = export_like_arcface_torch(model, tmp_path / "published.onnx")
    assert import_tool(capsys, published, tmp_path / "imported")[0] == 0
    imported = tmp_path / "imported" / "model.pt"

    onnx_row = _verify(capsys, "--onnx", str(published), data_dir=tuning)
    assert _verify(capsys, "--weights", str(imported), data_dir=tuning) == onnx_row  # every number of the row

    warmup, total = 36, 108  # RECIPE_SIZE's head warm-up (two epochs of 18 steps), then four more epochs
    data = (f"rec={tuning}", f"num_classes={FINETUNE[0]}", f"num_image={FINETUNE[0] * FINETUNE[1]}")
    train("configs/finetune_example", tmp_path / "finetuned", *RECIPE_SIZE, *data, f"init_backbone={imported}",
          "num_epoch=6", "val_targets=held_out", f"verbose={warmup}")
    log = (tmp_path / "finetuned" / "training.log").read_text()
    start, end = _logged_accuracy(log, warmup), _logged_accuracy(log, total)
    with capsys.disabled():
        print(f"\nheld-out pairs of the other camera, eval.verify of the ONNX model and of its import: {onnx_row}; "
              f"the recipe from the import: {start} after its head warm-up, {end} at its end")
    assert start == onnx_row.split()[1].split("±")[0]
    assert float(end) >= float(start) + 0.05
    assert "were folded into convolutions" not in log  # the recipe freezes the batch norms: no warning
