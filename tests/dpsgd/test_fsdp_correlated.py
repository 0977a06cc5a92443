"""Correlated (matrix-factorization) noise under FSDP2 (``torch.distributed.fsdp.fully_shard``): 2 processes, gloo, CPU.

Each rank of a sharded run keeps the noise history (:class:`dpsgd.noise.CorrelatedStream` for banded noise,
:class:`dpsgd.noise.BufferedStream` for BLT) of its own shard of each parameter only.  Trained once replicated and
once sharded, with the same seed, over more steps than the strategy's bands and cycles of
:class:`dpsgd.samplers.CyclicPoisson`:

* the same model reaches the same parameters (banded noise with estimated norms, BLT noise with exact norms), which
  differ from a noiseless run's;
* a model whose gradients are zero takes the noise alone as its update: each step's noise of the sharded run is the
  replicated run's, and both are the strategy's :math:`w = C^{-1} z` of the independent Gaussian draws ``z`` that a
  run with plain Gaussian noise (same seed, same sampling) takes, so the shards' histories carry the correlation
  across steps and bands;
* both ranks, sharded or not, take the same steps and compose the same accounting events (and, for the runs whose
  epsilon is cheap, report the same epsilon).

The workers train and save what they saw; the assertions run in the test's own process (no rank waits for another
that failed an assertion)."""

import os
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpmath.correlated import BandedStrategy, BLTStrategy
from dpsgd import PrivacyEngine
from dpsgd.noise import BandedNoise, BLTNoise, GaussianNoise
from dpsgd.samplers import CyclicPoisson

from .test_fsdp import Net, run_ranks  # embedding, two blocks (each its own FSDP unit), a Conv1d, an RMSNorm and a head

pytest.importorskip("torch.distributed.fsdp")

BANDED = BandedStrategy((1.0, 0.6, -0.3))          # 3 bands
BLT = BLTStrategy((0.4, 0.2), (0.8, 0.3))
GROUPS = 3                                         # CyclicPoisson groups: as many as BANDED's bands
PER_RANK, BATCH = 24, 3                            # N = 48, B = 6 globally: q = 6 x 3 / 48, 3 cycles, 9 steps
STEPS = 9
SIGMA, CLIP = 1.0, 0.1


def _noise(name: str):
    return {"banded": BandedNoise(BANDED), "blt": BLTNoise(BLT), "gaussian": GaussianNoise()}[name]


class Zero(nn.Module):
    """Two bias-free linear layers, each inside its own FSDP unit (a Sequential: 16 x 8 and 5 x 16, the second split
    3 + 2 rows over two ranks).  On zero inputs and zero targets every per-example gradient is zero, whatever the
    parameters: each step's update is the step's noise alone.  (Each Linear as its own FSDP unit:
    test_fsdp2_units_that_are_the_clipped_layers_train.)"""

    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.Linear(8, 16, bias=False))
        self.b = nn.Sequential(nn.Linear(16, 5, bias=False))

    def forward(self, x):
        return self.b(self.a(x))


def _full(p: torch.Tensor) -> torch.Tensor:
    """The whole parameter (a collective when sharded: every rank calls it at the same point)."""
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()


def _local(p: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded parameter (its rows), or the whole of a replicated one: no collective, so a
    rank may call it where the other does not."""
    return (p.to_local() if hasattr(p, "to_local") else p).detach().clone()


def _run(model: nn.Module, units, shard: bool, data, criterion, noise: str, sigma: float, estimator: str,
         updates: bool = False, check_rate: float | None = None):
    """``model`` (its ``units`` each an FSDP unit, then the root, when ``shard``) trained with ``noise`` under
    CyclicPoisson(GROUPS) for one pass of the loader (STEPS steps), lr 1 plain SGD: the full parameters, each step's
    update of this rank's part of them (with ``updates``: a sharded parameter's rows, a replicated one whole), the
    steps, the accounting events and (for exact norms) epsilon."""
    from torch.distributed.fsdp import fully_shard

    if shard:
        for unit in units:
            fully_shard(unit)
        fully_shard(model)
    engine = PrivacyEngine()
    m, opt, crit, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=DataLoader(data, batch_size=BATCH), criterion=criterion, max_grad_norm=CLIP,
        noise_multiplier=sigma, noise=_noise(noise), batch_sampling=CyclicPoisson(GROUPS), estimator=estimator,
        seed=11, **({"projection_dim": 4} if estimator == "hutch" else {}))
    if check_rate is not None:
        engine.check_rate = check_rate
    noisy = []
    for x, y in loader:   # a rank whose part of a step is empty yields nothing: the loader takes that step itself
        before = [_local(p) for p in model.parameters()] if updates else None
        opt.zero_grad()
        crit(m(x), y).backward()
        opt.step()
        if updates:   # lr 1: minus the step's noisy gradient
            noisy.append((engine.steps, [b - _local(p) for b, p in zip(before, model.parameters(), strict=True)]))
    eps = engine.get_epsilon(1e-5) if estimator == "exact" and sigma > 0 else None
    return {"params": [_full(p) for p in model.parameters()], "updates": noisy, "steps": engine.steps,
            "events": engine.accountant().events if sigma > 0 else None, "epsilon": eps}


def _net_run(shard: bool, data, noise: str, sigma: float, estimator: str):
    torch.manual_seed(0)
    model = Net()
    return _run(model, (*model.blocks, model.head), shard, data, nn.CrossEntropyLoss(), noise, sigma, estimator)


def _zero_run(shard: bool, noise: str):
    torch.manual_seed(0)
    model = Zero()
    with torch.no_grad():   # zeros: each parameter is minus the sum of its updates, without rounding on a larger start
        for p in model.parameters():
            p.zero_()
    data = TensorDataset(torch.zeros(PER_RANK, 8), torch.zeros(PER_RANK, 5))
    return _run(model, (model.a, model.b), shard, data, nn.MSELoss(), noise, SIGMA, "exact", updates=True)


def _worker(rank: int, world: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        gen = torch.Generator().manual_seed(rank)
        data = TensorDataset(torch.randint(0, 30, (PER_RANK, 7), generator=gen),
                             torch.randint(0, 3, (PER_RANK,), generator=gen))
        results = {}
        # banded noise with estimated norms (randomized clipping), BLT with exact ones (it refuses estimates)
        for noise, estimator in (("banded", "hutch"), ("blt", "exact")):
            for shard in (False, True):
                results["net", noise, shard] = _net_run(shard, data, noise, SIGMA, estimator)
            results["net", noise, "noiseless"] = _net_run(True, data, noise, 0.0, estimator)
        for noise in ("banded", "blt", "gaussian"):
            for shard in (False, True):
                results["zero", noise, shard] = _zero_run(shard, noise)
        torch.save(results, out.format(rank=rank))
    finally:
        dist.destroy_process_group()
    os._exit(0)   # see tests/dpsgd/test_distributed.py: a clean exit skips gloo's flaky teardown


_DEADLINE_S = 300   # a hang (ranks waiting in mismatched collectives) fails the test instead of blocking it


def _close(a, b, rtol=1e-5, atol=1e-6) -> bool:
    return len(a) == len(b) and all(torch.allclose(x, y, rtol=rtol, atol=atol) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp_correlated")
    out = str(tmp / "rank{rank}.pt")
    run_ranks(_worker, str(tmp / "store"), out, deadline_s=_DEADLINE_S)
    return [torch.load(out.format(rank=r), weights_only=False) for r in range(2)]


# about 25 s for the two-process runs of the module (18 trainings; 60 s on a loaded 2-core machine), and the bare
# layers' test
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")]


@pytest.mark.parametrize("noise", ["banded", "blt"])
def test_sharded_correlated_training_equals_replicated(ranks, noise):
    for rank in ranks:
        plain, sharded, noiseless = (rank["net", noise, k] for k in (False, True, "noiseless"))
        assert _close(plain["params"], sharded["params"])
        gap = max((a - b).abs().max().item() for a, b in zip(sharded["params"], noiseless["params"], strict=True))
        assert gap > 1e-3   # the noise is there
    # the replicated parameters and the full sharded ones are the same on both ranks
    assert _close(ranks[0]["net", noise, True]["params"], ranks[1]["net", noise, True]["params"], 0, 0)


def _steps(ranks, kind, noise, shard) -> list[list[torch.Tensor]]:
    """Each step's update of the whole parameters: a sharded run's from both ranks' shards (rank 0's rows, then
    rank 1's), a replicated run's from rank 0 (checked equal to rank 1's)."""
    runs = [rank[kind, noise, shard]["updates"] for rank in ranks]
    for run in runs:   # every step yielded a batch on each rank here, so each step's update was recorded
        assert [t for t, _ in run] == list(range(1, STEPS + 1))
    if not shard:
        for (_, a), (_, b) in zip(*runs, strict=True):
            assert _close(a, b, 0, 0)
        return [u for _, u in runs[0]]
    return [[torch.cat(parts) for parts in zip(a, b, strict=True)] for (_, a), (_, b) in zip(*runs, strict=True)]


@pytest.mark.parametrize("noise", ["banded", "blt"])
def test_sharded_noise_correlates_across_steps_as_the_strategy_says(ranks, noise):
    """Zero gradients, lr 1: each step's update is minus sigma C w_t / B.  The sharded run's (each rank's shard,
    made from its shard's own history) equal the replicated run's, and both are C^{-1} of the Gaussian run's (the
    same generator's draws z_t, independent across steps)."""
    strategy = BANDED if noise == "banded" else BLT
    plain, sharded = _steps(ranks, "zero", noise, False), _steps(ranks, "zero", noise, True)
    gauss = _steps(ranks, "zero", "gaussian", True)
    assert all(_close(a, b, 0, 0) for a, b in zip(_steps(ranks, "zero", "gaussian", False), gauss, strict=True))
    assert [[u.shape for u in step] for step in sharded] == [[(16, 8), (5, 16)]] * STEPS
    for a, b in zip(plain, sharded, strict=True):
        assert _close(a, b, rtol=1e-6, atol=1e-8)
    for i in range(2):   # each parameter's noise across the steps, as (steps, coordinates)
        z = torch.stack([step[i].reshape(-1) for step in gauss]).double().numpy()
        w = torch.stack([step[i].reshape(-1) for step in sharded]).double().numpy()
        assert np.abs(z).std() > 0.5 * SIGMA * CLIP / (2 * BATCH)   # noise of scale sigma C / B
        np.testing.assert_allclose(w, strategy.correlate(z), rtol=1e-4, atol=1e-7)
        np.testing.assert_allclose(w[0], z[0], rtol=1e-6, atol=1e-9)   # c_0 = 1: the first step's noise is z_0
        # the later steps' noise is not the independent draws: each step's differs from z_t by a sizeable part
        assert (np.abs(w[1:] - z[1:]).max(axis=1) > 0.1 * np.abs(z).std()).all()


@pytest.mark.parametrize("noise", ["banded", "blt"])
def test_both_ranks_take_the_replicated_runs_steps_and_events(ranks, noise):
    for kind in ("net", "zero"):
        ref = ranks[0][kind, noise, False]
        for rank in ranks:
            for shard in (False, True):
                got = rank[kind, noise, shard]
                assert got["steps"] == ref["steps"] == STEPS
                assert got["events"] == ref["events"]
                assert got["epsilon"] == ref["epsilon"]
    # STEPS steps in cycles of GROUPS: one event per cycle
    assert [n for _, n in ranks[0]["net", noise, True]["events"]] == [STEPS // GROUPS]
    assert ranks[0]["zero", noise, True]["epsilon"] > 0   # exact norms: computed on every rank (equal above)


class Bare(nn.Module):
    """:class:`Zero`'s layers, each Linear itself an FSDP unit."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16, bias=False)
        self.b = nn.Linear(16, 5, bias=False)

    def forward(self, x):
        return self.b(self.a(x))


def _bare_worker(rank: int, world: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=10))
    torch.manual_seed(0)
    model, seen, rows = Bare(), [], []
    # the layers' parameters once their forwards (and their FSDP2 and capture hooks) are over: what the step sees
    model.register_forward_hook(lambda m, a, o: seen.append([type(p).__name__ for p in m.parameters()]))
    model.register_forward_pre_hook(lambda m, a: rows.append(a[0].shape[0]))
    gen = torch.Generator().manual_seed(rank)
    data = TensorDataset(torch.randn(PER_RANK, 8, generator=gen), torch.randn(PER_RANK, 5, generator=gen))
    try:
        run = _run(model, (model.a, model.b), True, data, nn.MSELoss(), "gaussian", SIGMA, "exact", check_rate=0.0)
        result = {"steps": run["steps"], "error": None}
    except Exception as e:   # noqa: BLE001 - recorded for the test's message
        result = {"steps": None, "error": f"{type(e).__name__}: {e}"}
    torch.save({**result, "after_forward": seen[:1], "rows": rows}, out.format(rank=rank))
    os._exit(0)   # no destroy_process_group: after a timed-out collective it may wait for the other rank


def test_fsdp2_units_that_are_the_clipped_layers_train(tmp_path):
    """Two Linear layers, each fully_shard'ed itself, trained sharded for STEPS steps (Gaussian noise: what is tested
    is not the correlated noise).  check_rate = 0 makes the check's schedule deterministic: with seed 11 rank 0's part
    of step 4 has 5 rows (the output's width, so a new layout of shapes) and rank 1's 4, so rank 0 alone needs the
    attribution passes.  The ranks decide the row check together from the sharded parameters the optimizer holds, and
    a module that is both an FSDP unit and a clipped layer holds its sharded parameter again after the forward (the
    capture restores the gathered copy only where FSDP2's reshard has not already put the shard back): before, no
    rank saw a sharded parameter, each chose its own check level, and the ranks hung in mismatched collectives."""
    out = str(tmp_path / "rank{rank}.pt")
    run_ranks(_bare_worker, str(tmp_path / "store"), out, deadline_s=_DEADLINE_S)
    ranks = [torch.load(out.format(rank=r), weights_only=False) for r in range(2)]
    for r, rank in enumerate(ranks):
        assert rank["error"] is None and rank["steps"] == STEPS, (
            f"rank {r}: {rank['error']}; parameters after the forward: {rank['after_forward']}; rows a step: "
            f"{rank['rows']}")
        assert rank["after_forward"] == [["DTensor", "DTensor"]]
