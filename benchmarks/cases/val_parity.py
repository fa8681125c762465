"""Validation parity: the same model on the same val images, tensor backend vs PIL backend.

Validation on the fast path (libjpeg-turbo decode, uint8 v2 Resize + CenterCrop, antialias on)
must reach the PIL path's accuracy within a small tolerance on the same model. This
script evaluates one model on one list of val images with both backends, in lockstep, through the
trainer's own pieces (``data.image_folder``, ``transforms.val_transform``, ``transforms.normalize``,
``meters.topk_correct``), and prints top-1/top-5 of each, their difference, the per-image top-1
agreement, and how far the input crops themselves differ. Run by hand (not a test)::

    # No model given: draws the demo shapes data set at 112 px (validation then really resizes,
    # 112 -> 64 -> crop 56), trains ResNet-18 on it with main.py (--epochs 4), then compares.
    # About 5 minutes on 2 idle CPU cores (10 when busy); a second run reuses the trained
    # model in --work-dir.
    python benchmarks/bench.py val-parity

    # A trained checkpoint on its data (sizes and interpolation from its stored config):
    python benchmarks/bench.py val-parity --checkpoint runs/r50/model_best.pth.tar \\
        --data /data/imagenet --limit 5000

    # torchvision weights (cached under TORCH_HOME, or downloaded) on ImageNet val:
    python benchmarks/bench.py val-parity -a resnet50 --weights IMAGENET1K_V2 \\
        --data /data/imagenet --limit 5000
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, Subset

from benchmarks import harness
from imagenet.checkpoint.files import load_checkpoint, load_model_state
from imagenet.data import transforms as T
from imagenet.data.folder import image_folder
from imagenet.training.meters import topk_correct
from imagenet.training.models import build_model, resolve_weights

ROOT = harness.ROOT


@dataclass(frozen=True)
class ValSettings:
    """What the validation transform needs."""

    resize: int = 256
    crop: int = 224
    interpolation: str = "bilinear"


# --- the model to compare ------------------------------------------------------------------------

def train_demo_model(work: Path, args: argparse.Namespace) -> tuple[Path, Path]:
    """Demo shapes at ``--image-size`` px and a ResNet-18 trained on them: (data, checkpoint)."""
    from imagenet.tools.demo import make_demo_dataset

    params = {"train_per_class": args.train_per_class, "val_per_class": args.val_per_class,
              "image_size": args.image_size, "epochs": args.epochs, "recipe": 2}
    data = make_demo_dataset(work / "data", args.train_per_class, args.val_per_class,
                             args.image_size)
    out, stamp = work / "train", work / "trained-with.json"
    best = out / "model_best.pth.tar"
    if best.is_file() and stamp.is_file() and json.loads(stamp.read_text()) == params:
        print(f"=> reusing {best} (trained with {params})")
        return data, best
    shutil.rmtree(out, ignore_errors=True)  # an older run's best file must not stand in for ours
    stamp.unlink(missing_ok=True)
    # AdamW + cosine learns the demo shapes steadily (about 50% top-1 after 4-6 epochs, 10
    # classes); seeded, so every run of this script trains the same model.
    argv = [str(data), "-a", "resnet18", "--seed", "0", "--output-dir", str(out), "--epochs",
            str(args.epochs), "-b", "64", "--opt", "adamw", "--lr", "0.002", "--wd", "0.01",
            "--lr-scheduler", "cosine", "--train-crop-size", "56", "--val-resize-size", "64",
            "--val-crop-size", "56", "-j", str(args.workers), "-p", "5"]
    print(f"=> training: {sys.executable} {ROOT / 'main.py'} {' '.join(argv)}", flush=True)
    start = time.perf_counter()
    proc = harness.run_main(argv)
    if proc.returncode != 0:
        sys.exit(f"training {harness.failure(proc)}")
    stamp.write_text(json.dumps(params) + "\n")
    last = harness.last_metrics(out)
    print(f"=> trained in {time.perf_counter() - start:.0f} s; main.py's own validation "
          f"(tensor backend): top-1 {last['val_acc1']:.2f}")
    return data, best


def from_checkpoint(path: Path, arch: str | None) -> tuple[nn.Module, dict, list[str] | None]:
    """The checkpoint's plain model, its stored config, and its class names (if stored)."""
    ckpt = load_checkpoint(path)
    config = ckpt.get("config") or {}
    arch = arch or ckpt.get("arch") or config.get("arch") or "resnet18"
    num_classes = ckpt.get("num_classes") or _classifier_rows(ckpt["state_dict"])
    model = build_model(arch, num_classes)
    load_model_state(model, ckpt, path, arch)
    return model, config, ckpt.get("classes")


def _classifier_rows(state: dict[str, torch.Tensor]) -> int:
    """Number of classes of a bare state_dict: the rows of its last 2-D weight."""
    return [v for k, v in state.items() if k.endswith("weight") and v.ndim == 2][-1].shape[0]


def trained_on(config: dict) -> Path:
    """The data root a checkpoint was trained on (``--demo``: OUTPUT_DIR/demo-data)."""
    if config.get("demo"):
        return Path(config.get("output_dir", ".")) / "demo-data"
    return Path(config.get("data", "imagenet"))


def settings_for(args: argparse.Namespace, config: dict, weights=None) -> ValSettings:
    """Flags first, then the checkpoint's config, then the weights' own preset, then defaults."""
    preset = {}
    if weights is not None:
        tf = weights.transforms()
        preset = {"resize": tf.resize_size[0], "crop": tf.crop_size[0],
                  "interpolation": tf.interpolation.value}
    default = ValSettings()
    return ValSettings(
        resize=args.val_resize_size or config.get("val_resize_size") or preset.get("resize")
        or default.resize,
        crop=args.val_crop_size or config.get("val_crop_size") or preset.get("crop")
        or default.crop,
        interpolation=args.interpolation or config.get("interpolation")
        or preset.get("interpolation") or default.interpolation)


# --- the comparison ------------------------------------------------------------------------------

def val_loaders(val_dir: Path, settings: ValSettings, limit: int | None, batch_size: int,
                workers: int) -> tuple[dict[str, DataLoader], list[str], int]:
    """One loader per backend over the same images, in the same order."""
    loaders, classes, total = {}, [], 0
    for backend in T.BACKENDS:
        tf = T.val_transform(settings.resize, settings.crop, settings.interpolation,
                             backend=backend)
        dataset = image_folder(val_dir, tf, backend)
        classes, total = dataset.classes, len(dataset)
        if limit and limit < total:  # evenly spaced: every class keeps its share
            dataset = Subset(dataset, [round(i * total / limit) for i in range(limit)])
        loaders[backend] = DataLoader(dataset, batch_size=batch_size, num_workers=workers)
    return loaders, classes, total


@torch.no_grad()
def compare(model: nn.Module, loaders: dict[str, DataLoader]) -> dict[str, float]:
    """Top-1/top-5 per backend, top-1 agreement and input differences, on the same images."""
    model.eval()
    counts = dict.fromkeys(("n", "agree", "only_tensor", "only_pil", "pixels", "pixel_sum",
                            "pixels_gt2", "prob_diff_sum"), 0.0)
    counts.update({f"{b}_top{k}": 0.0 for b in T.BACKENDS for k in (1, 5)})
    pixel_max = logit_max = 0.0
    for (x_t, y_t), (x_p, y_p) in zip(loaders["tensor"], loaders["pil"], strict=True):
        if not torch.equal(y_t, y_p):
            raise RuntimeError("the backends' loaders are not on the same images")
        diff = (x_t.int() - x_p.int()).abs()
        counts["pixels"] += diff.numel()
        counts["pixel_sum"] += diff.sum().item()
        counts["pixels_gt2"] += (diff > 2).sum().item()
        pixel_max = max(pixel_max, diff.max().item())
        out = {"tensor": model(T.normalize(x_t)).float(), "pil": model(T.normalize(x_p)).float()}
        for b, logits in out.items():
            top1, top5 = topk_correct(logits, y_t).tolist()
            counts[f"{b}_top1"] += top1
            counts[f"{b}_top5"] += top5
        pred_t, pred_p = out["tensor"].argmax(1), out["pil"].argmax(1)
        counts["n"] += len(y_t)
        counts["agree"] += (pred_t == pred_p).sum().item()
        counts["only_tensor"] += ((pred_t == y_t) & (pred_p != y_t)).sum().item()
        counts["only_pil"] += ((pred_p == y_t) & (pred_t != y_t)).sum().item()
        logit_max = max(logit_max, (out["tensor"] - out["pil"]).abs().max().item())
        probs = [o.softmax(1) for o in out.values()]
        counts["prob_diff_sum"] += (probs[0] - probs[1]).abs().max(1).values.sum().item()
    return {**counts, "pixel_max": pixel_max, "logit_max": logit_max}


def report(c: dict[str, float]) -> None:
    """The table and the summary lines."""
    n = max(c["n"], 1)
    pct = {k: 100 * c[k] / n for k in c if k.endswith(("_top1", "_top5"))}
    print(f"\n{'backend':<10}{'top-1 %':>9}{'top-5 %':>9}")
    for b in T.BACKENDS:
        print(f"{b:<10}{pct[f'{b}_top1']:9.2f}{pct[f'{b}_top5']:9.2f}")
    print(f"difference (tensor - pil): top-1 {pct['tensor_top1'] - pct['pil_top1']:+.2f} pp, "
          f"top-5 {pct['tensor_top5'] - pct['pil_top5']:+.2f} pp over {int(c['n'])} images "
          f"(one image = {100 / n:.3f} pp)")
    print(f"top-1 prediction agreement: {100 * c['agree'] / n:.2f}% "
          f"({int(n - c['agree'])} images differ; right only with tensor: "
          f"{int(c['only_tensor'])}, right only with pil: {int(c['only_pil'])})")
    print(f"outputs: max |logit diff| {c['logit_max']:.4f}; mean over images of the largest "
          f"|softmax diff| {c['prob_diff_sum'] / n:.5f}")
    print(f"input crops (0..255): mean |pixel diff| {c['pixel_sum'] / max(c['pixels'], 1):.4f}, "
          f"max {c['pixel_max']:.0f}, {100 * c['pixels_gt2'] / max(c['pixels'], 1):.4f}% of "
          "values differ by more than 2")


# --- command line --------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The subcommand's flags."""
    model = parser.add_argument_group("model (default: train one on the demo shapes)")
    model.add_argument("--checkpoint", type=Path, help="a checkpoint written by main.py, or a "
                                                       "bare state_dict")
    model.add_argument("-a", "--arch", help="architecture (default: the checkpoint's)")
    model.add_argument("--weights", help="torchvision weights of --arch, e.g. IMAGENET1K_V1")
    data = parser.add_argument_group("validation data")
    data.add_argument("--data", type=Path, help="ImageFolder root holding val/ (default: the "
                                                "checkpoint's training data)")
    data.add_argument("--limit", type=int, help="evaluate this many val images, evenly spaced "
                                                "(default: all)")
    data.add_argument("--val-resize-size", type=int, help="default: checkpoint's, else 256")
    data.add_argument("--val-crop-size", type=int, help="default: checkpoint's, else 224")
    data.add_argument("--interpolation", choices=tuple(T.INTERPOLATIONS),
                      help="default: checkpoint's, else bilinear")
    run = parser.add_argument_group("running")
    run.add_argument("-b", "--batch-size", type=int, default=64,
                     help="images per validation batch (default: 64)")
    run.add_argument("-j", "--workers", type=int, default=2, help="loader processes per backend")
    run.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    demo = parser.add_argument_group("demo training (when no model is given)")
    demo.add_argument("--work-dir", type=Path, default=ROOT / "runs" / "val-parity",
                      help="demo data and training output; reused when the settings match")
    demo.add_argument("--epochs", type=int, default=4, help="training epochs (default: 4)")
    demo.add_argument("--image-size", type=int, default=112,
                      help="demo image side, pixels; validation resizes it to 64 (x1/1.75, "
                           "like an ImageNet photo to 256)")
    demo.add_argument("--train-per-class", type=int, default=100,
                      help="drawn training images per class (default: 100)")
    demo.add_argument("--val-per-class", type=int, default=100,
                      help="drawn validation images per class (default: 100)")


def check_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """What the flags cannot say alone (bench.py calls it after parsing)."""
    if args.checkpoint and args.weights:
        parser.error("give --checkpoint or --weights, not both")
    if args.weights and not (args.arch and args.data):
        parser.error("--weights needs -a ARCH and --data DIR")


def run(args: argparse.Namespace) -> None:
    """Pick or train the model, evaluate it with both backends, print the comparison."""
    torch.set_num_threads(args.threads)
    weights, classes = None, None
    if args.weights:
        weights = resolve_weights(args.arch, False, args.weights)
        model, config, source = build_model(args.arch, 1000, weights=args.weights), {}, \
            f"torchvision {weights}"
    else:
        data_dir, path = (None, args.checkpoint) if args.checkpoint else \
            train_demo_model(args.work_dir, args)
        model, config, classes = from_checkpoint(path, args.arch)
        args.data = args.data or data_dir or trained_on(config)
        source = str(path)
    settings = settings_for(args, config, weights)
    loaders, folder_classes, total = val_loaders(args.data / "val", settings, args.limit,
                                                 args.batch_size, args.workers)
    if classes and list(classes) != folder_classes:
        sys.exit(f"{args.data}/val has other classes than the checkpoint was trained on")
    n = len(loaders["tensor"].dataset)
    print(f"model: {source}\nval: {args.data / 'val'}: {n} of {total} images; resize "
          f"{settings.resize} -> centre crop {settings.crop}, {settings.interpolation}, "
          f"antialias on; fp32; torch {torch.__version__}, {torch.get_num_threads()} threads",
          flush=True)
    start = time.perf_counter()
    counts = compare(model, loaders)
    report(counts)
    print(f"({time.perf_counter() - start:.0f} s for both backends)")
