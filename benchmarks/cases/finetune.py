"""Fine-tuning from a checkpoint trained on other classes vs training from scratch, same recipe.

The built-in demo generator (``imagenet/tools/demo.py``) draws 5 shape and 5 texture classes.
A resnet18 is pretrained on six of them (100 images per class), then trained on the other four
(``--new``: by default a shape and a texture akin to pretrained ones each: ring ~ circle,
cross ~ square, diagonal ~ stripes, dots ~ checker) with few images per class (``--shots``),
every run with the same flags and seed:

- scratch: random initialisation;
- finetune: ``--finetune`` the pretrained model_best.pth.tar (its classifier is re-initialised:
  other classes);
- finetune, backbone lr x0.1: the same with ``--backbone-lr-scale 0.1``;
- linear probe: ``--freeze-backbone`` (only the classifier trains).

Each run is main.py as a subprocess; the accuracies come from its metrics.jsonl (the last
epoch's top-1 and the best). Run by hand (not a test)::

    python benchmarks/bench.py finetune                        # 6 classes -> 4 others, 10 shots
    python benchmarks/bench.py finetune --shots 5 --seeds 0 1 2
    python benchmarks/bench.py finetune --new stripes_h stripes_v checker diagonal dots

Measured: shapes alone -> textures alone hardly transfers (a linear probe on shape features
stays near chance): the classes have to share something, as photos of objects do.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks import harness
from imagenet.tools.demo import SHAPES, TEXTURES, make_demo_dataset

# The demo recipe (config.DEMO_DEFAULTS) at 40 px; epochs and batch are set per stage.
RECIPE = ["-a", "resnet18", "--opt", "adamw", "--lr", "0.002", "--wd", "0.01",
          "--lr-scheduler", "cosine", "--train-crop-size", "40", "--train-crop-scale", "0.5",
          "--val-resize-size", "46", "--val-crop-size", "40", "-j", "2", "-p", "1000"]
VARIANTS = {
    "scratch": [],
    "finetune": ["--finetune", "{ckpt}"],
    "finetune, backbone lr x0.1": ["--finetune", "{ckpt}", "--backbone-lr-scale", "0.1"],
    "linear probe": ["--finetune", "{ckpt}", "--freeze-backbone"],
}


def subset(demo: Path, out: Path, classes: Sequence[str], train_per_class: int | None) -> Path:
    """An ImageFolder of ``classes`` from the demo set (symlinks), with the first
    ``train_per_class`` training images of each (None: all)."""
    if out.exists():  # made by an earlier run with the same --workdir
        return out
    for split in ("train", "val"):
        for name in classes:
            images = sorted((demo / split / name).glob("*.jpg"))
            if split == "train" and train_per_class is not None:
                images = images[:train_per_class]
            (out / split / name).mkdir(parents=True)
            for image in images:
                (out / split / name / image.name).symlink_to(image)
    return out


def train(data: Path, out: Path, flags: Sequence[str]) -> dict:
    """main.py on ``data``; the last and best top-1 of its metrics.jsonl, and its time."""
    start = time.perf_counter()
    proc = harness.run_main([str(data), *RECIPE, *flags, "--output-dir", str(out)])
    if proc.returncode != 0:
        sys.exit(harness.failure(proc, tail=3000))
    last = harness.last_metrics(out)
    return {"last": last["val_acc1"], "best": last["best_acc1"],
            "seconds": time.perf_counter() - start}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The subcommand's flags."""
    parser.add_argument("--new", nargs="+", choices=SHAPES + TEXTURES,
                        default=["cross", "ring", "diagonal", "dots"],
                        help="the classes of the small data set; the others pretrain")
    parser.add_argument("--shots", type=int, default=10,
                        help="training images per class of the small data set (default: 10)")
    parser.add_argument("--pretrain-epochs", type=int, default=20,
                        help="epochs of the pretraining on the other classes (default: 20)")
    parser.add_argument("--epochs", type=int, default=30,
                        help="epochs on the small set (default: 30)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0],
                        help="--seed of each repetition of the small-set runs (default: 0)")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                        help="which small-set runs to compare (default: all)")
    parser.add_argument("--workdir", type=Path,
                        help="keep the data and runs here; a pretrained model there is reused")


def run(args: argparse.Namespace) -> None:
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-finetune-"))
    new_classes = args.new
    pre_classes = [c for c in SHAPES + TEXTURES if c not in new_classes]
    demo = make_demo_dataset(work / "demo")  # 100 train + 20 val images per class, 64 px
    pre = subset(demo, work / "pre", pre_classes, None)
    small = subset(demo, work / f"small-{args.shots}", new_classes, args.shots)
    print(f"pretrain on {', '.join(pre_classes)} ({len(pre_classes) * 100} images, "
          f"{args.pretrain_epochs} epochs); then {', '.join(new_classes)} with {args.shots} "
          f"training images per class ({args.epochs} epochs, -b 16), "
          f"{len(new_classes) * 20} validation images (chance {100 / len(new_classes):.0f}%)",
          flush=True)
    ckpt = work / "pretrained" / "model_best.pth.tar"
    if ckpt.is_file():
        print(f"pretrained: reusing {ckpt}")
    else:
        base = train(pre, work / "pretrained", ["--epochs", str(args.pretrain_epochs), "-b",
                                                 "64", "--seed", "0"])
        print(f"pretrained: top-1 {base['best']:.1f}% on its own classes in "
              f"{base['seconds']:.0f} s")
    print(f"{'variant':<30}{'last top-1':>12}{'best top-1':>12}{'seconds':>9}", flush=True)
    for name in args.variants:
        flags = VARIANTS[name]
        results = [train(small, work / f"{name.replace(' ', '_')}-{seed}",
                         ["--epochs", str(args.epochs), "-b", "16", "--seed", str(seed),
                          *(f.format(ckpt=ckpt) for f in flags)]) for seed in args.seeds]
        last = statistics.mean(r["last"] for r in results)
        best = statistics.mean(r["best"] for r in results)
        each = ", ".join(f"{r['last']:.1f}" for r in results)
        spread = f" (last top-1 per seed: {each})" if len(results) > 1 else ""
        print(f"{name:<30}{last:>11.1f}%{best:>11.1f}%"
              f"{statistics.mean(r['seconds'] for r in results):>9.0f}{spread}", flush=True)
    print(f"runs in {work}")
