"""DP-SGD-RC under FSDP2 (``torch.distributed.fsdp.fully_shard``): 2 processes, gloo, CPU.

The same model and the same per-rank batches, trained once replicated (every parameter whole on every rank)
and once sharded: with the same seed the updates are equal (sigma = 0 and sigma > 0: the sharded step
reduce-scatters the clipped sums and keeps its shard of the same noise), the ledger and epsilon are equal on
both ranks, and a parameter used outside its module is refused under sharding too."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpsgd import IncompleteGradientError, PrivacyEngine
from dpsgd.engine import PlanRow

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
    os._exit(0)   # see tests/test_distributed.py: a clean exit skips gloo's flaky teardown


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")
def test_fsdp2_sharded_training_equals_replicated(tmp_path):
    mp.spawn(_worker, args=(2, str(tmp_path / "store")), nprocs=2, join=True)
