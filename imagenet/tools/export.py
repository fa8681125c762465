"""``python -m imagenet.tools.export CKPT --format {pt2,onnx,torchscript} --out FILE``: the
network a checkpoint holds, for serving without this trainer.

The exported program takes what the trainer's model takes: float32 NCHW images, RGB scaled to
[0, 1], minus the ImageNet mean, divided by its std (``transforms.normalize``), at the
checkpoint's validation crop size, any batch size; it returns the class scores (logits). The
class names and this description are stored inside the file ("model.json": an extra file of
pt2 and TorchScript, a metadata entry of ONNX). Before it reports success, the tool runs the
exported program and the eager model on the same random input at several batch sizes and
prints the largest difference; above --atol the file is removed and the tool fails.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from imagenet.data.transforms import IMAGENET_MEAN, IMAGENET_STD
from imagenet.errors import RunError, TrainerError, UsageError, report

log = logging.getLogger(__name__)

FORMATS = ("pt2", "onnx", "torchscript")
CHECK_BATCHES = (1, 2, 5)  # batch sizes the exported program is compared at
EXAMPLE_BATCH = 2  # traced with 2 images: torch.export specialises a batch dimension of 1
METADATA = "model.json"
ONNX_MODULES = ("onnx", "onnxscript", "onnxruntime")


def get_args_parser() -> argparse.ArgumentParser:
    """The tool's flags."""
    parser = argparse.ArgumentParser(
        prog="python -m imagenet.tools.export",
        description="Export the network of a checkpoint to a file that runs without this "
                    "trainer, and check it against eager PyTorch. Input: float32 NCHW images, "
                    "RGB scaled to [0, 1], minus the ImageNet mean (0.485, 0.456, 0.406), "
                    "divided by its std (0.229, 0.224, 0.225) - as the trainer normalises - at "
                    "the validation crop size; any batch size. Output: the class scores "
                    "(logits). The class names and this description are stored in the file "
                    f"('{METADATA}').")
    parser.add_argument("checkpoint", metavar="CKPT",
                        help="a checkpoint of this trainer (file or --sharded-checkpoint "
                             "directory; model_best_ema.pth.tar for the EMA weights), the "
                             "classic script's, or a plain state dict (then give -a)")
    parser.add_argument("--format", required=True, choices=FORMATS,
                        help="pt2: torch.export (torch.export.load); onnx: ONNX via torch's "
                             "dynamo exporter, checked with onnxruntime (pip install "
                             "'imagenet-trainer[export]'); torchscript: torch.jit.script, "
                             "or trace where scripting fails")
    parser.add_argument("--out", required=True, metavar="FILE", help="the file to write")
    parser.add_argument("-a", "--arch", metavar="ARCH",
                        help="architecture (default: the checkpoint's)")
    parser.add_argument("--num-classes", type=int, metavar="N",
                        help="classes (default: the checkpoint's, else its classifier's rows)")
    parser.add_argument("--image-size", type=int, metavar="PX",
                        help="side of the example input, pixels (default: the checkpoint's "
                             "--val-crop-size, else 224)")
    parser.add_argument("--atol", type=float, default=1e-3, metavar="X",
                        help="largest allowed |exported - eager| of a logit (default: "
                             "%(default)s)")
    return parser


# ---------------------------------------------------------------- the model

def load_model(path: Path, arch: str | None, num_classes: int | None
               ) -> tuple[nn.Module, dict[str, Any]]:
    """The eager model with the checkpoint's weights (eval mode), and the metadata to store."""
    from imagenet.checkpoint import files
    from imagenet.checkpoint.weights import read_weights
    from imagenet.training.finetune import classifier_names
    from imagenet.training.models import build_model

    weights = read_weights(path, flag="CKPT")
    arch = arch or weights.arch
    if not arch:
        raise UsageError(f"{path} does not name its architecture: give -a ARCH")
    if num_classes is None:
        if weights.classes:
            num_classes = len(weights.classes)
        else:  # the rows of the classifier, wherever this architecture keeps it
            head = classifier_names(build_model(arch, 1000), 1000)[0]
            rows = weights.state.get(f"{head}.weight", weights.state.get(f"{head}.bias"))
            if rows is None:
                raise UsageError(f"{path} has no {head}.weight for -a {arch}: give -a ARCH "
                                 "and --num-classes N")
            num_classes = rows.shape[0]
    model = build_model(arch, num_classes)
    files.load_model_state(model, {"state_dict": weights.state, "arch": arch}, path, arch)
    classes = weights.classes or [str(i) for i in range(num_classes)]
    meta = {"arch": arch, "num_classes": num_classes, "classes": classes,
            "source": str(path), "output": "logits, one per class in the order of 'classes'",
            "input": {"layout": "NCHW", "dtype": "float32", "color": "RGB",
                      "scale": "pixel / 255", "mean": list(IMAGENET_MEAN),
                      "std": list(IMAGENET_STD), "batch": "any",
                      "size": weights.config.get("val_crop_size", 224),
                      "resize": weights.config.get("val_resize_size", 256)}}
    return model.eval(), meta


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Without the exporters' deprecation and tracer warnings (the check below has the word)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


# ---------------------------------------------------------------- the formats

def export_pt2(model: nn.Module, example: torch.Tensor, out: Path, meta: str
               ) -> Callable[[torch.Tensor], torch.Tensor]:
    """torch.export with a dynamic batch dimension; the loaded program's callable."""
    batch = torch.export.Dim("batch", min=1, max=65536)
    with quiet():
        program = torch.export.export(model, (example,), dynamic_shapes=({0: batch},))
        torch.export.save(program, out, extra_files={METADATA: meta})
        loaded = torch.export.load(out).module()
    return loaded


def export_torchscript(model: nn.Module, example: torch.Tensor, out: Path, meta: str
                       ) -> Callable[[torch.Tensor], torch.Tensor]:
    """torch.jit.script (trace where scripting fails); the loaded module."""
    with quiet():
        try:
            scripted = torch.jit.script(model)
        except Exception as exc:  # TorchScript rejects many Python constructs
            print(f"torch.jit.script failed ({str(exc).splitlines()[0][:120]}); tracing instead "
                  "(control flow is fixed to this input's path)")
            scripted = torch.jit.trace(model, example)
        torch.jit.save(scripted, str(out), _extra_files={METADATA: meta})
        loaded = torch.jit.load(str(out))
    return loaded


def onnx_modules() -> None:
    """UsageError naming the extra when onnx, onnxscript or onnxruntime is missing."""
    missing = []
    for name in ONNX_MODULES:
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise UsageError(f"--format onnx needs {', '.join(missing)}: pip install "
                         "'imagenet-trainer[export]'")


def export_onnx(model: nn.Module, example: torch.Tensor, out: Path, meta: str
                ) -> Callable[[torch.Tensor], torch.Tensor]:
    """ONNX (torch's dynamo exporter) with a dynamic batch; an onnxruntime session."""
    import onnx
    import onnxruntime

    batch = torch.export.Dim("batch", min=1, max=65536)
    with quiet():
        torch.onnx.export(model, (example,), str(out), dynamo=True, input_names=["images"],
                          output_names=["logits"], dynamic_shapes=({0: batch},), verbose=False)
    proto = onnx.load(str(out))
    onnx.helper.set_model_props(proto, {METADATA: meta})
    onnx.save(proto, str(out))
    session = onnxruntime.InferenceSession(str(out), providers=["CPUExecutionProvider"])

    def run(images: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(session.run(None, {"images": images.numpy()})[0])

    return run


EXPORTERS = {"pt2": export_pt2, "onnx": export_onnx, "torchscript": export_torchscript}


# ---------------------------------------------------------------- the check

@torch.no_grad()
def largest_difference(model: nn.Module, exported: Callable[[torch.Tensor], torch.Tensor],
                       size: int, batches: Sequence[int] = CHECK_BATCHES) -> float:
    """max |exported - eager| over random normalised-scale input at each batch size."""
    g = torch.Generator().manual_seed(0)
    worst = 0.0
    for n in batches:
        images = torch.randn(n, 3, size, size, generator=g)
        got, want = exported(images), model(images)
        if tuple(got.shape) != tuple(want.shape):
            raise RunError(f"the exported program returned shape {tuple(got.shape)} for a "
                           f"batch of {n}; eager PyTorch {tuple(want.shape)}")
        worst = max(worst, float((got.float() - want.float()).abs().max()))
    return worst


def export(args: argparse.Namespace) -> float:
    """Write and check the file; returns the largest difference."""
    path, out = Path(args.checkpoint), Path(args.out)
    if out.is_dir():
        raise UsageError(f"--out {out} is a folder; give a file name")
    if args.format == "onnx":
        onnx_modules()  # before any work
    model, meta = load_model(path, args.arch, args.num_classes)
    size = args.image_size or meta["input"]["size"]
    meta["input"]["size"] = size
    out.parent.mkdir(parents=True, exist_ok=True)
    example = torch.randn(EXAMPLE_BATCH, 3, size, size, generator=torch.Generator().manual_seed(1))
    try:
        exported = EXPORTERS[args.format](model, example, out, json.dumps(meta))
    except TrainerError:
        raise
    except Exception as exc:  # the exporters raise many types; the first line says what
        out.unlink(missing_ok=True)
        raise RunError(f"cannot export -a {meta['arch']} to {args.format}: "
                       f"{str(exc).strip().splitlines()[0][:300]}") from None
    diff = largest_difference(model, exported, size)
    print(f"checked {args.format} against eager PyTorch at batch sizes "
          f"{', '.join(map(str, CHECK_BATCHES))} ({size} px): largest difference {diff:.3g}")
    if not diff <= args.atol:
        out.unlink(missing_ok=True)
        raise RunError(f"the exported program differs from the checkpoint's model by {diff:.3g} "
                       f"(more than --atol {args.atol}); removed {out}")
    return diff


def main(argv: Sequence[str] | None = None) -> int:
    """Export; 0 on success, the error's exit code otherwise."""
    args = get_args_parser().parse_args(argv)
    try:
        export(args)
    except TrainerError as exc:
        return report(exc)
    print(f"wrote {args.out} ({args.format}; input float32 NCHW normalised as the trainer "
          f"does, any batch size; class names in '{METADATA}')")
    return 0


if __name__ == "__main__":
    sys.exit(main())
