"""``python -m imagenet.tools.unshard DIR [FILE]``: a --sharded-checkpoint directory -> the classic
single-file checkpoint (what --fsdp writes without --sharded-checkpoint).

The result loads into a plain torchvision model (``torch.load(FILE)["state_dict"]``), ``main.py -e
--resume FILE``, and DDP or --fsdp runs at any world size. It needs the whole state in this host's
memory once, and no process group.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from imagenet.errors import CheckpointError, TrainerError, UsageError, report


def get_args_parser() -> argparse.ArgumentParser:
    """The tool's flags."""
    parser = argparse.ArgumentParser(
        prog="python -m imagenet.tools.unshard",
        description="Turn a checkpoint directory written with --sharded-checkpoint into the "
                    "classic single file.")
    parser.add_argument("checkpoint", metavar="DIR",
                        help="the directory, e.g. runs/vit/checkpoint.dcp or model_best.dcp")
    parser.add_argument("output", nargs="?", metavar="FILE",
                        help="the file to write (default: next to DIR, .dcp -> .pth.tar)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Convert; 0 on success, the error's exit code otherwise."""
    args = get_args_parser().parse_args(argv)
    src = Path(args.checkpoint)
    dst = Path(args.output) if args.output else src.with_name(
        src.name.removesuffix(".dcp") + ".pth.tar")
    try:
        from imagenet.checkpoint import sharded

        src = checked_source(src)
        check_output(src, dst)
        state = sharded.to_single_file(src, dst)
    except TrainerError as exc:
        return report(exc)
    except OSError as exc:  # the output could not be written (permissions, a vanished mount)
        return report(CheckpointError(f"cannot write {exc.filename or dst}: "
                                      f"{exc.strerror or exc}"))
    print(f"wrote {dst} (epoch {state.get('epoch')}, step {state.get('step_in_epoch', 0)}, "
          f"best Acc@1 {state.get('best_acc1', 0.0):.3f})")
    return 0


def checked_source(src: Path) -> Path:
    """``src`` if it is a whole checkpoint directory (or the one a kill left aside, said)."""
    from imagenet.checkpoint import files

    if src.is_dir() and not files.is_checkpoint_dir(src) and not files.aside(src).exists():
        raise UsageError(f"{src} is not a checkpoint directory written with "
                         f"--sharded-checkpoint (no {files.SHARDED_META} in it)")
    found = files.existing_dir(src, fix="it cannot be converted; give another checkpoint "
                                        "directory (an earlier run's are in previous/)")
    if found is None:
        raise UsageError(f"{src} does not exist: give a checkpoint directory written with "
                         "--sharded-checkpoint, e.g. OUTPUT_DIR/checkpoint.dcp")
    return found


def check_output(src: Path, dst: Path) -> None:
    """The output must be a file in a folder that exists, and not the directory itself."""
    if dst.resolve() == src.resolve():
        raise UsageError(f"the output {dst} is the directory itself: give another FILE")
    if dst.is_dir():
        raise UsageError(f"the output {dst} is a folder: give a file name, e.g. "
                         f"{dst / src.name.removesuffix('.dcp')}.pth.tar")
    if not dst.parent.is_dir():
        raise UsageError(f"the output's folder {dst.parent} does not exist: create it or give "
                         "another FILE")


if __name__ == "__main__":
    sys.exit(main())
