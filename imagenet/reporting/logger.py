"""Console logging, the notes before a run and progress lines, TensorBoard, metrics.jsonl and
config.json - rank-aware.

Rank 0 writes; on the other ranks ``RunLogger`` is a no-op and only warnings reach the console.

Start-up stages that take a while (listing a data set, starting loader workers, the first
batch) say what they are doing once they have lasted a few seconds, and how long they took.

``StartClock`` times each stage of this process's start, from the moment the process started to
the end of its first optimizer step; the trainer prints them in one line at that step and
config.json keeps every start's (``starts``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import os
import platform
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from imagenet.errors import Preempted
from imagenet.settings.choices import tracker_names
from imagenet.settings.flags import DEMO_DEFAULTS, Config

if TYPE_CHECKING:
    from imagenet.reporting.trackers import Trackers


log = logging.getLogger(__name__)

METRICS = "metrics.jsonl"
CONFIG = "config.json"
RUN_IDS = "trackers.json"  # MLflow's and W&B's run ids: {"mlflow": {"run_id": ...}, ...}
# The per-class report (``reporting.results``, imported when one is written): -e, the last epoch.
PER_CLASS_CSV, PER_CLASS_JSON = "per_class.csv", "per_class.json"
CONFUSION_CSV = "confusion_matrix.csv"
REPORTS = (PER_CLASS_CSV, PER_CLASS_JSON, CONFUSION_CSV)  # in OUTPUT_DIR


def console(rank: int, debug: bool = False) -> tuple[logging.Handler, int]:
    """The console's handler and level: rank 0 logs INFO to stdout; other ranks log warnings
    and errors only, tagged, to stderr (--debug: everything)."""
    handler = logging.StreamHandler(sys.stdout if rank == 0 else sys.stderr)
    handler.setFormatter(logging.Formatter(
        "%(message)s" if rank == 0 else f"[rank {rank}] %(levelname)s: %(message)s"))
    return handler, logging.DEBUG if debug else logging.INFO if rank == 0 else logging.WARNING


def setup_logging(rank: int, debug: bool = False) -> None:
    """A process of its own logs to the console (``console``), through the root logger."""
    handler, level = console(rank, debug)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


def _flag(name: str) -> str:
    """The flag of a Config field as a user types it: '-b', '--lr'."""
    field = next(f for f in dataclasses.fields(Config) if f.name == name)
    return field.metadata["names"][0]


def startup_notes(cfg: Config) -> list[str]:
    """What a person reads before a run starts: the demo's own settings, and outputs in the
    current folder (start-up stages that take a while: ``slow_stage``; what a run says
    about itself: ``run.preflight``)."""
    notes = []
    if cfg.demo:
        settings = " ".join(f"{_flag(k)} {getattr(cfg, k)}" for k, v in DEMO_DEFAULTS.items()
                            if getattr(cfg, k) == v)
        notes.append(f"=> --demo: training on the built-in demo data in {cfg.data} (drawn "
                     "once, no download)")
        if settings:
            notes.append(f"=> --demo settings in place of the ImageNet defaults (flags you give "
                         f"win): {settings}")
    if not cfg.evaluate and Path(cfg.output_dir).resolve() == Path.cwd().resolve():
        notes.append(f"=> outputs (checkpoints, metrics.jsonl, config.json, tb/) go to the "
                     f"current folder {Path.cwd()} (--output-dir {cfg.output_dir}); give "
                     "--output-dir DIR to keep runs apart")
    return notes


def _duration(seconds: float) -> str:
    return str(datetime.timedelta(seconds=int(max(seconds, 0))))


def print_train_progress(r: Mapping[str, Any]) -> None:
    """One line like the classic's, plus lr, throughput, data wait and ETAs."""
    width = len(str(r["steps"]))
    mem = f"  mem {r['max_mem_gb']:.1f}G" if "max_mem_gb" in r else ""
    log.info("Epoch: [%d][%*d/%d]  Time %6.3f  Data %6.3f  Loss %.4e (%.4e)  Acc@1 %6.2f  "
             "Acc@5 %6.2f  LR %.3g  %.1f img/s  data-wait %3.0f%%  ETA %s (run %s)%s",
             r["epoch"], width, r["step"], r["steps"], r["batch_time"], r["data_time"],
             r["loss"], r["loss_avg"], r["acc1"], r["acc5"], r["lr"], r["images_per_sec"],
             100 * min(r["data_wait"], 1.0), _duration(r["eta_epoch"]), _duration(r["eta_run"]),
             mem)


def print_val_progress(r: Mapping[str, Any], ranks: int = 1) -> None:
    """The classic's 'Test:' line: this rank's shard so far, labelled so when there are others
    (the job's numbers are the ' * Acc@1' line at the end)."""
    width = len(str(r["batches"]))
    shard = f"  (rank 0 only, 1 of {ranks} ranks; the * line is the job's)" if ranks > 1 else ""
    log.info("Test: [%*d/%d]  Time %6.3f  Acc@1 %6.2f  Acc@5 %6.2f%s", width, r["batch"],
             r["batches"], r["batch_time"], r["acc1"], r["acc5"], shard)


def git_commit() -> str | None:
    """The commit of the code that runs, when it is a git checkout."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent,
                             capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def environment() -> dict[str, Any]:
    """Versions that explain a run later."""
    import torchvision

    return {"torch": torch.__version__, "torchvision": torchvision.__version__,
            "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version()
            if torch.backends.cudnn.is_available() else None,
            "python": platform.python_version(), "git_commit": git_commit()}


def _epoch_of(line: str) -> float:
    """The epoch of a metrics.jsonl line (damaged lines sort last, so they are dropped)."""
    try:
        return float(json.loads(line)["epoch"])
    except (ValueError, KeyError, TypeError):
        return float("inf")


def preload_writers(log_to: str, main_rank: bool) -> None:
    """Import TensorBoard's writer now if this process will write events (rank 0): the
    import takes a second or two, and the start-up does it while Ctrl-C is held back."""
    if main_rank and "tensorboard" in tracker_names(log_to):
        import torch.utils.tensorboard  # noqa: F401


def quiet_tensorboard_write_errors() -> None:
    """TensorBoard writes events in a thread of its own; when that write fails (the disk full,
    the folder gone) the thread prints a traceback and the next ``add_scalar`` raises the same
    error in the training thread, which ends the run with one line. Keep the thread quiet."""
    previous = threading.excepthook
    if getattr(previous, "quiets_tensorboard", False):
        return

    def hook(args: threading.ExceptHookArgs) -> None:
        if issubclass(args.exc_type, OSError) and \
                type(args.thread).__name__ == "_AsyncWriterThread":
            log.debug("TensorBoard's writer thread: %s", args.exc_value)
            return
        previous(args)

    hook.quiets_tensorboard = True  # type: ignore[attr-defined]
    threading.excepthook = hook


class RunLogger:
    """Writes metrics on rank 0 (and to the --log-to trackers); a no-op on the others.

    As a context manager it tells the trackers how the run ended (finished, stopped, failed).
    """

    def __init__(self, output_dir: Path, enabled: bool, purge_step: int | None = None,
                 log_to: str = "tensorboard", continues: bool = True) -> None:
        """``continues``: the trackers continue OUTPUT_DIR's runs (trackers.json); -e starts
        runs of its own."""
        self.enabled = enabled
        self.output_dir = output_dir
        self._tb = None
        self._trackers: Trackers | None = None  # MLflow and W&B: imported when --log-to names one
        if enabled and any(name != "tensorboard" for name in tracker_names(log_to)):
            from imagenet.reporting.trackers import open_trackers

            self._trackers = open_trackers(log_to, output_dir, output_dir / RUN_IDS, continues)
        if enabled and "tensorboard" in tracker_names(log_to):
            from torch.utils.tensorboard import SummaryWriter

            # purge_step drops events a killed run wrote after its checkpoint, so a resumed
            # run continues the curves without duplicate or backwards steps.
            quiet_tensorboard_write_errors()
            self._tb = SummaryWriter(str(output_dir / "tb"), purge_step=purge_step)

    def write_config(self, config: Mapping[str, Any], extra: Mapping[str, Any]) -> None:
        """config.json: the resolved flags plus derived values and versions, and the earlier
        starts of the run it continues (``record_start``; a fresh run moved its folder's
        earlier config.json aside)."""
        if self.enabled:
            payload = {"config": dict(config), **extra, "environment": environment(),
                       "starts": self._starts()}
            self._write_json(CONFIG, payload)
            simple = {k: v for k, v in extra.items() if isinstance(v, (int, float, str, bool))}
            self._track("config", {**config, **simple})

    def tracked_config(self, config: Mapping[str, Any]) -> None:
        """The flags to the trackers alone (-e: config.json stays the training run's)."""
        if self.enabled:
            self._track("config", config)

    def record_start(self, start: Mapping[str, Any]) -> None:
        """Add this start's record (time to its first step, its stages) to config.json's
        ``starts``: one per start of the run, requeues and restarts included."""
        if not self.enabled:
            return
        try:
            payload = json.loads((self.output_dir / CONFIG).read_text())
        except (OSError, ValueError):
            return  # no config.json of this start to add to
        payload["starts"] = [*self._starts(payload), dict(start)]
        self._write_json(CONFIG, payload)

    def _starts(self, payload: Mapping[str, Any] | None = None) -> list[Any]:
        """The starts config.json records so far (none when it is missing or damaged)."""
        if payload is None:
            try:
                payload = json.loads((self.output_dir / CONFIG).read_text())
            except (OSError, ValueError):
                return []
        starts = payload.get("starts") if isinstance(payload, dict) else None
        return list(starts) if isinstance(starts, list) else []

    def _write_json(self, name: str, payload: Mapping[str, Any]) -> None:
        """Replace ``name`` in the output folder whole (a temporary file renamed)."""
        tmp = self.output_dir / f".{name}.tmp"
        tmp.write_text(json.dumps(payload, indent=2) + "\n")
        tmp.replace(self.output_dir / name)

    def scalars(self, prefix: str, values: Mapping[str, float], step: int) -> None:
        """TensorBoard scalars ``prefix/name`` at ``step``."""
        if self._tb is not None:
            for name, value in values.items():
                self._tb.add_scalar(f"{prefix}/{name}", value, step)
        self._track("scalars", {f"{prefix}/{name}": v for name, v in values.items()}, step)

    def epoch(self, record: Mapping[str, Any]) -> None:
        """One line in metrics.jsonl per epoch (cheap to grep and plot)."""
        if self.enabled:
            with open(self.output_dir / METRICS, "a") as f:
                f.write(json.dumps(record) + "\n")

    def has_epoch(self, epoch: int) -> bool:
        """Whether metrics.jsonl has a line for ``epoch`` (True off rank 0: nothing to write)."""
        path = self.output_dir / METRICS
        if not self.enabled:
            return True
        return path.is_file() and any(_epoch_of(line) == epoch
                                      for line in path.read_text().splitlines())

    def drop_epochs_from(self, epoch: int) -> None:
        """Remove metrics.jsonl lines of ``epoch`` and later: this run writes them again."""
        path = self.output_dir / METRICS
        if not self.enabled or not path.is_file():
            return
        lines = path.read_text().splitlines(keepends=True)
        kept = [line for line in lines if _epoch_of(line) < epoch]
        if len(kept) != len(lines):
            tmp = path.with_name(f".{METRICS}.tmp")
            tmp.write_text("".join(kept))
            tmp.replace(path)

    def images(self, tag: str, grid: torch.Tensor, step: int) -> None:
        """An image grid (e.g. augmented training samples)."""
        if self._tb is not None:
            self._tb.add_image(tag, grid, step)

    def hparams(self, hparams: Mapping[str, Any], metrics: Mapping[str, float],
                step: int) -> None:
        """The hyper-parameters next to the final metrics (at the run's last step)."""
        if self._tb is not None:
            clean = {k: (v if isinstance(v, (int, float, str, bool)) else str(v))
                     for k, v in hparams.items()}
            self._tb.add_hparams(clean, dict(metrics), run_name=".", global_step=step)
        self._track("final", {k.split("/")[-1]: v for k, v in metrics.items()}, step)

    def progress_hook(self) -> Callable[[dict], None] | None:
        """The engine's ``on_progress``: the step scalars in TensorBoard, on disk before the
        progress line (its images/s: all ranks, over the record's own window) is printed; None
        off rank 0. TensorBoard's writer thread would otherwise hold them for a while: a kill
        after a checkpoint lost the steps it covers, and the resume continues after them."""
        if not self.enabled:
            return None

        def on_progress(record: dict) -> None:
            self.scalars("step", {k: record[k] for k in ("loss", "lr", "images_per_sec",
                                                          "data_wait")}, record["global_step"])
            self.flush()
            print_train_progress(record)

        return on_progress

    def flush(self) -> None:
        """Push buffered events to disk."""
        if self._tb is not None:
            self._tb.flush()

    def close(self, status: str = "finished") -> None:
        """Flush and close the TensorBoard writer; end the trackers' runs with ``status``."""
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        self._track("close", status)

    def _track(self, method: str, *args: Any) -> None:
        """Call ``method`` of the open trackers (``reporting.trackers.Trackers``), if any."""
        if self._trackers is not None:
            getattr(self._trackers, method)(*args)

    def __enter__(self) -> RunLogger:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        stopped = kind is not None and issubclass(kind, (Preempted, KeyboardInterrupt))
        self.close("finished" if kind is None else "stopped" if stopped else "failed")


# ----------------------------------------- start-up stages: what they do and how long they took

# A start-up stage that lasts longer than this says what it is doing (seconds). 0 shows every
# stage: useful to see where a start-up hangs.
NOTICE_AFTER_ENV = "IMAGENET_NOTICE_AFTER"
NOTICE_AFTER_DEFAULT = 5.0


def notice_after() -> float:
    """Seconds a start-up stage may take before it says what it does."""
    value = os.environ.get(NOTICE_AFTER_ENV, "")
    try:
        return float(value) if value else NOTICE_AFTER_DEFAULT
    except ValueError:
        return NOTICE_AFTER_DEFAULT


@dataclass
class Stage:
    """A start-up stage: ``done`` is printed at its end if its start was (the slow case)."""

    what: str
    done: str = ""
    announced: bool = False


@contextlib.contextmanager
def slow_stage(what: str) -> Iterator[Stage]:
    """Say '=> WHAT ...' once the body has run for ``notice_after()`` seconds, and then
    ``stage.done`` with the time when it ends; a fast body prints nothing."""
    stage, start, after = Stage(what), time.perf_counter(), notice_after()

    def announce() -> None:
        stage.announced = True
        log.info("=> %s ...", stage.what)

    timer = threading.Timer(after, announce)
    timer.daemon = True
    if after <= 0:
        announce()
    else:
        timer.start()
    try:
        yield stage
    finally:
        timer.cancel()
        if timer.is_alive():
            timer.join()  # an announcement under way is printed before the end line
    if stage.announced and stage.done:
        log.info("=> %s (%.1f s)", stage.done, time.perf_counter() - start)


class FirstBatch:
    """``loader``'s batches; starting its workers and waiting for its first batch are stages.
    ``iter()`` starts the loader at once (its workers begin to prefetch); the first ``next()``
    waits for the first batch."""

    def __init__(self, loader: Iterable, workers: int, name: str) -> None:
        self.loader, self.workers, self.name = loader, workers, name

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator:
        with slow_stage(f"starting the {self.name} loader ({self.workers} worker process(es))"
                        if self.workers else f"starting the {self.name} loader") as stage:
            batches = iter(self.loader)
            stage.done = f"{self.name} loader started"
        return _FirstWaited(batches, self.name)


class _FirstWaited:
    """An iterator whose first batch is a start-up stage."""

    def __init__(self, batches: Iterator, name: str) -> None:
        self.batches, self.name, self.first = batches, name, True

    def __iter__(self) -> _FirstWaited:
        return self

    def __next__(self):
        if not self.first:
            return next(self.batches)
        self.first = False
        with slow_stage(f"waiting for the first {self.name} batch (reading and decoding its "
                        "images)") as stage:
            batch = next(self.batches)  # StopIteration: an empty loader
            stage.done = f"first {self.name} batch ready"
        return batch


# The stages, in order, and how the start-up line names them.
STAGES = {"start": "Python, imports and joining the ranks", "data": "data set",
          "model": "model", "resume": "checkpoint", "checks": "checks and logs",
          "first_step": "first step"}


@dataclass
class StartClock:
    """The seconds each stage of this start took (see ``STAGES``)."""

    started: float  # unix time the process started (the plan's)
    seconds: dict[str, float] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)  # a word on a stage: "folder index"
    last: float = field(default_factory=time.perf_counter)
    done: bool = False

    @classmethod
    def begin(cls, started: float) -> StartClock:
        """The clock of a start whose process started at ``started`` (unix time)."""
        clock = cls(started)
        clock.seconds["start"] = max(time.time() - started, 0.0)
        return clock

    def mark(self, stage: str, note: str = "") -> None:
        """``stage`` ends now (it began when the previous one ended)."""
        now = time.perf_counter()
        self.seconds[stage] = self.seconds.get(stage, 0.0) + now - self.last
        self.last = now
        if note:
            self.notes[stage] = note

    def first_step(self) -> dict[str, Any] | None:
        """Call after each step: at the first, the start's record (else None)."""
        if self.done:
            return None
        self.done = True
        self.mark("first_step")
        return {"started": datetime.datetime.fromtimestamp(self.started).isoformat(
                    timespec="seconds"),
                "time_to_first_step_s": round(time.time() - self.started, 3),
                "stages_s": {k: round(v, 3) for k, v in self.seconds.items()},
                "notes": dict(self.notes)}

    @staticmethod
    def line(record: dict[str, Any]) -> str:
        """The start-up line of a start's record."""
        parts = []
        for stage, seconds in record["stages_s"].items():
            note = record["notes"].get(stage)
            parts.append(f"{STAGES.get(stage, stage)} {seconds:.1f} s"
                         + (f" ({note})" if note else ""))
        return (f"=> first step {record['time_to_first_step_s']:.1f} s after the process "
                f"started: {', '.join(parts)}")
