"""Devices through ``torch.accelerator`` (as pytorch/examples' imagenet/main.py picks them): the
device each process trains on, the process-group backend for its type, what a device type
cannot do refused in one line before any process starts, and --no-accel.

This machine has no accelerator: the decisions are tested by giving the planning functions an
``Accelerator`` (the type and count ``torch.accelerator`` would report on a Mac, an Intel GPU, a
CUDA node); the run itself is tested for real on the CPU, and on CUDA by benchmarks/gpu_smoke.py
where a GPU is lent.
"""

from __future__ import annotations

import pytest
import torch
from helpers import TINY, run_main, write_image_folder

from imagenet.errors import UsageError
from imagenet.settings import devices
from imagenet.settings.devices import Accelerator
from imagenet.settings.flags import parse_config
from imagenet.settings.launch import (
    Launch,
    check_sync_bn,
    choose_backend,
    plan_launch,
)
from imagenet.settings.plan import choose_device, make_plan

XPU, MPS = Accelerator("xpu", 2), Accelerator("mps", 1)


def cfg_of(*argv: str):
    return parse_config(["data", *argv])


def test_the_accelerator_is_torchs_answer():
    found = devices.detect()
    if torch.accelerator.is_available():
        assert found == Accelerator(torch.accelerator.current_accelerator().type,
                                    torch.accelerator.device_count())
    else:
        assert found == Accelerator("cpu", 0) and not found
    assert devices.as_accelerator(3) == Accelerator("cuda", 3)
    assert devices.as_accelerator(0) == Accelerator("cpu", 0)


@pytest.mark.parametrize("accel", [XPU, MPS, Accelerator("cuda", 2)], ids=lambda a: a.type)
def test_each_process_trains_on_its_device_of_whatever_accelerator_is_present(accel):
    kind = accel.type
    assert choose_device(cfg_of(), Launch("single"), 0, accel) == torch.device(kind, 0)
    assert choose_device(cfg_of("--no-accel"), Launch("single"), 0, accel) == torch.device("cpu")
    last = accel.count - 1
    assert choose_device(cfg_of("--gpu", str(last)), Launch("single"), 0, accel) == \
        torch.device(kind, last)
    with pytest.raises(UsageError, match=f"--gpu {accel.count}: only {accel.count} {kind} "):
        choose_device(cfg_of("--gpu", str(accel.count)), Launch("single"), 0, accel)
    plan = make_plan(cfg_of(), {}, accel)
    assert plan.device_type == kind
    assert make_plan(cfg_of("--no-accel"), {}, accel).device_type == "cpu"
    if kind != "cuda":  # the device decode path is nvJPEG's
        assert not plan.decode.on_device and "no CUDA device" in plan.decode.why


def test_several_devices_spawn_one_process_each():
    launch = plan_launch(cfg_of(), {}, XPU)
    assert (launch.mode, launch.nprocs) == ("spawn", 2)
    assert choose_device(cfg_of(), launch, 1, XPU) == torch.device("xpu", 1)
    assert plan_launch(cfg_of("--no-accel"), {}, XPU).mode == "single"
    assert plan_launch(cfg_of(), {}, MPS).mode == "single"


def test_the_backend_is_the_one_torch_registers_for_the_device_type():
    assert choose_backend(None, "cuda") == "nccl"
    assert choose_backend(None, "xpu") == "xccl"
    assert choose_backend(None, "cpu") == "gloo"
    assert choose_backend(None, "mps") == devices.default_backend("mps")
    with pytest.raises(UsageError, match="--dist-backend nccl needs CUDA GPUs.*xpu devices; "
                                         "use --dist-backend xccl"):
        choose_backend("nccl", "xpu")


def test_a_device_type_without_a_backend_is_refused_before_any_process_starts():
    """Gaudi's hccl registers only when habana_frameworks is imported: without it torch has
    nothing to train hpu tensors with (its "fake" tracing backend does not count)."""
    with pytest.raises(UsageError, match="no process-group backend for hpu devices.*--no-accel"):
        make_plan(cfg_of("--nproc-per-node", "2"), {}, Accelerator("hpu", 2))
    assert make_plan(cfg_of(), {}, Accelerator("hpu", 1)).device_type == "hpu"  # one process


def test_sync_bn_only_where_torch_has_its_kernels():
    check_sync_bn(True, "xpu")
    check_sync_bn(True, "cuda")
    with pytest.raises(UsageError, match="--sync-bn: torch's SyncBatchNorm has no kernels for "
                                         "mps devices"):
        check_sync_bn(True, "mps")
    with pytest.raises(UsageError, match="--sync-bn: .*mps"):
        make_plan(cfg_of("--sync-bn", "--nproc-per-node", "2"), {}, Accelerator("mps", 2))


def test_peak_memory_is_reported_where_the_device_keeps_it():
    assert not devices.has_memory_stats(torch.device("cpu"))
    assert devices.peak_memory_gb(torch.device("cpu")) == 0.0
    assert devices.has_memory_stats(torch.device("cuda", 0))



def test_torch_cuda_is_called_by_the_devices_module_alone():
    """Every ``torch.cuda.*`` call of the package is in settings/devices.py, but for the
    environment report (CUDA's and NCCL's versions): a new accelerator is one module's change."""
    import ast

    from helpers import ROOT

    callers = set()
    for path in (ROOT / "imagenet").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and ast.unparse(node).startswith("torch.cuda."):
                callers.add(path.relative_to(ROOT).as_posix())
    assert callers == {"imagenet/settings/devices.py", "imagenet/tools/envcheck.py"}, callers


def test_the_cpu_makes_batches_in_turn_without_streams():
    cpu = torch.device("cpu")
    assert devices.side_stream(cpu) is None
    assert devices.rng_device() is None or torch.cuda.is_initialized()
    assert devices.name(torch.device("xpu", 0)) == "xpu device"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_side_stream_overlaps_and_its_event_orders_the_step():
    """The prefetcher's stream calls on a real GPU: work queued on a side stream, an event
    recorded after it, the step's stream waiting on the event, sees the finished copy."""
    device = torch.device("cuda", 0)
    stream = devices.side_stream(device)
    assert stream is not None and stream != devices.current_stream(device)
    host = torch.arange(1 << 20, dtype=torch.float32).pin_memory()
    with stream:
        copied = host.to(device, non_blocking=True) * 2
    event = devices.ready_event(stream)
    current = devices.current_stream(device)
    current.wait_event(event)
    copied.record_stream(current)
    assert torch.equal(copied.cpu(), host * 2)
    assert devices.name(device).endswith(")") and "(sm_" in devices.name(device)
    state = devices.get_rng_state()
    assert devices.rng_device() == (0, torch.cuda.device_count())
    devices.set_rng_state(state)


@pytest.mark.slow
@pytest.mark.skipif(torch.accelerator.is_available(), reason="this machine has an accelerator")
def test_a_classic_command_without_an_accelerator(tmp_path):
    """No accelerator here: ``--gpu 0`` (the classic's single-device command) is one error line
    naming torch.accelerator, not a silent CPU run; without it the run says it trains on the
    CPU, and --no-accel trains there without a word about devices."""
    data = write_image_folder(tmp_path / "data", classes=2, train_per_class=2, val_per_class=1)
    small = [*TINY, "-b", "2", "--epochs", "1"]
    refused = run_main(str(data), *small, "--gpu", "0", "--output-dir", str(tmp_path / "a"))
    assert refused.returncode == 2, refused.stderr
    lines = [x for x in refused.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "--gpu 0: no accelerator device is visible" in lines[0]
    assert "torch.accelerator.is_available() is False" in lines[0], lines
    ran = run_main(str(data), *small, "--output-dir", str(tmp_path / "b"))
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert "=> no accelerator device (torch.accelerator found none): training on the CPU" \
        in ran.stdout
    quiet = run_main(str(data), *small, "--no-accel", "--output-dir", str(tmp_path / "c"))
    assert quiet.returncode == 0, quiet.stderr[-2000:]
    assert "no accelerator device" not in quiet.stdout
    assert (tmp_path / "c" / "checkpoint.pth.tar").is_file()
