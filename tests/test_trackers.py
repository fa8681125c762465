"""--log-to mlflow,wandb: the scalars TensorBoard gets, the flags and the final metrics, read back
from a local MLflow file store and W&B's offline run files; a resume continues the same runs, a
fresh run in the used folder starts new ones; missing packages are one line."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT, TINY18, child_env, run_main, write_image_folder

from imagenet.reporting.logger import RUN_IDS
from imagenet.reporting.trackers import Trackers

STEPS_PER_EPOCH = 3  # 24 training images, -b 8


@pytest.fixture(scope="module")
def tracked(tmp_path_factory) -> dict:
    """Epoch 1 with TensorBoard, MLflow and W&B; a resume for epoch 2; then a fresh run in the
    same folder with MLflow only."""
    base = tmp_path_factory.mktemp("trackers")
    data = write_image_folder(base / "data")
    out = base / "out"
    env = child_env(MLFLOW_TRACKING_URI=f"file:{base / 'mlruns'}", MLFLOW_ALLOW_FILE_STORE="true",
                    WANDB_MODE="offline", WANDB_DIR=str(base / "wandb"), WANDB_SILENT="true")
    common = [str(data), *TINY18, "-p", "1", "--output-dir", str(out), "--model-ema"]
    runs = []
    for extra in (["--epochs", "1", "--log-to", "tensorboard,mlflow,wandb"],
                  ["--epochs", "2", "--log-to", "tensorboard,mlflow,wandb", "--resume", "auto"],
                  ["--epochs", "1", "--log-to", "mlflow"]):
        proc = run_main(*common, *extra, env=env)
        assert proc.returncode == 0, proc.stderr
        runs.append(proc)
    first = next((out / "previous").iterdir())  # runs 1-2's record, moved aside by run 3
    return {"base": base, "out": out, "first": first, "runs": runs,
            "ids": json.loads((first / RUN_IDS).read_text()),
            "fresh_ids": json.loads((out / RUN_IDS).read_text())}


def _mlflow_client(base: Path, monkeypatch: pytest.MonkeyPatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 deprecates file stores
    return MlflowClient(tracking_uri=f"file:{base / 'mlruns'}")


def _tensorboard_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.mark.slow
def test_mlflow_logs_what_tensorboard_gets_and_a_resume_continues_the_run(tracked, monkeypatch):
    client = _mlflow_client(tracked["base"], monkeypatch)
    run_id = tracked["ids"]["mlflow"]["run_id"]
    assert f"MLflow run {run_id} (new)" in tracked["runs"][0].stdout
    assert f"MLflow run {run_id} (continued)" in tracked["runs"][1].stdout
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    tensorboard = _tensorboard_scalars(tracked["first"] / "tb")
    scalars = {k for k in run.data.metrics if not k.startswith("final/")}
    assert scalars == {k for k in tensorboard if not k.startswith("hparam/")}
    for tag in ("step/loss", "epoch/val/acc1", "epoch/ema_val/acc1"):
        history = {m.step: m.value for m in client.get_metric_history(run_id, tag)}
        assert history == pytest.approx(dict(tensorboard[tag]), rel=1e-6), tag
    steps = [m.step for m in client.get_metric_history(run_id, "epoch/val/acc1")]
    assert sorted(steps) == [STEPS_PER_EPOCH, 2 * STEPS_PER_EPOCH]  # both runs, one curve
    last = json.loads((tracked["first"] / "metrics.jsonl").read_text().splitlines()[-1])
    assert run.data.metrics["final/best_acc1"] == pytest.approx(last["best_acc1"])
    # The flags: the first run's as params, what the resume changed as tags.
    params, tags = run.data.params, run.data.tags
    assert (params["lr"], params["arch"], params["epochs"]) == ("0.01", "resnet18", "1")
    assert params["global_batch"] == "8"  # derived values too
    assert tags["changed.epochs"] == "1 -> 2"


@pytest.mark.slow
def test_a_fresh_run_in_a_used_folder_starts_a_new_tracker_run(tracked, monkeypatch):
    old, new = tracked["ids"]["mlflow"]["run_id"], tracked["fresh_ids"]["mlflow"]["run_id"]
    assert new != old and set(tracked["fresh_ids"]) == {"mlflow"}
    run = _mlflow_client(tracked["base"], monkeypatch).get_run(new)
    assert run.data.params["epochs"] == "1" and "changed.epochs" not in run.data.tags
    assert run.info.run_name == "out"  # the output folder's name
    assert not (tracked["out"] / "tb").exists()  # --log-to mlflow: no TensorBoard


@pytest.mark.slow
def test_wandb_offline_runs_continue_the_same_run(tracked):
    run_id = tracked["ids"]["wandb"]["run_id"]
    folders = sorted((tracked["base"] / "wandb" / "wandb").glob("offline-run-*"))
    assert [f.name.rsplit("-", 1)[1] for f in folders] == [run_id, run_id]  # run 3 has none
    steps, config, summary = [], {}, {}
    for folder in folders:
        for record in _wandb_records(next(folder.glob("*.wandb"))):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                assert record.run.run_id == run_id
            elif kind == "history":
                row = _items(record.history.item)
                if "step/loss" in row:
                    steps.append(row["global_step"])
            elif kind == "config":
                config.update(_items(record.config.update))
            elif kind == "summary":
                summary.update(_items(record.summary.update))
    assert steps == list(range(1, 2 * STEPS_PER_EPOCH + 1))
    assert (config["lr"], config["epochs"], config["global_batch"]) == (0.01, 2, 8)
    last = json.loads((tracked["first"] / "metrics.jsonl").read_text().splitlines()[-1])
    assert summary["final/best_acc1"] == pytest.approx(last["best_acc1"])


def _items(items) -> dict:
    """A W&B record's items as {key: value}; W&B stores a key with '/' as a nested key."""
    return {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}


def _wandb_records(path: Path) -> list:
    """The protobuf records of a .wandb file (a LevelDB-format log after a 7-byte header)."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, chunk, records = 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        chunk += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, or LAST of a record split over blocks
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            records.append(record)
            chunk = b""
    return records


MISSING = """
import json, sys
from imagenet.settings.flags import parse_config
import imagenet.run.trainer  # everything a training run imports
parse_config([])
imported = [m for m in ("timm", "mlflow", "wandb") if m in sys.modules]
for name in ("timm", "mlflow", "wandb"):
    sys.modules[name] = None  # as if not installed
from imagenet.cli import main
codes = [main(["/nodata", *argv]) for argv in (["-a", "timm/resnet18"],
         ["--log-to", "tensorboard,mlflow"], ["--log-to", "wandb"])]
print(json.dumps({"imported": imported, "codes": codes}))
"""


@pytest.mark.slow
def test_missing_packages_are_one_line_and_nothing_is_imported_unasked(tmp_path):
    proc = subprocess.run([sys.executable, "-c", MISSING], capture_output=True, text=True,
                          env=child_env(), cwd=ROOT, timeout=300)
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result == {"imported": [], "codes": [2, 2, 2]}, proc.stderr
    assert proc.stderr.splitlines() == [
        "error: -a timm/resnet18 needs timm, which is not installed: pip install "
        "'imagenet-trainer[timm]' (or pip install timm)",
        "error: --log-to mlflow: the mlflow package is not installed; pip install "
        "'imagenet-trainer[mlflow]' (or pip install mlflow)",
        "error: --log-to wandb: the wandb package is not installed; pip install "
        "'imagenet-trainer[wandb]' (or pip install wandb)"]


class _Broken:
    run_id = "x"

    def scalars(self, values, step):
        raise ConnectionError("server went away\nmore")


class _Counting:
    run_id = "y"

    def __init__(self) -> None:
        self.calls = 0

    def scalars(self, values, step):
        self.calls += 1


def test_a_tracker_that_fails_warns_once_and_training_goes_on(caplog):
    counting = _Counting()
    trackers = Trackers({"mlflow": _Broken(), "wandb": counting})
    with caplog.at_level(logging.WARNING):
        for step in range(3):
            trackers.scalars({"step/loss": 1.0}, step)
    assert counting.calls == 3
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == ["--log-to mlflow stopped working (ConnectionError: server went away); "
                        "training goes on without it (metrics.jsonl has every epoch)"]


def test_unknown_tracker_is_a_usage_error(capsys):
    from imagenet.settings.flags import parse_config

    with pytest.raises(SystemExit) as exit_:
        parse_config(["--log-to", "tensorboard,mlfow"])
    assert exit_.value.code == 2
    assert "argument --log-to: unknown tracker 'mlfow': give a comma-separated list of " \
           "tensorboard, mlflow, wandb, or none" in capsys.readouterr().err


@pytest.mark.slow
def test_log_to_none_writes_no_tensorboard_and_names_none(tmp_path, capsys):
    from imagenet.cli import main

    data = write_image_folder(tmp_path / "data", classes=2, train_per_class=4, val_per_class=2)
    out, ev = tmp_path / "out", tmp_path / "ev"
    assert main([str(data), *TINY18, "--epochs", "1", "--log-to", "none", "--output-dir",
                 str(out)]) == 0
    text = capsys.readouterr().out
    assert "tensorboard --logdir" not in text and not (out / "tb").exists()
    assert main([str(data), *TINY18, "-e", "--resume", str(out / "checkpoint.pth.tar"),
                 "--log-to", "none", "--output-dir", str(ev)]) == 0
    assert (ev / "per_class.json").is_file() and not (ev / "tb").exists()


@pytest.mark.slow
def test_evaluate_logs_to_mlflow_and_wandb_in_runs_of_its_own(tracked, monkeypatch):
    """-e --log-to mlflow,wandb in a training run's folder: new runs (OUTPUT_DIR-eval) with the
    evaluation's numbers; the folder's trackers.json keeps naming the training runs."""
    base, out = tracked["base"], tracked["out"]
    env = child_env(MLFLOW_TRACKING_URI=f"file:{base / 'mlruns'}", MLFLOW_ALLOW_FILE_STORE="true",
                    WANDB_MODE="offline", WANDB_DIR=str(base / "wandb-eval"), WANDB_SILENT="true")
    (base / "wandb-eval").mkdir()
    proc = run_main(str(base / "data"), *TINY18, "-e", "--resume", str(out / "checkpoint.pth.tar"),
                    "--output-dir", str(out), "--log-to", "mlflow,wandb", env=env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((out / RUN_IDS).read_text()) == tracked["fresh_ids"]
    client = _mlflow_client(base, monkeypatch)
    runs = client.search_runs(client.search_experiments()[0].experiment_id,
                              filter_string="tags.mlflow.runName = 'out-eval'")
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    acc1 = float(proc.stdout.split(" * Acc@1 ")[1].split()[0])
    assert runs[0].data.metrics["eval/acc1"] == pytest.approx(acc1, abs=1e-3)
    assert runs[0].data.params["evaluate"] == "True"
    assert len(list((base / "wandb-eval" / "wandb").glob("offline-run-*"))) == 1


def test_a_progress_lines_step_scalars_are_on_disk_before_it_is_printed(tmp_path, monkeypatch):
    """TensorBoard's writer thread writes events behind the training loop; on a slow disk it
    lagged, and a kill right after a checkpoint lost the step scalars the checkpoint covers (the
    resume continues after them: a gap in step/lr). The progress hook now has them on disk first:
    once its line is printed, every step it reports is in the event file."""
    import time

    from tensorboard.summary.writer.record_writer import RecordWriter

    from imagenet.reporting.logger import RunLogger

    write = RecordWriter.write

    def slow_write(self, data):  # a disk that takes 0.2 s per event
        time.sleep(0.2)
        write(self, data)

    monkeypatch.setattr(RecordWriter, "write", slow_write)
    logger = RunLogger(tmp_path, True)
    hook = logger.progress_hook()
    record = {"epoch": 0, "step": 1, "steps": 3, "batch_time": 0.1, "data_time": 0.0, "loss": 1.5,
              "loss_avg": 1.5, "acc1": 0.0, "acc5": 0.0, "lr": 0.1, "images_per_sec": 80.0,
              "data_wait": 0.0, "eta_epoch": 1.0, "eta_run": 2.0, "global_step": 7}
    try:
        for step, lr in ((7, 0.1), (8, 0.05)):
            hook({**record, "global_step": step, "lr": lr})
            on_disk = dict(_tensorboard_scalars(tmp_path / "tb").get("step/lr", []))
            assert on_disk.get(step) == pytest.approx(lr), (step, on_disk)
    finally:
        logger.close()
