"""``python -m imagenet.tools.prepare`` on miniature archives with the real ILSVRC2012 structure."""

from __future__ import annotations

import io
import json
import struct
import subprocess
import sys
import tarfile
import zlib
from pathlib import Path

import pytest

from imagenet.tools.matfile import load_mat

ROOT = Path(__file__).resolve().parents[1]
WNIDS = ["n01440764", "n01443537", "n01484850"]
TRAIN_PER_CLASS = [3, 2, 4]
# ILSVRC2012_ID of each val image (1-based ids into WNIDS), as in the devkit ground truth file.
VAL_IDS = [2, 1, 3, 3, 1, 2]


# --- a MAT v5 writer: the real level-5 layout (header, tagged elements, miMATRIX, structs) ---

def _element(mtype: int, payload: bytes) -> bytes:
    """A tagged data element padded to 8 bytes."""
    return struct.pack("<II", mtype, len(payload)) + payload + b"\0" * (-len(payload) % 8)


def _small_element(mtype: int, payload: bytes) -> bytes:
    """A small data element (at most 4 bytes of data packed into the tag)."""
    return struct.pack("<HH", mtype, len(payload)) + payload.ljust(4, b"\0")


def _matrix(cls: int, dims: tuple[int, ...], name: str, body: bytes) -> bytes:
    """An miMATRIX element: array flags, dimensions, name, then the class-specific body."""
    flags = _element(6, struct.pack("<II", cls, 0))
    dims_el = _element(5, struct.pack(f"<{len(dims)}i", *dims))
    return _element(14, flags + dims_el + _element(1, name.encode()) + body)


def _value(value, name: str = "") -> bytes:
    """A MATLAB array for a Python str (char, UTF-16), number or list (double row)."""
    if isinstance(value, str):
        return _matrix(4, (1, len(value)), name, _element(4, value.encode("utf-16-le")))
    values = value if isinstance(value, list) else [value]
    if all(float(v).is_integer() and 0 <= v < 256 for v in values) and values:
        # MATLAB stores whole doubles in the smallest integer type that holds them.
        data = _element(2, bytes(int(v) for v in values))
    else:
        data = _element(9, struct.pack(f"<{len(values)}d", *values))
    return _matrix(6, (1, len(values)), name, data)


def mat_file(name: str, records: list[dict], compress: bool) -> bytes:
    """A MAT v5 file holding one N x 1 struct array ``name`` (like devkit meta.mat)."""
    fields = list(records[0])
    width = 32
    body = _small_element(5, struct.pack("<i", width))
    body += _element(1, b"".join(f.encode().ljust(width, b"\0") for f in fields))
    body += b"".join(_value(r[f]) for r in records for f in fields)
    var = _matrix(2, (len(records), 1), name, body)
    if compress:
        compressed = zlib.compress(var)
        var = struct.pack("<II", 15, len(compressed)) + compressed  # miCOMPRESSED: no padding
    text = b"MATLAB 5.0 MAT-file, Platform: GLNXA64, Created on: test".ljust(116, b" ")
    return text + b"\0" * 8 + struct.pack("<H", 0x0100) + b"IM" + var


# --- miniature archives ---

def jpeg(seed: int) -> bytes:
    """A tiny real JPEG, different for every seed."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8 + seed % 5, 8), ((37 * seed) % 256, (91 * seed) % 256, 120)).save(
        buf, format="JPEG")
    return buf.getvalue()


def add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    """Add one regular file to a tar being written."""
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def synsets() -> list[dict]:
    """meta.mat's synsets: the three leaf classes plus one parent, all 8 real fields."""
    rows = [dict(ILSVRC2012_ID=i + 1, WNID=w, words=f"fish {i}", gloss="a fish", num_children=0,
                 children=[], wordnet_height=0, num_train_images=1300)
            for i, w in enumerate(WNIDS)]
    rows.append(dict(ILSVRC2012_ID=1001, WNID="n02512053", words="fish", gloss="any fish",
                     num_children=3, children=[1, 2, 3], wordnet_height=1.5, num_train_images=0))
    return rows


@pytest.fixture(scope="module")
def archives(tmp_path_factory) -> dict[str, Path]:
    """The four ILSVRC2012 inputs in miniature, plus what each image must end up as."""
    root = tmp_path_factory.mktemp("archives")
    images: dict[str, bytes] = {}
    with tarfile.open(root / "ILSVRC2012_img_train.tar", "w") as outer:
        for c, (wnid, n) in enumerate(zip(WNIDS, TRAIN_PER_CLASS)):
            inner_buf = io.BytesIO()
            with tarfile.open(fileobj=inner_buf, mode="w") as inner:
                for i in range(n):
                    name = f"{wnid}_{100 + i}.JPEG"
                    images[f"train/{wnid}/{name}"] = jpeg(10 * c + i)
                    add_bytes(inner, name, images[f"train/{wnid}/{name}"])
            add_bytes(outer, f"{wnid}.tar", inner_buf.getvalue())
    with tarfile.open(root / "ILSVRC2012_img_val.tar", "w") as val:
        for i, class_id in enumerate(VAL_IDS, start=1):
            name = f"ILSVRC2012_val_{i:08d}.JPEG"
            images[f"val/{WNIDS[class_id - 1]}/{name}"] = jpeg(100 + i)
            add_bytes(val, name, images[f"val/{WNIDS[class_id - 1]}/{name}"])
    with tarfile.open(root / "ILSVRC2012_devkit_t12.tar.gz", "w:gz") as devkit:
        data = "ILSVRC2012_devkit_t12/data/"
        add_bytes(devkit, data + "meta.mat", mat_file("synsets", synsets(), compress=True))
        truth = "".join(f"{i}\n" for i in VAL_IDS).encode()
        add_bytes(devkit, data + "ILSVRC2012_validation_ground_truth.txt", truth)
    lines = ["ImageId,PredictionString"] + [
        f"ILSVRC2012_val_{i:08d},{WNIDS[c - 1]} 1 2 30 40 {WNIDS[c - 1]} 5 6 7 8"
        for i, c in enumerate(VAL_IDS, start=1)]
    (root / "LOC_val_solution.csv").write_text("\n".join(lines) + "\n")
    paths = {p.name: p for p in root.iterdir()}
    return {"train": paths["ILSVRC2012_img_train.tar"], "val": paths["ILSVRC2012_img_val.tar"],
            "devkit": paths["ILSVRC2012_devkit_t12.tar.gz"], "csv": paths["LOC_val_solution.csv"],
            "images": images}  # type: ignore[dict-item]


def prepare(*args: object) -> subprocess.CompletedProcess:
    """Run the command as a user would."""
    cmd = [sys.executable, "-m", "imagenet.tools.prepare", *map(str, args)]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)


def full_args(archives, out: Path) -> list:
    """Both splits, devkit labels, expected counts of the miniature set."""
    return ["--train-tar", archives["train"], "--val-tar", archives["val"], "--devkit",
            archives["devkit"], "--out", out, "--expect-train", sum(TRAIN_PER_CLASS),
            "--expect-val", len(VAL_IDS)]


def image_files(out: Path) -> dict[str, bytes]:
    """Every image under ``out`` by relative path."""
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*.JPEG")}


def mtimes(out: Path) -> dict[Path, int]:
    """Modification times of every file under ``out``."""
    return {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}


def test_matfile_reads_what_a_v5_writer_wrote():
    for compress in (False, True):
        synsets_back = load_mat(mat_file("synsets", synsets(), compress))["synsets"]
        assert [s["WNID"] for s in synsets_back] == WNIDS + ["n02512053"]
        assert synsets_back[3]["children"] == [1.0, 2.0, 3.0]
        assert synsets_back[3]["wordnet_height"] == [1.5]
        assert synsets_back[0]["children"] == [] and synsets_back[0]["words"] == "fish 0"


def test_devkit_builds_the_image_folder(archives, tmp_path):
    out = tmp_path / "imagenet"
    result = prepare(*full_args(archives, out), "--log-every", 1)
    assert result.returncode == 0, result.stdout + result.stderr
    assert image_files(out) == archives["images"]  # every image, right folder, same bytes
    assert sorted(p.name for p in (out / "train").iterdir() if p.is_dir()) == WNIDS
    assert sorted(p.name for p in (out / "val").iterdir() if p.is_dir()) == WNIDS
    assert "train: 9 images in 3 classes, as expected: OK" in result.stdout
    assert "val: 6 images in 3 classes, as expected: OK" in result.stdout
    assert "images/s" in result.stdout  # progress lines with a rate
    assert not list(out.rglob("*.part"))


def test_second_run_skips_everything(archives, tmp_path):
    out = tmp_path / "imagenet"
    assert prepare(*full_args(archives, out)).returncode == 0
    before = mtimes(out)
    result = prepare(*full_args(archives, out))
    assert result.returncode == 0, result.stdout + result.stderr
    assert mtimes(out) == before
    assert "(3 complete before this run)" in result.stdout
    assert "val: 6 images already complete" in result.stdout


def test_interrupted_class_and_val_are_redone(archives, tmp_path):
    out = tmp_path / "imagenet"
    assert prepare(*full_args(archives, out)).returncode == 0
    broken = out / "train" / WNIDS[2]
    # What a kill mid-class leaves: no marker, a missing image, a stray temp file.
    (broken / ".imagenet-prepare-done").unlink()
    victim = sorted(broken.glob("*.JPEG"))[0]
    victim.unlink()
    (broken / "x.JPEG.part").write_bytes(b"half")
    (out / "val" / ".imagenet-prepare-done").unlink()
    (out / "val" / WNIDS[0] / "ILSVRC2012_val_00000002.JPEG").write_bytes(b"truncated")
    untouched = mtimes(out / "train" / WNIDS[0])
    result = prepare(*full_args(archives, out))
    assert result.returncode == 0, result.stdout + result.stderr
    assert image_files(out) == archives["images"]
    assert not list(out.rglob("*.part"))
    assert (broken / ".imagenet-prepare-done").read_text().strip() == "4"
    assert mtimes(out / "train" / WNIDS[0]) == untouched
    assert "(2 complete before this run)" in result.stdout


def test_refuses_a_folder_it_did_not_make(archives, tmp_path):
    out = tmp_path / "data"
    (out / "train").mkdir(parents=True)
    (out / "train" / "precious.txt").write_text("keep me")
    result = prepare(*full_args(archives, out))
    assert result.returncode == 2
    assert str(out / "train") in result.stderr and "Traceback" not in result.stderr
    assert [p.name for p in (out / "train").iterdir()] == ["precious.txt"]


def test_a_split_made_by_hand_next_to_one_it_made_is_refused(archives, tmp_path):
    # train/ comes from this tool; val/ is the user's own: preparing val must not touch it.
    out = tmp_path / "imagenet"
    train_only = ["--train-tar", archives["train"], "--out", out,
                  "--expect-train", sum(TRAIN_PER_CLASS)]
    assert prepare(*train_only).returncode == 0
    (out / "val" / WNIDS[0]).mkdir(parents=True)
    mine = out / "val" / WNIDS[0] / "ILSVRC2012_val_00000002.JPEG"
    mine.write_bytes(b"my own image")
    result = prepare("--val-tar", archives["val"], "--devkit", archives["devkit"], "--out", out)
    assert result.returncode == 2, result.stdout + result.stderr
    assert str(out / "val") in result.stderr and "Traceback" not in result.stderr
    assert mine.read_bytes() == b"my own image"


def test_count_mismatch_warns_and_fails_with_strict(archives, tmp_path):
    out = tmp_path / "imagenet"
    args = ["--train-tar", archives["train"], "--out", out]
    result = prepare(*args)  # the default expects the full 1281167
    assert result.returncode == 0
    assert "expected 1281167 (difference -1281158)" in result.stdout
    assert prepare(*args, "--strict").returncode == 1
    assert prepare(*args, "--strict", "--expect-train", 9).returncode == 0


@pytest.mark.parametrize("form", ["csv", "text"])
def test_val_only_with_csv_or_text_labels(archives, tmp_path, form):
    out = tmp_path / "imagenet"
    if form == "csv":
        labels = ["--val-csv", archives["csv"]]
    else:
        text = tmp_path / "val_labels.txt"
        text.write_text("".join(f"ILSVRC2012_val_{i:08d}.JPEG {WNIDS[c - 1]}\n"
                                for i, c in enumerate(VAL_IDS, start=1)))
        labels = ["--val-labels", text]
    result = prepare("--val-tar", archives["val"], *labels, "--out", out, "--expect-val", 6)
    assert result.returncode == 0, result.stdout + result.stderr
    expected = {k: v for k, v in archives["images"].items() if k.startswith("val/")}
    assert image_files(out) == expected
    assert not (out / "train").exists()


def test_bad_input_gets_one_clear_message(archives, tmp_path):
    out = tmp_path / "imagenet"
    missing = prepare("--train-tar", tmp_path / "nope.tar", "--out", out)
    assert missing.returncode == 2 and "nope.tar: file not found" in missing.stderr
    swapped = prepare("--train-tar", archives["val"], "--out", out)
    assert swapped.returncode == 2 and "is not a per-class tar" in swapped.stderr
    not_tar = prepare("--train-tar", archives["csv"], "--out", out)
    assert not_tar.returncode == 2 and "not a tar archive" in not_tar.stderr
    no_labels = prepare("--val-tar", archives["val"], "--out", out)
    assert no_labels.returncode == 2 and "--devkit" in no_labels.stderr
    bad_devkit = prepare("--val-tar", archives["val"], "--devkit", archives["train"], "--out", out)
    assert bad_devkit.returncode == 2 and "meta.mat" in bad_devkit.stderr
    for result in (missing, swapped, not_tar, no_labels, bad_devkit):
        assert "Traceback" not in result.stdout + result.stderr


def test_wrong_labels_and_truncated_archive(archives, tmp_path):
    out = tmp_path / "imagenet"
    text = tmp_path / "labels.txt"
    text.write_text(f"ILSVRC2012_val_00000001.JPEG {WNIDS[0]}\n")  # 1 of the 6 images
    unlabelled = prepare("--val-tar", archives["val"], "--val-labels", text, "--out", out)
    assert unlabelled.returncode == 2
    assert "no label for ILSVRC2012_val_00000002.JPEG" in unlabelled.stderr
    train_as_val = prepare("--val-tar", archives["train"], "--val-csv", archives["csv"],
                           "--out", out)
    assert train_as_val.returncode == 2 and "looks like the train archive" in train_as_val.stderr
    truncated = tmp_path / "ILSVRC2012_img_train.tar"
    truncated.write_bytes(archives["train"].read_bytes()[:3000])  # a download cut short
    cut = prepare("--train-tar", truncated, "--out", out)
    assert cut.returncode == 1 and "truncated or corrupt" in cut.stderr
    for result in (unlabelled, train_as_val, cut):
        assert "Traceback" not in result.stdout + result.stderr


# --- tar shards (--format shards, --from-folder) ---

def shard_files(out: Path) -> dict[str, bytes]:
    """The shards and _info.json under ``out`` by name."""
    return {p.name: p.read_bytes() for p in out.iterdir() if p.suffix in (".tar", ".json")}


def shard_samples(out: Path) -> dict[str, tuple[bytes, int]]:
    """Every sample of every shard (read by tarfile): key -> (image bytes, label)."""
    samples: dict[str, list] = {}
    for shard in sorted(out.glob("*.tar")):
        with tarfile.open(shard) as tar:
            for member in tar:
                key, ext = member.name.split(".", 1)
                samples.setdefault(f"{shard.name[:3]}/{key}", [None, None])
                data = tar.extractfile(member).read()
                samples[f"{shard.name[:3]}/{key}"][ext == "cls"] = int(data) if ext == "cls" \
                    else data
    return {k: tuple(v) for k, v in samples.items()}


SHARDS = ["--format", "shards", "--shard-max-images", 4]


@pytest.mark.slow
def test_shards_from_the_archives_equal_shards_of_the_prepared_folder(archives, tmp_path):
    folder = tmp_path / "imagenet"
    assert prepare(*full_args(archives, folder)).returncode == 0
    direct = prepare(*full_args(archives, tmp_path / "direct"), *SHARDS)
    assert direct.returncode == 0, direct.stdout + direct.stderr
    via = prepare("--from-folder", folder, "--out", tmp_path / "via", "--shard-max-images", 4)
    assert via.returncode == 0, via.stdout + via.stderr
    direct_files, via_files = shard_files(tmp_path / "direct"), shard_files(tmp_path / "via")
    info = json.loads(direct_files.pop("_info.json"))
    assert info == {**json.loads(via_files.pop("_info.json")), "name": "direct"}
    assert direct_files == via_files  # the same shards, byte for byte
    assert info["classes"] == WNIDS and info["num_classes"] == 3
    assert info["splits"]["train"] == {"name": "train", "filenames": [
        "train-000000.tar", "train-000001.tar", "train-000002.tar"], "shard_lengths": [4, 4, 1],
        "num_samples": 9}
    assert info["splits"]["validation"]["shard_lengths"] == [4, 2]
    expected = {f"{path[:3]}/{wnid}/{name.split('.')[0]}": (data, WNIDS.index(wnid))
                for path, data in archives["images"].items()
                for _, wnid, name in [path.split("/")]}
    assert shard_samples(tmp_path / "direct") == expected  # each image once, right label
    with tarfile.open(tmp_path / "direct" / "train-000000.tar") as tar:
        order = [m.name for m in tar]
    assert order != sorted(order)  # a shuffled order, not the folder's


@pytest.mark.slow
def test_shard_writing_is_idempotent_and_resumes_after_an_interruption(archives, tmp_path):
    out = tmp_path / "shards"
    args = [*full_args(archives, out), *SHARDS]
    assert prepare(*args).returncode == 0
    written, before = shard_files(out), mtimes(out)
    assert prepare(*args).returncode == 0
    assert mtimes(out) == before  # nothing rewritten
    # What a kill leaves: a missing shard, a cut one, a temporary file.
    (out / "train-000001.tar").unlink()
    (out / "train-000002.tar").write_bytes(b"x" * 100)
    (out / "val-000000.tar.part").write_bytes(b"half")
    result = prepare(*args)
    assert result.returncode == 0, result.stdout + result.stderr
    assert shard_files(out) == written and not list(out.glob("*.part"))
    assert (out / "train-000000.tar").stat().st_mtime_ns == before[out / "train-000000.tar"]
    # Another seed is another plan: every shard is written again, none left over.
    result = prepare(*args, "--seed", 1)
    assert result.returncode == 0 and "writing them again" in result.stdout
    assert shard_files(out).keys() == written.keys()
    assert shard_files(out)["train-000000.tar"] != written["train-000000.tar"]
    assert shard_samples(out) == shard_samples_of(written, tmp_path)
    assert prepare("--from-folder", tmp_path / "nope", "--out", out).returncode == 2


def shard_samples_of(files: dict[str, bytes], tmp_path: Path) -> dict:
    copy = tmp_path / "copy"
    copy.mkdir()
    for name, data in files.items():
        (copy / name).write_bytes(data)
    return shard_samples(copy)


def test_the_writers_import_their_shared_helpers_one_way():
    """prepare -> shardwrite -> prepfiles: neither writer imports the command line module."""
    import ast

    tools = ROOT / "imagenet" / "tools"
    for name, forbidden in (("shardwrite", {"imagenet.tools.prepare"}),
                            ("prepfiles", {"imagenet.tools.prepare", "imagenet.tools.shardwrite"})):
        tree = ast.parse((tools / f"{name}.py").read_text())
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        imported |= {a.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                     for a in node.names}
        assert not imported & forbidden, f"{name} imports {imported & forbidden}"


def test_shards_refuse_the_train_archive_as_val_and_an_out_inside_the_input(archives, tmp_path):
    out = tmp_path / "shards"
    swapped = prepare("--val-tar", archives["train"], "--val-csv", archives["csv"], "--out", out,
                      *SHARDS)
    assert swapped.returncode == 2 and "looks like the train archive" in swapped.stderr
    assert not (out / "_info.json").exists()  # no empty validation split written
    folder = tmp_path / "imagenet"
    assert prepare(*full_args(archives, folder)).returncode == 0
    before = sorted(p.relative_to(folder) for p in folder.rglob("*"))
    inside = [prepare("--from-folder", folder, "--out", out)
              for out in (folder / "train" / "shards", folder / "shards")]
    assert sorted(p.relative_to(folder) for p in folder.rglob("*")) == before  # input untouched
    for result in (swapped, *inside):
        assert "Traceback" not in result.stdout + result.stderr
    for result in inside:
        assert result.returncode == 2 and f"is inside --from-folder {folder}" in result.stderr


def test_a_damaged_info_json_is_named_with_what_to_do(archives, tmp_path):
    out = tmp_path / "shards"
    args = ["--val-tar", archives["val"], "--devkit", archives["devkit"], "--out", out,
            "--expect-val", len(VAL_IDS), *SHARDS]
    assert prepare(*args).returncode == 0
    shards = shard_files(out)
    (out / "_info.json").write_text('{"name": "shards", "splits": {"validation": {"filen')
    damaged = prepare(*args)
    assert damaged.returncode == 2 and "Traceback" not in damaged.stdout + damaged.stderr
    [line] = damaged.stderr.strip().splitlines()
    assert line.startswith(f"error: {out / '_info.json'} is damaged (Unterminated string")
    assert line.endswith("; delete it and run this command again with every split it should "
                         "list (finished shards are kept, not written again)")
    (out / "_info.json").unlink()  # what the message says
    (out / ".imagenet-prepare-shards").write_text("{not json")  # our own record: rewritten
    again = prepare(*args)
    assert again.returncode == 0 and "is damaged: writing the validation shards again" in \
        again.stdout
    assert shard_files(out) == shards
