"""make_private(batch_sampling=...): each scheme draws what its mechanism says (chi-square tests at stated
confidence, fixed seeds), the engine accounts it with that mechanism, and the canary audit passes with it and catches
its deliberately wrong accounting."""

import itertools
import math

import numpy as np
import pytest
import torch
from scipy import stats
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, default_collate

from dpmath import (
    FixedSizeSubsampledGaussian,
    PLDAccountant,
    RandomAllocationGaussian,
    ShuffledGaussian,
    SubsampledGaussian,
    TruncatedSubsampledGaussian,
)
from dpsgd import PrivacyEngine
from dpsgd.data import KeepsRowOrder, RowOrderError
from dpsgd.noise import GaussianNoise
from dpsgd.samplers import (
    BallsInBins,
    CyclicBatchSampler,
    CyclicPoisson,
    EpochBatchSampler,
    FixedSize,
    FixedSizeBatchSampler,
    Poisson,
    Shuffling,
    TruncatedPoisson,
    TruncatedPoissonBatchSampler,
    as_batch_sampling,
)

N, B = 200, 20
ALPHA = 1e-3   # each chi-square test rejects a correct sampler with probability 1e-3


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _uniform_counts_ok(counts: np.ndarray) -> bool:
    """Chi-square test of equal expected counts, at level ALPHA."""
    return stats.chisquare(counts).pvalue > ALPHA


# ------------------------------------------------------------------------------------------------ what they draw
def test_fixed_size_batches_have_b_distinct_examples_each_equally_often():
    s = FixedSizeBatchSampler(N, B, steps=2000, generator=_gen())
    counts = np.zeros(N)
    for batch in s:
        assert len(batch) == B == len(set(batch))
        counts[batch] += 1
    assert _uniform_counts_ok(counts)


def test_truncated_poisson_sizes_follow_the_binomial_capped_at_max_batch_size():
    q, cap, steps = 0.1, 22, 4000
    s = TruncatedPoissonBatchSampler(N, q, cap, steps=steps, generator=_gen(1))
    sizes = np.array([len(b) for b in s])
    assert sizes.max() <= cap
    # the capped binomial: sizes below the cap as Binomial(N, q), the rest at the cap
    expected = np.array([stats.binom.pmf(k, N, q) for k in range(12, cap)])
    expected = np.concatenate([[stats.binom.cdf(11, N, q)], expected, [stats.binom.sf(cap - 1, N, q)]]) * steps
    observed = np.array([np.sum(sizes <= 11)] + [np.sum(sizes == k) for k in range(12, cap)] + [np.sum(sizes == cap)])
    assert stats.chisquare(observed, expected).pvalue > ALPHA


def test_balls_in_bins_puts_every_example_in_exactly_one_uniform_step_per_epoch():
    steps = 10
    s = EpochBatchSampler(N, "allocate", steps=steps, generator=_gen(2))
    position = np.zeros((N, steps))
    for _ in range(100):
        epoch = list(s)
        assert sorted(i for b in epoch for i in b) == list(range(N))
        for t, batch in enumerate(epoch):
            position[batch, t] += 1
    assert _uniform_counts_ok(position.sum(0)) and _uniform_counts_ok(position[0] + position[1])


def test_balls_in_bins_with_k_participations_puts_every_example_in_k_distinct_uniform_steps():
    steps, k = 10, 3
    s = EpochBatchSampler(N, "allocate", steps=steps, generator=_gen(12), participations=k)
    position = np.zeros((N, steps))
    for _ in range(100):
        epoch = list(s)
        assert all(len(set(b)) == len(b) for b in epoch)                  # an example at most once a step
        assert sorted(i for b in epoch for i in b) == sorted(list(range(N)) * k)
        for t, batch in enumerate(epoch):
            position[batch, t] += 1
    assert _uniform_counts_ok(position.sum(0)) and _uniform_counts_ok(position[0] + position[1])


def test_balls_in_bins_with_k_participations_is_accounted_as_k_of_t_steps():
    bound = BallsInBins(participations=2).bind(1000, 10)
    assert (bound.steps_per_epoch, bound.sample_rate) == (200, 0.01)
    assert bound.mechanism(1.5, GaussianNoise(), None) == RandomAllocationGaussian(1.5, 200, participations=2)
    assert BallsInBins(participations=2).settings() == {"name": "balls_in_bins", "participations": 2}
    with pytest.raises(ValueError, match="participations must be a positive integer"):
        BallsInBins(participations=0)
    for k, message in ((0, "positive integer"), (True, "positive integer"), (11, r"\[1, steps=10\]")):
        with pytest.raises(ValueError, match=f"participations must (be a|lie in) .*{message}"):
            EpochBatchSampler(N, "allocate", steps=10, participations=k)
    assert BallsInBins(participations=2.0) == BallsInBins(participations=np.int64(2)) == BallsInBins(participations=2)
    engine = _train(BallsInBins(participations=2), loops=1, stop=4)
    # 4 batches: one epoch of 2 in 20 steps begun, composed as 2 epochs of 1 in 10
    assert engine.accountant().events == ((RandomAllocationGaussian(1.5, 10), 2),)


def test_shuffling_cuts_a_permutation_into_batches_of_b():
    s = EpochBatchSampler(N + 5, "shuffle", batch_size=B, generator=_gen(3))
    first = np.zeros(math.ceil((N + 5) / B))
    for _ in range(200):
        epoch = list(s)
        assert [len(b) for b in epoch] == [B] * (len(epoch) - 1) + [(N + 5) % B]
        assert sorted(i for b in epoch for i in b) == list(range(N + 5))
        first[[t for t, b in enumerate(epoch) if 0 in b]] += 1
    # example 0's batch is uniform over the full batches (the short last one holds it B/5 times less often)
    assert _uniform_counts_ok(first[:-1])


def test_an_epoch_stopped_early_resumes_where_it_stopped():
    s = EpochBatchSampler(N, "shuffle", batch_size=B, generator=_gen(4))
    it = iter(s)
    head = [next(it) for _ in range(3)]
    rest = list(s)[:7]   # the next loop starts with the same epoch's remaining 7 batches
    assert sorted(i for b in head + rest for i in b) == list(range(N))
    assert s.drawn == 3 + 10


# ------------------------------------------------------------------------------------------------ the engine
def _train(batch_sampling, estimator="exact", steps=None, sigma=1.5, loops=1, stop=None, **kw):
    data = TensorDataset(torch.randn(N, 4), torch.randint(0, 2, (N,)))
    model = nn.Linear(4, 2)
    engine = PrivacyEngine()
    model, opt, crit, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=DataLoader(data, batch_size=B),
        max_grad_norm=1.0, noise_multiplier=None if kw else sigma, estimator=estimator, seed=0,
        batch_sampling=batch_sampling, criterion=nn.CrossEntropyLoss(), **kw)
    for _ in range(loops):
        # stopping early: before drawing the next batch (a drawn batch must be stepped on)
        for x, y in (loader if stop is None else itertools.islice(loader, stop)):
            opt.zero_grad()
            crit(model(x), y).backward()
            opt.step()
            if steps is not None and engine.steps >= steps:
                break
    return engine


@pytest.mark.parametrize("scheme, mechanism, relation", [
    (TruncatedPoisson(40), TruncatedSubsampledGaussian(1.5, 0.1, 40, N), "add_or_remove"),
    (FixedSize(), FixedSizeSubsampledGaussian(1.5, B, N), "replace_one"),
])
def test_the_engine_composes_the_schemes_mechanism_once_a_step(scheme, mechanism, relation):
    engine = _train(scheme, steps=7)
    assert engine.steps == 7
    assert engine.get_epsilon(1e-3) == PLDAccountant(neighboring=relation).compose(mechanism, 7).epsilon(1e-3)


@pytest.mark.parametrize("scheme, mechanism, relation", [
    pytest.param("balls_in_bins", RandomAllocationGaussian(1.5, 10), "add_or_remove", marks=pytest.mark.slow),
    ("shuffling", ShuffledGaussian(1.5, 10), "replace_one"),
])
def test_epoch_schemes_charge_every_epoch_their_stream_began(scheme, mechanism, relation):
    # three loops stopped after 4 batches each: 12 steps, but the stream drew 4 + 4 + 4 batches of epochs 1 and 2
    engine = _train(scheme, loops=3, stop=4)
    assert engine.steps == 12
    expected = PLDAccountant(neighboring=relation).compose(mechanism, 2).epsilon(1e-5)
    assert engine.get_epsilon(1e-5) == expected
    assert engine.accountant().events == ((mechanism, 2),)


@pytest.mark.parametrize("estimator", [
    "hutch",                                       # each epoch one Gaussian step with the envelope
    pytest.param("exact", marks=pytest.mark.slow),  # each epoch's own PLD, built at every noise tried (about 50 s)
])
def test_calibration_meets_the_target_over_the_schemes_events(estimator):
    engine = _train("balls_in_bins", estimator, target_epsilon=3.0, target_delta=1e-5, epochs=2)
    assert engine.planned_steps == 20
    envelope = engine.accountant().events[0][0].envelope
    eps = PLDAccountant().compose(RandomAllocationGaussian(engine.noise_multiplier, 10, envelope), 2).epsilon(1e-5)
    assert 2.95 <= eps <= 3.0
    with pytest.raises(RuntimeError, match="calibrated for 20 steps"):
        _train("balls_in_bins", estimator, target_epsilon=3.0, target_delta=1e-5, epochs=2, loops=3)


def test_randomized_clipping_runs_with_every_scheme():
    for scheme in (Poisson(), TruncatedPoisson(60), BallsInBins(), FixedSize(), Shuffling()):
        engine = _train(scheme, estimator="hutch", steps=3)
        assert 0 < engine.get_epsilon(1e-5) < math.inf


def test_fixed_size_randomized_clipping_charges_two_scales_together():
    from dpmath import HutchEnvelope, ReplacementEnvelope, SubsampledGaussian

    engine = _train(FixedSize(), estimator="hutch", steps=4)
    m = engine.accountant().events[0][0]
    assert m == FixedSizeSubsampledGaussian(1.5, B, N, engine.envelope)
    assert m.dominating() == SubsampledGaussian(1.5, B / N, ReplacementEnvelope(engine.envelope))
    exact = PLDAccountant(neighboring="replace_one").compose(FixedSizeSubsampledGaussian(1.5, B, N), 4).epsilon(1e-5)
    assert engine.get_epsilon(1e-5) > exact
    # the union bound: the sum of two scales above s at most twice one scale above s / 2
    env = HutchEnvelope(projection_dim=16, dim=1000)
    y = np.array([0.01, 0.05, 0.1, 0.2])
    assert np.array_equal(ReplacementEnvelope(env).cdf(y), np.minimum(1.0, 2 * env.cdf(4 * y)))


@pytest.mark.parametrize("kwargs, match", [
    ({"batch_sampling": "fixed_size", "noise": "laplace"}, "Gaussian noise only"),
    ({"batch_sampling": "truncated_poisson"}, "needs its max_batch_size"),
    ({"batch_sampling": TruncatedPoisson(10)}, "below the loader's batch_size"),
    ({"batch_sampling": "uniform"}, "batch_sampling must be"),
    ({"batch_sampling": "fixed_size", "privacy_unit": "user", "user_ids": list(range(N))}, "users are Poisson"),
])
def test_unsupported_combinations_are_refused_with_the_reason(kwargs, match):
    data = TensorDataset(torch.randn(N, 4), torch.randint(0, 2, (N,)))
    model = nn.Linear(4, 2)
    kwargs.setdefault("estimator", "exact")
    with pytest.raises(ValueError, match=match):
        PrivacyEngine().make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                     data_loader=DataLoader(data, batch_size=B), max_grad_norm=1.0,
                                     noise_multiplier=1.0, **kwargs)


def test_epoch_schemes_refuse_a_ledger(tmp_path):
    data = TensorDataset(torch.randn(N, 4), torch.randint(0, 2, (N,)))
    model = nn.Linear(4, 2)
    with pytest.raises(ValueError, match="ledger_path"):
        PrivacyEngine(ledger_path=tmp_path / "ledger").make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(data, batch_size=B), max_grad_norm=1.0, noise_multiplier=1.0, estimator="exact",
            batch_sampling="shuffling")


def test_batch_sampling_names_and_the_engines_record():
    assert as_batch_sampling("shuffling") == Shuffling() or isinstance(as_batch_sampling("shuffling"), Shuffling)
    engine = _train(TruncatedPoisson(40), steps=1)
    assert engine.batch_sampling == TruncatedPoisson(40)
    assert engine.state_dict()["settings"]["batch_sampling"] == {"name": "truncated_poisson", "max_batch_size": 40}


# ------------------------------------------------------------------------------------------------ the audit
@pytest.mark.slow   # 22 s; `python -m verify --quick` runs the same audit
def test_the_sampler_audit_passes_and_catches_each_schemes_wrong_accounting():
    from verify.training import SAMPLER_BREAKS, sampler_audit

    result = sampler_audit()   # 4000 canaries a run, delta 0.05, 95 % confidence
    assert result.holds, result.rows
    assert {r["step"] for r in result.rows} == {"as shipped"} | {f"BROKEN: {b}" for b in SAMPLER_BREAKS.values()}


# ------------------------------------------------------------------------------------------------ padded batches
def test_padded_truncated_batches_have_one_shape_and_their_filler_rows_add_nothing():
    from dpsgd.capture import Capture
    from dpsgd.clipping import clipped_backward
    from dpsgd.plan import NormPlan

    s = TruncatedPoissonBatchSampler(N, 0.1, 24, steps=50, generator=_gen(5), pad=True)
    batches = list(s)
    assert {len(b) for b in batches} == {24} and any(b.real < 24 for b in batches)
    assert all(b[:b.real] == sorted(set(b[:b.real])) for b in batches)
    # the engine: a padded batch's sums are those of its real rows alone
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).double()
    x, y = torch.randn(24, 4, dtype=torch.float64), torch.randint(0, 2, (24,))
    real = 17
    padding = torch.arange(24) >= real

    def sums(rows, mask=None):
        capture = Capture(NormPlan.build(model, "ghost"))
        try:
            losses = nn.functional.cross_entropy(model(x[rows]), y[rows], reduction="none")
            out = clipped_backward(capture, losses, 0.5, 1, None, padding=mask)
        finally:
            capture.remove()
        return out

    padded, alone = sums(slice(None), padding), sums(slice(0, real))
    for key, value in alone.sums.items():
        torch.testing.assert_close(padded.sums[key], value)
    assert (padded.weights[real:] == 0).all()


def test_a_padded_run_accounts_truncated_poisson_and_refuses_splitting_it():
    engine = _train(TruncatedPoisson(30, pad=True), estimator="ghost", steps=5)
    assert engine.get_epsilon(1e-5) == PLDAccountant().compose(TruncatedSubsampledGaussian(1.5, 0.1, 30, N),
                                                               5).epsilon(1e-5)
    from dpsgd import BatchMemoryManager

    data = TensorDataset(torch.randn(N, 4), torch.randint(0, 2, (N,)))
    model = nn.Linear(4, 2)
    model, opt, crit, loader = PrivacyEngine().make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=DataLoader(data, batch_size=B),
        max_grad_norm=1.0, noise_multiplier=1.0, estimator="ghost", batch_sampling=TruncatedPoisson(30, pad=True),
        criterion=nn.CrossEntropyLoss())
    with pytest.raises(ValueError, match="cannot be split"):
        BatchMemoryManager(data_loader=loader, max_physical_batch_size=10, optimizer=opt)
    x, y = next(iter(loader))
    with pytest.raises(RuntimeError, match="backpropagated whole"):
        crit(model(x[:20]), y[:20]).backward()


# ------------------------------------------------------------------------------------------------ collate order
def by_value(items):
    """A collate_fn that sorts its rows (by the first feature), as a length-sorting collator does."""
    return default_collate(sorted(items, key=lambda item: float(item[0][0])))


def reversed_rows(items):
    """A collate_fn that returns its rows in reverse."""
    return default_collate(items[::-1])


def _step_by_brute_force(model, batch, before, c):
    """The noise-free step (lr 1) of a padded batch of rows ``(x, y, index)``: its first rows are distinct drawn
    examples and every later row repeats one of them; each drawn example's gradient is clipped to ``c`` once (by
    autograd on an unhooked copy of the model at ``before``), the filler rows add nothing, and the sum is divided by
    the expected batch size ``B``.  Returns the number of filler rows."""
    x, y, index = batch[:3]
    first: dict[int, int] = {}
    for row, i in enumerate(index.tolist()):
        first.setdefault(i, row)
    drawn = list(first.values())
    assert drawn == list(range(len(drawn)))   # the drawn rows first, then only filler
    fresh = nn.Linear(4, 2).double()
    with torch.no_grad():
        for p, b in zip(fresh.parameters(), before, strict=True):
            p.copy_(b)
    total = [torch.zeros_like(b) for b in before]
    for r in drawn:
        grads = torch.autograd.grad(nn.functional.cross_entropy(fresh(x[r:r + 1]), y[r:r + 1]), fresh.parameters())
        w = min(1.0, c / float(sum(g.square().sum() for g in grads).sqrt()))
        total = [t + w * g for t, g in zip(total, grads, strict=True)]
    for p, b, t in zip(model.parameters(), before, total, strict=True):
        torch.testing.assert_close(p.detach() - b, -t / B, rtol=1e-10, atol=1e-13)
    return len(index) - len(drawn)


def _padded_run(collate, steps=6, brute_force=False):
    """Parameters after a noise-free ghost run of a float64 linear model over examples ``(x, y, index)``, batches
    from ``TruncatedPoisson(24, pad=True)`` (about four filler rows each) collated by ``collate``."""
    gen = _gen(3)
    data = TensorDataset(torch.randn(N, 4, generator=gen, dtype=torch.float64) * 3,
                         torch.randint(0, 2, (N,), generator=gen), torch.arange(N))
    torch.manual_seed(0)
    model = nn.Linear(4, 2).double()
    engine = PrivacyEngine()
    model, opt, crit, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=DataLoader(data, batch_size=B, collate_fn=collate), max_grad_norm=0.5, noise_multiplier=0.0,
        estimator="ghost", seed=0, batch_sampling=TruncatedPoisson(24, pad=True), criterion=nn.CrossEntropyLoss())
    clipped, filler = 0.0, 0
    for batch in itertools.islice(loader, steps):
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        crit(model(batch[0]), batch[1]).backward()
        clipped = max(clipped, engine.last_clipped_fraction)
        opt.step()
        if brute_force:
            filler += _step_by_brute_force(model, batch, before, 0.5)
    assert engine.steps == steps and clipped > 0   # some examples clipped: the weights matter
    assert filler or not brute_force
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("collate", [by_value, reversed_rows])
def test_a_padded_batch_is_the_same_whatever_order_collate_fn_gives_its_rows(collate):
    # a collate_fn that sorted a drawn example's filler copy among the drawn rows would have it weighted while the
    # original kept its weight: the loader collates the drawn examples alone and appends the filler after them
    want = _padded_run(None)
    got = _padded_run(collate, brute_force=True)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-15)   # the same rows, summed in another order
    declared = _padded_run(KeepsRowOrder(default_collate), brute_force=True)   # one call on the whole batch
    for d, w in zip(declared, want, strict=True):
        assert torch.equal(d, w)


def test_a_padded_batch_whose_rows_cannot_be_told_apart_is_refused_unless_declared_in_order():
    def with_names(items):   # a list of strings: nothing says which string is which row's
        x, y, i = default_collate(items)
        return x, y, i, [f"example {int(j)}" for j in i]

    with pytest.raises(RowOrderError, match=r"with_names.*at batch\[3\]\[0\], a str, not a tensor.*"
                                            r"KeepsRowOrder\(collate_fn\)"):
        _padded_run(with_names, steps=1)
    _padded_run(KeepsRowOrder(with_names), steps=2, brute_force=True)


VOCAB = 24


def text_tokenizer():
    """A word-level tokenizer of ``VOCAB`` words (``[PAD]`` is 0), built here: no download."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({"[PAD]": 0, "[UNK]": 1, **{f"w{i}": i for i in range(2, VOCAB)}},
                                      unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="[PAD]", unk_token="[UNK]")


def texts(n: int, seed: int = 4) -> list[dict]:
    """``n`` tokenized examples of 1 to 8 words and a label, as a tokenized data set holds them."""
    gen = _gen(seed)
    tokenizer = text_tokenizer()
    out = []
    for k in torch.randint(1, 9, (n,), generator=gen).tolist():
        words = " ".join(f"w{int(t)}" for t in torch.randint(2, VOCAB, (k,), generator=gen))
        out.append({"input_ids": tokenizer(words)["input_ids"], "label": int(torch.randint(0, 2, (), generator=gen))})
    return out


class Bag(nn.Module):
    """A row's mean token embedding over its attention mask, then a linear layer: each row's output is its own,
    however far it is padded."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.out = nn.Embedding(VOCAB, 6), nn.Linear(6, 2)

    def forward(self, input_ids, attention_mask):
        m = attention_mask.unsqueeze(-1).to(self.out.weight.dtype)
        return self.out((self.emb(input_ids) * m).sum(1) / m.sum(1))


class LongestFirst:
    """A Hugging Face collator that first sorts its rows, longest first (as length-grouping pipelines do)."""

    def __init__(self, collator) -> None:
        self.collator = collator

    def __call__(self, features):
        return self.collator(sorted(features, key=lambda f: -len(f["input_ids"])))


def text_run(collate, data, batch_size, steps=5, **kw):
    """Parameters of :class:`Bag` (float64) after a noise-free ghost run on ``data`` collated by ``collate``."""
    model = Bag().double()
    engine = PrivacyEngine()
    model, opt, crit, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=DataLoader(data, batch_size=batch_size, collate_fn=collate), max_grad_norm=0.05,
        noise_multiplier=0.0, estimator="ghost", seed=0, criterion=nn.CrossEntropyLoss(), **kw)
    for batch in itertools.islice(loader, steps):
        opt.zero_grad()
        crit(model(batch["input_ids"], batch["attention_mask"]), batch["labels"]).backward()
        opt.step()
    assert engine.steps == steps
    return [p.detach().clone() for p in model.parameters()]


def test_a_hugging_face_padding_collator_pads_a_padded_batch_and_its_filler_alike_in_any_row_order():
    from transformers import DataCollatorWithPadding

    collator = DataCollatorWithPadding(text_tokenizer())
    data, padded = texts(N), {"batch_sampling": TruncatedPoisson(24, pad=True)}
    want = text_run(KeepsRowOrder(collator), data, B, **padded)   # one call on drawn and filler rows, in order
    for got in (text_run(collator, data, B, **padded), text_run(LongestFirst(collator), data, B, **padded)):
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-15)


def test_a_resumed_epoch_run_charges_the_epochs_before_and_begins_a_new_one():
    data = TensorDataset(torch.randn(N, 4), torch.randint(0, 2, (N,)))

    def run(state=None, batches=15, drawn=None):
        model = nn.Linear(4, 2)
        engine = PrivacyEngine()
        model, opt, crit, loader = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(data, batch_size=B), max_grad_norm=1.0, noise_multiplier=1.5, estimator="exact",
            seed=0, batch_sampling="balls_in_bins", criterion=nn.CrossEntropyLoss())
        if state is not None:
            engine.load_state_dict(state)
        stream = itertools.chain.from_iterable(itertools.repeat(loader, 3))
        for x, y in itertools.islice(stream, batches):
            if drawn is not None:
                drawn.append(x)
            opt.zero_grad()
            crit(model(x), y).backward()
            opt.step()
        return engine

    first = run()   # 15 batches: epochs 1 and 2 (half of it) charged
    assert first.accountant().events == ((RandomAllocationGaussian(1.5, 10), 2),)
    state = first.state_dict()
    assert state["epochs"] == 2 and not any(isinstance(v, torch.Tensor) for v in state.values())
    drawn = [[], []]
    for seen in drawn:   # 5 more: a third epoch, not the rest of the second
        second = run(state, batches=5, drawn=seen)
        assert second.spent_steps == 20
        assert second.accountant().events == ((RandomAllocationGaussian(1.5, 10), 3),)
    # the new epoch is a fresh allocation (from os.urandom), not one the checkpoint or the seed predicts
    assert [len(x) for x in drawn[0]] != [len(x) for x in drawn[1]] or \
        any(not torch.equal(a, b) for a, b in zip(drawn[0], drawn[1], strict=True))


def test_cyclic_poisson_draws_each_example_only_at_its_groups_steps_at_the_rate():
    """Eight cycles of 4 groups over 400 examples at q = 0.3: each example drawn only at steps of its one group, the
    total of draws binomial(3200, 0.3) (each example eligible 8 times: a two-sided 1e-4 test), and an example's
    group independent of the others' (adding one leaves the others' groups: the same generator state assigns the
    first 400 alike)."""
    bound = CyclicPoisson(4).bind(400, 30)
    assert (bound.sample_rate, bound.steps_per_epoch, bound.expected_batch_size) == (0.3, 4, 30.0)
    sampler = bound.sampler(torch.Generator().manual_seed(1))
    assert isinstance(sampler, CyclicBatchSampler) and len(sampler) == 4 * round(1 / 0.3)
    batches = [b for _ in range(3) for b in sampler][:32]
    seen: dict[int, set] = {}
    for t, batch in enumerate(batches):
        for i in batch:
            seen.setdefault(i, set()).add(t % 4)
    assert all(len(groups) == 1 for groups in seen.values())
    total = sum(len(b) for b in batches)
    assert stats.binomtest(total, 3200, 0.3).pvalue > 1e-4
    assert bound.events(32, sampler) == math.ceil(sampler.drawn / 4)
    sampler.resume(2)
    assert sampler.drawn == 8
    one_more = CyclicBatchSampler(401, 4, 1.0, generator=torch.Generator().manual_seed(5))
    same = CyclicBatchSampler(400, 4, 1.0, generator=torch.Generator().manual_seed(5))
    cycle = [list(b) for b, _ in zip(one_more, range(4), strict=False)]
    other = [list(b) for b, _ in zip(same, range(4), strict=False)]
    assert [[i for i in b if i < 400] for b in cycle] == other


def test_cyclic_poisson_refuses_a_rate_above_one_and_bad_groups():
    with pytest.raises(ValueError, match="groups"):
        CyclicPoisson(0)
    with pytest.raises(ValueError, match="at most 10 groups"):
        CyclicPoisson(11).bind(100, 10)
    with pytest.raises(ValueError, match=r"CyclicPoisson\(groups\)"):
        as_batch_sampling("cyclic_poisson")


def test_cyclic_poisson_with_gaussian_noise_charges_one_subsampled_step_per_cycle():
    x = torch.randn(120, 3)
    model = nn.Linear(3, 2)
    engine = PrivacyEngine()
    model, opt, crit, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=6),
        criterion=nn.CrossEntropyLoss(), max_grad_norm=1.0, noise_multiplier=1.0, batch_sampling=CyclicPoisson(3))
    for i, (xb, yb) in enumerate(loader):
        opt.zero_grad()
        crit(model(xb), yb).backward()
        opt.step()
        if i == 6:
            break
    assert engine.steps == 7
    expected = PLDAccountant().compose(SubsampledGaussian(1.0, 0.15), 3).epsilon(1e-5)   # cycles 1, 2 and 3 begun
    assert engine.get_epsilon(1e-5) == expected


@pytest.mark.parametrize("scheme", [Poisson(), FixedSize(), BallsInBins(), Shuffling(), CyclicPoisson(2),
                                    TruncatedPoisson(8)])
@pytest.mark.parametrize("n,b,match", [(100, 0, "batch_size must be a positive integer"),
                                       (0, 1, "num_samples must be a positive integer"),
                                       (10, 20, r"batch_size \(20\) must be at most")])
def test_every_scheme_refuses_impossible_sizes_by_name(scheme, n, b, match):
    with pytest.raises(ValueError, match=match):
        scheme.bind(n, b)
    assert scheme.bind(np.int64(100), np.int64(4)).batch_size == 4   # numpy integers are integers
