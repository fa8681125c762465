"""--compile's graphs follow the run (issue 31): kept in --cache-dir, one archive per training crop
size, loaded by a requeued start (which then compiles nothing it compiled before), not used -
with one line - when they were made for another torch, device, model or shapes, or are damaged.

Real inductor compiles in processes of their own (a process keeps compiled graphs in memory;
forked from a forkserver that imported torch and compiled nothing, ``helpers.start_ranks``): a
tiny model through the cache's own calls for the cases, and main.py for the requeued run, whose
weights must be the uninterrupted run's, bit for bit. Inductor's C++ kernels need a compiler:
without one these tests are skipped (as test_recipe.py's compile smoke test is).
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers import (  # noqa: E402
    TINY18,
    child_env,
    fault_at,
    load_checkpoint,
    prestarted_cmd,
    run_main,
    start_ranks,
    write_image_folder,
)

pytestmark = pytest.mark.slow

SIGNATURE = {"arch": "tiny", "batch": 4}


def compile_steps(_: int, place: str, sizes: str, signature: str, result: str) -> None:
    """In a process of its own: open the compile cache at ``place``, train a tiny model one step
    at each crop size in ``sizes`` (comma-separated), keeping each size's graphs; write what the
    cache said and inductor's counts to ``result`` (JSON)."""
    import logging

    import torch
    from helpers import tiny_net

    from imagenet.training.compile_cache import graph_cache_counts, open_cache
    from imagenet.training.models import compile_model

    torch.set_num_threads(1)  # as OMP_NUM_THREADS=1 (child_env) sets it for a new process
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger().addHandler(handler)
    logging.getLogger().setLevel(logging.INFO)
    made_for = json.loads(signature)
    cache = open_cache(Path(place), made_for, writes=True)
    assert cache is not None
    model = compile_model(tiny_net((8,)), crop_sizes=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for size in map(int, sizes.split(",")):
        x, y = torch.randn(4, 3, size, size), torch.randint(0, 3, (4,))
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        cache.save_if_compiled(size)
    cache.close()
    Path(result).write_text(json.dumps({"lines": lines, **graph_cache_counts()}))


def run_compile(place: Path, sizes: str, signature: dict | None = None) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        result = Path(folder) / "result.json"
        start_ranks(compile_steps, args=(str(place), sizes, json.dumps(signature or SIGNATURE),
                                         str(result)), nprocs=1, env=child_env())
        return json.loads(result.read_text())


def manifest(place: Path) -> dict:
    return json.loads((place / "compile" / "manifest.json").read_text())


@pytest.fixture(scope="module")
def toolchain() -> None:
    """Inductor's C++ compiler and Python headers, or the test is skipped."""
    from test_recipe import _compile_toolchain_missing

    reason = _compile_toolchain_missing()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def compiled(toolchain, tmp_path_factory) -> tuple[Path, dict]:
    """A cache holding a tiny model's graphs for crop sizes 16 and 24 (compiled cold)."""
    place = tmp_path_factory.mktemp("compiled") / "cache"
    return place, run_compile(place, "16,24")


def copy_of(compiled: tuple[Path, dict], tmp_path: Path) -> Path:
    place = tmp_path / "cache"
    shutil.copytree(compiled[0], place)
    return place


def test_each_crop_size_keeps_an_archive_and_a_requeue_compiles_nothing(compiled, tmp_path):
    place, cold = compiled
    assert cold["misses"] > 0 and cold["hits"] == 0
    assert any("no compiled graphs in" in line for line in cold["lines"])
    sizes = manifest(place)["sizes"]
    assert sorted(sizes, key=int) == ["16", "24"]
    for entry in sizes.values():
        assert (place / "compile" / entry["archive"]).is_file() and entry["files"] > 0
    warm = run_compile(copy_of(compiled, tmp_path), "16,24")  # another node: another path
    assert warm["misses"] == 0 and warm["hits"] >= cold["misses"]
    assert any("reusing the graphs compiled for crop size(s) 16, 24 px" in line
               for line in warm["lines"])


def test_a_damaged_archive_is_not_used_and_is_replaced(compiled, tmp_path):
    place = copy_of(compiled, tmp_path)
    damaged = place / "compile" / manifest(place)["sizes"]["24"]["archive"]
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    again = run_compile(place, "16,24")
    assert any("reusing the graphs compiled for crop size(s) 16 px" in line
               for line in again["lines"])
    assert any("the graphs for 24 px" in line and "damaged" in line for line in again["lines"])
    assert again["misses"] > 0 and again["hits"] > 0  # 16 px loaded, 24 px compiled
    entry = manifest(place)["sizes"]["24"]
    assert entry["archive"] != damaged.name and not damaged.exists()
    assert run_compile(place, "16,24")["misses"] == 0  # the new archive serves


@pytest.mark.parametrize("change, words", [
    ({"batch": 8}, "they were made for batch 4 (now 8)"),
    ("manifest", "its manifest is unreadable"),
])
def test_graphs_made_for_another_model_or_a_damaged_manifest_are_rebuilt(compiled, tmp_path,
                                                                        change, words):
    place = copy_of(compiled, tmp_path)
    old = {e["archive"] for e in manifest(place)["sizes"].values()}
    if change == "manifest":
        (place / "compile" / "manifest.json").write_text('{"format": "imagenet-trai')
        signature = SIGNATURE
    else:
        signature = {**SIGNATURE, **change}
    again = run_compile(place, "16", signature)
    (line,) = [ln for ln in again["lines"] if "are not used" in ln]
    assert words in line and "this run's graphs replace them" in line
    assert again["hits"] == 0 and again["misses"] > 0
    saved = manifest(place)
    assert saved["made_for"] == signature and list(saved["sizes"]) == ["16"]
    left = {p.name for p in (place / "compile").glob("graphs-*.tar")}
    assert left == {saved["sizes"]["16"]["archive"]} and not left & old


def test_a_cache_folder_that_cannot_be_written_warns_and_the_step_goes_on(toolchain, tmp_path):
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the cache folder would be")
    done = run_compile(blocker, "16")
    assert done["misses"] > 0
    assert any("cannot keep the compiled graphs" in line and "a restart compiles them again"
               in line for line in done["lines"])


def test_a_requeued_compiled_run_compiles_nothing_and_ends_bitwise(toolchain, tmp_path):
    """main.py --compile uninterrupted, and stopped by SIGTERM in its second epoch and
    requeued on the same --cache-dir: the requeue loads every graph (no inductor cache miss in
    its first step or its epoch) and ends with the uninterrupted run's weights, bit for bit.
    Under --hang-timeout 4: the uninterrupted run's cold compiles of the training step and of
    the evaluation graph (inductor on the CPU: far longer) do not count toward it (the hang
    watch's pause; test_hang.py has the other work that pauses it)."""
    import torchvision
    from chaos import Leg

    hang = 4
    data = write_image_folder(tmp_path / "data", val_per_class=4)  # 3 steps of 8, val 8 + 4
    cache = tmp_path / "cache"
    flags = [str(data), *TINY18, "-b", "8", "-j", "1", "-p", "1", "--seed", "0", "--compile",
             "--epochs", "2", "--cache-dir", str(cache), "--hang-timeout", str(hang)]
    whole = tmp_path / "whole"
    proc = run_main(*flags, "--output-dir", str(whole), timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "hang:" not in proc.stdout + proc.stderr
    assert "kept" in proc.stdout and "newly compiled file(s) for crop size 32 px" in proc.stdout
    assert " * Acc@1" in proc.stdout  # the evaluation graph too
    start = json.loads((whole / "config.json").read_text())["starts"][0]
    assert start["stages_s"]["first_step"] > hang, start  # the compile: longer than the timeout
    first = json.loads((whole / "metrics.jsonl").read_text().splitlines()[0])
    assert first["compiled_graphs"] >= 2, first  # epoch 0 compiled training and evaluation
    ckpt = load_checkpoint(whole / "checkpoint.pth.tar")
    assert ckpt["config"]["compile"] is True
    wrapped = [k for k in ckpt["state_dict"] if "_orig_mod." in k or k.startswith("module.")]
    assert not wrapped, wrapped[:5]  # a plain torchvision state: strict into resnet18
    torchvision.models.resnet18(num_classes=3).load_state_dict(ckpt["state_dict"])
    out = tmp_path / "out"
    # SIGTERM to the whole group (as SLURM sends it) after the first step of epoch 1.
    leg = Leg(prestarted_cmd(*flags, "--output-dir", str(out)), tmp_path / "leg1.txt",
              {"IMAGENET_FAILPOINTS": fault_at("train.step", 4, "sigterm(group)")})
    assert leg.wait(timeout=900) == 143, leg.output
    assert "stopped by SIGTERM at epoch 1 step 1;" in leg.output, leg.output
    proc = run_main(*flags, "--output-dir", str(out), "--resume", "auto", timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "reusing the graphs compiled for crop size(s) 32 px" in proc.stdout
    starts = json.loads((out / "config.json").read_text())["starts"]
    assert [s["compile_cache"]["misses"] for s in starts] == [0, 0]
    assert all(s["compile_cache"]["hits"] > 0 for s in starts)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["epoch"], r["compile_cache_misses"]) for r in records] == [(0, 0), (1, 0)]
    got, want = (load_checkpoint(o / "checkpoint.pth.tar") for o in (out, whole))
    for key, value in want["state_dict"].items():
        assert value.equal(got["state_dict"][key]), key

