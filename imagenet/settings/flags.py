"""Command-line flags -> a frozen ``Config``; the only reader of ``argv``.

Every flag of pytorch/examples' ``imagenet/main.py`` keeps its name, alias and meaning. Each
field of ``Config`` declares its own flag, so the parser, the frozen value and the dict stored in
checkpoints cannot drift apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from imagenet.errors import UsageError
from imagenet.settings.choices import (
    check_arch,
    check_trackers_installed,
    parse_log_to,
    parse_time_limit,
)

GROUPS = ("recipe", "data", "model", "optimisation", "distributed", "checkpointing", "logging")
AUTO_AUGMENT = ("ra", "ta_wide", "augmix", "imagenet")
COMM_HOOKS = ("none", "fp16", "bf16", "powersgd")
DATA_FORMATS = ("auto", "folder", "shards", "parquet")
CACHE = "cache"  # --cache-dir's default: OUTPUT_DIR/cache
DEMO_DATA = "demo-data"  # --demo writes its data set to OUTPUT_DIR/demo-data
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


OFF = ("off", "none")  # what turns off a value a recipe file gave (--amp off, --auto-augment none)


class Switch(argparse.Action):
    """An on/off flag: --NAME turns it on, --no-NAME off again (for --no-NAME: --NAME), so that
    the command line can undo a recipe file's ``true``; the last one given wins."""

    def __init__(self, option_strings: Sequence[str], dest: str, default: Any = False,
                 help: str | None = None, **kwargs: Any) -> None:
        self.negatives = tuple(("--" + o[5:]) if o.startswith("--no-") else "--no-" + o[2:]
                               for o in option_strings if o.startswith("--"))
        super().__init__([*option_strings, *self.negatives], dest, nargs=0, const=True,
                         default=default, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, option_string not in self.negatives)


def float_or_none(text: str) -> float | None:
    """A number, or none/off (a recipe file's value undone)."""
    return None if text.strip().lower() in OFF else float(text)


def int_or_none(text: str) -> int | None:
    """An integer, or none/off (a recipe file's value undone)."""
    return None if text.strip().lower() in OFF else int(text)


# argparse names the type in its message: "invalid float value: 'x'"
float_or_none.__name__, int_or_none.__name__ = "float", "int"


def duration_text(text: str) -> str:
    """--time-limit's text (a recipe file may give a number of seconds); checked by
    ``choices.parse_time_limit``."""
    return str(text)


def _flag(*names: str, group: str, help: str, cpu_per_image: bool = False,
          **kwargs: Any) -> Any:
    """A dataclass field that also describes its argparse flag. ``cpu_per_image``: an
    augmentation that runs per image on the CPU, which --decode-on-device (decoding and
    cropping on the GPU) cannot run: on, it rules that path out (``cpu_per_image_flags``)."""
    default = kwargs.pop("default", None)
    meta = {"names": names, "group": group, "help": help, "kwargs": kwargs,
            "cpu_per_image": cpu_per_image}
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class Config:
    """The resolved command line; never mutated after parsing."""

    # ---- recipe
    config: str | None = _flag("--config", group="recipe", default=None, metavar="FILE.toml",
                               help="recipe file: TOML whose keys are long flag names, e.g. "
                                    "epochs = 90, lr-scheduler = 'cosine' (recipes/ has some); "
                                    "flags on the command line override it (default: none)")
    # ---- data
    data: str = _flag("data", group="data", default="imagenet", nargs="?", metavar="DIR",
                      help="dataset root holding train/ and val/ in ImageFolder layout, or tar "
                           "shards (WebDataset): a folder or http(s):// URL with _info.json, a "
                           "pattern such as /data/train-{000000..000146}.tar, or "
                           "'pipe:COMMAND' (default: %(default)s)")
    data_format: str = _flag("--data-format", group="data", default="auto",
                             choices=DATA_FORMATS,
                             help="how to read DIR; auto = ImageFolder when DIR holds "
                                  "train/ and val/ class folders (whatever other files it "
                                  "holds), Parquet (Hugging Face's layout) when DIR or a URL "
                                  "holds .parquet files and no _info.json, or is an hf:// "
                                  "URL, tar shards when DIR is a pattern, URL, pipe: or holds "
                                  "_info.json (default: %(default)s)")
    val_data: str | None = _flag("--val-data", group="data", default=None, metavar="PATH",
                                 help="the validation images: with a shard pattern DIR, shards "
                                      "(default: the validation split of the _info.json beside "
                                      "them); with Parquet, a file or a folder of Parquet "
                                      "files: its validation split (validation, val, valid or "
                                      "test files, never its training files), or all its files "
                                      "when none names a split; else an ImageFolder (class "
                                      "folders) used instead of DIR/val/, its classes matched "
                                      "to the training classes by name (a subset is fine); "
                                      "with -e it needs no DIR: the classes are the --resume "
                                      "checkpoint's")
    num_classes: int | None = _flag("--num-classes", group="data", default=None, type=int,
                                    metavar="N",
                                    help="classes of shards whose _info.json lists no class "
                                         "names, e.g. 1000 for the published ImageNet-1k "
                                         "shards (default: from _info.json)")
    workers: int | None = _flag("-j", "--workers", group="data", default=None, type=int,
                                metavar="N",
                                help="data loading processes per node, split across its ranks "
                                     "like -b (default: auto = each process's own CPU cores "
                                     "less one, at most 16: an srun task's are its own, "
                                     "processes that share cores divide them; the classic "
                                     "used 4 per node)")
    dummy: bool = _flag("--dummy", group="data", default=False, action=Switch,
                        help="train on synthetic random tensors (speed tests; no DIR needed)")
    dummy_size: int = _flag("--dummy-size", group="data", default=1281167, type=int, metavar="N",
                            help="images per epoch with --dummy (default: %(default)s, ImageNet's)")
    dummy_val_size: int = _flag("--dummy-val-size", group="data", default=50000, type=int,
                                metavar="N", help="validation images with --dummy "
                                                  "(default: %(default)s)")
    dummy_classes: int = _flag("--dummy-classes", group="data", default=1000, type=int,
                               metavar="N", help="classes with --dummy (default: %(default)s)")
    demo: bool = _flag("--demo", group="data", default=False, action=Switch,
                       help="generate and train on the built-in procedural JPEG data set under "
                            "OUTPUT_DIR/demo-data (no download); sets demo-sized defaults for "
                            "flags you did not give")
    train_crop_size: int = _flag("--train-crop-size", group="data", default=224, type=int,
                                 metavar="PX", help="training crop, pixels (default: %(default)s)")
    train_crop_scale: float = _flag("--train-crop-scale", group="data", default=0.08, type=float,
                                    metavar="F",
                                    help="smallest RandomResizedCrop area, as a fraction of the "
                                         "image (default: %(default)s)")
    train_crop_start: int | None = _flag(
        "--train-crop-start", group="data", default=None, type=int, metavar="PX",
        help="progressive resizing: the training crop starts at PX and grows linearly to "
             "--train-crop-size over --train-crop-ramp; validation sizes stay as given "
             "(default: off)")
    train_crop_ramp: tuple[int, int] | None = _flag(
        "--train-crop-ramp", group="data", default=None, type=int, nargs=2,
        metavar=("START_EPOCH", "END_EPOCH"),
        help="with --train-crop-start: epochs up to START_EPOCH train at the start size, epochs "
             "from END_EPOCH on at --train-crop-size, the ones between on a linear ramp "
             "(default: off)")
    train_crop_multiple: int = _flag(
        "--train-crop-multiple", group="data", default=32, type=int, metavar="PX",
        help="sizes on the --train-crop-ramp are rounded to a multiple of PX; 32 is the total "
             "stride of torchvision's CNNs, as FFCV rounds (default: %(default)s)")
    ra_reps: int = _flag("--ra-reps", group="data", default=1, type=int, metavar="N",
                         help="repeated augmentation: each image an epoch selects is trained N "
                              "times, differently augmented, the copies spread over the "
                              "processes; an epoch stays one pass of the data set "
                              "(torchvision's RASampler; its ResNet-50 recipe uses 4) "
                              "(default: %(default)s = off)")
    val_resize_size: int = _flag("--val-resize-size", group="data", default=256, type=int,
                                 metavar="PX", help="validation resize of the short side, pixels "
                                                    "(default: %(default)s)")
    val_crop_size: int = _flag("--val-crop-size", group="data", default=224, type=int,
                               metavar="PX", help="validation centre crop, pixels "
                                                  "(default: %(default)s)")
    interpolation: str = _flag("--interpolation", group="data", default="bilinear",
                               choices=("nearest", "bilinear", "bicubic"),
                               help="resize interpolation (default: %(default)s)")
    image_backend: str = _flag("--image-backend", group="data", default="tensor",
                               choices=("tensor", "pil"),
                               help="'tensor': libjpeg-turbo decode + v2 transforms on uint8 "
                                    "(fast); 'pil': the classic PIL pipeline "
                                    "(default: %(default)s)")
    decoder: str = _flag("--decoder", group="data", default="auto",
                         choices=("auto", "torchvision", "torchcodec"),
                         help="the JPEG decoder of --image-backend tensor and the device path: "
                              "torchvision.io's or TorchCodec's (an extra); auto = the faster, "
                              "TorchCodec once torchvision's are gone; the same pixels either "
                              "way (default: %(default)s)")
    decode_on_device: str = _flag("--decode-on-device", group="data", default="auto",
                                  choices=("auto", "on", "off"),
                                  help="decode JPEGs (nvJPEG, batched) and crop, resize and flip "
                                       "them on the training device, the loader workers only "
                                       "reading files (ImageFolder, tar shards, Parquet); "
                                       "auto = on with CUDA and fewer than 8 loader workers, "
                                       "without --image-backend pil, --auto-augment or "
                                       "--random-erase (default: %(default)s)")
    auto_augment: str | None = _flag("--auto-augment", group="data", default=None,
                                     choices=(*AUTO_AUGMENT, *OFF), cpu_per_image=True,
                                     help="automatic augmentation policy; none = off "
                                          "(default: none)")
    ra_magnitude: int = _flag("--ra-magnitude", group="data", default=9, type=int, metavar="M",
                              help="RandAugment magnitude, 0-30 (default: %(default)s)")
    augmix_severity: int = _flag("--augmix-severity", group="data", default=3, type=int,
                                 metavar="S", help="AugMix severity, 1-10 (default: %(default)s)")
    random_erase: float = _flag("--random-erase", group="data", default=0.0, type=float,
                                metavar="P", cpu_per_image=True,
                                help="RandomErasing probability per image (default: %(default)s)")
    mixup_alpha: float = _flag("--mixup-alpha", group="data", default=0.0, type=float,
                               metavar="A", help="MixUp Beta(alpha) parameter; 0 = off "
                                                 "(default: %(default)s)")
    cutmix_alpha: float = _flag("--cutmix-alpha", group="data", default=0.0, type=float,
                                metavar="A", help="CutMix Beta(alpha) parameter; 0 = off "
                                                  "(default: %(default)s)")
    # ---- model
    arch: str = _flag("-a", "--arch", group="model", default="resnet18", metavar="ARCH",
                      help="torchvision architecture, one of "
                           "torchvision.models.list_models(), or timm/NAME for a timm model "
                           "(timm.list_models(), with timm installed) (default: %(default)s)")
    pretrained: bool = _flag("--pretrained", group="model", default=False, action=Switch,
                             help="start from the architecture's default torchvision weights")
    weights: str | None = _flag("--weights", group="model", default=None, metavar="NAME",
                                help="torchvision weights enum member, e.g. IMAGENET1K_V1 "
                                     "(default: none)")
    finetune: str | None = _flag("--finetune", group="model", default=None, metavar="PATH",
                                 help="start from the weights of PATH (a checkpoint of this "
                                      "trainer, also --fsdp's and EMA/best files, the classic "
                                      "script's, a plain state dict or a torchvision .pth); "
                                      "layers whose shape differs (the classifier, for "
                                      "another class count) are re-initialised and named; "
                                      "optimizer, schedule, epoch and best start fresh "
                                      "(default: none)")
    freeze_backbone: bool = _flag("--freeze-backbone", group="model", default=False,
                                  action=Switch,
                                  help="linear probe: train only the classifier; the rest of "
                                       "the model keeps its weights and BatchNorm statistics "
                                       "and runs as in evaluation (no dropout)")
    sync_bn: bool = _flag("--sync-bn", group="model", default=False, action=Switch,
                          help="convert BatchNorm to SyncBatchNorm in distributed runs")
    channels_last: bool = _flag("--channels-last", group="model", default=False,
                                action=Switch,
                                help="NHWC memory format for model and input (faster convs)")
    compile: bool = _flag("--compile", group="model", default=False, action=Switch,
                          help="torch.compile the model (the DDP-wrapped one: graphs split at "
                               "DDP's buckets); static shapes, every batch shape compiled once, "
                               "in the first epoch")
    compile_mode: str = _flag("--compile-mode", group="model", default="default",
                              choices=COMPILE_MODES,
                              help="with --compile: inductor's mode; reduce-overhead replays "
                                   "CUDA graphs (fewer kernel launches per step), max-autotune "
                                   "also tunes kernels (long first epoch); see docs/gpu.md "
                                   "(default: %(default)s)")
    model_ema: bool = _flag("--model-ema", group="model", default=False, action=Switch,
                            help="keep, evaluate and checkpoint an exponential moving average "
                                 "of the weights")
    model_ema_steps: int = _flag("--model-ema-steps", group="model", default=32, type=int,
                                 metavar="N", help="optimizer steps between EMA updates "
                                                   "(default: %(default)s)")
    model_ema_decay: float = _flag("--model-ema-decay", group="model", default=0.99998,
                                   type=float, metavar="D",
                                   help="EMA decay per optimizer step; adjusted for "
                                        "--model-ema-steps (default: %(default)s)")
    # ---- optimisation
    epochs: int = _flag("--epochs", group="optimisation", default=90, type=int, metavar="N",
                        help="total epochs to run (default: %(default)s)")
    start_epoch: int = _flag("--start-epoch", group="optimisation", default=0, type=int,
                             metavar="N", help="first epoch number, useful on restarts; "
                                               "a --resume checkpoint overrides it "
                                               "(default: %(default)s)")
    batch_size: int = _flag("-b", "--batch-size", group="optimisation", default=256, type=int,
                            metavar="N",
                            help="images per step, per node with --multiprocessing-distributed "
                                 "(or several GPUs and no launcher: split across the node's "
                                 "processes, as the classic), per process under torchrun, srun "
                                 "and manual --rank; x --grad-accum-steps per optimizer step; "
                                 "the global batch is printed at start (default: %(default)s)")
    global_batch_size: int | None = _flag(
        "--global-batch-size", group="optimisation", default=None, type=int, metavar="N",
        help="images per optimizer step over all processes, instead of -b: each process takes "
             "N / (processes x --grad-accum-steps), which must divide evenly; stays the same "
             "when a resume runs on another number of processes (default: from -b)")
    lr: float = _flag("--lr", "--learning-rate", group="optimisation", default=0.1, type=float,
                      metavar="LR", help="initial learning rate, whatever the global batch "
                                         "(default: %(default)s)")
    lr_base: float | None = _flag(
        "--lr-base", group="optimisation", default=None, type=float_or_none, metavar="LR",
        help="instead of --lr: the learning rate at a global batch of --lr-base-size images; "
             "the run's is scaled to its own global batch by --lr-base-scale, printed at start "
             "and recorded in config.json (timm's --lr-base) (default: none = --lr as given)")
    lr_base_size: int = _flag("--lr-base-size", group="optimisation", default=256, type=int,
                              metavar="N", help="the global batch (images per optimizer step) "
                                                "of --lr-base (default: %(default)s)")
    lr_base_scale: str = _flag("--lr-base-scale", group="optimisation", default="linear",
                               choices=("linear", "sqrt"),
                               help="how --lr-base follows the global batch: linear = x "
                                    "(batch / --lr-base-size) (Goyal et al.), sqrt = x its "
                                    "square root (Adam-style optimizers) "
                                    "(default: %(default)s)")
    momentum: float = _flag("--momentum", group="optimisation", default=0.9, type=float,
                            metavar="M", help="SGD/RMSprop momentum (default: %(default)s)")
    weight_decay: float = _flag("--wd", "--weight-decay", group="optimisation", default=1e-4,
                                type=float, metavar="W",
                                help="weight decay (default: %(default)s)")
    norm_weight_decay: float | None = _flag(
        "--norm-weight-decay", group="optimisation", default=None, type=float_or_none,
        metavar="W", help="weight decay for normalisation layers; none = as --wd "
                          "(default: same as --wd)")
    bias_weight_decay: float | None = _flag(
        "--bias-weight-decay", group="optimisation", default=None, type=float_or_none,
        metavar="W", help="weight decay for biases; none = as --wd (default: same as --wd)")
    backbone_lr_scale: float = _flag("--backbone-lr-scale", group="optimisation", default=1.0,
                                     type=float, metavar="F",
                                     help="fine-tuning: every layer but the classifier learns "
                                          "at F x the learning rate, through the whole "
                                          "schedule (the logged lr is the classifier's) "
                                          "(default: %(default)s)")
    class_balanced_loss: float | None = _flag(
        "--class-balanced-loss", group="optimisation", default=None, type=float_or_none,
        metavar="BETA",
        help="weight each class's loss by (1 - BETA) / (1 - BETA^n), n its training images "
             "(the 'effective number' of Cui et al. 2019), normalised to a mean of 1 over the "
             "classes; 1 = inverse frequency, 0.999-0.9999 usual (default: off)")
    opt: str = _flag("--opt", group="optimisation", default="sgd",
                     choices=("sgd", "sgd_nesterov", "adamw", "rmsprop", "lamb", "lars"),
                     help="optimizer; lamb and lars scale each layer's step by a trust ratio "
                          "and leave biases and normalisation layers unadapted and undecayed "
                          "(docs/recipes.md) (default: %(default)s)")
    lars_trust_coef: float = _flag("--lars-trust-coef", group="optimisation", default=0.001,
                                   type=float, metavar="ETA",
                                   help="--opt lars: each layer's step is ETA x ||w|| / (||g|| + "
                                        "wd x ||w||) of --lr (MLPerf's ResNet-50 uses 0.001) "
                                        "(default: %(default)s)")
    bce_loss: bool = _flag("--bce-loss", group="optimisation", default=False, action=Switch,
                           help="binary cross-entropy on the one-hot (MixUp/CutMix: mixed) "
                                "targets, one sigmoid per class, instead of softmax "
                                "cross-entropy (ResNet Strikes Back; timm's --bce-loss); "
                                "--label-smoothing and --class-balanced-loss apply to it")
    bce_target_thresh: float | None = _flag(
        "--bce-target-thresh", group="optimisation", default=None, type=float_or_none,
        metavar="T", help="with --bce-loss: targets above T become 1, the rest 0, after "
                          "mixing and smoothing (RSB uses 0.2) (default: none = soft targets)")
    distill_teacher: str | None = _flag(
        "--distill-teacher", group="optimisation", default=None, metavar="PATH_OR_ARCH",
        help="knowledge distillation from a teacher: a checkpoint of this trainer, a state dict "
             "or torchvision .pth (its architecture: --distill-teacher-arch), or an "
             "architecture name, with its default pretrained weights. It sees the student's "
             "augmented and mixed batch, in eval mode, without gradients; it is not saved in "
             "checkpoints (its path and digest are) (default: none)")
    distill_teacher_arch: str | None = _flag(
        "--distill-teacher-arch", group="optimisation", default=None, metavar="ARCH",
        help="the architecture of a --distill-teacher file (default: the one its checkpoint "
             "records, else -a)")
    distill_alpha: float = _flag("--distill-alpha", group="optimisation", default=0.5,
                                 type=float, metavar="A",
                                 help="the loss is (1 - A) x the label loss + A x the "
                                      "distillation loss (default: %(default)s)")
    distill_temperature: float = _flag("--distill-temperature", group="optimisation",
                                       default=1.0, type=float, metavar="T",
                                       help="--distill-type soft: the softmax temperature of "
                                            "both models; the KL term is scaled by T^2 "
                                            "(default: %(default)s)")
    distill_type: str = _flag("--distill-type", group="optimisation", default="soft",
                              choices=("soft", "hard"),
                              help="soft: KL divergence to the teacher's softened "
                                   "probabilities (Hinton et al.); hard: cross-entropy to the "
                                   "teacher's top class (DeiT) (default: %(default)s)")
    lr_scheduler: str = _flag("--lr-scheduler", group="optimisation", default="step",
                              choices=("step", "multistep", "cosine", "linear"),
                              help="schedule after warm-up, stepped per iteration; linear "
                                   "falls straight to --lr-min at the last step (FFCV's) "
                                   "(default: %(default)s = x0.1 every 30 epochs)")
    lr_step_size: int = _flag("--lr-step-size", group="optimisation", default=30, type=int,
                              metavar="EPOCHS", help="step schedule period, epochs after "
                                                     "the warm-up (default: %(default)s)")
    lr_milestones: tuple[int, ...] = _flag(
        "--lr-milestones", group="optimisation", default=(30, 60, 80), type=int, nargs="+",
        metavar="EPOCH", help="multistep schedule epochs (default: 30 60 80)")
    lr_gamma: float = _flag("--lr-gamma", group="optimisation", default=0.1, type=float,
                            metavar="G", help="step/multistep decay factor "
                                              "(default: %(default)s)")
    lr_min: float = _flag("--lr-min", group="optimisation", default=0.0, type=float,
                          metavar="LR", help="cosine and linear schedules' floor "
                                              "(default: %(default)s)")
    lr_warmup_epochs: int = _flag("--lr-warmup-epochs", group="optimisation", default=0,
                                  type=int, metavar="N",
                                  help="warm-up epochs, stepped per iteration "
                                       "(default: %(default)s)")
    lr_warmup_method: str = _flag("--lr-warmup-method", group="optimisation", default="linear",
                                  choices=("linear", "constant"),
                                  help="warm-up shape (default: %(default)s)")
    lr_warmup_decay: float = _flag("--lr-warmup-decay", group="optimisation", default=0.01,
                                   type=float, metavar="F",
                                   help="warm-up starts at F x --lr (default: %(default)s)")
    label_smoothing: float = _flag("--label-smoothing", group="optimisation", default=0.0,
                                   type=float, metavar="E",
                                   help="cross-entropy label smoothing (default: %(default)s)")
    clip_grad_norm: float | None = _flag("--clip-grad-norm", group="optimisation", default=None,
                                         type=float_or_none, metavar="N",
                                         help="max gradient L2 norm, on unscaled gradients; "
                                              "none = off (default: off)")
    grad_accum_steps: int = _flag("--grad-accum-steps", group="optimisation", default=1,
                                  type=int, metavar="K",
                                  help="micro-batches per optimizer step; -b is the micro-batch "
                                       "(default: %(default)s)")
    amp: str | None = _flag("--amp", group="optimisation", default=None,
                            choices=("bf16", "fp16", *OFF),
                            help="autocast dtype; fp16 adds a GradScaler; off = fp32 "
                                 "(default: off)")
    seed: int | None = _flag("--seed", group="optimisation", default=None, type=int_or_none,
                             metavar="S",
                             help="seed python/torch/data per process and switch on "
                                  "deterministic algorithms; none = unseeded (default: "
                                  "unseeded, cudnn.benchmark on)")
    # ---- distributed
    world_size: int = _flag("--world-size", group="distributed", default=-1, type=int,
                            metavar="N", help="nodes with --multiprocessing-distributed, else "
                                              "processes (default: from the launcher, or 1)")
    rank: int = _flag("--rank", group="distributed", default=-1, type=int, metavar="R",
                      help="node rank with --multiprocessing-distributed, else process rank "
                           "(default: from the launcher, or 0)")
    dist_url: str = _flag("--dist-url", group="distributed", default="env://", metavar="URL",
                          help="rendezvous: env:// (torchrun/SLURM variables) or "
                               "tcp://HOST:PORT of rank 0 (default: %(default)s)")
    dist_backend: str | None = _flag("--dist-backend", group="distributed", default=None,
                                     choices=("nccl", "gloo"),
                                     help="default: nccl with CUDA, gloo on CPU")
    dist_timeout: float = _flag("--dist-timeout", group="distributed", default=600.0,
                                type=float, metavar="SEC",
                                help="give up when peers do not arrive or answer, seconds "
                                     "(default: %(default)s)")
    hang_timeout: float | None = _flag(
        "--hang-timeout", group="distributed", default=None, type=float, metavar="SEC",
        help="a rank that makes no progress (a training step, a validation batch, a save) for "
             "this long is a hang (a compile, the checkpoint's load and an upload do not count: "
             "each may take max(30 min, 6 x this)): every rank writes its Python stacks to "
             "OUTPUT_DIR/hang/, one line names the rank that stopped and where, and every "
             "process exits with code 143 so that a requeue resumes; 0 = off (default: 300, at "
             "most half of --dist-timeout)")
    multiprocessing_distributed: bool = _flag(
        "--multiprocessing-distributed", group="distributed", default=False, action=Switch,
        help="start one process per local device with mp.spawn and train with DDP")
    nproc_per_node: int | None = _flag("--nproc-per-node", group="distributed", default=None,
                                       type=int, metavar="N",
                                       help="processes per node for "
                                            "--multiprocessing-distributed (default: visible "
                                            "GPUs, or 1 on CPU)")
    local_rank: int | None = _flag("--local-rank", "--local_rank", group="distributed",
                                   default=None, type=int, metavar="R",
                                   help="set by torch.distributed.launch; do not pass by hand "
                                        "(default: LOCAL_RANK)")
    gpu: int | None = _flag("--gpu", group="distributed", default=None, type=int, metavar="ID",
                            help="accelerator device index for a single-process run, on "
                                 "whatever torch.accelerator finds: CUDA/ROCm, MPS, XPU, ... "
                                 "(default: 0 when one is present)")
    no_accel: bool = _flag("--no-accel", group="distributed", default=False,
                           action=Switch, help="run on the CPU even if an accelerator is present")
    ddp_comm_hook: str = _flag("--ddp-comm-hook", group="distributed", default="none",
                               choices=COMM_HOOKS,
                               help="gradient compression for slow links "
                                    "(default: %(default)s)")
    powersgd_rank: int = _flag("--powersgd-rank", group="distributed", default=4, type=int,
                               metavar="R", help="PowerSGD matrix rank (default: %(default)s)")
    powersgd_start_iter: int = _flag("--powersgd-start-iter", group="distributed", default=10,
                                     type=int, metavar="N",
                                     help="uncompressed warm-up steps before PowerSGD "
                                          "(default: %(default)s)")
    bucket_cap_mb: float = _flag("--bucket-cap-mb", group="distributed", default=25.0,
                                 type=float, metavar="MB",
                                 help="DDP gradient bucket size, MB (default: %(default)s)")
    fsdp: bool = _flag("--fsdp", group="distributed", default=False, action=Switch,
                       help="fully sharded data parallel instead of DDP: each of N processes "
                            "holds 1/N of the weights, gradients and optimizer state, and "
                            "gathers a block's weights just before using it (torch FSDP2); for "
                            "models whose training state does not fit one device")
    fsdp_zero: int | None = _flag("--fsdp-zero", group="distributed", default=None, type=int,
                                  choices=(2, 3),
                                  help="with --fsdp: 3 = free each block's gathered weights "
                                       "after its forward and gather them again for its "
                                       "backward (least memory); 2 = keep them until the "
                                       "backward (one all-gather less per step, more memory) "
                                       "(default: 3)")
    fsdp_cpu_offload: bool = _flag("--fsdp-cpu-offload", group="distributed", default=False,
                                   action=Switch,
                                   help="with --fsdp: keep the weight, gradient and optimizer "
                                        "shards in host memory, copied to the device for each "
                                        "block (least device memory; the optimizer steps on "
                                        "the CPU)")
    fsdp_reduce_dtype: str | None = _flag("--fsdp-reduce-dtype", group="distributed",
                                          default=None, choices=("fp32", "bf16", "fp16"),
                                          help="with --fsdp: dtype of the gradient "
                                               "reduce-scatter (default: fp32; with --amp the "
                                               "weights are gathered and used in the --amp "
                                               "dtype)")
    # ---- checkpointing
    output_dir: str = _flag("--output-dir", group="checkpointing", default=".", metavar="DIR",
                            help="checkpoints, logs, TensorBoard: a folder, or an s3:// / "
                                 "gs:// (any fsspec) URL, staged locally and uploaded by rank "
                                 "0 (extra 'cloud') (default: current folder)")
    resume: str | None = _flag("--resume", group="checkpointing", default=None, metavar="PATH",
                               help="checkpoint to resume from (a path or URL); 'auto' = "
                                    "OUTPUT_DIR/checkpoint.pth.tar if present (default: none)")
    evaluate: bool = _flag("-e", "--evaluate", group="checkpointing", default=False,
                           action=Switch,
                           help="evaluate the model (--resume PATH, or --pretrained) on val/ "
                                "or --val-data and exit; writes per_class.csv/.json and the "
                                "confusion matrix to OUTPUT_DIR")
    predictions: str | None = _flag("--predictions", group="checkpointing", default=None,
                                    metavar="FILE.csv",
                                    help="with -e, and at the end of training: one row per "
                                         "validation image (path,target,pred,confidence and "
                                         "the top 5 classes with their probabilities) "
                                         "(default: none)")
    tta_flip: bool = _flag("--tta-flip", group="checkpointing", default=False,
                           action=Switch,
                           help="validate on each image and its mirror image, averaging the "
                                "two softmax probabilities (every validation, so model_best "
                                "too)")
    sharded_checkpoint: bool = _flag(
        "--sharded-checkpoint", group="checkpointing", default=False, action=Switch,
        help="with --fsdp: write checkpoint.dcp/ (torch.distributed.checkpoint; every rank "
             "writes its own shards, nothing is gathered) instead of checkpoint.pth.tar, for "
             "models whose state does not fit one host; python -m imagenet.tools.unshard "
             "turns it into the single file")
    save_every: int = _flag("--save-every", group="checkpointing", default=0, type=int,
                            metavar="STEPS", help="also checkpoint every N optimizer steps "
                                                  "within an epoch; 0 = epoch ends only "
                                                  "(default: %(default)s)")
    keep_checkpoints: int = _flag(
        "--keep-checkpoints", group="checkpointing", default=0, type=int, metavar="N",
        help="also keep the N best epoch checkpoints by top-1 (checkpoint_epoch012.pth.tar: "
             "after 12 epochs), their scores in OUTPUT_DIR/checkpoints.json (default: "
             "%(default)s = none)")
    time_limit: str | None = _flag(
        "--time-limit", group="checkpointing", default=None, type=duration_text,
        metavar="DURATION",
        help="stop early enough to save before this much wall-clock time has passed since "
             "main.py started (imagenet.train: since its call): seconds, HH:MM:SS or "
             "D-HH:MM:SS; 'slurm' = this SLURM job's end time. Exits with code 143 (as on "
             "preemption); --resume auto continues (default: none)")
    cache_dir: str | None = _flag(
        "--cache-dir", group="checkpointing", default=None, metavar="DIR",
        help="what a restart reuses instead of redoing: the data set's folder index (no listing "
             "of every image) and, with --compile, the compiled graphs; put it where a requeued "
             "job finds it (any node's); 'none' keeps nothing (default: OUTPUT_DIR/cache)")
    # ---- logging
    print_freq: int = _flag("-p", "--print-freq", group="logging", default=10, type=int,
                            metavar="N", help="progress line every N steps "
                                              "(default: %(default)s)")
    debug: bool = _flag("--debug", group="logging", default=False, action=Switch,
                        help="show full tracebacks and debug logs")
    log_to: str = _flag("--log-to", group="logging", default="tensorboard", type=parse_log_to,
                        metavar="LIST",
                        help="experiment trackers, comma-separated: tensorboard, mlflow, wandb, "
                             "or none (metrics.jsonl is always written) (default: %(default)s)")
    env_check: bool = _flag("--env-check", group="logging", default=False, action=Switch,
                            help="check the installation and local devices, then exit")

    def to_dict(self) -> dict[str, Any]:
        """Plain, checkpoint-safe dict (loads with weights_only=True)."""
        return {k: list(v) if isinstance(v, tuple) else v
                for k, v in dataclasses.asdict(self).items()}


# Demo-sized defaults applied by --demo to flags the user did not give. ResNet-18 from scratch
# on 1,000 64 px images: small crops keep an epoch near 10 s on 2 CPU cores; AdamW + cosine learn
# in the ~220 steps that leaves (SGD at lr 0.1 stayed at chance); crops keep half the image or
# more, since a smaller one often misses the shape that is the class. Measured: ~70% top-1 on the
# 10 classes (chance 10%) in ~2.7 min.
DEMO_DEFAULTS = {"epochs": 14, "batch_size": 64, "opt": "adamw", "lr": 0.002,
                 "weight_decay": 0.01, "lr_scheduler": "cosine", "workers": 2,
                 "train_crop_size": 40, "train_crop_scale": 0.5, "val_resize_size": 46,
                 "val_crop_size": 40, "print_freq": 5}


def get_args_parser() -> argparse.ArgumentParser:
    """The argparse parser, grouped by concern; reusable by scripts and tests."""
    parser = argparse.ArgumentParser(
        prog="main.py", description="ImageNet / ImageFolder training with torchvision models "
                                    "(drop-in for pytorch/examples imagenet/main.py)")
    groups = {g: parser.add_argument_group(g) for g in GROUPS}
    for f in dataclasses.fields(Config):
        meta = f.metadata
        kwargs = dict(meta["kwargs"])
        if meta["names"][0].startswith("-"):
            kwargs["dest"] = f.name
        groups[meta["group"]].add_argument(*meta["names"], default=f.default, help=meta["help"],
                                           **kwargs)
    return parser


# Flags that say one thing two ways: give one of each pair. Both on the command line, or both
# in one file, is an error; one on the command line sets the file's other one aside (defaults <
# the file < the command line).
EITHER = {("batch_size", "global_batch_size"):
          "give either -b/--batch-size (per process or per node, by launcher) or "
          "--global-batch-size (all processes together), not both",
          ("lr", "lr_base"):
          "give either --lr (the learning rate as it is) or --lr-base (scaled to the global "
          "batch by --lr-base-scale), not both"}
NOT_GIVEN = object()  # the default of every flag when telling which ones the command line gives


def parse_config(argv: Sequence[str] | None = None) -> Config:
    """Parse ``argv`` (None = sys.argv) into a validated ``Config``; a --config file's values
    stand in for the defaults."""
    parser = get_args_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    ns = parser.parse_args(argv)
    given = given_flags(argv, parser)
    check_either(given, "")
    from_file: dict[str, Any] = {}
    if ns.config:  # the file's values become defaults: flags on the command line win
        from imagenet.settings.recipe import file_values

        from_file = file_values(parser, Path(ns.config))
        check_either(from_file, f"--config {ns.config}: ")
        for pair in EITHER:
            for mine, other in (pair, pair[::-1]):
                if given.get(mine) is not None:
                    from_file.pop(other, None)  # set aside by the command line's
        parser.set_defaults(**from_file)
        ns = parser.parse_args(argv)
    values = vars(ns)
    for name in ("amp", "auto_augment"):  # --amp off, --auto-augment none
        if values[name] in OFF:
            values[name] = None
    chosen = set(given) | set(from_file)  # a value from the file counts as given
    for plain, instead in EITHER:  # --global-batch-size, --lr-base: the demo's -b, --lr unused
        if values[instead] is not None:
            chosen.add(plain)
    if values["demo"]:
        if "data" in given:
            raise UsageError(f"--demo trains on the built-in data it writes to "
                             f"OUTPUT_DIR/demo-data: drop DIR '{values['data']}' or --demo")
        values.update({k: v for k, v in DEMO_DEFAULTS.items() if k not in chosen})
        values["data"] = str(Path(values["output_dir"]) / DEMO_DATA)  # recorded as trained
    values["lr_milestones"] = tuple(values["lr_milestones"])
    if values["train_crop_ramp"] is not None:
        values["train_crop_ramp"] = tuple(values["train_crop_ramp"])
    cfg = Config(**values)
    validate(cfg)
    return cfg


def cpu_per_image_flags(cfg: Config) -> list[str]:
    """The per-image CPU augmentations ``cfg`` turns on, by flag (marked ``cpu_per_image`` where
    each flag is defined): the device decode path cannot run them."""
    return [f.metadata["names"][0] for f in dataclasses.fields(Config)
            if f.metadata.get("cpu_per_image") and getattr(cfg, f.name)]


def given_flags(argv: Sequence[str], parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The flags the command line gives, with their values, as ``parser`` (main.py's) read
    them: any spelling (-b32, --batch=16, --epoch 2 for --epochs), the last of repeated ones.
    Every flag's default is NOT_GIVEN while it parses; the parser is left as it was."""
    actions = [a for a in parser._actions if a.dest != "help"]
    defaults = [a.default for a in actions]
    for action in actions:
        action.default = NOT_GIVEN
    try:
        parsed = vars(parser.parse_args(list(argv)))
    finally:
        for action, default in zip(actions, defaults):
            action.default = default
    return {k: v for k, v in parsed.items() if v is not NOT_GIVEN}


def check_either(values: dict[str, Any], where: str) -> None:
    """UsageError when ``values`` (the command line's, or a file's) set both flags of a pair."""
    for pair, message in EITHER.items():
        if all(values.get(name) is not None for name in pair):
            if where:
                keys = " and ".join(_long_name(name)[2:] for name in pair)
                raise UsageError(f"{where}sets both {keys}: {message}")
            raise UsageError(message)


def _long_name(name: str) -> str:
    """A Config field's long flag: '--batch-size'."""
    names = next(f for f in dataclasses.fields(Config) if f.name == name).metadata["names"]
    return next(n for n in names if n.startswith("--"))


def validate(cfg: Config) -> None:
    """Raise UsageError naming the flag when a value cannot work."""
    positive = {"-b/--batch-size": cfg.batch_size, "--epochs": cfg.epochs,
                "-p/--print-freq": cfg.print_freq, "--train-crop-size": cfg.train_crop_size,
                "--val-crop-size": cfg.val_crop_size, "--val-resize-size": cfg.val_resize_size,
                "--grad-accum-steps": cfg.grad_accum_steps, "--dist-timeout": cfg.dist_timeout,
                "--model-ema-steps": cfg.model_ema_steps, "--bucket-cap-mb": cfg.bucket_cap_mb,
                "--powersgd-rank": cfg.powersgd_rank, "--ra-reps": cfg.ra_reps,
                "--train-crop-multiple": cfg.train_crop_multiple,
                "--lr-base-size": cfg.lr_base_size,
                "--global-batch-size": 1 if cfg.global_batch_size is None
                else cfg.global_batch_size}
    for name, value in positive.items():
        if value <= 0:
            raise UsageError(f"{name} must be positive, got {value}")
    non_negative = {"--hang-timeout": cfg.hang_timeout or 0, "--lr": cfg.lr,
                    "--lr-base": cfg.lr_base or 0.0,
                    "--momentum": cfg.momentum, "--wd": cfg.weight_decay,
                    "-j/--workers": cfg.workers or 0, "--start-epoch": cfg.start_epoch,
                    "--save-every": cfg.save_every, "--label-smoothing": cfg.label_smoothing,
                    "--mixup-alpha": cfg.mixup_alpha, "--cutmix-alpha": cfg.cutmix_alpha,
                    "--lr-warmup-epochs": cfg.lr_warmup_epochs, "--lr-min": cfg.lr_min,
                    "--powersgd-start-iter": cfg.powersgd_start_iter,
                    "--keep-checkpoints": cfg.keep_checkpoints}
    for name, value in non_negative.items():
        if value < 0:
            raise UsageError(f"{name} must not be negative, got {value}")
    if cfg.epochs < cfg.start_epoch:
        raise UsageError(f"--epochs ({cfg.epochs}) is smaller than --start-epoch "
                         f"({cfg.start_epoch}): nothing to train")
    if not 0.0 < cfg.train_crop_scale <= 1.0:
        raise UsageError(f"--train-crop-scale is an area fraction in (0, 1], got "
                         f"{cfg.train_crop_scale}")
    if not 0.0 <= cfg.random_erase <= 1.0:
        raise UsageError(f"--random-erase is a probability in [0, 1], got {cfg.random_erase}")
    if not 0.0 <= cfg.label_smoothing < 1.0:
        raise UsageError(f"--label-smoothing must be in [0, 1), got {cfg.label_smoothing}")
    if cfg.lr_scheduler == "multistep" and min(cfg.lr_milestones) <= cfg.lr_warmup_epochs:
        raise UsageError(f"--lr-milestones are epochs of the whole run and must come after the "
                         f"--lr-warmup-epochs {cfg.lr_warmup_epochs}, got "
                         f"{' '.join(map(str, cfg.lr_milestones))}")
    if cfg.lr_scheduler == "linear" and cfg.lr_min > cfg.lr and cfg.lr_base is None:
        raise UsageError(f"--lr-scheduler linear falls from --lr to --lr-min: --lr-min "
                         f"({cfg.lr_min}) must not exceed --lr ({cfg.lr})")
    if cfg.pretrained and cfg.weights:
        raise UsageError("give either --pretrained or --weights NAME, not both")
    check_finetune(cfg)
    if cfg.dummy and cfg.demo:
        raise UsageError("--dummy and --demo both choose the data; give one")
    if cfg.num_classes is not None and cfg.num_classes < 1:
        raise UsageError(f"--num-classes must be at least 1, got {cfg.num_classes}")
    if cfg.nproc_per_node is not None and cfg.nproc_per_node < 1:
        raise UsageError(f"--nproc-per-node must be at least 1, got {cfg.nproc_per_node}")
    if cfg.compile_mode != "default" and not cfg.compile:
        raise UsageError(f"--compile-mode {cfg.compile_mode} applies to --compile: add --compile "
                         "(or drop --compile-mode)")
    if cfg.compile and not cfg.fsdp and cfg.bucket_cap_mb < 1:
        # torch's DDPOptimizer requires buckets no smaller than DDP's first one (1 MB).
        raise UsageError(f"--bucket-cap-mb {cfg.bucket_cap_mb:g} with --compile: a compiled DDP "
                         "model needs buckets of at least 1 MB (torch's DDPOptimizer); give "
                         "--bucket-cap-mb 1 or more")
    if cfg.cache_dir is not None and "://" in cfg.cache_dir:
        raise UsageError(f"--cache-dir {cfg.cache_dir}: give a folder (a shared file system "
                         "where a requeued job finds it), or 'none'; object storage is not "
                         "supported for it")
    check_training_controls(cfg)
    check_losses(cfg)
    check_numbers_and_ranks(cfg)
    check_dist_url(cfg.dist_url)
    check_fsdp(cfg)
    check_arch(cfg.arch, cfg.weights, cfg.pretrained)
    check_trackers_installed(cfg.log_to)


def check_training_controls(cfg: Config) -> None:
    """Progressive resizing and --time-limit (docs/training-controls.md)."""
    check_crop_flags(cfg)
    parse_time_limit(cfg.time_limit)


def check_crop_flags(cfg: Config) -> None:
    """UsageError naming the flag when the progressive-resizing flags cannot work together."""
    if (cfg.train_crop_start is None) != (cfg.train_crop_ramp is None):
        given = "--train-crop-start" if cfg.train_crop_start is not None else "--train-crop-ramp"
        raise UsageError(f"{given} needs the other flag of progressive resizing: give "
                         "--train-crop-start PX and --train-crop-ramp START_EPOCH END_EPOCH")
    if cfg.train_crop_start is not None and cfg.train_crop_start <= 0:
        raise UsageError(f"--train-crop-start must be positive, got {cfg.train_crop_start}")
    if cfg.train_crop_ramp is not None:
        first, last = cfg.train_crop_ramp
        if not 0 <= first <= last:
            raise UsageError(f"--train-crop-ramp START_EPOCH END_EPOCH: epochs with 0 <= START "
                             f"<= END, got {first} {last}")


def check_finetune(cfg: Config) -> None:
    """--finetune, --freeze-backbone, --backbone-lr-scale and --class-balanced-loss."""
    if cfg.finetune and (cfg.pretrained or cfg.weights):
        raise UsageError("--finetune PATH and --pretrained/--weights both choose the starting "
                         "weights: give one")
    if cfg.finetune and cfg.evaluate:
        raise UsageError("-e evaluates the weights of --resume PATH (any checkpoint or state "
                         "dict); --finetune starts a training run from PATH: give -e --resume "
                         f"{cfg.finetune}")
    if cfg.freeze_backbone and cfg.backbone_lr_scale != 1.0:
        raise UsageError("--freeze-backbone trains the classifier alone; --backbone-lr-scale "
                         "is for training the whole model: give one")
    if not cfg.backbone_lr_scale > 0:
        raise UsageError(f"--backbone-lr-scale must be positive, got {cfg.backbone_lr_scale} "
                         "(--freeze-backbone keeps the backbone as it is)")
    beta = cfg.class_balanced_loss
    if beta is not None and not 0.0 <= beta <= 1.0:
        raise UsageError(f"--class-balanced-loss BETA must be in [0, 1], got {beta}")


def check_losses(cfg: Config) -> None:
    """--opt lamb/lars, --bce-loss and the distillation flags."""
    if not cfg.lars_trust_coef > 0:
        raise UsageError(f"--lars-trust-coef must be positive, got {cfg.lars_trust_coef}")
    thresh = cfg.bce_target_thresh
    if thresh is not None and not cfg.bce_loss:
        raise UsageError(f"--bce-target-thresh {thresh:g} applies to --bce-loss: add --bce-loss "
                         "(or drop it)")
    if thresh is not None and not 0.0 <= thresh < 1.0:
        raise UsageError(f"--bce-target-thresh must be in [0, 1), got {thresh}")
    if not 0.0 <= cfg.distill_alpha <= 1.0:
        raise UsageError(f"--distill-alpha must be in [0, 1], got {cfg.distill_alpha}")
    if not cfg.distill_temperature > 0:
        raise UsageError(f"--distill-temperature must be positive, got "
                         f"{cfg.distill_temperature}")
    if cfg.distill_teacher_arch and not cfg.distill_teacher:
        raise UsageError("--distill-teacher-arch names the architecture of a --distill-teacher "
                         "file: add --distill-teacher PATH (or drop it)")


def check_numbers_and_ranks(cfg: Config) -> None:
    """NaN or infinite values, and world sizes or ranks that name no process."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise UsageError(f"{f.metadata['names'][0]} must be a finite number, got {value}")
    # -1 is the classic's "not given" (then the launcher decides); 0 would silently train alone.
    if cfg.world_size == 0 or cfg.world_size < -1:
        raise UsageError(f"--world-size must be at least 1 (or left unset), got {cfg.world_size}")
    if cfg.rank < -1:
        raise UsageError(f"--rank must not be negative (or left unset), got {cfg.rank}")
    if cfg.gpu is not None and cfg.gpu < 0:
        raise UsageError(f"--gpu is a CUDA device index (0, 1, ...), got {cfg.gpu}")


def check_dist_url(url: str) -> None:
    """--dist-url must be a rendezvous torch knows: env://, tcp://HOST:PORT or file://PATH."""
    parsed = urlparse(url)
    try:
        port = parsed.port
    except ValueError:  # not a number, or out of range
        port = None
    valid = (url == "env://" or (parsed.scheme == "tcp" and bool(parsed.hostname) and bool(port))
             or (parsed.scheme == "file" and bool(parsed.path)))
    if not valid:
        raise UsageError(f"--dist-url '{url}' is not a rendezvous address: give env:// (the "
                         "launcher's MASTER_ADDR and MASTER_PORT), tcp://HOST:PORT of rank 0, or "
                         "file:///a/shared/file")


def check_fsdp(cfg: Config) -> None:
    """--fsdp and what cannot go with it (or only with it)."""
    only_fsdp = {"--fsdp-zero": cfg.fsdp_zero is not None,
                 "--fsdp-cpu-offload": cfg.fsdp_cpu_offload,
                 "--fsdp-reduce-dtype": cfg.fsdp_reduce_dtype is not None,
                 "--sharded-checkpoint": cfg.sharded_checkpoint}
    given = [name for name, on in only_fsdp.items() if on]
    if given and not cfg.fsdp:
        raise UsageError(f"{given[0]} applies to fully sharded training: add --fsdp "
                         "(or drop it)")
    if cfg.fsdp and cfg.ddp_comm_hook != "none":
        raise UsageError(f"--ddp-comm-hook {cfg.ddp_comm_hook} compresses DDP's gradient "
                         "all-reduce; --fsdp reduce-scatters gradient shards instead and has no "
                         "DDP hooks: drop one (--fsdp-reduce-dtype bf16 halves FSDP's "
                         "gradient bytes)")

