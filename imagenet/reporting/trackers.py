"""Experiment trackers (--log-to): MLflow and Weights & Biases beside TensorBoard.

Rank 0's ``RunLogger`` hands every tracker what TensorBoard gets: the step and epoch scalars at
the global step, the flags at start, the final metrics at the end. Each tracker's package is
imported only when --log-to names it. A run that continues OUTPUT_DIR's record (a resume from one
of its checkpoints) continues the same tracker runs: their ids are kept in OUTPUT_DIR/trackers.json,
which a fresh run moves to previous/ with the rest of the record, so it starts new ones.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from imagenet.errors import RunError, first_line
from imagenet.settings.choices import install_hint, tracker_names

log = logging.getLogger(__name__)

# close(status): how the run ended, in each tracker's words.
MLFLOW_STATUS = {"finished": "FINISHED", "stopped": "KILLED", "failed": "FAILED"}
WANDB_EXIT_CODE = {"finished": 0, "stopped": 143, "failed": 1}


class Tracker(Protocol):
    """What rank 0's RunLogger calls on each tracker."""

    run_id: str

    def config(self, config: Mapping[str, Any]) -> None: ...

    def scalars(self, values: Mapping[str, float], step: int) -> None: ...

    def final(self, metrics: Mapping[str, float], step: int) -> None: ...

    def close(self, status: str) -> None: ...


class MLflowTracker:
    """An MLflow run at MLFLOW_TRACKING_URI (MLflow's default without it), in the experiment of
    MLFLOW_EXPERIMENT_NAME / MLFLOW_EXPERIMENT_ID (else MLflow's Default)."""

    def __init__(self, run_id: str | None, run_name: str) -> None:
        import mlflow

        self._mlflow = mlflow
        run = None
        if run_id is not None:
            try:
                run = mlflow.start_run(run_id=run_id)
            except mlflow.exceptions.MlflowException as exc:
                log.warning("MLflow run %s cannot be continued at %s (%s): starting a new one",
                            run_id, mlflow.get_tracking_uri(), str(exc).splitlines()[0])
        if run is None:
            run = mlflow.start_run(run_name=run_name)
        self.run_id = run.info.run_id
        self._params = dict(run.data.params)  # a continued run's; MLflow params never change
        log.info("=> MLflow run %s (%s) at %s", self.run_id,
                 "continued" if run_id == self.run_id else "new", mlflow.get_tracking_uri())

    def config(self, config: Mapping[str, Any]) -> None:
        """The flags as params; a continued run's changed flags as tags ``changed.NAME``."""
        params = {k: str(v) for k, v in config.items()}
        new = {k: v for k, v in params.items() if k not in self._params}
        if new:
            self._mlflow.log_params(new)
        for key, value in params.items():
            if key in self._params and self._params[key] != value:
                self._mlflow.set_tag(f"changed.{key}", f"{self._params[key]} -> {value}")
        self._params.update(new)

    def scalars(self, values: Mapping[str, float], step: int) -> None:
        self._mlflow.log_metrics(dict(values), step=step)

    def final(self, metrics: Mapping[str, float], step: int) -> None:
        self._mlflow.log_metrics({f"final/{k}": v for k, v in metrics.items()}, step=step)

    def close(self, status: str) -> None:
        self._mlflow.end_run(status=MLFLOW_STATUS[status])


class WandbTracker:
    """A W&B run (WANDB_PROJECT / WANDB_ENTITY / WANDB_MODE as usual); its local files go to
    WANDB_DIR, else OUTPUT_DIR. Charts use the global step as their x axis ("global_step"): W&B's
    own step only grows, and a resume repeats the steps after its checkpoint."""

    def __init__(self, run_id: str | None, run_name: str, output_dir: Path) -> None:
        import wandb

        self._run = wandb.init(id=run_id, resume="allow" if run_id else None, name=run_name,
                               dir=None if os.environ.get("WANDB_DIR") else str(output_dir))
        self.run_id = self._run.id
        self._run.define_metric("global_step")
        self._run.define_metric("*", step_metric="global_step")
        log.info("=> W&B run %s (%s)", self.run_id,
                 "continued" if run_id == self.run_id else "new")

    def config(self, config: Mapping[str, Any]) -> None:
        self._run.config.update(dict(config), allow_val_change=True)

    def scalars(self, values: Mapping[str, float], step: int) -> None:
        self._run.log({**values, "global_step": step})

    def final(self, metrics: Mapping[str, float], step: int) -> None:
        self._run.summary.update({f"final/{k}": v for k, v in metrics.items()})

    def close(self, status: str) -> None:
        if status == "stopped":
            self._run.mark_preempting()
        self._run.finish(exit_code=WANDB_EXIT_CODE[status])


def saved_run_ids(path: Path) -> dict[str, str]:
    """The tracker run ids recorded in ``path``, OUTPUT_DIR/trackers.json ({} for a fresh
    record)."""
    try:
        saved = json.loads(path.read_text())
        return {name: str(entry["run_id"]) for name, entry in saved.items()}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning("cannot read %s (%s): the trackers start new runs", path, exc)
        return {}


def save_run_ids(path: Path, trackers: Mapping[str, Tracker]) -> None:
    """``path``, OUTPUT_DIR/trackers.json, written atomically; keeps ids of trackers not used
    now."""
    saved = {name: {"run_id": run_id} for name, run_id in saved_run_ids(path).items()}
    saved.update({name: {"run_id": t.run_id} for name, t in trackers.items()})
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(saved, indent=2) + "\n")
    tmp.replace(path)


class Trackers:
    """The open trackers, called together. One that fails to log warns once and is skipped
    from then on: a tracker's server going away must not end a long training run."""

    def __init__(self, opened: Mapping[str, Tracker]) -> None:
        self._open = dict(opened)

    def config(self, config: Mapping[str, Any]) -> None:
        self._each("config", config)

    def scalars(self, values: Mapping[str, float], step: int) -> None:
        self._each("scalars", values, step)

    def final(self, metrics: Mapping[str, float], step: int) -> None:
        self._each("final", metrics, step)

    def close(self, status: str) -> None:
        self._each("close", status)
        self._open.clear()

    def _each(self, method: str, *args: Any) -> None:
        for name, tracker in list(self._open.items()):
            try:
                getattr(tracker, method)(*args)
            except Exception as exc:
                log.warning("--log-to %s stopped working (%s); training goes on without it "
                            "(metrics.jsonl has every epoch)", name, first_line(exc))
                del self._open[name]


def open_trackers(log_to: str, output_dir: Path, run_ids_file: Path,
                  continues: bool = True) -> Trackers:
    """Start (or continue) the MLflow and W&B runs --log-to asks for; rank 0 only. Their ids
    are kept in ``run_ids_file`` (OUTPUT_DIR/trackers.json). ``continues=False`` (-e): new runs
    named OUTPUT_DIR-eval, not recorded there (the training run's record stays as it is)."""
    names = [n for n in tracker_names(log_to) if n != "tensorboard"]
    run_ids = saved_run_ids(run_ids_file) if names and continues else {}
    run_name = output_dir.resolve().name + ("" if continues else "-eval")
    opened: dict[str, Tracker] = {}
    try:
        for name in names:
            opened[name] = start_tracker(name, run_ids.get(name), run_name, output_dir)
    except BaseException:
        Trackers(opened).close("failed")
        raise
    if opened and continues:
        save_run_ids(run_ids_file, opened)
    return Trackers(opened)


def start_tracker(name: str, run_id: str | None, run_name: str, output_dir: Path) -> Tracker:
    """One tracker's run, new or continued; a failure to start is one RunError line."""
    try:
        if name == "mlflow":
            return MLflowTracker(run_id, run_name)
        return WandbTracker(run_id, run_name, output_dir)
    except ImportError as exc:
        raise RunError(f"{install_hint(name)} ({exc})") from None
    except Exception as exc:  # a server that cannot be reached, a bad URI, no credentials
        raise RunError(f"--log-to {name}: cannot start the run ({first_line(exc)})") from None


