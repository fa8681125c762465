"""The trainer's benchmarks: one command, a subcommand per measurement. Run by hand (not tests)::

    python benchmarks/bench.py                        # the list of subcommands
    python benchmarks/bench.py SUBCOMMAND --help      # what it measures, how, and its flags
    python benchmarks/bench.py data --num-images 50   # e.g. the data pipeline, per core

Each subcommand lives in benchmarks/cases/ and is imported only when it runs; what they share
(timing, the table, running main.py and reading its metrics.jsonl) is benchmarks/harness.py.
Two need a setup of their own and stay apart: benchmarks/bench_comm.py (two network namespaces,
as root) and benchmarks/gpu_smoke.py (a GPU node).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from pathlib import Path

if str(Path(__file__).resolve().parents[1]) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import harness  # noqa: E402

# subcommand: what it measures (the module is benchmarks/cases/<subcommand, - as _>.py)
CASES = {
    "speed": "the data pipeline, the train step and one end-to-end epoch, side by side",
    "data": "the data pipeline per core: classic PIL vs ours vs decode alone",
    "train-step": "the train step: fp32 / channels_last / bf16 / both, next to the plain loop",
    "e2e": "one main.py epoch on a JPEG folder: the classic settings vs ours",
    "val-parity": "validation top-1 of the tensor path against the PIL path, same model",
    "val-check": "the validation image check before training vs decoding the images",
    "decoders": "torchvision's decode_jpeg vs TorchCodec's on the same JPEGs",
    "distributed": "DDP overhead: 1 process vs 2 at the same global batch; one all-reduce",
    "checkpoint": "what --save-every costs: checkpoint size, write time, step time",
    "async-save": "the steps that overlap a background save to slow storage",
    "restart": "time to the first step, cold start vs requeued start",
    "start-path": "what a run does before its first step: modules entered, files opened",
    "shards": "tar shards vs ImageFolder: per core, first batch, resume, over a shaped link",
    "parquet": "Hugging Face Parquet vs tar shards: per core, accuracy, the row check",
    "fsdp-memory": "--fsdp against DDP: memory per process, and a cap only FSDP fits under",
    "fsdp-step": "--fsdp against DDP: step time, and where FSDP's time goes",
    "progressive": "--compile with progressive resizing: graphs and step time per crop size",
    "finetune": "--finetune against training from scratch on a small data set",
}


def case_module(name: str):
    """The module of subcommand ``name`` (benchmarks/cases/)."""
    return importlib.import_module(f"benchmarks.cases.{name.replace('-', '_')}")


def get_parser(selected: str | None = None) -> argparse.ArgumentParser:
    """The command line; only the ``selected`` subcommand's module is imported for its flags."""
    parser = argparse.ArgumentParser(
        prog="bench.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="case", metavar="SUBCOMMAND", required=True,
                                help="the measurement (SUBCOMMAND --help says more)")
    parser.cases = {}  # subcommand: its parser
    for name, summary in CASES.items():
        case = parser.cases[name] = sub.add_parser(
            name, help=summary, description=summary,
            formatter_class=argparse.RawDescriptionHelpFormatter)
        if name == selected:
            module = case_module(name)
            case.description = module.__doc__
            module.add_arguments(case)
    return parser


def selected_case(argv: Sequence[str]) -> str | None:
    """The subcommand named on the command line (the first word that is not a flag)."""
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the subcommand on the command line (or a case's helper process); its exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == [harness.CHILD]:  # a case's helper process (harness.child_command)
        return case_module(argv[1]).child(argv[2:]) or 0
    parser = get_parser(selected_case(argv))
    if not argv:
        parser.print_help()
        return 0
    args, rest = parser.parse_known_args(argv)
    module, case_parser = case_module(args.case), parser.cases[args.case]
    if hasattr(module, "check_args"):
        module.check_args(args, case_parser)
    if rest and not getattr(module, "PASSES_FLAGS_TO_MAIN", False):
        case_parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.main_args = [a for a in rest if a != "--"]
    args.argv = argv  # the command line, for a case that starts itself again
    return module.run(args) or 0


if __name__ == "__main__":
    sys.exit(main())
