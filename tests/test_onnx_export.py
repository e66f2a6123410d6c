"""backbones.onnx_export: a backbone as an ONNX file with a dynamic batch, equal to torch, written atomically."""
from __future__ import annotations

import sys
import types

import pytest
import torch

from backbones import get_model
from backbones.onnx_export import export, max_difference


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return get_model("tiny", num_features=16, widths=[4, 8, 8, 16]).eval()


def test_export_has_a_dynamic_batch_and_equals_torch(tiny, tmp_path):
    import onnxruntime

    export(tiny, tmp_path / "sub" / "m.onnx")
    assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == ["m.onnx"]  # no temporary left
    session = onnxruntime.InferenceSession(str(tmp_path / "sub" / "m.onnx"), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["input"] and session.get_outputs()[0].name == "embedding"
    images = torch.rand(3, 3, 112, 112) * 2 - 1
    assert session.run(None, {"input": images.numpy()})[0].shape == (3, 16)
    assert max_difference(tiny, tmp_path / "sub" / "m.onnx", batch=5) < 1e-4


def test_a_simplification_that_fails_writes_nothing_and_says_so_in_one_line(tiny, tmp_path, monkeypatch):
    def refuse(model):
        raise RuntimeError("unsupported op\nsecond line")

    monkeypatch.setitem(sys.modules, "onnxsim", types.SimpleNamespace(simplify=refuse))
    (tmp_path / "m.onnx").write_bytes(b"old")
    with pytest.raises(ValueError, match=r"^--simplify: onnxsim failed \(RuntimeError: unsupported op\); export "
                                         r"without --simplify$"):
        export(tiny, tmp_path / "m.onnx", simplify=True)
    monkeypatch.setitem(sys.modules, "onnxsim", types.SimpleNamespace(simplify=lambda model: (model, False)))
    with pytest.raises(ValueError, match="outputs differ"):
        export(tiny, tmp_path / "m.onnx", simplify=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"] and (tmp_path / "m.onnx").read_bytes() == b"old"
