"""DP-SGD-RC under torch.distributed: 2 processes, gloo, CPU.  Norms stay local, the clipped sums are
all-reduced, the noise is added once with standard deviation sigma C (not sqrt(2) sigma C).  The non-Poisson
batch samplings draw over the global index set: the union of the ranks' batches is the single-process batch."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpmath import (
    FixedSizeSubsampledGaussian,
    PLDAccountant,
    RandomAllocationGaussian,
    ShuffledGaussian,
    SubsampledGaussian,
    TruncatedSubsampledGaussian,
)
from dpmath.correlated import BandedStrategy
from dpsgd import PrivacyEngine
from dpsgd.noise import BandedNoise
from dpsgd.samplers import BallsInBins, CyclicPoisson, FixedSize, Shuffling, TruncatedPoisson


def _worker(rank: int, world: int, store: str) -> None:
    # a file store, not a TCP port: no race for a free port when other tests run beside this one
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        x, y = torch.randn(80, 6), torch.randn(80, 1)
        shard = TensorDataset(x[rank::world], y[rank::world])
        init = nn.Linear(6, 1)
        # 1. sigma = 0, huge C: one step equals the non-private step on the union of both ranks' batches
        model = nn.Linear(6, 1)
        model.load_state_dict(init.state_dict())
        engine = PrivacyEngine()
        m, opt, crit, loader = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
            data_loader=DataLoader(shard, batch_size=10), criterion=nn.MSELoss(reduction="sum"),
            max_grad_norm=1e9, noise_multiplier=0.0, estimator="ghost", seed=7)
        xb, yb = next(iter(loader))
        crit(m(xb), yb).backward()
        opt.step()
        batches = [None] * world
        dist.all_gather_object(batches, (xb, yb))
        params = [None] * world
        dist.all_gather_object(params, [p.detach() for p in model.parameters()])
        if rank == 0:
            assert engine.expected_batch_size == pytest.approx(20.0)
            assert all(torch.equal(a, b) for a, b in zip(params[0], params[1], strict=True))
            ref = nn.Linear(6, 1)
            ref.load_state_dict(init.state_dict())
            xs = torch.cat([b[0] for b in batches])
            ys = torch.cat([b[1] for b in batches])
            (((ref(xs) - ys) ** 2).sum() / 20.0).backward()
            with torch.no_grad():
                for p in ref.parameters():
                    p -= p.grad
            assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(params[0], ref.parameters(), strict=True))
        # 2. zero gradients: the update is the noise alone, std sigma C / (expected batch size)
        big = nn.Linear(100, 100)
        with torch.no_grad():
            for p in big.parameters():
                p.zero_()
        engine = PrivacyEngine()
        m, opt, crit, loader = engine.make_private(
            module=big, optimizer=torch.optim.SGD(big.parameters(), lr=1.0),
            data_loader=DataLoader(TensorDataset(torch.zeros(40, 100), torch.zeros(40, 100)), batch_size=10),
            criterion=nn.MSELoss(), max_grad_norm=2.0, noise_multiplier=1.5, estimator="exact", seed=3)
        xb, yb = next(iter(loader))
        crit(m(xb) * 0.0, yb).backward()
        opt.step()
        std = torch.cat([p.detach().flatten() for p in big.parameters()]).std().item()
        if rank == 0:
            assert std == pytest.approx(1.5 * 2.0 / 20.0, rel=0.05)  # once, not sqrt(2) times
        # 3. unequal shards (100 and 50 examples, batch 10 each): one global rate q = 20 / 150 on both ranks, the
        # same number of steps per epoch (each rank's own q = 10/100 and 10/50 charged the wrong rate and gave
        # gloo unequal step counts), and one ledger
        shard = TensorDataset(torch.randn(100 if rank == 0 else 50, 6), torch.randn(100 if rank == 0 else 50, 1))
        model = nn.Linear(6, 1)
        engine = PrivacyEngine()
        m, opt, crit, loader = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(shard, batch_size=10), criterion=nn.MSELoss(), max_grad_norm=1.0,
            target_epsilon=4.0, target_delta=1e-5, epochs=1, estimator="ghost", seed=5)
        assert engine.sample_rate == pytest.approx(20 / 150) and engine.expected_batch_size == pytest.approx(20.0)
        assert loader.logical_sampler.sample_rate == engine.sample_rate
        for xb, yb in loader:
            crit(m(xb), yb).backward()
            opt.step()
        out = [None] * world
        dist.all_gather_object(out, (engine.steps, engine.noise_multiplier, engine.get_epsilon(1e-5)))
        assert out[0] == out[1] and out[0][0] == len(loader) and out[0][2] <= 4.0
    finally:
        dist.destroy_process_group()
    # Every check above has passed here.  About one run in five, the worker then aborts during interpreter
    # teardown ("terminate called without an active exception", no Python frame: a native thread of torch's
    # gloo build still joinable at exit), which spawn reports as a failure; a clean exit skips that teardown.
    os._exit(0)


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")
def test_two_process_gloo_training_step(tmp_path):
    mp.spawn(_worker, args=(2, str(tmp_path / "store")), nprocs=2, join=True)


# unequal shards (52 and 8 examples) and unequal loader batch sizes (8 and 2): N = 60, B = 10 globally; rank 1's
# part of a global batch is often empty (a noise-only step on rank 1 while rank 0 has rows)
_SIZES, _BATCHES, _SEED = (52, 8), (8, 2), 11
_SCHEMES = {"truncated_poisson": TruncatedPoisson(11), "fixed_size": FixedSize(), "balls_in_bins": BallsInBins(),
            "shuffling": Shuffling(), "cyclic_poisson": CyclicPoisson(2)}


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(sum(_SIZES), 6, generator=g), torch.randn(sum(_SIZES), 1, generator=g)


def _run(engine: PrivacyEngine, dataset: TensorDataset, batch_size: int, scheme, sigma: float, seed=_SEED,
         state=None, noise="gaussian"):
    """One epoch of a linear model under ``scheme`` (resumed from the engine ``state`` if given): the global
    indices of each step's batch (a step whose batch is empty on this rank is a noise-only step the loader takes
    itself: no entry) and the final parameters."""
    model = _init()
    m, opt, crit, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(dataset, batch_size=batch_size), criterion=nn.MSELoss(reduction="sum"),
        max_grad_norm=1e9, noise_multiplier=sigma, estimator="ghost", batch_sampling=scheme, seed=seed, noise=noise)
    if state is not None:
        engine.load_state_dict(state)
    drawn = {}
    for xb, yb, ib in loader:
        drawn[engine.steps] = ib.tolist()
        crit(m(xb), yb).backward()
        opt.step()
    assert engine.steps == len(loader) * (1 if state is None else 2)
    return drawn, [p.detach().clone() for p in model.parameters()]


def _init() -> nn.Linear:
    torch.manual_seed(1)
    return nn.Linear(6, 1)


def _scheme_worker(rank: int, world: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        x, y = _data()
        lo = sum(_SIZES[:rank])
        idx = torch.arange(lo, lo + _SIZES[rank])
        shard = TensorDataset(x[idx], y[idx], idx)
        results = {}
        for name, scheme in _SCHEMES.items():
            # sigma = 0, huge C: every step is the non-private step on the union of the ranks' batches
            engine = PrivacyEngine()
            drawn, params = _run(engine, shard, _BATCHES[rank], scheme, 0.0)
            assert engine.expected_batch_size == pytest.approx(10.0)
            # noise: the accounting is the scheme's at the global N and B, the same on every rank
            engine = PrivacyEngine()
            _run(engine, shard, _BATCHES[rank], scheme, 1.0)
            results[name] = (drawn, params, engine.sample_rate, engine.get_epsilon(1e-5))
        # banded correlated noise under cyclic Poisson: the same noise on every rank, so the same parameters
        engine = PrivacyEngine()
        _, params = _run(engine, shard, _BATCHES[rank], CyclicPoisson(2), 1.0,
                         noise=BandedNoise(BandedStrategy((1.0, 0.5))))
        results["banded"] = (params, engine.get_epsilon(1e-5))
        # a scheme that differs between ranks would draw other global batches: refused on every rank, before rank
        # 0 alone refuses a max_batch_size below B (which would leave rank 1 waiting in a collective)
        with pytest.raises(ValueError, match="batch sampling .* differs between ranks"):
            _run(PrivacyEngine(), shard, _BATCHES[rank], TruncatedPoisson(9 + 2 * rank), 0.0)
        gathered = [None] * world
        dist.all_gather_object(gathered, results)
        if rank == 0:
            torch.save(gathered, out)
    finally:
        dist.destroy_process_group()
    os._exit(0)   # see _worker


def test_sharded_index_batches_are_the_global_batches():
    """Each rank's part of a shared global stream: the parts concatenate to the unsharded batches."""
    for scheme in _SCHEMES.values():
        bound = scheme.bind(60, 10)
        whole = list(bound.sampler(torch.Generator().manual_seed(3)))
        parts = [list(bound.sampler(torch.Generator().manual_seed(3), offset=lo, size=n))
                 for lo, n in ((0, 52), (52, 8))]
        assert whole == [a + [52 + i for i in b] for a, b in zip(*parts, strict=True)]
    with pytest.raises(ValueError, match="exceeds"):
        FixedSize().bind(60, 10).sampler(None, offset=52, size=9)


@pytest.mark.slow   # 9 s: two processes per scheme
@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")
def test_two_process_batch_samplings(tmp_path):
    out = tmp_path / "ranks.pt"
    mp.spawn(_scheme_worker, args=(2, str(tmp_path / "store"), str(out)), nprocs=2, join=True)
    ranks = torch.load(out)
    x, y = _data()
    everything = TensorDataset(x, y, torch.arange(len(x)))
    mechanisms = {"truncated_poisson": TruncatedSubsampledGaussian(1.0, 10 / 60, 11, 60, None),
                  "fixed_size": FixedSizeSubsampledGaussian(1.0, 10, 60),
                  "balls_in_bins": RandomAllocationGaussian(1.0, 6, None), "shuffling": ShuffledGaussian(1.0, 6),
                  "cyclic_poisson": SubsampledGaussian(1.0, 10 * 2 / 60)}
    lopsided = 0   # steps in which one rank had rows and the other none
    for name, scheme in _SCHEMES.items():
        # the single-process run with the same seed draws the global batches
        reference, _ = _run(PrivacyEngine(), everything, 10, scheme, 0.0)
        union = [sorted(sum((r[name][0].get(t, []) for r in ranks), [])) for t in range(6)]
        lopsided += sum((t in ranks[0][name][0]) != (t in ranks[1][name][0]) for t in range(6))
        assert union == [reference.get(t, []) for t in range(6)], name
        sizes = [len(b) for b in union]
        if name == "fixed_size":
            assert sizes == [10] * 6
        elif name == "truncated_poisson":
            assert max(sizes) <= 11
        elif name == "cyclic_poisson":   # each index in at most one step of each cycle of 2
            assert all(not set(union[t]) & set(union[t + 1]) for t in range(0, 6, 2))
        else:   # one epoch: every global index exactly once
            assert sorted(sum(union, [])) == list(range(60))
        # sigma = 0: the same parameters on both ranks, those of non-private SGD on the union (sum / B)
        ref = _init()
        for batch in union:
            ref.zero_grad()
            if batch:
                (((ref(x[batch]) - y[batch]) ** 2).sum() / 10.0).backward()
                with torch.no_grad():
                    for p in ref.parameters():
                        p -= 0.5 * p.grad
        for r in ranks:
            assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(r[name][1], ref.parameters(), strict=True))
        # the epsilon is the scheme's mechanism composed at N = 60, B = 10 (one epoch: 6 steps, or 1 epoch event)
        mechanism = mechanisms[name]
        events = {"cyclic_poisson": 3}.get(name, 1 if scheme.per_epoch else 6)   # cycles of 2 steps
        expected = PLDAccountant(neighboring=scheme.neighboring).compose(mechanism, events).epsilon(1e-5)
        for r in ranks:
            assert r[name][2] == pytest.approx(scheme.bind(60, 10).sample_rate)
            assert r[name][3] == pytest.approx(expected, rel=1e-9), name
    assert lopsided > 0
    # banded noise: both ranks drew the same correlated noise (equal parameters), accounted as 3 cycles at sigma/||c||
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["banded"][0], ranks[1]["banded"][0], strict=True))
    expected = PLDAccountant().compose(SubsampledGaussian(1.0 / BandedStrategy((1.0, 0.5)).column_norm, 1 / 3), 3)
    assert ranks[0]["banded"][1] == pytest.approx(expected.epsilon(1e-5), rel=1e-9)


def _resume_worker(rank: int, world: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        x, y = _data()
        lo = sum(_SIZES[:rank])
        idx = torch.arange(lo, lo + _SIZES[rank])
        shard = TensorDataset(x[idx], y[idx], idx)
        results = {}
        for name in ("poisson", "shuffling"):
            engine = PrivacyEngine()   # no seed: every rank's generators from os.urandom, rank 0's where shared
            _run(engine, shard, _BATCHES[rank], name, 1.0, seed=None)
            state = engine.state_dict()
            # two resumes: the generators every rank shares are reseeded alike from rank 0's entropy (one global
            # stream of batches, the same noise on every rank), and differently in each resume
            resumes = []
            for _ in range(2):
                resumed = PrivacyEngine()
                drawn, params = _run(resumed, shard, _BATCHES[rank], name, 1.0, seed=None, state=state)
                assert resumed.steps == 12
                resumes.append((drawn, params))
            results[name] = resumes
        gathered = [None] * world
        dist.all_gather_object(gathered, results)
        if rank == 0:
            torch.save(gathered, out)
    finally:
        dist.destroy_process_group()
    os._exit(0)   # see _worker


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")
def test_two_process_resume_reseeds_the_shared_generators_alike_on_every_rank(tmp_path):
    out = tmp_path / "ranks.pt"
    mp.spawn(_resume_worker, args=(2, str(tmp_path / "store"), str(out)), nprocs=2, join=True)
    ranks = torch.load(out)
    for name in ("poisson", "shuffling"):
        finals = []
        for resume in range(2):
            (drawn0, params0), (drawn1, params1) = ranks[0][name][resume], ranks[1][name][resume]
            # the same noise on both ranks: the same parameters
            assert all(torch.equal(a, b) for a, b in zip(params0, params1, strict=True)), name
            if name == "shuffling":   # one global permutation: every global index exactly once in the epoch
                union = sum((drawn0.get(t, []) + drawn1.get(t, []) for t in range(6, 12)), [])
                assert sorted(union) == list(range(60))
            finals.append(params0)
        assert not all(torch.equal(a, b) for a, b in zip(*finals, strict=True)), name
