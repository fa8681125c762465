"""Tar shards (WebDataset format) read by ``imagenet.data.shards``: real JPEG shards written by
``python -m imagenet.tools.prepare``, real DataLoader workers, a real ``python -m http.server``
and real ``pipe:`` commands. The end-to-end runs of main.py are in test_shards_train.py."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
from helpers import (
    ROOT,
    TINY,
    child_env,
    device_images_match,
    main_cmd,
    run_main,
    run_parallel,
    write_image_folder,
)
from torch.utils.data import DataLoader

from imagenet.data import transforms as T
from imagenet.data.shards import plan, streams
from imagenet.data.shards.reader import ShardBatchSampler, ShardSamples
from imagenet.data.shards.sources import (
    ShardList,
    beside,
    expand_braces,
    resolve,
)
from imagenet.data.shards.tarreader import SampleReader, ShardError
from imagenet.errors import UsageError
from imagenet.settings.images import data_format

TRAIN_COUNTS = [10, 10, 10, 10, 10, 7]  # 57 images: 3 classes x 19, 10 per shard
VAL_COUNTS = [10, 5]


def prepare_shards(folder: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    """``python -m imagenet.tools.prepare --from-folder`` as a user runs it."""
    cmd = [sys.executable, "-m", "imagenet.tools.prepare", "--from-folder", str(folder),
           "--out", str(out), *extra]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory) -> Path:
    """Shards of a 3-class JPEG folder (57 train, 15 val images), 10 images per shard."""
    root = tmp_path_factory.mktemp("shards")
    write_image_folder(root / "folder", classes=3, train_per_class=19, val_per_class=5)
    proc = prepare_shards(root / "folder", root / "shards", "--shard-max-images", "10")
    assert proc.returncode == 0, proc.stderr
    return root / "shards"


def make_loader(shards: ShardList, *, world: int = 1, rank: int = 0, batch: int = 4,
                train: bool = True, workers: int = 0, block: int = plan.BLOCK) -> DataLoader:
    """The loader the trainer builds, with sample keys in its batches."""
    tf = T.train_transform(16) if train else T.val_transform(18, 16)
    sampler = ShardBatchSampler(shards, world_size=world, rank=rank, batch_size=batch,
                                shuffle=train, seed=3, aug_seed=5, block=block)
    return DataLoader(ShardSamples(tf, "tensor", 3, train, keys=True), batch_sampler=sampler,
                      num_workers=workers)


def batches(shards: ShardList, *, epoch: int = 0, first: int = 0,
            loader: DataLoader | None = None, **kwargs) -> list[tuple[list[str], list[int], str]]:
    """(keys, labels, sha1 of the images) of every batch a rank's loader yields."""
    loader = loader or make_loader(shards, **kwargs)
    loader.batch_sampler.set_position(epoch, first)
    return [(keys, labels.tolist(), hashlib.sha1(images.numpy().tobytes()).hexdigest())
            for images, labels, keys in loader]


def keys_of(result) -> list[str]:
    return [k for keys, _, _ in result for k in keys]


# ---------------------------------------------------------------- patterns and _info.json


def test_brace_patterns_and_the_info_beside_them():
    assert expand_braces("t-{000..002}.tar") == ["t-000.tar", "t-001.tar", "t-002.tar"]
    assert expand_braces("{a,b}{8..10}") == ["a8", "a9", "a10", "b8", "b9", "b10"]
    assert beside("https://h/d/train-{0..9}.tar", "_info.json") == "https://h/d/_info.json"
    assert beside("pipe:aws s3 cp s3://b/d/train-{0..9}.tar -", "x.tar") == \
        "pipe:aws s3 cp s3://b/d/x.tar -"
    with pytest.raises(UsageError, match="may only stand in the shard file name"):
        beside("/data/{a,b}/train-{0..9}.tar", "_info.json")


@pytest.mark.slow
def test_the_data_argument_chooses_the_reader(shard_dir, tmp_path):
    assert data_format(str(shard_dir), "auto") == "shards"
    assert data_format(str(shard_dir.parent / "folder"), "auto") == "folder"
    for form in ("/x/train-{0..3}.tar", "http://h/d", "pipe:cat /x/a.tar"):
        assert data_format(form, "auto") == "shards"
    both = tmp_path / "both"
    shutil.copytree(shard_dir.parent / "folder", both)
    shutil.copy(shard_dir / "_info.json", both)
    with pytest.raises(UsageError, match="--data-format"):
        data_format(str(both), "auto")
    assert data_format(str(both), "folder") == "folder"
    loose = tmp_path / "loose"
    loose.mkdir()
    shutil.copy(shard_dir / "train-000000.tar", loose)
    with pytest.raises(UsageError, match="no _info.json"):
        data_format(str(loose), "auto")


def test_our_info_and_a_pattern_give_the_same_shards(shard_dir):
    whole = resolve(str(shard_dir), None, None)
    assert whole.train.counts == tuple(TRAIN_COUNTS) and whole.val.counts == tuple(VAL_COUNTS)
    assert whole.classes == ["class0", "class1", "class2"]
    info = json.loads((shard_dir / "_info.json").read_text())
    assert info["splits"]["train"]["num_samples"] == 57 and info["num_classes"] == 3
    picked = resolve(f"{shard_dir}/train-{{000000..000005}}.tar",
                     f"{shard_dir}/val-{{000000..000001}}.tar", None)
    assert picked == whole
    counted = tmp_copy_without_info(shard_dir)
    assert resolve(f"{counted}/train-{{000000..000005}}.tar", f"{counted}/val-000001.tar",
                   3).train.counts == tuple(TRAIN_COUNTS)
    with pytest.raises(UsageError, match="--num-classes 4 but"):
        resolve(str(shard_dir), None, 4)


def tmp_copy_without_info(shard_dir: Path) -> Path:
    copy = shard_dir.parent / "no-info"
    if not copy.exists():
        shutil.copytree(shard_dir, copy, ignore=shutil.ignore_patterns("_info.json"))
    return copy


def write_published_layout(root: Path, source: Path) -> None:
    """Shards named and laid out like timm/imagenet-1k-wds: KEY.cls, KEY.jpg, KEY.json members
    (sorted by extension), keys without a class folder, an _info.json without class names."""
    root.mkdir()
    info = {"name": "imagenet1k", "splits": {}}
    for split, folder, names in (("train", "train", ["0000", "0001"]),
                                 ("validation", "val", ["00"])):
        files = sorted((source / folder).rglob("*.jpg"))
        parts = [files[i::len(names)] for i in range(len(names))]
        filenames = [f"imagenet1k-{split}-{n}.tar" for n in names]
        for filename, part in zip(filenames, parts):
            with tarfile.open(root / filename, "w") as tar:
                for f in part:
                    label = int(f.parent.name.removeprefix("class"))
                    meta = json.dumps({"label": label, "filename": f.name}).encode()
                    for ext, data in (("cls", str(label).encode()), ("jpg", f.read_bytes()),
                                      ("json", meta)):
                        member = tarfile.TarInfo(f"{f.parent.name}_{f.stem}.{ext}")
                        member.size = len(data)
                        tar.addfile(member, io.BytesIO(data))
        info["splits"][split] = {"name": split, "filenames": filenames,
                                 "shard_lengths": [len(p) for p in parts],
                                 "num_samples": len(files)}
    (root / "_info.json").write_text(json.dumps(info))


def test_the_published_imagenet_layout_is_read(shard_dir, tmp_path):
    published = tmp_path / "imagenet-1k-wds"
    write_published_layout(published, shard_dir.parent / "folder")
    with pytest.raises(UsageError, match="--num-classes N"):
        resolve(str(published), None, None)
    shards = resolve(str(published), None, 3)
    assert shards.classes == ["0", "1", "2"] and shards.train.total == 57
    result = batches(shards.val, batch=8, train=False)
    assert sorted(keys_of(result)) == sorted(
        f"{p.parent.name}_{p.stem}" for p in (shard_dir.parent / "folder" / "val").rglob("*.jpg"))
    assert all(labels == [int(k.split("_")[0][-1]) for k in keys]
               for keys, labels, _ in result)


# ---------------------------------------------------------------- the tar reader


def test_reader_reads_every_tar_variant_tarfile_writes(tmp_path):
    long_dir = "d" * 120
    for fmt in (tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT):
        path = tmp_path / f"f{fmt}.tar"
        with tarfile.open(path, "w", format=fmt) as tar:
            directory = tarfile.TarInfo("adir")
            directory.type = tarfile.DIRTYPE
            tar.addfile(directory)  # not a sample
            if fmt == tarfile.USTAR_FORMAT:
                tar.addfile(tarfile.TarInfo("x"))  # no extension: a sample with no members
            names = [f"short/k{i}" for i in range(3)]
            if fmt != tarfile.USTAR_FORMAT:
                names.append(f"{long_dir}/longkey")  # needs a GNU long name or a pax header
            for name in names:
                for ext in ("jpg", "cls", "txt"):
                    data = f"{name}.{ext}".encode() * 100
                    member = tarfile.TarInfo(f"{name}.{ext}")
                    member.size = len(data)
                    tar.addfile(member, io.BytesIO(data))
        for url in (str(path), f"pipe:cat {path}"):  # seeking and streaming
            reader = SampleReader(streams.open_shard(url), url, frozenset({"jpg", "cls"}))
            samples = []
            while (sample := reader.next()) is not None:
                samples.append(sample)
            reader.close()
            keys = [s["__key__"] for s in samples if s["__key__"] != "x"]
            assert keys == names
            assert all(s["jpg"] == f"{s['__key__']}.jpg".encode() * 100 and "txt" not in s
                       for s in samples if "jpg" in s)
    skipper = SampleReader(streams.open_shard(str(tmp_path / f"f{tarfile.PAX_FORMAT}.tar")),
                           "x", frozenset({"jpg"}))
    assert skipper.skip(3) == 3 and skipper.next()["__key__"] == f"{long_dir}/longkey"


def member_offsets(path: Path) -> list[tuple[int, int, int]]:
    """(header offset, data offset, size) of each member, by tarfile."""
    with tarfile.open(path) as tar:
        return [(m.offset, m.offset_data, m.size) for m in tar.getmembers()]


@pytest.mark.parametrize("cut", ["at a member", "inside data", "inside a header",
                                 "no end block", "garbage"])
def test_a_truncated_or_corrupt_shard_is_an_error_naming_it(shard_dir, tmp_path, cut):
    source = shard_dir / "train-000001.tar"
    raw = source.read_bytes()
    members = member_offsets(source)
    header, data, size = members[7]
    last_end = members[-1][1] + -(-members[-1][2] // 512) * 512
    bad = {"at a member": raw[:header], "inside data": raw[:data + size // 2],
           "inside a header": raw[:header + 100], "no end block": raw[:last_end],
           "garbage": raw[:header] + b"<html>not found</html>" * 30 + raw[header + 660:]}[cut]
    path = tmp_path / "train-000001.tar"
    path.write_bytes(bad)
    shards = ShardList((str(path),), (10,))
    for url in (str(path), f"pipe:cat {path}"):
        with pytest.raises(ShardError, match=f"shard {url} is (truncated|not a tar file)"):
            batches(ShardList((url,), shards.counts), batch=5, train=False)


def test_missing_unreadable_and_miscounted_shards_are_errors_naming_them(shard_dir, tmp_path):
    good = str(shard_dir / "train-000000.tar")
    (tmp_path / "dir.tar").mkdir()
    cases = [(f"{tmp_path}/gone.tar", 10, "is missing"),
             (f"{tmp_path}/dir.tar", 10, "cannot be read"),
             (good, 11, "ends after 10 samples but its _info.json lists 11"),
             (good, 9, "holds more than the 9 samples its _info.json lists")]
    for url, count, message in cases:
        with pytest.raises(ShardError, match=f"shard {url} {message}"):
            batches(ShardList((url,), (count,)), batch=3, train=False)


# ---------------------------------------------------------------- the epoch plan, as read


@pytest.mark.parametrize("world,batch", [(1, 8), (2, 4), (3, 5)])
def test_equal_steps_per_rank_and_each_training_sample_at_most_once(shard_dir, world, batch):
    shards = resolve(str(shard_dir), None, None)
    steps = 57 // (world * batch)
    seen = {}
    for epoch in (0, 1):
        per_rank = [batches(shards.train, world=world, rank=r, batch=batch, epoch=epoch)
                    for r in range(world)]
        assert [len(b) for b in per_rank] == [steps] * world
        keys = [k for result in per_rank for k in keys_of(result)]
        assert len(keys) == len(set(keys)) == steps * world * batch  # no sample twice
        seen[epoch] = per_rank
    assert keys_of(seen[0][0]) != keys_of(seen[1][0])  # each epoch its own order


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_validation_reads_every_image_exactly_once(shard_dir, world):
    shards = resolve(str(shard_dir), None, None)
    keys = [k for r in range(world)
            for k in keys_of(batches(shards.val, world=world, rank=r, batch=4, train=False))]
    assert sorted(keys) == sorted(f"{p.parent.name}/{p.stem}" for p in
                                  (shard_dir.parent / "folder" / "val").rglob("*.jpg"))


def test_batches_do_not_depend_on_the_number_of_loader_workers(shard_dir):
    shards = resolve(str(shard_dir), None, None)
    reference = batches(shards.train, world=2, rank=1, batch=4, epoch=2)
    for workers in (1, 2):  # real worker processes
        assert batches(shards.train, world=2, rank=1, batch=4, epoch=2,
                       workers=workers) == reference


def test_the_device_path_gives_the_cpu_path_s_images_from_shards(shard_dir):
    """--decode-on-device on tar shards: every image as the CPU path gives it."""
    assert device_images_match(resolve(str(shard_dir), None, None)) == (112, 15)  # 7 steps of 8


def test_a_resumed_epoch_continues_exactly_without_decoding_the_samples_before(shard_dir):
    shards = resolve(str(shard_dir), None, None)
    for block in (3, plan.BLOCK):  # shuffled in blocks of 3: streams skip whole blocks
        whole = batches(shards.train, epoch=1, block=block)
        resumed = make_loader(shards.train, block=block)
        rest = batches(shards.train, epoch=1, first=9, loader=resumed)
        assert len(whole) == 14 and rest == whole[9:]
        assert resumed.dataset.stats.decoded == 4 * len(rest)  # only the samples it yields
        if block == 3:
            assert resumed.batch_sampler.stats.skipped >= 9  # passed over by their headers
            assert keys_of(whole) != keys_of(batches(shards.train, batch=4, epoch=1))


# ---------------------------------------------------------------- http and pipe:


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(directory: Path, port: int) -> subprocess.Popen:
    """``python -m http.server`` on 127.0.0.1:port, once it accepts connections."""
    proc = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind",
                             "127.0.0.1", "--directory", str(directory)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise AssertionError("http.server did not start")


@pytest.fixture(scope="module")
def http_base(shard_dir):
    port = free_port()
    proc = start_server(shard_dir, port)
    yield f"http://127.0.0.1:{port}"
    proc.kill()
    proc.wait()


@pytest.mark.slow
def test_http_and_pipe_read_the_same_batches_as_local_files(shard_dir, http_base):
    local = resolve(str(shard_dir), None, None)
    reference = batches(local.train, world=2, rank=0, batch=4, epoch=1, first=2, workers=2)
    for data in (http_base, f"{http_base}/train-{{000000..000005}}.tar",
                 f"pipe:cat {shard_dir}/train-{{000000..000005}}.tar"):
        remote = resolve(data, None, None)
        assert remote.train.counts == local.train.counts and remote.classes == local.classes
        assert batches(remote.train, world=2, rank=0, batch=4, epoch=1, first=2,
                       workers=2) == reference


def test_failed_downloads_are_retried_then_name_the_shard(shard_dir, http_base, tmp_path,
                                                          monkeypatch):
    monkeypatch.setattr(streams, "BACKOFF", 0.05)
    with pytest.raises(ShardError, match=f"shard {http_base}/nope.tar is missing .HTTP 404"):
        streams.open_shard(f"{http_base}/nope.tar")
    with pytest.raises(UsageError, match="no _info.json beside"):
        resolve(f"{http_base}/elsewhere/nope-{{0..1}}.tar", None, 3)
    # A server killed in the middle of a shard: urllib's read() then returns b"" early.
    big = tmp_path / "served"
    big.mkdir()
    (big / "big.tar").write_bytes(b"\1" * (48 << 20))
    port = free_port()
    server = start_server(big, port)
    url = f"http://127.0.0.1:{port}/big.tar"
    f = streams.open_shard(url)
    f.read(1 << 20)
    server.send_signal(signal.SIGKILL)
    server.wait()
    with pytest.raises(ShardError, match=f"shard {url}: download failed 3 times, at byte"):
        while f.read(1 << 20):
            pass
    command = f"pipe:cat {tmp_path}/nope.tar"
    with pytest.raises(ShardError, match="exited with code 1: cat: .*No such file"):
        streams.open_shard(command).read()


def test_a_download_that_drops_continues_where_it_stopped(shard_dir, tmp_path, monkeypatch):
    """The retry continues at the byte where the dropped try stopped: whole shard, once."""
    monkeypatch.setattr(streams, "BACKOFF", 0.05)
    source = shard_dir / "train-000002.tar"
    flaky = tmp_path / "flaky.sh"  # fails after 3000 bytes on its first run only
    flaky.write_text(f"#!/bin/sh\nif [ -e {tmp_path}/ran ]; then cat {source}; else "
                     f"touch {tmp_path}/ran; head -c 3000 {source}; exit 7; fi\n")
    flaky.chmod(0o755)
    assert streams.open_shard(f"pipe:{flaky}").read() == source.read_bytes()


# ---------------------------------------------------------------- before training; every error ends


def test_each_rank_checks_its_share_of_the_validation_shards(shard_dir, tmp_path, monkeypatch):
    from imagenet.data.shards.check import first_bad_shard

    monkeypatch.setattr(streams, "BACKOFF", 0.05)
    names = ["train-000000.tar", "train-000001.tar", "val-000000.tar", "val-000001.tar"]
    for name in names:
        shutil.copy(shard_dir / name, tmp_path)
    urls, counts = tuple(str(tmp_path / n) for n in names), (10, 10, 10, 5)

    def found(shards: ShardList) -> list[str | None]:
        return [str(e) if e else None for e in (first_bad_shard(shards, r, 2) for r in (0, 1))]

    assert found(ShardList(urls, counts)) == [None, None]
    piped = tuple(f"pipe:head -c 15000 {u}" for u in urls)  # cut, but its start is read
    assert found(ShardList(piped, counts)) == [None, None]
    assert found(ShardList(urls, (10, 10, 11, 5))) == [
        f"shard {urls[2]} ends after 10 samples but its _info.json lists 11: copy it again or "
        "fix _info.json", None]
    assert found(ShardList(urls, (10, 10, 10, 4)))[1].startswith(f"shard {urls[3]} holds more")
    cut = tmp_path / names[1]
    cut.write_bytes(cut.read_bytes()[:15000])
    assert found(ShardList(urls, counts))[1].startswith(f"shard {cut} is truncated")
    cut.unlink()
    assert found(ShardList(urls, counts)) == [None, f"shard {cut} is missing"]
    cut.mkdir()
    assert found(ShardList(urls, counts))[1].startswith(f"shard {cut} cannot be read")
    failing = (f"pipe:cat {tmp_path}/gone.tar",)
    assert "exited with code 1: cat:" in found(ShardList(failing, (10,)))[0]


@pytest.mark.slow
def test_a_truncated_validation_shard_stops_the_run_before_its_first_step(shard_dir, tmp_path):
    broken = tmp_path / "shards"
    shutil.copytree(shard_dir, broken)
    victim = broken / "val-000001.tar"
    victim.write_bytes(victim.read_bytes()[:9000])
    out = tmp_path / "out"
    proc = run_main(str(broken), *TINY, "--epochs", "1", "--output-dir", str(out), timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: shard {victim} is truncated")
    assert line.endswith("; found by the check of the validation shards before training")
    assert "Epoch: [" not in proc.stdout and not (out / "checkpoint.pth.tar").exists()


@pytest.mark.slow
def test_a_validation_loader_error_ends_the_process(shard_dir, tmp_path):
    """-j 1: the loader's first batches fail while its iterator is built (the truncated shard
    is read in the training process), leaving a worker no loader holds; the process used to
    print its error and wait for that worker forever."""
    broken = tmp_path / "shards"
    shutil.copytree(shard_dir, broken)
    victim = broken / "val-000000.tar"
    victim.write_bytes(victim.read_bytes()[:15000])
    cmd = main_cmd(str(broken), *TINY, "-j", "1", "-e", "--output-dir", str(tmp_path / "out"))
    (result,) = run_parallel([cmd], [child_env()], tmp_path / "logs", timeout=90)
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(f"error: shard {victim} is truncated")


def process_gone(pid: int, within: float = 10.0) -> bool:
    """Whether process ``pid`` ended (a zombie counts: it runs no more) within ``within`` s."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z":
                return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


def test_a_failing_or_stalled_info_command_is_reported_with_its_stderr(tmp_path, monkeypatch):
    from imagenet.errors import DataError

    monkeypatch.setattr(streams, "SMALL_TIMEOUT", 1.0)
    denied = tmp_path / "denied.sh"  # what an expired credential looks like, at once
    denied.write_text("#!/bin/sh\necho 'download failed:' >&2\necho 'An error occurred "
                      "(ExpiredToken) when calling the GetObject operation' >&2\nexit 1\n")
    stall = tmp_path / "stall.sh"  # a child that would outlive its shell, then no output
    stall.write_text(f"#!/bin/sh\nsleep 300 &\necho $! > {tmp_path}/child\n"
                     "echo 'connecting to s3' >&2\nwait\n")
    for script in (denied, stall):
        script.chmod(0o755)
    start = time.monotonic()
    with pytest.raises(DataError) as error:
        resolve(f"pipe:{denied} s3://b/train-{{0..1}}.tar", None, 3)
    assert str(error.value) == (
        f"cannot fetch the _info.json beside 'pipe:{denied} s3://b/train-{{0..1}}.tar': "
        f"'{denied} s3://b/_info.json' exited with code 1: download failed: / An error occurred "
        "(ExpiredToken) when calling the GetObject operation; fix the command (path, "
        "credentials) or put the file there (the sample counts are needed before training)")
    with pytest.raises(DataError) as error:
        resolve(f"pipe:{stall} /d/train-{{0..1}}.tar", None, 3)
    assert f"'{stall} /d/_info.json' gave no output for 1 s: connecting to s3;" in \
        str(error.value)
    assert time.monotonic() - start < 20  # one try, not 3 x 60 s for each of two names
    assert process_gone(int((tmp_path / "child").read_text()))  # its whole group was killed
