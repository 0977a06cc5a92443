"""DP-SGD-RC under FSDP2 (``torch.distributed.fsdp.fully_shard``): 2 processes, gloo, CPU.

The same model and the same per-rank batches, trained once replicated (every parameter whole on every rank)
and once sharded: with the same seed the updates are equal (sigma = 0 and sigma > 0: the sharded step
reduce-scatters the clipped sums and keeps its shard of the same noise), the ledger and epsilon are equal on
both ranks, and a parameter used outside its module is refused under sharding too.

A rank whose part of a step holds no example, or one, still runs the step's forward, row check and backward (on
filler rows weighted 0): over a tiny data set split unevenly, the sharded run finishes, trains to the parameters
of one process on the whole data set with the same global batches, and reports the same epsilon."""

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpsgd import BatchMemoryManager, ExampleMixingError, IncompleteGradientError, PrivacyEngine
from dpsgd.plan import PlanRow
from dpsgd.samplers import FixedSize

pytest.importorskip("torch.distributed.fsdp")


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class Net(nn.Module):
    """Embedding, two blocks (each its own FSDP unit), a Conv1d over positions, an RMSNorm and a head."""

    def __init__(self, vocab=30, dim=10, leak=False):
        super().__init__()
        self.mix = False   # subtract the batch mean after the blocks: examples mixed
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(2))
        self.conv = nn.Conv1d(dim, dim, 3, padding=1)
        self.rms = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, 3)
        self.leak = leak

    def forward(self, ids):
        x = self.emb(ids)
        for blk in self.blocks:
            x = blk(x)
        if self.mix:
            x = x - x.mean(0)
        x = x + self.conv(x.transpose(1, 2)).transpose(1, 2)
        x = self.rms(x).mean(1)
        if self.leak:  # the embedding (gathered with the root unit) used outside the embedding's forward
            return self.head(x) + x @ self.emb.weight[:3].t()
        return self.head(x)


def _train(shard: bool, data, sigma: float, leak: bool = False):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Net(leak=leak)
    if shard:
        for unit in (*model.blocks, model.head):
            fully_shard(unit)
        fully_shard(model)
    engine = PrivacyEngine()
    m, opt, crit, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5), data_loader=DataLoader(data, batch_size=6),
        criterion=nn.CrossEntropyLoss(), max_grad_norm=0.1, noise_multiplier=sigma, estimator="hutch",
        projection_dim=4, seed=11)
    for _, (x, y) in zip(range(2), loader, strict=False):
        opt.zero_grad()
        crit(m(x), y).backward()
        opt.step()
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    return [t.detach().clone() for t in full], engine


def _worker(rank: int, world: int, store: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        gen = torch.Generator().manual_seed(rank)
        data = TensorDataset(torch.randint(0, 30, (24, 7), generator=gen), torch.randint(0, 3, (24,), generator=gen))
        plain, e1 = _train(False, data, 1.0)
        sharded, e2 = _train(True, data, 1.0)
        assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(plain, sharded, strict=True))
        noiseless, _ = _train(True, data, 0.0)
        assert max((a - b).abs().max().item() for a, b in zip(sharded, noiseless, strict=True)) > 1e-3
        assert e2.steps == e1.steps == 2
        # the same handlers (FSDP's wrapper classes are looked through) and the same envelope
        assert [r[1:] for r in e1.plan.table()] == [r[1:] for r in e2.plan.table()]
        assert PlanRow("head.weight", "Linear", (3, 10), "LinearHandler", "hutch", 3) in e2.plan.table()
        # every rank, and the replicated run, composes the same mechanism the same number of times: the same
        # epsilon (its value is deterministic in the events; computing it here would cost ~10 s per rank)
        events = [None] * world
        dist.all_gather_object(events, e2.accountant().events)
        assert events[0] == events[1] == e1.accountant().events and events[0][0][1] == 2
        with pytest.raises(IncompleteGradientError, match="gathered FSDP parameter"):
            _train(True, data, 1.0, leak=True)
    finally:
        dist.destroy_process_group()
    os._exit(0)   # see tests/dpsgd/test_distributed.py: a clean exit skips gloo's flaky teardown


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")
def test_fsdp2_sharded_training_equals_replicated(tmp_path):
    mp.spawn(_worker, args=(2, str(tmp_path / "store")), nprocs=2, join=True)


def run_ranks(worker, *args, deadline_s: float = 90.0) -> None:
    """``worker(rank, 2, *args)`` on two processes; fails the test if they have not finished within ``deadline_s``
    (a hang, ranks waiting in mismatched collectives, fails the test instead of blocking it)."""
    context = mp.start_processes(worker, args=(2, *args), nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + deadline_s
    while not context.join(timeout=max(deadline - time.monotonic(), 0.1)):
        if time.monotonic() > deadline:
            for proc in context.processes:   # the processes this test started, by their own handles
                if proc.is_alive():
                    proc.kill()
            pytest.fail(f"the ranks did not finish within {deadline_s:g} s: they wait for each other")


def _tiny_data():
    """12 examples, the first token of each its index (to tell which shard an example is in); rank 0's shard is
    examples 0-9, rank 1's 10-11."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 30, (12, 7), generator=gen)
    ids[:, 0] = torch.arange(12)
    return TensorDataset(ids, torch.randint(0, 3, (12,), generator=gen))


_SPLIT = {0: (range(0, 10), 2), 1: (range(10, 12), 1)}   # rank: (its shard, its loader batch size): B = 3


def _reversed_collate(items):
    """``default_collate`` of the items in reverse order: a collate_fn that does not keep the rows' order."""
    return torch.utils.data.default_collate(items[::-1])


def _train_tiny(data, batch_size: int, shard: bool, collate_fn=None, **kwargs):
    """Net trained with exact norms (no randomness but the noise and the batches) for one epoch of the loader;
    the full parameters, the engine, and each step's count of examples drawn from rank 1's shard."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Net()
    if shard:
        for unit in (*model.blocks, model.head):
            fully_shard(unit)
        fully_shard(model)
    engine = PrivacyEngine()
    m, opt, crit, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(data, batch_size=batch_size, collate_fn=collate_fn), criterion=nn.CrossEntropyLoss(),
        max_grad_norm=0.1, noise_multiplier=1.0, estimator="exact", seed=11, **kwargs)
    high = []
    for x, y in loader:   # the ordinary loop: nothing here knows about filler rows
        high.append(int((x[:, 0] >= 10).sum()))
        opt.zero_grad()
        crit(m(x), y).backward()
        opt.step()
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    return [t.detach().clone() for t in full], engine, high, (m, opt, crit, loader)


def _small_parts_worker(rank: int, world: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        shard, batch = _SPLIT[rank]
        params, engine, _, (m, opt, crit, loader) = _train_tiny(torch.utils.data.Subset(_tiny_data(), shard),
                                                                batch, True, batch_sampling=FixedSize())
        eps = engine.get_epsilon(1e-5)
        both = [None] * world
        dist.all_gather_object(both, eps)
        assert both[0] == both[1]
        if rank == 0:
            torch.save({"params": params, "epsilon": eps, "events": engine.accountant().events, "steps": engine.steps},
                       out)
        # micro-batches would split the ranks' parts into different numbers of forwards: refused on every rank
        with pytest.raises(ValueError, match="refused under FSDP2"):
            BatchMemoryManager(data_loader=loader, max_physical_batch_size=1, optimizer=opt)
        with pytest.raises(ValueError, match="cannot be split"):
            loader.in_chunks(2)
        # a batch made by hand with one row on some rank: refused on every rank, before any backward
        x, y = torch.utils.data.default_collate([_tiny_data()[i] for i in (range(3) if rank == 0 else [10])])
        loss = crit(m(x), y)
        with pytest.raises(ValueError, match="at least 2 rows"):
            loss.backward()
        assert engine.steps == 4
    finally:
        dist.destroy_process_group()
    os._exit(0)


@pytest.mark.slow   # 10 s; test_fsdp2_poisson_parts_of_no_example_or_one covers the default run
@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")
def test_fsdp2_rank_parts_of_no_example_or_one(tmp_path):
    """Fixed-size global batches of 3 over 12 examples, rank 1 holding 2 of them: its part is empty, one example and
    two examples in different steps.  The sharded run equals one process training on all 12 with batch size 3."""
    single, engine, high, _ = _train_tiny(_tiny_data(), 3, False, batch_sampling=FixedSize())
    assert {0, 1} <= set(high), high   # the cases under test happen: rank 1's part is empty, and one example
    run_ranks(_small_parts_worker, str(tmp_path / "store"), str(tmp_path / "rank0.pt"))
    sharded = torch.load(tmp_path / "rank0.pt", weights_only=False)   # written by this test's rank 0
    assert sharded["steps"] == engine.steps == 4
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(single, sharded["params"], strict=True))
    assert sharded["events"] == engine.accountant().events
    assert sharded["epsilon"] == engine.get_epsilon(1e-5)


def _poisson_worker(rank: int, world: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        shard, batch = _SPLIT[rank]
        data = torch.utils.data.Subset(_tiny_data(), shard)
        # rows collated in reverse: which rows are filler does not depend on their order
        sharded, e1, _, (m, _, crit, loader) = _train_tiny(data, batch, True, collate_fn=_reversed_collate)
        plain, e2, high, _ = _train_tiny(data, batch, False)   # replicated: an empty part is a noise-only step
        assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(plain, sharded, strict=True))
        # the replicated parameters stay equal on both ranks (a rank's noise-only step all-reduces row-major zeros
        # with the other's convolution sum, laid out otherwise)
        both = [None] * world
        dist.all_gather_object(both, plain)
        assert all(torch.equal(a, b) for a, b in zip(*both, strict=True))
        assert e1.steps == e2.steps == 4 and e1.accountant().events == e2.accountant().events
        eps = [None] * world
        dist.all_gather_object(eps, (e1.get_epsilon(1e-5), e2.get_epsilon(1e-5)))
        assert eps[0][0] == eps[0][1] == eps[1][0] == eps[1][1]
        if rank == 1:   # the cases under test happened: an empty part (no batch yielded) and a part of one example
            torch.save({"yielded": high, "steps": e2.steps}, out)
        # examples mixed on rank 0 only: its row check fails, and rank 1's, which found nothing, fails too (rather
        # than go on to the step's backward, where it would wait for rank 0 for ever)
        m.mix = rank == 0
        x, y = next(iter(loader))
        with pytest.raises(ExampleMixingError if rank == 0 else IncompleteGradientError) as err:
            crit(m(x), y).backward()
        assert rank == 0 or "failed on another rank" in str(err.value)
    finally:
        dist.destroy_process_group()
    os._exit(0)


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")
def test_fsdp2_poisson_parts_of_no_example_or_one(tmp_path):
    """Poisson sampling at q = 3/12, rank 1 sampling its 2 examples: the sharded run (with a collate_fn that
    reverses the rows) equals the replicated one (whose rank 1 takes noise-only steps for its empty parts) and
    reports the same epsilon."""
    run_ranks(_poisson_worker, str(tmp_path / "store"), str(tmp_path / "rank1.pt"))
    rank1 = torch.load(tmp_path / "rank1.pt")
    assert len(rank1["yielded"]) < rank1["steps"] and 1 in rank1["yielded"], rank1
