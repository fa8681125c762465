"""--compile: DDP compiled from the outside (graphs split at its buckets), static shapes with
every batch shape compiled in the first epoch (ragged last batches and validation included),
FSDP's per-block frames within the recompile limit.

Counted with torch's own machinery: a Dynamo backend that records each graph it is given and
runs it eagerly (inductor's C++ compile would cost minutes here; the guards, graphs and
recompiles are Dynamo's and the same for any backend). test_compile_cache.py runs
inductor end to end.
"""

from __future__ import annotations

import pytest
import torch
from helpers import gloo_rank_saving, start_ranks, tiny_engine, uint8_batches
from torch import nn

from imagenet.evaluation.validate import evaluate
from imagenet.launching.process_group import DistInfo
from imagenet.settings.flags import parse_config
from imagenet.settings.plan import free_port
from imagenet.training.engine import Step, train_one_epoch
from imagenet.training.models import for_evaluation, unwrap, wrap

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class Graphs:
    """A Dynamo backend that records the graphs it compiles (and whether any has a symbolic,
    i.e. dynamic, size) and runs them eagerly."""

    def __init__(self) -> None:
        self.count = 0
        self.dynamic = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        self.count += 1
        self.dynamic += any(isinstance(d, torch.SymInt) for x in example_inputs
                            if isinstance(x, torch.Tensor) for d in x.shape)
        return gm.forward


class Block(nn.Module):
    """Conv + BatchNorm + ReLU; a user-level class (Dynamo compiles its forward as a frame)."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x)))


class Net(nn.Module):
    """Blocks of the given widths, pooling and a classifier."""

    def __init__(self, widths: tuple[int, ...], classes: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        chans = (3, *widths)
        self.blocks = nn.Sequential(*(Block(a, b) for a, b in zip(chans, chans[1:])))
        self.head = nn.Linear(widths[-1], classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x).mean((2, 3)))


def graphs_per_epoch(graphs: Graphs, engine, model: nn.Module, train: list, val: list,
                     epochs: int, world: int = 1) -> list[int]:
    """Graphs compiled in each of ``epochs`` epochs of training on ``train`` and validating on
    ``val`` (this rank's batches of ``world`` ranks)."""
    per_epoch = []
    for epoch in range(epochs):
        before = graphs.count
        train_one_epoch(engine, train, Step(epoch=epoch))
        evaluate(engine, for_evaluation(model), val,
                 expected_count=world * sum(len(t) for _, t in val))
        per_epoch.append(graphs.count - before)
    return per_epoch


# ---------------------------------------------------------------- DDP: compiled from outside

STEPS = 2


def ddp_steps(info: DistInfo) -> dict:
    """Two DDP steps of 2 micro-batches (no_sync, then all-reduce into the gradient views) of a
    1.36 MB model (two 1 MB buckets), compiled or not; what they made."""
    out = {}
    for compiled in (False, True):
        graphs = Graphs()
        raw = Net((8, 96, 384))  # the 96 -> 384 conv alone is 1.3 MB of fp32 weights
        flags = ["--bucket-cap-mb", "1", "--lr", "0.1", "--grad-accum-steps", "2",
                 *(["--compile"] if compiled else [])]
        model = wrap(raw, parse_config(["data", *flags]), info, compile_backend=graphs)
        engine = tiny_engine(model, *flags, steps=STEPS, world=2, batch=4)
        batches = uint8_batches(2 * STEPS, 4, size=8, seed=info.rank)  # 2 micro-batches a step
        train_one_epoch(engine, batches, Step())
        ddp = model._orig_mod if compiled else model
        out[compiled] = {"weights": [p.detach().clone() for p in raw.parameters()],
                         "wrapping": [type(model).__name__, type(ddp).__name__],
                         "bucket_view": ddp.gradient_as_bucket_view,
                         "graphs": graphs.count,
                         "eval": [type(for_evaluation(model)).__name__,
                                  type(unwrap(for_evaluation(model))).__name__]}
    return out


def both(info: DistInfo) -> dict:
    """What each rank of the one spawned pair reports: DDP's steps and FSDP's epochs."""
    return {"ddp": ddp_steps(info), "fsdp": fsdp_epochs(info)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """Both ranks' reports (one pair of processes for both tests: start-up is the cost)."""
    out = tmp_path_factory.mktemp("compile")
    start_ranks(gloo_rank_saving, args=(2, free_port(), out, both))
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


@pytest.mark.slow
def test_ddp_is_compiled_from_outside_and_split_at_its_buckets(ranks):
    for rank in ranks:
        compiled, plain = rank["ddp"][True], rank["ddp"][False]
        assert compiled["wrapping"] == ["OptimizedModule", "DistributedDataParallel"]
        assert plain["wrapping"][0] == "DistributedDataParallel" and plain["graphs"] == 0
        assert compiled["bucket_view"] and plain["bucket_view"]
        # DDPOptimizer hands the backend one piece of the forward graph per 1 MB bucket: the
        # 1.3 MB conv's, and the rest (one graph without DDP: the next test).
        assert compiled["graphs"] == 2
        # Validation runs the model without DDP, compiled too.
        assert compiled["eval"] == ["OptimizedModule", "Net"]
        assert plain["eval"] == ["Net", "Net"]
        for a, b in zip(compiled["weights"], plain["weights"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(ranks[0]["ddp"][True]["weights"], ranks[1]["ddp"][True]["weights"]):
        assert torch.equal(a, b)  # the ranks agree: the gradients were all-reduced


# ---------------------------------------------------------------- zero recompiles after epoch 0


@pytest.mark.slow
def test_every_batch_shape_compiles_in_the_first_epoch_only():
    """3 epochs of 2 full and one ragged training batch, validation of a full and a ragged
    batch: every graph is compiled in epoch 0, with static shapes (the full batch never runs a
    dynamic graph compiled for the ragged one)."""
    graphs = Graphs()
    model = wrap(Net((8, 16)), parse_config(["data", "--compile"]), DistInfo(),
                 compile_backend=graphs)
    engine = tiny_engine(model, "--lr", "0.01", "-p", "100", steps=3, batch=8)
    train = uint8_batches(2, 8, size=16) + uint8_batches(1, 5, size=16, seed=1)
    val = uint8_batches(1, 8, size=16, seed=2) + uint8_batches(1, 3, size=16, seed=3)
    per_epoch = graphs_per_epoch(graphs, engine, model, train, val, epochs=3)
    assert per_epoch == [4, 0, 0]  # train full + ragged, eval full + ragged; then nothing
    assert graphs.dynamic == 0


# ---------------------------------------------------------------- FSDP's per-block frames


def fsdp_epochs(info: DistInfo) -> dict:
    """Two epochs (full + ragged batch, eval full + ragged) of a --fsdp --compile model whose
    one block function has 6 shapes: 24 graphs for that function, more than torch's 8."""
    graphs = Graphs()
    flags = ["--fsdp", "--compile", "--lr", "0.01", "-p", "100"]
    model = wrap(Net((8, 8, 16, 16, 24, 24)), parse_config(["data", *flags]), info,
                 compile_backend=graphs)
    engine = tiny_engine(model, *flags, steps=2, world=2, batch=4)
    train = uint8_batches(1, 4, size=8, seed=info.rank) + uint8_batches(1, 3, size=8, seed=5)
    val = uint8_batches(1, 4, size=8, seed=6) + uint8_batches(1, 1, size=8, seed=7)
    per_epoch = graphs_per_epoch(graphs, engine, model, train, val, epochs=2, world=2)
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    entries = len(_debug_get_cache_entry_list(Block.forward.__code__))
    return {"per_epoch": per_epoch, "block_graphs": entries, "dynamic": graphs.dynamic}


@pytest.mark.slow
def test_fsdp_block_frames_stay_compiled(ranks):
    for rank in ranks:
        result = rank["fsdp"]
        # Every block shape x train/eval x full/ragged batch, none left uncompiled.
        assert result["block_graphs"] == 6 * 4, result
        assert result["per_epoch"][1] == 0, result
        assert result["dynamic"] == 0


def test_small_buckets_with_compile_are_refused():
    from imagenet.errors import UsageError

    with pytest.raises(UsageError, match="--bucket-cap-mb 0.5 with --compile.*at least 1 MB"):
        parse_config(["data", "--compile", "--bucket-cap-mb", "0.5"])
    parse_config(["data", "--bucket-cap-mb", "0.5"])  # fine uncompiled


# ---------------------------------------------------------------- the GPU's fast paths


def test_fused_optimizer_steps_on_cuda_where_torch_has_them():
    from imagenet.training.optim import build_optimizer, use_fused

    def cfg(*flags):
        return parse_config(["data", *flags])

    assert use_fused("cuda", cfg()) and use_fused("cuda", cfg("--opt", "adamw"))
    assert not use_fused("cuda", cfg("--opt", "rmsprop"))  # torch has no fused RMSprop
    assert not use_fused("cuda", cfg("--fsdp"))  # DTensor parameters
    assert not use_fused("cpu", cfg())  # the CPU keeps the foreach step (and the tests' numbers)
    model = nn.Linear(4, 2)
    assert build_optimizer(model, cfg(), fused=True).param_groups[0]["fused"]
    assert not build_optimizer(model, cfg()).param_groups[0].get("fused")


def test_compile_mode_reaches_torch_compile(monkeypatch):
    from imagenet.errors import UsageError
    from imagenet.training.models import compile_model

    calls = []
    monkeypatch.setattr(torch, "compile", lambda model, **kw: calls.append(kw) or model)
    compile_model(nn.Linear(2, 2), "inductor", 1, "reduce-overhead")
    compile_model(nn.Linear(2, 2), "eager", 1, "reduce-overhead")  # inductor's only
    compile_model(nn.Linear(2, 2))
    assert [c.get("mode") for c in calls] == ["reduce-overhead", None, None]
    assert all(c["dynamic"] is False for c in calls)
    assert parse_config(["data", "--compile", "--compile-mode", "max-autotune"]).compile_mode \
        == "max-autotune"
    with pytest.raises(UsageError, match="--compile-mode reduce-overhead applies to --compile"):
        parse_config(["data", "--compile-mode", "reduce-overhead"])
