"""main.py trains and validates from tar shards as from the ImageFolder they were written from:
one process and two (x 2 loader workers), local files and a real ``python -m http.server``,
killed with SIGKILL and resumed bitwise, and a bad shard ending in one error line. The runs fork
from the pre-imported trainer (``prestarted_cmd``): what they test comes after start-up."""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import pytest
import torch
from helpers import child_env, fault_at, load_checkpoint, prestarted_cmd, run_main, run_parallel
from helpers import write_image_folder as write_folder
from test_fault_tolerance import assert_same_run, fault_run, run_to_end
from test_shards import batches, free_port, prepare_shards, start_server, write_published_layout

from imagenet.data.folder import build_data
from imagenet.data.shards.sources import resolve
from imagenet.settings.flags import parse_config
from imagenet.settings.launch import Layout
from imagenet.settings.plan import fixed_plan

pytestmark = pytest.mark.slow

# A set that resnet18 learns in 3 epochs: 3 colour-coded classes, 96 train and 30 val images.
# Measured on the folder with AdamW: 100% top-1 at the third epoch for seeds 0, 1 and 2.
MODEL = ["-a", "resnet18", "--train-crop-size", "32", "--val-resize-size", "36",
         "--val-crop-size", "32", "--train-crop-scale", "0.5", "--opt", "adamw", "--lr", "0.001",
         "--label-smoothing", "0.1", "--random-erase", "0.1", "--seed", "0", "-p", "1"]
LEARN = [*MODEL, "-b", "16", "--epochs", "3"]
STEPS = 6  # 96 / 16


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    """The JPEG folder, its shards and its Hub Parquet: 20 images per file (5 train files,
    the last of 16)."""
    root = tmp_path_factory.mktemp("learn")
    folder = write_folder(root / "folder", classes=3, train_per_class=32, val_per_class=10)
    proc = prepare_shards(folder, root / "shards", "--shard-max-images", "20")
    assert proc.returncode == 0, proc.stderr
    proc = prepare_shards(folder, root / "parquet", "--shard-max-images", "20", "--format",
                          "parquet")
    assert proc.returncode == 0, proc.stderr
    return {"folder": folder, "shards": root / "shards", "parquet": root / "parquet",
            "root": root}


@pytest.fixture(scope="module")
def shard_run(data) -> Path:
    """An uninterrupted shard run without loader workers: the reference of the resume test."""
    out = data["root"] / "shard-run"
    run_to_end(prestarted_cmd(str(data["shards"]), *LEARN, "-j", "0", "--output-dir", str(out)))
    return out


def epochs(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_shards_train_on_the_folders_samples_to_the_same_top1(data, shard_run, tmp_path):
    # The same samples every epoch: each rank's sampler over the folder vs the shard keys.
    cfg = parse_config([str(data["folder"]), *LEARN])
    shards = resolve(str(data["shards"]), None, None)
    for world in (1, 2):
        layout = Layout(world, 16 // world, 1, 0)
        folder = [build_data(fixed_plan(cfg, layout), data["folder"], r, 5, False) for r in
                  range(world)]
        samples = folder[0].train.loader.dataset.dataset.samples
        for epoch in range(3):
            seen_folder = set()
            for rank_data in folder:
                rank_data.train.set_position(epoch, 0)
                seen_folder |= {Path(samples[i][0]).relative_to(data["folder"] / "train")
                                .with_suffix("").as_posix()
                                for i in rank_data.train.sampler.indices()}
            seen_shards = [k for r in range(world) for b in
                           batches(shards.train, world=world, rank=r, batch=16 // world,
                                   epoch=epoch) for k in b[0]]
            assert len(seen_shards) == len(set(seen_shards)) == 96
            assert set(seen_shards) == seen_folder
    # Trained with the same flags, both reach the same top-1 (within 6 of 30 images).
    out = tmp_path / "folder-run"
    run_to_end(prestarted_cmd(str(data["folder"]), *LEARN, "-j", "0", "--output-dir", str(out)))
    folder_run, shards_run = epochs(out), epochs(shard_run)
    assert [r["val_count"] for r in shards_run] == [30] * 3
    assert folder_run[-1]["val_acc1"] >= 80 and shards_run[-1]["val_acc1"] >= 80, \
        (folder_run, shards_run)
    assert abs(folder_run[-1]["val_acc1"] - shards_run[-1]["val_acc1"]) <= 20


@pytest.mark.parametrize("fmt", ["shards", "parquet"])
def test_sigkill_mid_epoch_on_shards_resumes_bitwise_with_other_workers(data, shard_run,
                                                                        tmp_path, fmt):
    """Hub Parquet as well: ``prepare --format parquet`` puts the images in the files and
    order of the shards, so the killed and resumed Parquet run ends as the shard run, bitwise
    (each file's rows read from the middle of a row group on resume)."""
    out = tmp_path / "out"
    cmd = prestarted_cmd(str(data[fmt]), *LEARN, "-j", "2", "--output-dir", str(out))
    # Epoch 0's saves (steps 2 and 4, before its validation, at its end), then epoch 1's step
    # 2: the whole job killed once that one is on disk.
    code, output = fault_run([*cmd, "--save-every", "2"],
                             fault_at("save.done", len(range(2, STEPS, 2)) + 3, "sigkill(group)"))
    assert code == -signal.SIGKILL, output
    ckpt = load_checkpoint(out / "checkpoint.pth.tar")
    assert (ckpt["epoch"], ckpt["step_in_epoch"]) == (1, 2), output
    output = run_to_end([*cmd, "--resume", "auto"])
    assert f"(epoch 1, step {ckpt['step_in_epoch']}," in output, output
    assert_same_run(out, shard_run)


SPAWN = ["--multiprocessing-distributed", "--nproc-per-node", "2", "-b", "20", "-j", "4",
         "--epochs", "1"]  # 10 images per process, 2 loader workers each


def test_two_processes_two_workers_locally_and_over_http(data, tmp_path):
    """Uneven shards (20, 20, 20, 20, 16) on 2 ranks: 96 // 20 = 4 steps each, 16 images left
    out; validation: 30 images once. The HTTP run ends bitwise equal to the local one."""
    flags = [*MODEL, *SPAWN]
    shards = resolve(str(data["shards"]), None, None)
    per_rank = [batches(shards.train, world=2, rank=r, batch=10, workers=2) for r in range(2)]
    keys = [k for result in per_rank for b in result for k in b[0]]
    assert [len(r) for r in per_rank] == [4, 4] and len(keys) == len(set(keys)) == 80
    port = free_port()
    server = start_server(data["shards"], port)
    try:
        outs = {"local": tmp_path / "local", "http": tmp_path / "http"}
        sources = {"local": str(data["shards"]), "http": f"http://127.0.0.1:{port}/"}
        results = run_parallel([prestarted_cmd(sources[k], *flags, "--output-dir", str(outs[k]))
                                for k in outs], [child_env(), child_env()], tmp_path / "logs")
    finally:
        server.kill()
        server.wait()
    for name, result in zip(outs, results):
        assert result.returncode == 0, result.stdout + result.stderr
        log = result.stdout + result.stderr
        assert "4 batches of 10 per process and epoch (16 left out" in log, log
        assert "(30 images)" in log, log
        (record,) = epochs(outs[name])
        assert record["val_count"] == 30 and record["train_images"] == 80, record  # 2 ranks
    local, remote = (load_checkpoint(o / "checkpoint.pth.tar") for o in outs.values())
    assert local["steps_per_epoch"] == 4
    for key, value in local["state_dict"].items():
        assert torch.equal(value, remote["state_dict"][key]), key


def test_a_bad_shard_or_missing_class_count_is_one_error_line(data, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(data["shards"], broken)
    victim = broken / "train-000002.tar"
    victim.write_bytes(victim.read_bytes()[:5000])
    proc = run_main(str(broken), *LEARN, "-j", "2", "--output-dir", str(tmp_path / "out"))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[-1].startswith(f"error: shard {victim} is truncated"), proc.stderr
    published = tmp_path / "published"
    write_published_layout(published, data["folder"])
    proc = run_main(str(published), *LEARN, "--output-dir", str(tmp_path / "out2"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: ") and \
        "lists no class names: give --num-classes N" in proc.stderr
