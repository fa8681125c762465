"""What a one-process run does before its first optimizer step: the modules of ``imagenet/`` it
enters, how often it opens the resume checkpoint, builds the argument parser and sets up logging.
Run by hand (not a test)::

    python benchmarks/bench.py start-path            # a fresh run, then its resume
    python benchmarks/bench.py start-path --list     # and the modules, one per line

Each leg runs ``main.py DIR -a resnet18 -j 1 --epochs N`` (one loader worker: the loader starts
early) in a fresh interpreter (``runpy``), on a small JPEG folder it writes, under
``sys.setprofile``: a module counts once the interpreter runs any of its code (its import
included); "with a function called" leaves out modules only imported. The count stops at the
first ``Optimizer.step`` (a global pre-hook raises, and the leg ends there). The second leg
resumes the first's checkpoint with ``--resume``.
Opens count ``open`` of any file named ``*.pth.tar`` in the run folder (``torch.load`` of a path
opens it so); ``argparse.ArgumentParser`` and ``logging.Formatter`` instances made by code of
``imagenet/`` count as parser builds and logging set-ups. ``START_PATH_WHERE=1`` prints where
each happened.
"""

from __future__ import annotations

import argparse
import builtins
import io
import json
import logging
import os
import runpy
import sys
import tempfile
from pathlib import Path

from benchmarks import harness

ROOT = harness.ROOT
PACKAGE = str(ROOT / "imagenet") + os.sep


class FirstStep(BaseException):
    """Raised by the optimizer's pre-hook: the leg is over."""


def write_folder(root: Path) -> Path:
    from PIL import Image

    for split, n in (("train", 8), ("val", 2)):
        for c in range(2):
            folder = root / split / f"class{c}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                Image.new("RGB", (40, 40), (90 * c, 20 * i, 120)).save(folder / f"{i}.jpg")
    return root


def leg(argv: list[str], out: Path) -> dict:

    entered: list[str] = []
    seen: set[str] = set()
    called: set[str] = set()  # a function of it ran (its import alone does not count)
    counts = {"parser builds": 0, "logging set-ups": 0}
    opened: dict[str, int] = {}  # checkpoint file name: times opened

    def profile(frame, event, _arg):
        if event == "call":
            name = frame.f_code.co_filename
            if name.startswith(PACKAGE):
                if name not in seen:
                    seen.add(name)
                    entered.append(name[len(PACKAGE):])
                if frame.f_code.co_name != "<module>":
                    called.add(name[len(PACKAGE):])

    def checkpoint(path) -> bool:
        try:
            p = Path(os.fspath(path))
        except TypeError:
            return False
        return p.name.endswith(".pth.tar") and out in p.resolve().parents

    real_open = builtins.open

    def where() -> None:
        if os.environ.get("START_PATH_WHERE"):
            import traceback

            ours = [f"{f.filename[len(PACKAGE):]}:{f.lineno} {f.name}"
                    for f in traceback.extract_stack() if f.filename.startswith(PACKAGE)]
            print("WHERE " + " > ".join(ours[-4:]), file=sys.stderr)

    def counting_open(file, *args, **kwargs):
        if checkpoint(file):
            name = Path(os.fspath(file)).name
            opened[name] = opened.get(name, 0) + 1
            where()
        return real_open(file, *args, **kwargs)

    parser_init, formatter_init = argparse.ArgumentParser.__init__, logging.Formatter.__init__

    def ours() -> bool:
        return sys._getframe(2).f_code.co_filename.startswith(PACKAGE)

    def parser(self, *args, **kwargs):
        if ours():
            counts["parser builds"] += 1
            where()
        parser_init(self, *args, **kwargs)

    def formatter(self, *args, **kwargs):
        if ours():
            counts["logging set-ups"] += 1
            where()
        formatter_init(self, *args, **kwargs)

    def stop(_optimizer, _args, _kwargs):
        raise FirstStep

    from torch.optim.optimizer import register_optimizer_step_pre_hook

    hook = register_optimizer_step_pre_hook(stop)
    builtins.open = io.open = counting_open
    argparse.ArgumentParser.__init__ = parser
    logging.Formatter.__init__ = formatter
    sys.argv = [str(ROOT / "main.py"), *argv]
    sys.path.insert(0, str(ROOT))
    sys.setprofile(profile)
    try:
        runpy.run_path(str(ROOT / "main.py"), run_name="__main__")
    except FirstStep:
        pass
    finally:
        sys.setprofile(None)
        hook.remove()
        builtins.open = io.open = real_open
        argparse.ArgumentParser.__init__ = parser_init
        logging.Formatter.__init__ = formatter_init
        root = logging.getLogger()
        for handler in list(root.handlers):
            root.removeHandler(handler)
    return {"modules": entered, "called": sorted(called), "opened": opened, **counts}


def in_own_process(argv: list[str], out: Path) -> dict:
    """One leg in a fresh interpreter: every module's import is counted."""
    import subprocess

    got = subprocess.run(harness.child_command("start-path", json.dumps([argv, str(out)])),
                         check=True, capture_output=True, text=True)
    return json.loads(got.stdout.splitlines()[-1])


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The subcommand's flags."""
    ap.add_argument("--list", action="store_true", help="print the modules each leg entered")
    ap.add_argument("-a", "--arch", default="resnet18",
                    help="the architecture of both legs (default: resnet18)")


def child(args: list[str]) -> None:
    """One leg in this process (``in_own_process``): args is ``[json.dumps([argv, out])]``."""
    argv, out = json.loads(args[0])
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    got = leg(argv, Path(out))
    print(json.dumps(got))


def run(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="start_path_"))
    data = write_folder(work / "data")
    out = (work / "run").resolve()
    common = [str(data), "-a", args.arch, "-b", "4", "-j", "1", "--output-dir", str(out)]
    import subprocess

    # The checkpoint the resume leg reads: one whole epoch, in its own process.
    harness.run_main([*common, "--epochs", "1"], check=True, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL)
    fresh = in_own_process([*common, "--epochs", "1", "--output-dir", str(work / "fresh")],
                (work / "fresh").resolve())
    resumed = in_own_process([*common, "--epochs", "2", "--resume",
                              str(out / "checkpoint.pth.tar")], out)
    for name, got in (("fresh run", fresh), ("resume", resumed)):
        shards = [m for m in got["modules"] if m.startswith("data/shards/")]
        print(f"{name}: {len(got['modules'])} modules of imagenet/ entered before the first step "
              f"({len(shards)} of data/shards/), {len(got['called'])} of them with a function "
              f"called; opened: {got['opened'] or 'no checkpoint'}; "
              f"parser built {got['parser builds']}x; logging set up {got['logging set-ups']}x")
        if args.list:
            print("  " + "\n  ".join(m + ("" if m in got["called"] else "  (import only)")
                                      for m in got["modules"]))
