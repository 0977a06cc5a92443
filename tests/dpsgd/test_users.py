"""User-level privacy (make_private(privacy_unit="user")): each user's summed gradient clipped once, users
Poisson-sampled at q_u = batch_size / U, epsilon per user, and the canary audit with whole users as canaries."""

import numpy as np
import pytest
import torch
from scipy import stats
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpmath import PLDAccountant, SubsampledGaussian
from dpsgd import BatchMemoryManager, PrivacyEngine
from dpsgd.capture import Capture
from dpsgd.clipping import clipped_backward
from dpsgd.data import KeepsRowOrder, RowOrderError
from dpsgd.plan import NormPlan
from dpsgd.strategies import TwiceSampling
from dpsgd.users import UserBatch, UserPoissonSampler, user_level
from verify.workloads import data, lm_losses, make

from .test_samplers import LongestFirst, by_value, reversed_rows, text_run, text_tokenizer, texts

C = 0.2   # small enough that some users are clipped and others not
GROUPS = torch.tensor([0, 0, 1, 2, 2, 2])   # six rows: users of 2, 1 and 3 examples


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.Tanh(), nn.Linear(7, 3)).double()


def _mlp_losses(model, x, y):
    return nn.functional.cross_entropy(model(x), y, reduction="none")


def _mlp_data(b=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(b, 5, generator=gen, dtype=torch.float64), torch.randint(0, 3, (b,), generator=gen)


def _engine_sums(model, losses_of, estimator, groups, k=1, seed=0, norms_only=False):
    """``(clipped sums by parameter name, per-user squared norms)`` from the engine's user-level backward."""
    capture = Capture(NormPlan.build(model, estimator, k))
    try:
        result = clipped_backward(capture, losses_of(model), C, k, torch.Generator().manual_seed(seed),
                                  groups=groups, norms_only=norms_only)
    finally:
        capture.remove()
    sums = {n: result.sums[id(p)] for n, p in model.named_parameters() if id(p) in result.sums}
    return sums, result.sq_norms


def _brute_force(model, losses_of, groups):
    """Per user: autograd of the user's summed loss, clipped to C once; ``(sums by name, per-user sq norms)``."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = [p for p in model.parameters() if p.requires_grad]
    total = {n: torch.zeros_like(p) for n, p in zip(names, params, strict=True)}
    norms = []
    for u in range(int(groups.max()) + 1):
        losses = losses_of(model)
        grads = torch.autograd.grad(losses[groups == u].sum(), params, allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)]
        sq = sum(g.square().sum() for g in grads)
        norms.append(sq)
        w = min(1.0, C / float(sq.sqrt()))
        for n, g in zip(names, grads, strict=True):
            total[n] += w * g
    return total, torch.stack(norms)


def _models(b=6):
    ids = data(b, seed=3)
    x, y = _mlp_data(b)
    return {
        "sequential": (_mlp(), lambda m: _mlp_losses(m, x, y)),
        "gpt2_tied": (make("gpt2_tied"), lambda m: lm_losses(m, ids)),
        "llama_untied": (make("llama_untied"), lambda m: lm_losses(m, ids)),
        "module_called_twice": (make("module_called_twice"), lambda m: lm_losses(m, ids)),
        "cnn_groupnorm": (make("cnn_groupnorm"), lambda m: lm_losses(m, ids)),
    }


@pytest.mark.parametrize("estimator", ["exact", "ghost"])
@pytest.mark.parametrize("name", ["sequential", "gpt2_tied", "llama_untied", "module_called_twice",
                                  "cnn_groupnorm"])
def test_exact_per_user_clipped_sum_equals_brute_force(name, estimator):
    model, losses_of = _models()[name]
    sums, norms = _engine_sums(model, losses_of, estimator, GROUPS)
    want, want_norms = _brute_force(model, losses_of, GROUPS)
    torch.testing.assert_close(norms, want_norms, rtol=1e-9, atol=1e-12)
    assert set(sums) == set(want)   # every trainable parameter counted
    for n in want:
        torch.testing.assert_close(sums[n], want[n], rtol=1e-9, atol=1e-12, msg=n)
    assert (norms.sqrt() > C).any()   # some user is clipped: the weights matter


@pytest.mark.parametrize("name", ["sequential", "llama_untied"])
def test_very_uneven_users_take_the_per_example_path_to_the_same_clipped_sum(name):
    # one user of five rows and two of one: regrouping along tokens would pad 15 rows for 7, so linear layers sum
    # their per-example gradients per user instead
    model, losses_of = _models(7)[name]
    groups = torch.tensor([1, 0, 0, 0, 0, 0, 2])
    sums, norms = _engine_sums(model, losses_of, "ghost", groups)
    want, want_norms = _brute_force(model, losses_of, groups)
    torch.testing.assert_close(norms, want_norms, rtol=1e-9, atol=1e-12)
    for n in want:
        torch.testing.assert_close(sums[n], want[n], rtol=1e-9, atol=1e-12, msg=n)


@pytest.mark.parametrize("name", ["sequential", "gpt2_tied"])
def test_hutchpp_with_k_above_every_rank_is_the_exact_per_user_clipped_sum(name):
    # Hutch++ is exact when min(rows, cols) <= k: a check of the sketch through each user's summed products
    # (GPT-2's tied embedding: several calls) and of the regrouped linear layers
    model, losses_of = _models()[name]
    sums, norms = _engine_sums(model, losses_of, "hutchpp", GROUPS, k=40)
    want, want_norms = _brute_force(model, losses_of, GROUPS)
    torch.testing.assert_close(norms, want_norms, rtol=1e-7, atol=1e-10)
    for n in want:
        torch.testing.assert_close(sums[n], want[n], rtol=1e-7, atol=1e-10, msg=n)


@pytest.mark.parametrize("name", ["sequential", "module_called_twice"])
def test_hutch_per_user_norm_is_unbiased_and_exact_as_k_grows(name):
    model, losses_of = _models()[name]
    _, exact = _engine_sums(model, losses_of, "exact", GROUPS, norms_only=True)
    draws = torch.stack([_engine_sums(model, losses_of, "hutch", GROUPS, k=4, seed=s, norms_only=True)[1]
                         for s in range(300)])
    sem = draws.std(0) / 300 ** 0.5
    assert ((draws.mean(0) - exact).abs() < 4.5 * sem).all(), (draws.mean(0), exact)
    _, huge = _engine_sums(model, losses_of, "hutch", GROUPS, k=20000, norms_only=True)
    torch.testing.assert_close(huge, exact, rtol=0.05, atol=0)


def test_single_example_users_are_the_example_level_step():
    model, losses_of = _models()["gpt2_tied"]
    per_user, _ = _engine_sums(model, losses_of, "ghost", torch.arange(6))
    capture = Capture(NormPlan.build(model, "ghost"))
    try:
        plain = clipped_backward(capture, losses_of(model), C, 1, None)
    finally:
        capture.remove()
    for n, p in model.named_parameters():
        torch.testing.assert_close(per_user[n], plain.sums[id(p)], rtol=1e-10, atol=1e-13)


def _user_run(users, collate=None, batch_size=4, **kw):
    """An MLP on float64 examples whose third column is the example's user, batches collated by ``collate``;
    make_private(privacy_unit='user')."""
    model = _mlp()
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(len(users), 5, generator=gen, dtype=torch.float64) * 3
    y = torch.randint(0, 3, (len(users),), generator=gen)
    ds = TensorDataset(x, y, torch.as_tensor(users))
    engine = PrivacyEngine()
    args = dict(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                data_loader=DataLoader(ds, batch_size=batch_size, collate_fn=collate), max_grad_norm=C,
                noise_multiplier=0.0, estimator="ghost", privacy_unit="user", user_ids=users, seed=1,
                criterion=nn.CrossEntropyLoss())
    args.update(kw)
    return engine, *engine.make_private(**args)


def _reference_update(state, batches, expected_users):
    """The noise-free update of one logical batch (its physical ``batches``) by brute force on an unhooked copy of
    the model at ``state``: -(sum over the drawn users of w_u G_u) / (q_u U)."""
    x, y, u = (torch.cat([b[j] for b in batches]) for j in range(3))
    _, groups = torch.unique(u, return_inverse=True)
    fresh = _mlp()
    fresh.load_state_dict(state)
    want, _ = _brute_force(fresh, lambda m: _mlp_losses(m, x, y), groups)
    return {n: -g / expected_users for n, g in want.items()}


def _assert_update(model, state, want):
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach() - state[n], want[n], rtol=1e-9, atol=1e-12, msg=n)


@pytest.mark.parametrize("clipping_pass", ["bookkeeping", "two-pass"])
def test_trainer_step_clips_each_drawn_user_once(clipping_pass):
    users = [i % 12 for i in range(60)]   # 12 users of 5 examples, interleaved in the dataset
    engine, model, opt, crit, loader = _user_run(users, clipping_pass=clipping_pass)
    assert engine.sample_rate == 4 / 12 and engine.expected_batch_size == pytest.approx(4.0)
    clipped = 0.0
    for batch in loader:
        state = {n: p.detach().clone() for n, p in model.state_dict().items()}
        opt.zero_grad()
        crit(model(batch[0]), batch[1]).backward()
        clipped = max(clipped, engine.last_clipped_fraction)   # the fraction of the batch's users clipped
        opt.step()
        _assert_update(model, state, _reference_update(state, [batch], engine.expected_batch_size))
    assert engine.steps == len(loader) == 3 and clipped > 0


def test_an_epoch_with_empty_user_batches_takes_every_step():
    # one user per batch expected among 12: about a third of the batches draw nobody (a noise-only step each)
    engine, model, opt, crit, loader = _user_run([i % 12 for i in range(60)], noise_multiplier=1.0,
                                                 data_loader=DataLoader(TensorDataset(
                                                     torch.randn(60, 5, dtype=torch.float64),
                                                     torch.randint(0, 3, (60,)), torch.arange(60) % 12),
                                                     batch_size=1))
    seen = 0
    for x, y, u in loader:
        assert len(x) and len(torch.unique(u)) >= 1
        seen += 1
        opt.zero_grad()
        crit(model(x), y).backward()
        opt.step()
    assert engine.steps == len(loader) == 12 and seen < 12


def test_physical_batches_hold_whole_users_and_accumulate_to_their_logical_step():
    users = [i // 3 for i in range(60)]   # 20 users of 3 examples, capped at 2
    ds = TensorDataset(torch.randn(60, 5, dtype=torch.float64) * 3, torch.randint(0, 3, (60,)),
                       torch.as_tensor(users))
    engine, model, opt, crit, loader = _user_run(users, max_examples_per_user=2,
                                                 data_loader=DataLoader(ds, batch_size=10))
    chunks, state, split = [], None, False
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=5, optimizer=opt) as small:
        for batch in small:
            assert len(batch[0]) <= 5
            if not chunks:
                state = {n: p.detach().clone() for n, p in model.state_dict().items()}
            chunks.append(batch)
            steps = engine.steps
            opt.zero_grad()
            crit(model(batch[0]), batch[1]).backward()
            opt.step()
            if engine.steps == steps:
                continue   # accumulated only: the logical batch goes on
            split |= len(chunks) > 1
            ids = [set(c[2].tolist()) for c in chunks]
            assert all(a.isdisjoint(b) for i, a in enumerate(ids) for b in ids[i + 1:])   # no user split
            assert all((torch.bincount(c[2]) <= 2).all() for c in chunks)                # the cap
            _assert_update(model, state, _reference_update(state, chunks, engine.expected_batch_size))
            chunks = []
    assert engine.steps == len(loader) and split


# users of 1 to 6 examples, interleaved in the dataset: a reversed or sorted batch puts rows at other users' places
UNEVEN = [u for u in range(12) for _ in range(u % 6 + 1)][::2] + [u for u in range(12) for _ in range(u % 6 + 1)][1::2]


def _uneven_run(collate, physical=None):
    """Parameters after a noise-free run over the ``UNEVEN`` users, each logical batch checked against the brute-force
    update from its rows' user column (its physical batches with ``physical``, each holding whole users)."""
    engine, model, opt, crit, loader = _user_run(UNEVEN, collate, noise_multiplier=0.0)
    chunks, state, clipped = [], None, 0.0
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=physical or 64, optimizer=opt) as small:
        for _ in range(2):
            for batch in (small if physical else loader):
                if not chunks:
                    state = {n: p.detach().clone() for n, p in model.state_dict().items()}
                chunks.append(batch)
                steps = engine.steps
                opt.zero_grad()
                crit(model(batch[0]), batch[1]).backward()
                clipped = max(clipped, engine.last_clipped_fraction)
                opt.step()
                if engine.steps == steps:
                    continue   # accumulated only: the logical batch goes on
                ids = [set(c[2].tolist()) for c in chunks]
                assert all(a.isdisjoint(b) for i, a in enumerate(ids) for b in ids[i + 1:])   # no user split
                _assert_update(model, state, _reference_update(state, chunks, engine.expected_batch_size))
                chunks = []
    assert engine.steps == 2 * len(loader) and clipped > 0
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("physical", [None, 7])
@pytest.mark.parametrize("collate", [by_value, reversed_rows])
def test_a_reordering_collate_fn_cannot_split_a_user(collate, physical):
    # the loader collates each user's rows by a call of their own and joins the calls user after user: the engine's
    # groups hold whatever order collate_fn returns rows in (by position, a sorted batch would clip users apart)
    want = _uneven_run(None, physical)
    got = _uneven_run(collate, physical)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-12, atol=1e-15, msg=n)   # another summation order
    declared = _uneven_run(KeepsRowOrder(torch.utils.data.default_collate), physical)   # one call per batch
    for n in want:
        assert torch.equal(declared[n], want[n]), n


def test_a_collate_fn_whose_users_cannot_be_joined_is_refused_by_name():
    def with_names(items):   # a list of strings: nothing says which string is which row's
        x, y, u = torch.utils.data.default_collate(items)
        return x, y, u, [f"user {int(j)}" for j in u]

    engine, model, opt, crit, loader = _user_run([i % 12 for i in range(60)], with_names)
    with pytest.raises(RowOrderError, match=r"with_names.*at batch\[3\]\[0\], a str.*privacy_unit='user'.*"
                                            r"KeepsRowOrder\(collate_fn\)"):
        next(iter(loader))
    _uneven_run(KeepsRowOrder(with_names))


def test_a_hugging_face_padding_collator_is_refused_for_users_unless_fixed_length_or_declared_in_order():
    from transformers import DataCollatorWithPadding

    data, users = texts(120), {"privacy_unit": "user", "user_ids": [i % 30 for i in range(120)]}
    longest = DataCollatorWithPadding(text_tokenizer())   # pads each call to its longest row
    with pytest.raises(RowOrderError, match=r"DataCollatorWithPadding\) pads each call to its longest row.*"
                                            r"padding='max_length'.*KeepsRowOrder\(collator\)"):
        text_run(longest, data, 6, **users)
    want = text_run(KeepsRowOrder(longest), data, 6, **users)   # one call per batch, users by their places
    fixed = DataCollatorWithPadding(text_tokenizer(), padding="max_length", max_length=8)
    for collate in (fixed, LongestFirst(fixed)):   # each user by a call of its own, joined
        got = text_run(collate, data, 6, **users)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-15)
    # a collate function of its own that pads to the longest row: refused as users of different lengths are joined
    with pytest.raises(RowOrderError, match=r"LongestFirst.*at batch\['input_ids'\], tensors whose shapes past the "
                                            r"first dimension differ.*padding='max_length'.*KeepsRowOrder"):
        text_run(LongestFirst(longest), data, 6, **users)


def test_user_larger_than_the_physical_batch_is_refused_by_name():
    users = [0] * 10 + list(range(1, 11))
    engine, model, opt, crit, loader = _user_run(users[:20], data_loader=DataLoader(TensorDataset(
        torch.randn(20, 5, dtype=torch.float64), torch.randint(0, 3, (20,)), torch.as_tensor(users[:20])),
        batch_size=4))
    with pytest.raises(ValueError, match="max_physical_batch_size=8.*max_examples_per_user"):
        BatchMemoryManager(data_loader=loader, max_physical_batch_size=8, optimizer=opt)
    # with the cap the user fits
    _, _, opt, _, loader = _user_run(users[:20], max_examples_per_user=8, data_loader=DataLoader(TensorDataset(
        torch.randn(20, 5, dtype=torch.float64), torch.randint(0, 3, (20,)), torch.as_tensor(users[:20])),
        batch_size=4))
    BatchMemoryManager(data_loader=loader, max_physical_batch_size=8, optimizer=opt)


def test_sampler_draws_each_user_at_rate_q():
    # 200 users, q = 0.3, 400 batches: each user's count is Binomial(400, 0.3); the chi-square statistic over
    # users is checked at 99.9% confidence (fixed seed)
    users = torch.arange(200).repeat_interleave(torch.arange(200) % 3 + 1)
    s = UserPoissonSampler(users, 0.3, steps=400, generator=torch.Generator().manual_seed(0))
    counts = torch.zeros(200)
    for b in s:
        drawn = torch.unique(users[torch.tensor(b, dtype=torch.long)]) if len(b) else torch.zeros(0, dtype=torch.long)
        counts[drawn] += 1
        assert sum(b.sizes) == len(b) and len(b.sizes) == len(drawn)   # each drawn user brings all its examples
    n, q = 400, 0.3
    chi2 = float(((counts - n * q) ** 2 / (n * q * (1 - q))).sum())
    assert stats.chi2.sf(chi2, 200) > 1e-3 and stats.chi2.cdf(chi2, 200) > 1e-3


def test_sampler_caps_each_user_with_a_uniform_subset():
    users = torch.tensor([0] * 6 + [1])
    s = UserPoissonSampler(users, 1.0, max_examples_per_user=2, steps=3000,
                           generator=torch.Generator().manual_seed(1))
    counts = torch.zeros(7)
    for b in s:
        assert b.sizes == [2, 1]
        assert b[2] == 6 and b[0] < b[1] < 6   # user 0's two rows (a subset, in order), then user 1's
        counts[torch.tensor(b)] += 1
    # each of user 0's six examples is kept with probability 1/3: chi-square over them at 99.9% confidence
    expected = 3000 * 2 / 6
    chi2 = float(((counts[:6] - expected) ** 2 / expected).sum())
    assert stats.chi2.sf(chi2, 5) > 1e-3


def test_split_rows_keeps_users_whole_and_numbers_them_per_piece():
    b = UserBatch([4, 5, 9, 1, 2, 3], [2, 1, 3])
    pieces = list(b.split_rows(3, None))
    assert [(p, g.tolist(), last) for p, g, last in pieces] == [([4, 5, 9], [0, 0, 1], False),
                                                                 ([1, 2, 3], [0, 0, 0], True)]
    fixed = list(b.split_rows(None, 2))
    assert [p for p, _, _ in fixed] == [[4, 5], [9, 1, 2, 3]]
    with pytest.raises(ValueError, match="max_examples_per_user"):
        list(b.split_rows(2, None))


@pytest.mark.parametrize("kw, match", [
    ({"user_ids": list(range(59))}, "user_ids has 59 labels"),
    ({"privacy_unit": "users"}, "privacy_unit must be one of"),
    ({"privacy_unit": "example"}, "user_ids is given but privacy_unit='example'"),
    ({"max_examples_per_user": 0}, "max_examples_per_user must be a positive integer"),
    ({"user_ids": None}, "needs user_ids"),
    ({"user_ids": torch.zeros(60, 2, dtype=torch.long)}, "1-D tensor"),
    ({"clipping": TwiceSampling(coordinate_rate=0.5, max_grad_coordinate=0.05)}, "twice sampling"),
    ({"user_ids": [i % 3 for i in range(60)]}, "exceeds the 3 users"),
])
def test_bad_user_level_arguments_are_refused_by_name(kw, match):
    with pytest.raises(ValueError, match=match):
        _user_run([i % 12 for i in range(60)], **kw)


class _SeriesLike:
    """What a pandas Series offers (``to_numpy``), without pandas."""

    def __init__(self, values):
        self.values = np.asarray(values)

    def __len__(self):
        return len(self.values)

    def to_numpy(self):
        return self.values


def test_user_ids_are_users_by_value_whatever_their_container():
    """The issue's measurement: user_ids=list(author_tensor) made every example its own user (0-d tensors hash
    by identity), so the user rate and epsilon were those of examples; numpy arrays were refused.  Equal values
    are one user, whatever holds them."""
    authors = [(7 * i) % 12 for i in range(60)]   # 12 users of 5 examples each, interleaved
    want, *_ = _user_run(authors, noise_multiplier=1.0)
    assert want.sample_rate == pytest.approx(4 / 12)
    as_tensor = torch.tensor(authors)
    for ids in (list(as_tensor), as_tensor, np.array(authors), list(np.array(authors)), _SeriesLike(authors),
                as_tensor.to(torch.int32), [a if i % 2 else torch.tensor(a) for i, a in enumerate(authors)],
                [f"user-{a}" for a in authors]):
        engine, *_ = _user_run(authors, noise_multiplier=1.0, user_ids=ids)
        assert engine.sample_rate == want.sample_rate and engine.expected_batch_size == want.expected_batch_size
    users = user_level("user", list(as_tensor), None)
    assert users.num_users == 12 and users.users.tolist() == user_level(
        "user", authors, None).users.tolist()


@pytest.mark.parametrize("ids, match", [
    ([float(i % 12) for i in range(60)], "user_ids.*float"),
    (torch.arange(60.0) % 12, "user_ids.*float"),
    (np.arange(60.0) % 12, "user_ids.*float"),
    ([torch.tensor(float(i % 12)) for i in range(60)], "user_ids.*float"),
    ([i % 12 if i % 2 else str(i % 12) for i in range(60)], "user_ids.*mixes"),
    ([[i % 12] for i in range(60)], "user_ids"),
    ([object() for _ in range(60)], "user_ids"),
    ([bool(i % 2) for i in range(60)], "user_ids"),
    ([torch.tensor([i % 12]) for i in range(60)], "user_ids"),
    ({"a": 1}, "user_ids"),
    ("abc", "user_ids"),
])
def test_user_ids_that_are_not_integer_or_string_labels_are_refused_by_name(ids, match):
    with pytest.raises(TypeError, match=match):
        user_level("user", ids, None)


def test_max_examples_per_user_without_users_is_refused():
    from ..helpers import private_classifier

    with pytest.raises(ValueError, match="max_examples_per_user is given"):
        private_classifier(max_examples_per_user=3, noise_multiplier=1.0)


def test_batches_not_from_the_loader_are_refused():
    engine, model, opt, crit, loader = _user_run([i % 12 for i in range(60)])
    x, y, _ = next(iter(loader))
    opt.zero_grad()
    with pytest.raises(RuntimeError, match="one whole physical batch"):
        crit(model(x[:-1]), y[:-1]).backward()   # a part of the drawn batch: rows no longer match users
    engine2, model2, opt2, crit2, loader2 = _user_run([i % 12 for i in range(60)])
    with pytest.raises(RuntimeError, match="without a batch drawn"):
        crit2(model2(x), y).backward()   # rows that no private loader yielded


def test_epsilon_is_per_user_at_the_user_rate():
    users = [i // 5 for i in range(60)]   # 12 users; batch_size 4: q_u = 1/3, the example rate would be 1/15
    engine, model, opt, crit, loader = _user_run(users, noise_multiplier=1.2)
    for x, y, _ in loader:
        opt.zero_grad()
        crit(model(x), y).backward()
        opt.step()
    by_hand = PLDAccountant().compose(SubsampledGaussian(noise_multiplier=1.2, sample_rate=4 / 12), 3)
    lo, hi = by_hand.epsilon_bracket(1e-5)
    eps = engine.get_epsilon(1e-5)
    assert lo <= eps <= hi * (1 + 1e-6)
    example_rate = PLDAccountant().compose(SubsampledGaussian(noise_multiplier=1.2, sample_rate=4 / 60), 3)
    assert eps > 2 * example_rate.epsilon(1e-5)


def test_hutch_epsilon_charges_the_user_rate_with_the_plans_envelope():
    engine, *_ = _user_run([i // 5 for i in range(60)], noise_multiplier=1.2, estimator="hutch", projection_dim=8)
    rc = SubsampledGaussian(noise_multiplier=1.2, sample_rate=4 / 12, envelope=engine.envelope)
    assert engine.accounting.mechanism(engine.noise_multiplier) == rc


def test_target_epsilon_calibrates_for_the_user_rate():
    engine, model, opt, crit, loader = _user_run([i // 5 for i in range(60)], noise_multiplier=None,
                                                 target_epsilon=3.0, target_delta=1e-5, epochs=2)
    assert engine.planned_steps == 6
    for _ in range(2):
        for x, y, _ in loader:
            opt.zero_grad()
            crit(model(x), y).backward()
            opt.step()
    eps = engine.get_epsilon(1e-5)
    assert 2.5 < eps <= 3.0
    sigma = engine.noise_multiplier
    by_hand = PLDAccountant().compose(SubsampledGaussian(noise_multiplier=sigma, sample_rate=1 / 3), 6)
    assert by_hand.epsilon(1e-5) == pytest.approx(eps, rel=1e-9)


def test_privacy_unit_is_a_fixed_setting_recorded_in_checkpoints():
    users = [i % 12 for i in range(60)]
    engine, *_ = _user_run(users, max_examples_per_user=3)
    assert engine.state_dict()["settings"]["privacy_unit"] == "user"
    assert engine.state_dict()["settings"]["max_examples_per_user"] == 3
    for name, value in (("privacy_unit", "example"), ("max_examples_per_user", 10)):
        with pytest.raises(AttributeError, match="fixed by make_private"):
            setattr(engine, name, value)
    other, *_ = _user_run(users, max_examples_per_user=4)
    with pytest.raises(ValueError, match="max_examples_per_user"):
        other.load_state_dict(engine.state_dict())
    from ..helpers import private_classifier

    example, *_ = private_classifier(noise_multiplier=1.0)
    assert "privacy_unit" not in example.state_dict()["settings"]   # example-level ledgers keep their format
    with pytest.raises(ValueError, match="privacy_unit"):
        example.load_state_dict(engine.state_dict())


def test_user_level_canary_audit_holds_and_catches_both_broken_variants():
    """Canary users of 4 examples (tiny decoder, exact, 4000 canary users, q_u = 0.5, 2 steps, sigma = 1): the
    audited bound (95% confidence) stays below the reported per-user epsilon at delta = 0.05; charging the
    example rate or clipping each example alone lands above it."""
    from verify.training import USER_BREAKS, USER_CONFIGS, user_audit

    result = user_audit(USER_CONFIGS[0])
    assert result.holds, result.rows
    rows = {r["step"]: r for r in result.rows}
    assert rows["as shipped"]["lower bound (Clopper-Pearson)"] <= rows["as shipped"]["reported epsilon"]
    for b in USER_BREAKS:
        assert rows[f"BROKEN: {b}"]["lower bound (Clopper-Pearson)"] > rows[f"BROKEN: {b}"]["reported epsilon"], b


def test_user_level_canary_audit_with_hutch_and_micro_batches():
    from verify.training import USER_CONFIGS, user_audit

    assert user_audit(USER_CONFIGS[1]).holds
