"""main.py end to end on a tiny JPEG ImageFolder: checkpoints, resume, -e, logs."""

from __future__ import annotations

import json
import re
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import (
    SMALL_ARCH,
    TINY,
    TINY18,
    child_env,
    fault_at,
    load_checkpoint,
    prestarted_cmd,
    run_main,
    save_edited,
)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path, str]:
    """One 2-epoch run shared by the tests that only read its artifacts."""
    from helpers import write_image_folder

    base = tmp_path_factory.mktemp("trained")
    data = write_image_folder(base / "data")
    out = base / "out"
    proc = run_main(str(data), *TINY18, "--epochs", "2", "--output-dir", str(out), "--seed", "0")
    assert proc.returncode == 0, proc.stderr
    return data, out, proc.stdout


@pytest.mark.slow
def test_run_writes_both_checkpoints_with_the_promised_keys(trained):
    _, out, stdout = trained
    ckpt = load_checkpoint(out / "checkpoint.pth.tar")
    best = load_checkpoint(out / "model_best.pth.tar")
    for key in ("epoch", "arch", "state_dict", "best_acc1", "optimizer", "scheduler", "config"):
        assert key in ckpt
    assert ckpt["epoch"] == 2 and ckpt["arch"] == "resnet18"
    assert isinstance(ckpt["best_acc1"], float)
    assert isinstance(ckpt["config"], dict) and ckpt["config"]["batch_size"] == 8
    assert not any(k.startswith("module.") for k in ckpt["state_dict"])
    assert ckpt["state_dict"]["fc.weight"].shape == (3, 512)
    assert best["best_acc1"] == ckpt["best_acc1"]
    assert not list(out.glob(".*tmp*")), "temp files left behind"
    assert "=> no accelerator device (torch.accelerator found none): training on the CPU" in stdout
    assert stdout.count(" * Acc@1") == 2


@pytest.mark.slow
def test_progress_lines_and_metrics_files(trained):
    _, out, stdout = trained
    line = next(ln for ln in stdout.splitlines() if ln.startswith("Epoch: [0]"))
    for field in ("Time", "Data", "Loss", "Acc@1", "Acc@5", "LR", "img/s", "ETA"):
        assert field in line
    records = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [0, 1]
    assert all(r["val_count"] == 9 for r in records)
    config = json.loads((out / "config.json").read_text())
    assert config["config"]["arch"] == "resnet18" and config["global_batch"] == 8
    assert config["environment"]["torch"] == torch.__version__


@pytest.mark.slow
def test_tensorboard_events_read_back(trained):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, out, _ = trained
    acc = EventAccumulator(str(out / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in ("epoch/train/loss", "epoch/train/acc1", "epoch/val/loss", "epoch/val/acc1",
                "epoch/val/acc5", "epoch/lr", "epoch/train/time", "epoch/train/images_per_sec",
                "epoch/epoch", "step/loss", "step/lr", "step/images_per_sec", "step/data_wait"):
        assert tag in tags, tag
    # Epoch scalars sit at the global step that ends the epoch (3 steps per epoch).
    assert [e.step for e in acc.Scalars("epoch/val/acc1")] == [3, 6]
    assert [e.value for e in acc.Scalars("epoch/epoch")] == [0, 1]
    assert "train/augmented_samples" in acc.Tags()["images"]
    records = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert acc.Scalars("epoch/val/acc1")[1].value == pytest.approx(records[1]["val_acc1"])
    # The hyper-parameters with the final metrics (TensorBoard's HPARAMS tab).
    assert {"_hparams_/experiment", "_hparams_/session_start_info"} <= set(
        acc.PluginTagToContent("hparams"))
    assert acc.Scalars("hparam/best_acc1")[-1].value == pytest.approx(records[1]["best_acc1"])


@pytest.mark.slow
def test_evaluate_reproduces_the_recorded_accuracy(trained):
    data, out, _ = trained
    best = load_checkpoint(out / "model_best.pth.tar")
    proc = run_main(str(data), *TINY18, "-e", "--resume", str(out / "model_best.pth.tar"),
                    "--output-dir", str(out / "eval"))
    assert proc.returncode == 0, proc.stderr
    acc1 = float(re.search(r" \* Acc@1 ([\d.]+)", proc.stdout).group(1))
    assert acc1 == pytest.approx(best["best_acc1"], abs=1e-3)
    assert not (out / "eval" / "checkpoint.pth.tar").exists()
    # It says what it evaluates (weights, data, images, classes), nothing about training.
    assert ("=> no accelerator device (torch.accelerator found none): evaluating on the CPU"
            in proc.stdout)
    assert (f"=> evaluating resnet18 with checkpoint '{out / 'model_best.pth.tar'}' (after "
            f"{best['epoch']} epoch(s)) on the validation split of {data}: 9 images, 3 classes"
            ) in proc.stdout
    for training in ("global batch", "accumulation", "learning-rate", "lr ", "outputs"):
        assert training not in proc.stdout, training


@pytest.mark.slow
def test_a_fast_start_is_quiet_and_the_end_names_the_outputs(trained):
    _, out, stdout = trained
    for stage in ("=> reading the data set", "=> starting the", "first training batch"):
        assert stage not in stdout  # each took less than a few seconds
    assert "current folder" not in stdout  # --output-dir was given
    assert f"=> outputs in {out}: model_best.pth.tar (best Acc@1 " in stdout
    assert stdout.rstrip().endswith(f"=> curves: tensorboard --logdir {out / 'tb'}")


@pytest.mark.slow
def test_resume_continues_at_the_next_epoch_and_keeps_best(trained, tmp_path):
    data, out, _ = trained
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    ckpt = load_checkpoint(out / "checkpoint.pth.tar")
    ckpt["best_acc1"] = 101.0  # unbeatable: model_best must not be overwritten after resume
    save_edited(ckpt, run_dir / "checkpoint.pth.tar")
    (run_dir / "model_best.pth.tar").write_bytes(b"sentinel")
    proc = run_main(str(data), *TINY18, "--epochs", "3", "--resume", "auto",
                    "--output-dir", str(run_dir))
    assert proc.returncode == 0, proc.stderr
    assert "(epoch 2, step 0, best Acc@1 101.000)" in proc.stdout
    assert proc.stdout.count(" * Acc@1") == 1  # only epoch 2 ran
    resumed = load_checkpoint(run_dir / "checkpoint.pth.tar")
    assert resumed["epoch"] == 3 and resumed["best_acc1"] == 101.0
    assert (run_dir / "model_best.pth.tar").read_bytes() == b"sentinel"
    assert resumed["global_step"] == ckpt["global_step"] + 3


@pytest.mark.slow
def test_classic_checkpoint_with_module_prefix_resumes(trained, tmp_path):
    import torchvision

    data, _, _ = trained
    model = torchvision.models.resnet18(num_classes=3)
    optimizer = torch.optim.SGD(model.parameters(), 0.1, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=30, gamma=0.1)
    for _ in range(31):  # the classic steps per epoch: epoch 31 runs at lr 0.01
        scheduler.step()
    classic = {"epoch": 31, "arch": "resnet18", "best_acc1": torch.tensor(12.5),
               "state_dict": {f"module.{k}": v for k, v in model.state_dict().items()},
               "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}
    path = tmp_path / "classic.pth.tar"
    torch.save(classic, path)
    # With the classic run's --lr 0.1 (TINY18 has 0.01): the resumed run is the one its command
    # line describes, so the learning rate comes from the flags, not from the checkpoint.
    proc = run_main(str(data), *TINY18, "--lr", "0.1", "--epochs", "32", "--resume", str(path),
                    "--output-dir", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    assert "(epoch 31, step 0, best Acc@1 12.500)" in proc.stdout
    assert "LR 0.01 " in proc.stdout
    ckpt = load_checkpoint(tmp_path / "out" / "checkpoint.pth.tar")
    assert ckpt["epoch"] == 32
    assert ckpt["optimizer"]["param_groups"][0]["lr"] == pytest.approx(0.01)


@pytest.mark.slow
def test_dummy_data_follows_the_size_flags(tmp_path):
    proc = run_main("--dummy", "--dummy-size", "12", "--dummy-val-size", "5",
                    "--dummy-classes", "4", *TINY18, "--epochs", "1",
                    "--output-dir", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "(5 images)" in proc.stdout
    state = load_checkpoint(tmp_path / "checkpoint.pth.tar")["state_dict"]
    assert state["fc.weight"].shape == (4, 512)


@pytest.mark.slow
def test_pretrained_offline_says_where_to_put_the_file(trained, tmp_path):
    data, _, _ = trained
    proc = run_main(str(data), *TINY18, "-e", "--pretrained", "--output-dir", str(tmp_path),
                    env=child_env(TORCH_HOME=str(tmp_path / "th")))
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    expected = tmp_path / "th" / "hub" / "checkpoints" / "resnet18-f37072fd.pth"
    assert str(expected) in proc.stderr


@pytest.mark.slow
def test_pretrained_weights_load_from_the_cache_and_adapt_the_classifier(trained, tmp_path):
    import torchvision

    data, _, _ = trained
    cache = tmp_path / "th" / "hub" / "checkpoints"
    cache.mkdir(parents=True)
    reference = torchvision.models.resnet18()
    torch.save(reference.state_dict(), cache / "resnet18-f37072fd.pth")
    proc = run_main(str(data), *TINY18, "--weights", "IMAGENET1K_V1", "--epochs", "1",
                    "--lr", "0", "--output-dir", str(tmp_path / "out"),
                    env=child_env(TORCH_HOME=str(tmp_path / "th")))
    assert proc.returncode == 0, proc.stderr
    state = load_checkpoint(tmp_path / "out" / "checkpoint.pth.tar")["state_dict"]
    assert torch.equal(state["conv1.weight"], reference.state_dict()["conv1.weight"])
    assert state["fc.weight"].shape == (3, 512)


@pytest.mark.slow
def test_resumed_run_continues_the_tensorboard_curves(image_folder, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "out"

    def run(epochs: str, *extra: str) -> tuple[dict[str, list[int]], list[int]]:
        """Train; then the steps of some TensorBoard tags and the epochs in metrics.jsonl."""
        proc = run_main(str(image_folder), *TINY18, "-p", "1", "--epochs", epochs, *extra,
                        "--output-dir", str(out))
        assert proc.returncode == 0, proc.stderr
        acc = EventAccumulator(str(out / "tb"))
        acc.Reload()
        steps = {tag: [e.step for e in acc.Scalars(tag)] for tag in ("step/loss",
                                                                     "epoch/val/acc1")}
        records = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
        return steps, [r["epoch"] for r in records]

    run("1")
    after_epoch_0 = (out / "checkpoint.pth.tar").read_bytes()
    # 3 steps per epoch; the resumed run continues the curves.
    assert run("2", "--resume", "auto") == ({"step/loss": [1, 2, 3, 4, 5, 6],
                                             "epoch/val/acc1": [3, 6]}, [0, 1])
    # Resuming from an older checkpoint redoes epoch 1: its old points and line are replaced,
    # not duplicated.
    (out / "checkpoint.pth.tar").write_bytes(after_epoch_0)
    assert run("2", "--resume", "auto") == ({"step/loss": [1, 2, 3, 4, 5, 6],
                                             "epoch/val/acc1": [3, 6]}, [0, 1])
    # A fresh start in the same folder starts fresh curves.
    assert run("1") == ({"step/loss": [1, 2, 3], "epoch/val/acc1": [3]}, [0])


@pytest.mark.slow
def test_a_kill_right_after_a_save_or_amid_an_epochs_records_loses_no_tensorboard_point(
        image_folder, tmp_path):
    """A checkpoint covers what TensorBoard shows: once one is on disk, the resume continues
    after it and cannot log the steps or the epoch it covers again. Killed (the whole job,
    SIGKILL) once a step's checkpoint is in place (--fsdp's --sharded-checkpoint saves in the
    training thread), then between an epoch's two records (its scalars, its metrics.jsonl line), the
    resumed run still ends with every step's and every epoch's point: at worst one twice (the
    same step, the same value), never one missing."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "out"
    cmd = prestarted_cmd(str(image_folder), *TINY, "-a", SMALL_ARCH, "-p", "1", "--epochs", "2",
                         "--seed", "0", "--save-every", "2", "--fsdp", "--sharded-checkpoint",
                         "--output-dir", str(out))
    # 3 steps per epoch: saves at step 2 (killed there), then epoch 0's end, then its records.
    faults = (fault_at("save.done", 1, "sigkill(group)"),
              fault_at("log.epoch", 1, "sigkill(group)"))
    for i, fault in enumerate([*faults, ""]):
        proc = subprocess.run([*cmd, *(["--resume", "auto"] if i else [])],
                              capture_output=True, text=True, timeout=300,
                              start_new_session=True,
                              env=child_env(IMAGENET_FAILPOINTS=fault))
        assert proc.returncode == (-signal.SIGKILL if fault else 0), proc.stdout + proc.stderr
    acc = EventAccumulator(str(out / "tb"))
    acc.Reload()
    points = {tag: {} for tag in ("step/lr", "epoch/val/acc1", "epoch/epoch")}
    for tag, values in points.items():
        for e in acc.Scalars(tag):
            values.setdefault(e.step, set()).add(e.value)
    assert {tag: sorted(values) for tag, values in points.items()} == {
        "step/lr": [1, 2, 3, 4, 5, 6], "epoch/val/acc1": [3, 6], "epoch/epoch": [3, 6]}, points
    assert all(len(v) == 1 for values in points.values() for v in values.values()), points
    records = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [0, 1]
