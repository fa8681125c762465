"""python -m imagenet.tools.export: each format reproduces the checkpoint's model at any batch size
and carries the class names; ONNX without its extra is one line naming it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torchvision

from imagenet.tools import export

CLASSES = ["apple", "pear", "plum"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    """A trainer-style checkpoint of a resnet18 with non-default BatchNorm statistics."""
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=3)
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.uniform_(-0.2, 0.2)
            m.running_var.uniform_(0.5, 1.5)
    path = tmp_path_factory.mktemp("export") / "model_best.pth.tar"
    torch.save({"state_dict": model.state_dict(), "arch": "resnet18", "classes": CLASSES,
                "config": {"val_crop_size": 32, "val_resize_size": 36}}, path)
    return path, model.eval()


def load_exported(fmt: str, path: Path):
    """The exported program as a callable, and the metadata stored inside it."""
    if fmt == "pt2":
        extra = {export.METADATA: ""}
        program = torch.export.load(path, extra_files=extra)
        return program.module(), json.loads(extra[export.METADATA])
    if fmt == "torchscript":
        extra = {export.METADATA: ""}
        module = torch.jit.load(str(path), _extra_files=extra)
        return module, json.loads(extra[export.METADATA])
    import onnx
    import onnxruntime

    meta = {p.key: p.value for p in onnx.load(str(path)).metadata_props}
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return (lambda x: torch.from_numpy(session.run(None, {"images": x.numpy()})[0]),
            json.loads(meta[export.METADATA]))


@pytest.mark.slow
@pytest.mark.parametrize("fmt", export.FORMATS)
def test_exported_program_reproduces_the_checkpoint(fmt, checkpoint, tmp_path, capsys):
    path, model = checkpoint
    out = tmp_path / f"model.{fmt}"
    assert export.main([str(path), "--format", fmt, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"checked {fmt} against eager PyTorch at batch sizes 1, 2, 5 (32 px): largest " \
           "difference" in printed, printed
    program, meta = load_exported(fmt, out)
    assert meta["classes"] == CLASSES and meta["input"]["size"] == 32
    assert meta["input"]["mean"] == [0.485, 0.456, 0.406]
    images = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        assert torch.allclose(program(images), model(images), atol=1e-4)


def test_onnx_without_its_extra_is_one_line(checkpoint, tmp_path, capsys, monkeypatch):
    """onnxruntime hidden (as if not installed: ``import onnxruntime`` raises ImportError):
    the tool names the extra to install, before any work."""
    path, _ = checkpoint
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    assert export.main([str(path), "--format", "onnx", "--out", str(tmp_path / "m.onnx")]) == 2
    assert capsys.readouterr().err.strip() == ("error: --format onnx needs onnxruntime: pip "
                                               "install 'imagenet-trainer[export]'")
    assert not (tmp_path / "m.onnx").exists()


@pytest.mark.slow
def test_a_plain_state_dict_needs_the_architecture(checkpoint, tmp_path, capsys):
    path, model = checkpoint
    plain = tmp_path / "plain.pth"
    torch.save(model.state_dict(), plain)
    assert export.main([str(plain), "--format", "torchscript", "--out",
                        str(tmp_path / "m.pt")]) == 2
    assert "does not name its architecture: give -a ARCH" in capsys.readouterr().err
    # With -a, the class count comes from the classifier's rows; names default to indices.
    assert export.main([str(plain), "-a", "resnet18", "--image-size", "32", "--format",
                        "torchscript", "--out", str(tmp_path / "m.pt")]) == 0
    assert load_exported("torchscript", tmp_path / "m.pt")[1]["classes"] == ["0", "1", "2"]
