"""How the epoch loop stops: a signal, --time-limit or the loss of the launcher, agreed by every
rank (``launching.preemption.StopFlag``), the state saved, and one error for all of it (exit 143,
or the time limit's code); with --compile, the graphs compiled so far kept for the restart.

``Stop`` is asked at the four points where a loop can stop: before an epoch whose new crop size
would compile graphs the time left does not cover, after a step (the engine's ``after_step``:
``checkpointing.Checkpointer``), during a validation and after an epoch's save. Each raises
``StopRequested`` with where it stopped; the loop turns it into the one error (``Stop.exit``).
--compile's upkeep between steps is here too (each epoch's graphs compiled and loaded from the
cache; what was compiled kept, as a stop keeps it).
"""

from __future__ import annotations

from typing import Any

from imagenet.errors import Preempted
from imagenet.launching.preemption import StopFlag, StopRequested
from imagenet.run.build import Run
from imagenet.run.checkpointing import finish_saves
from imagenet.run.preflight import checkpoint_bytes
from imagenet.training.models import graphs_compiled, new_graphs


class Stop:
    """The epoch loop's stop (signals, --time-limit) and --compile's upkeep; ``exit`` is the one
    way out of a stopped run. Installed as a context (the signal handlers put back on leaving)."""

    def __init__(self, run: Run) -> None:
        deadline = None
        if run.plan.time_limit is not None:  # --time-limit
            import imagenet.launching.timelimit as timelimit

            deadline = timelimit.deadline(run.plan.time_limit, run.dist.is_main,
                                          lambda: sum(checkpoint_bytes(run)))
        self.run, self.flag = run, StopFlag(deadline)
        self.crops_seen: set[int | None] = set()  # a crop size's first epoch compiles its graphs
        self.new_crop, self.graphs, self.cached = False, 0, {}  # at the epoch's start

    def __enter__(self) -> Stop:
        self.flag.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.flag.uninstall()

    def before_epoch(self, crop_px: int | None) -> None:
        """The graphs compiled so far counted; StopRequested when --compile's new crop size
        (``crop_px``) would compile graphs the time left does not cover."""
        run = self.run
        self.graphs = graphs_compiled() if run.cfg.compile else 0
        self.cached = cache_counts(run)
        self.new_crop = crop_px not in self.crops_seen
        if run.cfg.compile and self.new_crop and self.crops_seen and \
                self.flag.settle(compiles=True):
            raise StopRequested("before")  # no time to compile the new size's graphs
        self.crops_seen.add(crop_px)

    def after_training(self) -> None:
        """StopRequested when a signal stopped training (every rank saved this step's state)."""
        if self.flag.stopping:
            raise StopRequested("")

    def after_validation(self, record: dict[str, Any]) -> None:
        """--compile: the epoch's graphs compiled and loaded from the cache into ``record``, and
        what was compiled kept for the restarts."""
        run = self.run
        if run.cfg.compile:  # in the first epoch only (compiling); a warning otherwise
            record["compiled_graphs"] = new_graphs(self.graphs, run.step.epoch,
                                                   expected=self.new_crop)
            record.update(compile_cache_counts(self.cached, cache_counts(run)))
            keep_compiled(run)

    def after_save(self) -> None:
        """StopRequested when a signal came during the epoch's save (the epoch is saved)."""
        if self.flag.settle():
            raise StopRequested("after")

    def exit(self, when: str = "") -> Preempted:
        """The error that ends the stopped run (``stopped``); ``when``: where the loop stopped
        ("" at a step, "before", "during the validation of" or "after" the epoch)."""
        return stopped(self.run, self.flag, when)


def stopped(run: Run, stop: StopFlag, when: str = "") -> Preempted:
    """The error that ends a run stopped by a signal, once its state is on disk (every rank
    stops together: the last agreement is finished, ``finish_saves`` waits for the write under
    way) and, with --compile, the graphs compiled so far are kept for the restart."""
    stop.drain()
    keep_compiled(run)
    finish_saves(run)
    where = f"{when} epoch {run.step.epoch}" if when else \
        f"at epoch {run.step.epoch} step {run.step.step_in_epoch}"
    if stop.by_time_limit:
        from imagenet.launching.timelimit import reached

        return reached(where, run.output_dir, stop.deadline)
    return Preempted(f"stopped by {stop.reason} {where}; "
                     f"checkpoint saved in {run.output_dir}; resume with --resume auto")


def keep_compiled(run: Run) -> None:
    """--compile: keep what was compiled since the last time for the restarts (rank 0; between
    steps, where nothing is being compiled)."""
    if run.compile_cache is not None:
        run.compile_cache.save_if_compiled(run.plan.crops.size(run.step.epoch))


def cache_counts(run: Run) -> dict[str, int]:
    """--compile: inductor's cache hits and misses so far ({} without --compile)."""
    if not run.cfg.compile:
        return {}
    from imagenet.training.compile_cache import graph_cache_counts

    return graph_cache_counts()


def compile_cache_counts(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """An epoch's graphs loaded from the compile cache and compiled (inductor's counts)."""
    return {"compile_cache_hits": after["hits"] - before["hits"],
            "compile_cache_misses": after["misses"] - before["misses"]}
