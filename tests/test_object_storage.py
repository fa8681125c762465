"""Tar shards and --output-dir in object storage, against a real S3-compatible server (moto's
server mode on loopback; s3fs talks to it through AWS_ENDPOINT_URL as to AWS)."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import fsspec
import pytest
import torch
from helpers import ROOT, child_env, prestarted_cmd, run_main, write_image_folder
from moto.server import ThreadedMotoServer
from test_fault_tolerance import Live
from test_shards import prepare_shards

from imagenet.checkpoint import files, rundir, storage
from imagenet.data import objectstore
from imagenet.data.shards.streams import ShardMissing, open_shard
from imagenet.errors import RunError, UsageError
from imagenet.settings.flags import parse_config
from imagenet.settings.plan import stage, staging_dir


def staged(cfg):
    """``cfg`` with its URLs replaced by local paths, and what to sync (as a run does)."""
    cfg, staging = stage(cfg)
    return cfg, storage.Remote.of(staging)


# A small model: every save is uploaded, and a 3 MB checkpoint keeps that quick.
FLAGS = ["-a", "shufflenet_v2_x0_5", "--train-crop-size", "32", "--val-resize-size", "36",
         "--val-crop-size", "32", "-b", "8", "-j", "0", "-p", "1", "--lr", "0.01", "--seed", "0"]


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A moto S3 server on a free loopback port, buckets "data" and "runs"; yields the
    environment that points the AWS SDK (and s3fs) at it."""
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "test",
           "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        fs = fsspec.filesystem("s3", skip_instance_cache=True)
        for bucket in ("data", "runs"):
            fs.mkdir(bucket)
        yield env
        fsspec.filesystem("s3").clear_instance_cache()
    server.stop()


def bucket() -> fsspec.AbstractFileSystem:
    fs = fsspec.filesystem("s3")
    fs.invalidate_cache()
    return fs


@pytest.fixture(scope="module")
def shards_in_bucket(s3, tmp_path_factory) -> str:
    """Shards of a 3-class JPEG folder (24 train, 9 val images) uploaded to s3://data/wds."""
    root = tmp_path_factory.mktemp("s3data")
    folder = write_image_folder(root / "folder")
    proc = prepare_shards(folder, root / "shards", "--shard-max-images", "10")
    assert proc.returncode == 0, proc.stderr
    bucket().put(f"{root / 'shards'}/", "data/wds/", recursive=True)
    return "s3://data/wds"


def on_node(tmp: Path, name: str) -> dict[str, str]:
    """A node of its own: an empty temp dir, where the staging folder goes."""
    (tmp / name).mkdir(exist_ok=True)
    return {"TMPDIR": str(tmp / name)}


@pytest.mark.slow
def test_shards_and_checkpoints_in_a_bucket_survive_a_kill_and_resume_on_another_node(
        s3, shards_in_bucket, tmp_path):
    out = "s3://runs/r1"
    cmd = prestarted_cmd(shards_in_bucket, *FLAGS, "--epochs", "2", "--output-dir", out,
                   "--resume", "auto", "--save-every", "2")
    live = Live(cmd, **s3, **on_node(tmp_path, "node1"))
    live.wait_for("Epoch: [1][2/3]")
    live.signal_group(signal.SIGKILL)
    code, output = live.finish(), live.output
    assert code == -signal.SIGKILL, output
    assert "=> shards: 24 training images in 3 shards" in output
    assert "object storage, which has no lock" in output
    fs = bucket()
    with fs.open("runs/r1/checkpoint.pth.tar", "rb") as f:
        killed = torch.load(f, map_location="cpu", weights_only=True)
    assert (killed["epoch"], killed["step_in_epoch"]) in ((1, 0), (1, 2)), output
    assert [json.loads(ln)["epoch"] for ln in fs.cat_file("runs/r1/metrics.jsonl").split(
        b"\n") if ln] == [0]
    # Another node, nothing staged: --resume auto finds the run in the bucket.
    live = Live(cmd, **s3, **on_node(tmp_path, "node2"))
    code, output = live.finish(), live.output
    assert code == 0, output
    assert f"(epoch 1, step {killed['step_in_epoch']}," in output, output
    fs = bucket()
    names = {Path(p).name for p in fs.find("runs/r1")}
    assert {"checkpoint.pth.tar", "model_best.pth.tar", "metrics.jsonl",
            "config.json"} <= names, names
    assert not [n for n in names if ".tmp" in n or n.startswith(".write-test")], names
    assert any(n.startswith("events.out.tfevents") for n in names)
    with fs.open("runs/r1/checkpoint.pth.tar", "rb") as f:
        final = torch.load(f, map_location="cpu", weights_only=True)
    assert final["epoch"] == 2 and final["global_step"] == 6
    epochs = [json.loads(ln)["epoch"] for ln in fs.cat_file("runs/r1/metrics.jsonl").split(b"\n")
              if ln]
    assert epochs == [0, 1]  # one record across the two nodes
    config = json.loads(fs.cat_file("runs/r1/config.json"))
    assert config["output_url"] == out


def test_fresh_run_moves_the_urls_record_aside_and_push_uploads_in_order(s3, tmp_path,
                                                                          monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the staging folder's place
    fs = bucket()
    fs.pipe({"runs/old/checkpoint.pth.tar": b"old", "runs/old/metrics.jsonl": b"{}\n",
             "runs/old/config.json": json.dumps({"started": "2026-01-02T03:04:05"}).encode(),
             "runs/old/tb/events.out.tfevents.1": b"ev"})
    cfg, remote = staged(parse_config(["data", "--output-dir", "s3://runs/old/"]))
    staging = Path(cfg.output_dir)
    assert remote.output_url == "s3://runs/old" and staging == staging_dir(
        "s3://runs/old")
    staging.mkdir(parents=True, exist_ok=True)
    remote.attach(continuing=False, training=True)
    assert remote.move_previous_run() == "s3://runs/old/previous/2026-01-02_03-04-05"
    fs = bucket()
    assert sorted(p.split("/", 2)[2] for p in fs.find("runs/old")) == [
        "previous/2026-01-02_03-04-05/checkpoint.pth.tar",
        "previous/2026-01-02_03-04-05/config.json",
        "previous/2026-01-02_03-04-05/metrics.jsonl",
        "previous/2026-01-02_03-04-05/tb/events.out.tfevents.1"]
    # The staging folder: what belongs in the URL, and what stays local.
    for name, data in {files.CHECKPOINT: b"c1", files.BEST: b"b1", "metrics.jsonl": b"m\n",
                       "tb/events.out.tfevents.2": b"e", ".checkpoint.pth.tar.tmp-1": b"x",
                       "previous/x/config.json": b"{}", "demo-data/a.jpg": b"j"}.items():
        (staging / name).parent.mkdir(parents=True, exist_ok=True)
        (staging / name).write_bytes(data)
    sent = []
    real = objectstore.upload
    monkeypatch.setattr(objectstore, "upload",
                        lambda fs_, local, key: (sent.append(key.split("/", 2)[2]),
                                                 real(fs_, local, key)))
    remote.push()
    assert sent == [files.BEST, "metrics.jsonl", "tb/events.out.tfevents.2", files.CHECKPOINT]
    remote.push()  # nothing changed: nothing sent
    assert len(sent) == 4
    (staging / files.BEST).unlink()  # removed by the run: its copy goes too
    (staging / files.CHECKPOINT).write_bytes(b"c2")
    remote.push()
    fs = bucket()
    assert sent[4:] == [files.CHECKPOINT]
    assert fs.cat_file(f"runs/old/{files.CHECKPOINT}") == b"c2"
    assert not fs.exists(f"runs/old/{files.BEST}")
    # A run that continues the URL's run gets its record back on a node with nothing staged.
    storage.clear_staging(staging)
    remote.sent.clear()
    remote.attach(continuing=True, training=True)
    assert (staging / files.CHECKPOINT).read_bytes() == b"c2"
    assert (staging / "metrics.jsonl").read_bytes() == b"m\n"
    assert not (staging / "tb").exists()  # events stay in the bucket


def test_urls_that_cannot_work_are_one_clear_error(s3, shards_in_bucket, tmp_path):
    with pytest.raises(UsageError, match="--sharded-checkpoint"):
        staged(parse_config(["d", "--fsdp", "--sharded-checkpoint", "--output-dir",
                                    "s3://runs/x"]))
    _, remote = staged(parse_config(["d", "--output-dir", "s3://no-such-bucket/r"]))
    with pytest.raises(UsageError, match="s3://no-such-bucket/r: cannot write there"):
        remote.attach(continuing=False, training=True)
    _, remote = staged(parse_config(["d", "--output-dir", "nosuchfs://b/r"]))
    with pytest.raises(UsageError, match="nosuchfs://b/r"):
        remote.attach(continuing=False, training=True)
    # gcsfs is not installed here (no GCS server in CI): the line names it and the extra.
    _, remote = staged(parse_config(["d", "--output-dir", "gs://b/r"]))
    with pytest.raises(UsageError, match=r"gs://b/r: Please install gcsfs .*\[cloud\]"):
        remote.attach(continuing=False, training=True)
    _, remote = staged(parse_config(["d", "--resume", "s3://runs/none/checkpoint.pth.tar",
                                            "-e"]))
    with pytest.raises(UsageError, match="--resume: no checkpoint at s3://runs/none"):
        remote.attach(continuing=False, training=False)
    with pytest.raises(ShardMissing, match="s3://data/wds/train-999999.tar is missing"):
        open_shard("s3://data/wds/train-999999.tar")
    with open_shard(f"{shards_in_bucket}/_info.json") as f:
        assert json.loads(f.read())["splits"]["train"]["shard_lengths"] == [10, 10, 4]


def test_transfer_failures_name_the_file(s3, tmp_path):
    with pytest.raises(RunError, match="cannot upload x to s3://runs"):
        storage.guarded("upload x to s3://runs", lambda: bucket().put_file(
            str(tmp_path / "absent"), "runs/x"))


UPLOADER = """
import sys, fsspec
from pathlib import Path
from imagenet.data import objectstore
print("uploading", flush=True)
objectstore.upload(fsspec.filesystem("s3"), Path(sys.argv[1]), "runs/big/checkpoint.pth.tar")
print("uploaded", flush=True)
"""


@pytest.mark.slow
def test_an_upload_killed_midway_leaves_the_old_object_whole(s3, tmp_path):
    fs = bucket()
    old = os.urandom(1 << 20)
    fs.pipe_file("runs/big/checkpoint.pth.tar", old)
    new = tmp_path / "new.pth.tar"
    new.write_bytes(os.urandom(120 << 20))  # a multipart upload (s3fs: 50 MB parts)
    proc = subprocess.Popen([sys.executable, "-c", UPLOADER, str(new)], stdout=subprocess.PIPE,
                            text=True, env=child_env(**s3), cwd=ROOT)
    try:
        assert proc.stdout.readline().strip() == "uploading"
        deadline = time.monotonic() + 60
        while not fs.list_multipart_uploads("runs") and time.monotonic() < deadline:
            time.sleep(0.02)
        assert fs.list_multipart_uploads("runs"), "the upload never started"
    finally:
        proc.send_signal(signal.SIGKILL)
        rest = proc.communicate()[0]
    assert "uploaded" not in rest  # killed mid-upload
    assert bucket().cat_file("runs/big/checkpoint.pth.tar") == old  # nothing partial, ever


def test_other_filesystems_get_a_temporary_name_then_a_rename(tmp_path):
    fs = fsspec.filesystem("file")
    assert not objectstore.whole_objects(fs)
    local = tmp_path / "c.pth.tar"
    local.write_bytes(b"new")
    target = tmp_path / "remote" / "checkpoint.pth.tar"
    target.parent.mkdir()
    target.write_bytes(b"old")
    objectstore.upload(fs, local, str(target))
    assert target.read_bytes() == b"new"
    assert sorted(p.name for p in target.parent.iterdir()) == ["checkpoint.pth.tar"]


def test_a_predictions_url_beside_the_output_url_is_never_taken_for_a_staged_file(
        tmp_path, monkeypatch):
    """A training run pushes after its last epoch's line (the CSV goes up) and again at its
    end: that second push took the CSV's URL for a deleted staging file and failed the
    finished run ("cannot delete memory://runs/p/memory://preds/p.csv")."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    cfg, remote = staged(parse_config(["d", "--output-dir", "memory://t41/runs/p",
                                       "--predictions", "memory://t41/preds/p.csv"]))
    Path(cfg.output_dir).mkdir(parents=True)
    remote.attach(continuing=False, training=True)
    Path(cfg.predictions).parent.mkdir(parents=True)
    Path(cfg.predictions).write_text("path,target,pred\n")
    (Path(cfg.output_dir) / "metrics.jsonl").write_text("{}\n")
    remote.push()  # after the last epoch's line
    remote.push()  # the run's end
    fs = fsspec.filesystem("memory")
    assert fs.cat_file("/t41/preds/p.csv") == b"path,target,pred\n"
    assert fs.cat_file("/t41/runs/p/metrics.jsonl") == b"{}\n"
    fs.rm("/t41", recursive=True)


def test_a_resume_from_the_urls_previous_folder_leaves_that_checkpoint_there(tmp_path,
                                                                           monkeypatch):
    """The trainer points users to URL/previous/ for an earlier run: resuming from there read
    the checkpoint, then the first push deleted it from the store."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    old = tmp_path / "store" / "run" / "previous" / "old" / files.CHECKPOINT
    old.parent.mkdir(parents=True)
    old.write_bytes(b"old")
    out = f"local://{tmp_path}/store/run"
    cfg, remote = staged(parse_config(["d", "--output-dir", out, "--resume", f"local://{old}"]))
    Path(cfg.output_dir).mkdir(parents=True)
    remote.attach(continuing=False, training=True)
    assert Path(cfg.resume).read_bytes() == b"old"
    (Path(cfg.output_dir) / files.CHECKPOINT).write_bytes(b"new")
    remote.push()
    assert old.read_bytes() == b"old"
    assert (tmp_path / "store" / "run" / files.CHECKPOINT).read_bytes() == b"new"


def test_a_url_on_a_filesystem_with_folders_gets_its_folders_made(tmp_path, monkeypatch):
    """local://, sftp, hdfs have folders: a new --output-dir URL, its tb/, a --predictions
    URL's folder and previous/<start>/ are made as a local path's are."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    out = tmp_path / "fs" / "runs" / "new"  # not there yet
    cfg, remote = staged(parse_config(["d", "--output-dir", f"local://{out}", "--predictions",
                                       f"local://{tmp_path}/fs/preds/p.csv"]))
    staging = Path(cfg.output_dir)
    staging.mkdir(parents=True)
    remote.attach(continuing=False, training=True)
    (staging / "tb").mkdir()
    (staging / "tb" / "events.out.tfevents.1").write_bytes(b"e")
    (staging / rundir.CONFIG).write_text(json.dumps({"started": "2026-01-02T03:04:05"}))
    Path(cfg.predictions).parent.mkdir(parents=True)
    Path(cfg.predictions).write_text("p\n")
    remote.push()
    assert (out / "tb" / "events.out.tfevents.1").read_bytes() == b"e"
    assert (tmp_path / "fs" / "preds" / "p.csv").read_text() == "p\n"
    moved = remote.move_previous_run()  # a fresh run in the used folder
    assert moved == f"local://{out}/previous/2026-01-02_03-04-05"
    assert (out / "previous" / "2026-01-02_03-04-05" / "tb" / "events.out.tfevents.1").is_file()


def test_staging_is_private_to_the_user(tmp_path, monkeypatch):
    """A fixed folder shared by every user: once one user had made it (755) every other
    user's URL run failed, and one user ran on what another left in it (its cache/). Each
    user stages in a folder of their own, 0700, refused when others could write into it."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    (tmp_path / "imagenet-trainer" / "cache").mkdir(parents=True)  # someone else's
    cfg, _ = staged(parse_config(["d", "--output-dir", "s3://runs/x"]))
    mine = tmp_path / f"imagenet-trainer-{os.geteuid()}"
    assert Path(cfg.output_dir).parent == mine
    assert (stat.S_IMODE(mine.stat().st_mode), mine.stat().st_uid) == (0o700, os.geteuid())
    mine.chmod(0o770)
    with pytest.raises(UsageError, match=f"{mine} is writable by others"):
        staged(parse_config(["d", "--output-dir", "s3://runs/x"]))


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a folder to another user")
def test_a_staging_folder_another_user_made_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    theirs = tmp_path / f"imagenet-trainer-{os.geteuid()}"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 12345, 12345)
    with pytest.raises(UsageError, match=f"{theirs} belongs to user 12345"):
        staged(parse_config(["d", "--predictions", "s3://out/p.csv"]))


def _jsonl_epochs(fs, key: str) -> list[int]:
    return [json.loads(ln)["epoch"] for ln in fs.cat_file(key).split(b"\n") if ln]


@pytest.fixture(scope="module")
def folder_data(tmp_path_factory) -> Path:
    return write_image_folder(tmp_path_factory.mktemp("s3folder") / "data")


@pytest.mark.slow
def test_a_resume_from_the_bucket_continues_the_history_and_the_tracker_run(
        s3, folder_data, tmp_path):
    """--keep-checkpoints' index and files, and --log-to mlflow's run id (trackers.json), come
    back from the bucket on another node: the resumed run continues them."""
    env = child_env(**s3, MLFLOW_TRACKING_URI=f"file:{tmp_path / 'mlruns'}",
                    MLFLOW_ALLOW_FILE_STORE="true")
    common = [str(folder_data), *FLAGS, "--output-dir", "s3://runs/hist", "--resume", "auto",
              "--keep-checkpoints", "1", "--log-to", "mlflow"]
    first = run_main(*common, "--epochs", "1", env={**env, **on_node(tmp_path, "node1")},
                     cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    run_id = json.loads(bucket().cat_file("runs/hist/trackers.json"))["mlflow"]["run_id"]
    second = run_main(*common, "--epochs", "2", "--predictions", "s3://data/hist-pred/p.csv",
                      env={**env, **on_node(tmp_path, "node2")}, cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    assert f"MLflow run {run_id} (continued)" in second.stdout, second.stdout
    fs = bucket()
    assert json.loads(fs.cat_file("runs/hist/trackers.json"))["mlflow"]["run_id"] == run_id
    index = json.loads(fs.cat_file("runs/hist/checkpoints.json"))["checkpoints"]
    kept = sorted(Path(p).name for p in fs.glob("runs/hist/checkpoint_epoch*"))
    assert kept == [e["file"] for e in index] and len(kept) == 1, (kept, index)
    assert _jsonl_epochs(fs, "runs/hist/metrics.jsonl") == [0, 1]
    rows = fs.cat_file("data/hist-pred/p.csv").decode().splitlines()  # --predictions URL
    assert rows[0].startswith("path,target,pred") and len(rows) == 10
    assert not (tmp_path / "s3:").exists() and not (ROOT / "s3:").exists()
    # A fresh run in the used URL moves the whole record aside, the kept epochs too.
    third = run_main(str(folder_data), *FLAGS, "--output-dir", "s3://runs/hist", "--epochs", "1",
                     env={**env, **on_node(tmp_path, "node3")}, cwd=tmp_path)
    assert third.returncode == 0, third.stderr
    fs = bucket()
    assert [Path(p).name for p in fs.glob("runs/hist/previous/*/checkpoint_epoch*")] == kept
    assert [Path(p).name for p in fs.glob("runs/hist/previous/*/trackers.json")]
    assert not fs.glob("runs/hist/checkpoint_epoch*") and not fs.exists("runs/hist/trackers.json")


@pytest.mark.slow
def test_evaluate_uploads_its_reports_and_predictions_to_urls(s3, folder_data, tmp_path):
    """-e with --output-dir and --predictions URLs: the reports and the CSV are in the bucket,
    nothing lands in a local folder named 's3:'; -e --resume auto reads the URL's checkpoint."""
    env = child_env(**s3, **on_node(tmp_path, "node"))
    train = run_main(str(folder_data), *FLAGS, "--epochs", "1", "--output-dir", "s3://runs/ev0",
                     env=env, cwd=tmp_path)
    assert train.returncode == 0, train.stderr
    fs = bucket()
    checkpoint = fs.cat_file("runs/ev0/checkpoint.pth.tar")
    assert staged_files(tmp_path / "node") == [], "a finished run leaves its copies in $TMPDIR"
    flags = [str(folder_data), *FLAGS, "-e"]
    proc = run_main(*flags, "--resume", "s3://runs/ev0/model_best.pth.tar", "--output-dir",
                    "s3://runs/ev", "--predictions", "s3://runs/ev/sub/pred.csv", env=env,
                    cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    fs = bucket()
    names = {p.split("/", 2)[2] for p in fs.find("runs/ev")}
    assert {"per_class.csv", "per_class.json", "confusion_matrix.csv", "sub/pred.csv"} <= names
    assert not {"model_best.pth.tar", "checkpoint.pth.tar"} & names, names
    assert len(fs.cat_file("runs/ev/sub/pred.csv").decode().splitlines()) == 10
    assert not (tmp_path / "s3:").exists() and not (ROOT / "s3:").exists()
    # -e --resume auto in the training run's own URL: its checkpoint, its reports beside it
    proc = run_main(*flags, "--resume", "auto", "--output-dir", "s3://runs/ev0",
                    "--predictions", "s3://data/elsewhere/p.csv", "--log-to", "none", env=env,
                    cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "checkpoint.pth.tar' (after 1 epoch(s))" in proc.stdout, proc.stdout
    fs = bucket()
    assert json.loads(fs.cat_file("runs/ev0/per_class.json"))["images"] == 9
    assert fs.cat_file("runs/ev0/checkpoint.pth.tar") == checkpoint  # read, not rewritten
    assert len(fs.cat_file("data/elsewhere/p.csv").decode().splitlines()) == 10
    assert staged_files(tmp_path / "node") == []  # the downloaded checkpoints, the reports


def staged_files(tmp: Path) -> list[str]:
    """What the staging folders under ``tmp`` hold but the locks and the folder index."""
    root = tmp / f"imagenet-trainer-{os.geteuid()}"
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()
                  and p.name != rundir.LOCK and "cache" not in p.relative_to(root).parts[1:2])


def test_the_end_of_a_run_frees_the_staging_folder_once_everything_is_up(tmp_path,
                                                                        monkeypatch):
    """The staging folders held a finished run's checkpoints (GBs in $TMPDIR) until the next
    run on the same URL cleared them; they go once the last push has sent them, and stay when
    it could not."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    store = tmp_path / "store"
    (store / "elsewhere").mkdir(parents=True)
    (store / "elsewhere" / files.CHECKPOINT).write_bytes(b"old")
    cfg, remote = staged(parse_config([
        "d", "--output-dir", f"local://{store}/run", "--resume",
        f"local://{store}/elsewhere/{files.CHECKPOINT}", "--predictions",
        f"local://{store}/preds/p.csv"]))
    staging = Path(cfg.output_dir)
    staging.mkdir(parents=True)
    (staging / rundir.LOCK).write_text("")
    (staging / "cache").mkdir()
    (staging / "cache" / "index.json").write_text("{}")
    remote.attach(continuing=False, training=True)
    assert Path(cfg.resume).read_bytes() == b"old"
    Path(cfg.predictions).parent.mkdir(parents=True, exist_ok=True)
    Path(cfg.predictions).write_text("p\n")
    (staging / files.CHECKPOINT).write_bytes(b"new")
    (staging / "tb").mkdir()
    (staging / "tb" / "events.out.tfevents.1").write_bytes(b"e")
    remote.push()
    (staging / "metrics.jsonl").write_text("{}\n")  # written after the push (it failed): kept
    remote.release()
    assert staged_files(tmp_path) == [f"{staging.name}/metrics.jsonl"]
    remote.push()
    remote.release()
    assert staged_files(tmp_path) == []
    assert (staging / rundir.LOCK).exists() and (staging / "cache" / "index.json").exists()
    assert (store / "run" / files.CHECKPOINT).read_bytes() == b"new"
    assert (store / "preds" / "p.csv").read_text() == "p\n"
    assert (store / "elsewhere" / files.CHECKPOINT).read_bytes() == b"old"


@pytest.mark.slow
def test_what_reads_the_checkpoint_before_the_resume_finds_the_buckets(s3, folder_data,
                                                                        tmp_path):
    """The checkpoint of a URL --output-dir / --resume is downloaded before anything reads it:
    -e --val-data labels its folder with the bucket checkpoint's classes (it found no file on
    a node with nothing staged), and a chained job whose bucket run has trained every epoch
    ends at once, on another node, without building the data or the model."""
    env = child_env(**s3, **on_node(tmp_path, "a"))
    train = run_main(str(folder_data), *FLAGS, "--epochs", "1", "--output-dir", "s3://runs/vd",
                     env=env, cwd=tmp_path)
    assert train.returncode == 0, train.stderr
    node_b = child_env(**s3, **on_node(tmp_path, "b"))  # nothing staged there
    proc = run_main(*FLAGS, "-e", "--resume", "s3://runs/vd/checkpoint.pth.tar", "--val-data",
                    str(folder_data / "val"), "--output-dir", str(tmp_path / "ev"),
                    "--log-to", "none", env=node_b, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "ev" / "per_class.json").read_text())["images"] == 9
    chained = run_main(str(folder_data), *FLAGS, "--epochs", "1", "--output-dir",
                       "s3://runs/vd", "--resume", "auto",
                       env=child_env(**s3, **on_node(tmp_path, "c")), cwd=tmp_path)
    assert chained.returncode == 0, chained.stderr
    assert "=> nothing left to train" in chained.stdout, chained.stdout
    assert "on cpu: global batch" not in chained.stdout  # nothing was built


def test_the_plan_resolves_the_urls_once_every_stage_reads_the_local_folder(tmp_path,
                                                                            monkeypatch):
    """The plan stands a URL --output-dir / --resume / --predictions for local paths before any
    process starts: the mp.spawn parent's hang report, the hang watch and the run all use the
    staging folder (a report under Path('s3://...') made an 's3:' folder in the current one)."""
    monkeypatch.chdir(tmp_path)
    from imagenet.launching.failures import StoppedChildren
    from imagenet.settings.plan import make_plan

    cfg = parse_config(["d", "--output-dir", "s3://runs/x/", "--resume",
                        "s3://runs/x/checkpoint.pth.tar", "--predictions", "s3://out/p.csv"])
    plan = make_plan(cfg, {}, 0)
    staging = staging_dir("s3://runs/x")
    assert Path(plan.cfg.output_dir) == staging
    assert Path(plan.cfg.resume) == staging / "checkpoint.pth.tar"
    assert Path(plan.cfg.predictions) == staging_dir("s3://out/p.csv") / "p.csv"
    assert plan.staged.output_url == "s3://runs/x"
    assert plan.cache_dir == staging / "cache"  # the folder index and graphs: kept on this node
    remote = storage.Remote.of(plan.staged)
    assert remote.uploads == {"s3://out/p.csv": Path(plan.cfg.predictions)}
    assert storage.Remote.of(make_plan(parse_config(["d"]), {}, 0).staged) is None

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])

    class Stopped:  # the spawned child, as StoppedChildren sees it (it ends at the join)
        pid = child.pid
        join = staticmethod(lambda _timeout: (child.kill(), child.wait()))
        is_alive = staticmethod(lambda: child.poll() is None)
        kill = staticmethod(child.kill)

    StoppedChildren(1.0, plan.ranks, Path(plan.cfg.output_dir)).end(0, Stopped(), 40.0)
    assert (staging / "hang" / "report.json").is_file()
    assert not any(tmp_path.iterdir())  # nothing under the current folder


def test_hub_parquet_in_a_bucket_reads_as_it_does_from_a_disk(s3, tmp_path):
    """--data-format parquet on an S3-compatible store (where hf:// URLs go through the same
    fsspec reader): the same files, counts, class names and validation rows as on disk."""
    from test_parquet import hub_parquet, read_all

    from imagenet.data.shards.parquet import resolve_parquet

    local = hub_parquet(write_image_folder(tmp_path / "img", train_per_class=12,
                                           val_per_class=4), tmp_path / "hub")
    bucket().put(f"{local}/", "data/hub/", recursive=True)
    remote, disk = resolve_parquet("s3://data/hub", None), resolve_parquet(str(local), None)
    assert remote.train.urls[0] == \
        "s3://data/hub/data/train-00000-of-00003.parquet"
    assert (remote.train.counts, remote.val.counts, remote.classes) == \
        (disk.train.counts, disk.val.counts, disk.classes)
    for rank in range(2):
        assert read_all(remote.val, world=2, rank=rank, train=False) == \
            read_all(disk.val, world=2, rank=rank, train=False)
        assert read_all(remote.train, world=2, rank=rank, train=True, first=2) == \
            read_all(disk.train, world=2, rank=rank, train=True, first=2)
