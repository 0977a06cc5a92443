"""Example isolation by structure (dpsgd.isolation): every way found to let one example reach another's
loss is refused on the step it happens, whatever calling pattern the loop has, with no check rate
(the tracker on; the sampled row check off: ``check_rate = 0``, ``check_every_step = False``).  Each
case below released steps at 1.2 C to 37 C without an error before the tracker."""

import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpsgd import ExampleMixingError, ExampleTracker, PrivacyEngine, StateChangedError, audit_isolation

D = 4


def _private(model, n=64, batch=8, data=None, criterion=None):
    torch.manual_seed(0)
    model = model.double().train()
    if data is None:
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(n, D, dtype=torch.float64, generator=g),
                             torch.randn(n, 1, dtype=torch.float64, generator=g))
    engine = PrivacyEngine()
    engine.check_rate = 0.0
    engine._track_examples = True
    engine._set_checks()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, crit, loader = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(data, batch_size=batch), criterion=criterion or nn.MSELoss(),
            max_grad_norm=1.0, estimator="exact", noise_multiplier=0.0)
    # the first step's row check is the attribution check of a new layout; it must not be what refuses here
    engine.private_step.capture.checked_layouts.clear()
    return engine, model, opt, crit, loader


def _snapshot(model):
    return [p.detach().clone() for p in model.parameters()]


def _unchanged(model, before):
    return all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


class _Body(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(D, 6), nn.Linear(6, 1)

    def forward(self, x):
        return self.head(self.body(x))


def _loop(engine, model, opt, crit, loader, forward, steps=4):
    done = 0
    for x, y in loader:
        opt.zero_grad()
        crit(forward(model, x), y).backward()
        opt.step()
        done += 1
        if done == steps:
            return


def test_mixing_between_submodules_called_directly_is_refused():
    engine, model, opt, crit, loader = _private(_Body())
    before = _snapshot(model)

    def forward(m, x):
        h = m.body(x)                    # the root forward never runs
        return m.head(h - h.mean(0))

    with pytest.raises(ExampleMixingError, match="mean"):
        _loop(engine, model, opt, crit, loader, forward)
    assert _unchanged(model, before) and engine.steps == 0


class _DictModel(_Body):
    def forward(self, batch):
        h = self.body(batch["x"])
        return self.head(h * torch.softmax(h, dim=0))


def test_mixing_inside_a_model_called_on_a_dict_batch_is_refused():
    engine, model, opt, crit, loader = _private(_DictModel())
    with pytest.raises(ExampleMixingError, match="softmax"):
        _loop(engine, model, opt, crit, loader, lambda m, x: m({"x": x}))
    assert engine.steps == 0


class _Statistics(_Body):
    """A statistics pass without gradient that writes the batch mean into a buffer."""

    def __init__(self):
        super().__init__()
        self.register_buffer("mean", torch.zeros(D))

    def forward(self, x):
        with torch.no_grad():
            self.mean.copy_(x.mean(0))
        return super().forward(x)


def test_a_no_grad_pass_that_writes_example_data_into_a_buffer_is_refused():
    engine, model, opt, crit, loader = _private(_Statistics())
    with pytest.raises(StateChangedError, match="buffer mean"):
        _loop(engine, model, opt, crit, loader, lambda m, x: m(x))


class _LateMix(_Body):
    mixing = False

    def forward(self, x):
        h = self.body(x)
        if self.mixing:   # switched on mid-run
            h = h + h.mean(0)
        return self.head(h)


def test_mixing_that_begins_mid_run_is_refused_on_the_step_it_begins():
    engine, model, opt, crit, loader = _private(_LateMix())
    with pytest.raises(ExampleMixingError):
        for x, y in loader:
            model.mixing = engine.steps >= 2
            opt.zero_grad()
            crit(model(x), y).backward()
            opt.step()
    assert engine.steps == 2


class _WhenPresent(_Body):
    """Mixes only when one particular example (a marked first feature) is in the batch."""

    def forward(self, x):
        h = self.body(x)
        if bool((x[:, 0] > 100).any()):
            h = h + h.mean(0)
        return self.head(h)


def test_mixing_only_when_one_example_is_in_the_batch_is_refused_on_that_step():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, D, dtype=torch.float64, generator=g)
    x[5, 0] = 1000.0
    data = TensorDataset(x, torch.randn(64, 1, dtype=torch.float64, generator=g))
    engine, model, opt, crit, loader = _private(_WhenPresent(), data=data, batch=16)
    steps = 0
    with pytest.raises(ExampleMixingError):
        for _ in range(100):   # Poisson batches: the example is drawn in a step with probability 1/4
            for xb, yb in loader:
                present = bool((xb[:, 0] > 100).any())
                opt.zero_grad()
                crit(model(xb), yb).backward()
                opt.step()
                assert not present, "a step with the example in its batch was released"
                steps += 1
    assert engine.steps == steps


class _ProbeAware(_Body):
    """Mixes only when its input does not require grad (the former row check's probe made it require grad)."""

    def forward(self, x):
        h = self.body(x)
        if not x.requires_grad:
            h = h + 0.5 * h.mean(0)
        return self.head(h)


def test_a_forward_that_mixes_only_when_its_input_needs_no_gradient_is_refused():
    engine, model, opt, crit, loader = _private(_ProbeAware())
    with pytest.raises(ExampleMixingError):
        _loop(engine, model, opt, crit, loader, lambda m, x: m(x))


class _WeightedLoss(nn.Module):
    """Loss weights from detached batch statistics: w_i = L_i / mean_j L_j."""

    def forward(self, out, y):
        per = ((out - y) ** 2).squeeze(1)
        w = per.detach() / per.detach().mean()
        return w * per


def test_loss_weights_from_detached_batch_statistics_are_refused():
    engine, model, opt, crit, loader = _private(_Body(), criterion=nn.MSELoss())
    for x, y in loader:
        losses = _WeightedLoss()(model(x), y)
        with pytest.raises(ExampleMixingError, match="mean"):
            engine.private_loss(losses).backward()
        break
    assert engine.steps == 0


class _BatchNormalizeGrad(torch.autograd.Function):
    """Identity forward; the backward normalizes the gradient over the batch."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g / g.norm(dim=0, keepdim=True).clamp_min(1e-12) * g.shape[0]


class _CustomBackward(_Body):
    def forward(self, x):
        return self.head(_BatchNormalizeGrad.apply(self.body(x)))


def test_a_custom_autograd_function_whose_backward_could_mix_is_refused():
    engine, model, opt, crit, loader = _private(_CustomBackward())
    with pytest.raises(ExampleMixingError, match="_BatchNormalizeGrad"):
        _loop(engine, model, opt, crit, loader, lambda m, x: m(x))


class _Tokens(nn.Module):
    def __init__(self, op):
        super().__init__()
        self.emb, self.head = nn.Embedding(20, 6), nn.Linear(6, 1)
        self.op = op

    def forward(self, ids):
        return self.head(self.emb(self.op(ids)).mean(1))


@pytest.mark.parametrize("op", [lambda ids: ids.roll(1, 0), lambda ids: ids.sort(0).values,
                                lambda ids: ids.flip(0)], ids=["roll", "sort", "flip"])
def test_integer_operations_across_the_batch_on_token_ids_are_refused(op):
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randint(0, 20, (64, 5), generator=g), torch.randn(64, 1, dtype=torch.float64))
    engine, model, opt, crit, loader = _private(_Tokens(op), data=data)
    with pytest.raises(ExampleMixingError):
        _loop(engine, model, opt, crit, loader, lambda m, x: m(x))


class _CapacityMoE(nn.Module):
    """Two experts with a batch-wide capacity over flattened token rows: whether a token is dropped depends
    on the tokens before it in the batch (a cumulative count)."""

    def __init__(self):
        super().__init__()
        self.router, self.experts, self.head = nn.Linear(D, 2), nn.ModuleList([nn.Linear(D, D) for _ in range(2)]), \
            nn.Linear(D, 1)

    def forward(self, x):
        choice = self.router(x).argmax(-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            chosen = choice == e
            position = chosen.long().cumsum(0)          # the capacity counter runs over the batch
            keep = chosen & (position <= 3)
            out = out + keep.unsqueeze(1) * expert(x)
        return self.head(out)


def test_a_mixture_of_experts_with_a_batch_wide_capacity_is_refused():
    engine, model, opt, crit, loader = _private(_CapacityMoE())
    with pytest.raises(ExampleMixingError, match="cumsum"):
        _loop(engine, model, opt, crit, loader, lambda m, x: m(x))


class _Memory(_Body):
    """Transformer-XL style memory kept on a plain attribute between steps."""

    def __init__(self):
        super().__init__()
        self.memory = None

    def forward(self, x):
        h = self.body(x)
        if self.memory is not None:
            h = h + self.memory
        self.memory = h.detach()[:1]
        return self.head(h)


def test_memory_of_earlier_batches_kept_on_an_attribute_is_refused():
    engine, model, opt, crit, loader = _private(_Memory())
    with pytest.raises(ExampleMixingError):
        _loop(engine, model, opt, crit, loader, lambda m, x: m(x))
    assert engine.steps == 1


class _PerRow(_Body):
    """Everything an ordinary model does per example: reshapes, attention within an example, a gather of
    each example's last position, softmax over features."""

    def forward(self, x):
        h = self.body(x).view(x.shape[0], 2, 3)
        att = torch.softmax(h @ h.transpose(1, 2), dim=-1) @ h
        last = att[torch.arange(x.shape[0]), torch.full((x.shape[0],), 1)]
        return self.head(torch.cat([last, last], dim=1))


class _PerRowHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _PerRow()
        self.inner.head = nn.Linear(6, 1)

    def forward(self, x):
        return self.inner(x)


def test_ordinary_per_example_computation_trains_with_the_tracker_on_every_step():
    engine, model, opt, crit, loader = _private(_PerRowHead())
    before = _snapshot(model)
    _loop(engine, model, opt, crit, loader, lambda m, x: m(x), steps=5)
    assert engine.steps == 5 and not _unchanged(model, before)


def test_the_tracker_follows_reshapes_and_refuses_reductions_over_the_batch():
    tracker = ExampleTracker()
    x = torch.randn(3, 4, 5)
    with tracker:
        ids = tracker.register(x)
        flat = x.reshape(12, 5)                    # (B T) rows: each example's id repeated
        back = flat.view(3, 4, 5).sum(1)
        pooled = x.mean(0)
        pairs = x[:, 0] @ x[:, 0].T                # (B, B): pairs of examples, diagonal per example
        own = pairs.diagonal()
    assert tracker.rows(flat).axis(0).tolist() == ids.repeat_interleave(4).tolist()
    tracker.check_rows(back, ids, "back")
    tracker.check_rows(own, ids, "own")
    assert tracker.rows(pooled).mixed
    with pytest.raises(ExampleMixingError):
        tracker.check_rows(pairs.sum(1), ids, "pairs")


def test_an_attention_mask_built_by_indexing_rows_with_a_broadcast_arange_stays_per_example():
    """Attention-mask builders index a padding mask as ``mask[arange(B)[:, None, None, None], kv]``: an index
    along the example axis that varies along one dimension keeps each row its example's (the padded batches of
    DPO pairs take this path), an index that reorders the rows moves their examples with them, and an index that
    varies along two dimensions is refused."""
    tracker = ExampleTracker()
    mask = torch.ones(3, 6, dtype=torch.bool)
    mask[0, 4:] = False
    b, kv = torch.arange(3)[:, None, None, None], torch.arange(6)[None, None, None, :]
    with tracker:
        ids = tracker.register(mask)
        built = mask[b, kv]                                          # (B, 1, 1, K)
        crossed = mask[torch.arange(3)[:, None] * torch.ones(3, dtype=torch.long), torch.arange(3)[None, :]]
        flipped = mask[torch.arange(3).flip(0)[:, None], kv[0, 0]]
        soft = torch.nn.functional.logsigmoid(built.float()).sum((1, 2, 3))
    assert tracker.rows(built).axis(0).tolist() == ids.tolist()
    tracker.check_rows(soft, ids, "masked")
    assert tracker.rows(crossed).mixed
    assert tracker.rows(flipped).axis(0).tolist() == ids.flip(0).tolist()


def test_pieces_of_a_batch_of_one_example_stay_that_examples_and_pieces_of_two_are_refused():
    """A recurrent kernel on a batch of one example merges its rows with time steps and unbinds them: every piece is
    wholly that example's (marked on an axis of size 1), while a piece taken along the example axis of two examples
    is still refused."""
    tracker = ExampleTracker()
    one, two = torch.randn(1, 4, 5), torch.randn(2, 4, 5)
    with tracker:
        ids = tracker.register(one)
        steps = one.transpose(0, 1).reshape(4, 1, 5).unbind(0)     # time-major, then one piece per time step
        first = one.reshape(4, 5)[0]                                # no axis of size 1 left to say whose it is
        tracker.register(two)
        taken = two.reshape(8, 5).unsqueeze(1).unbind(0)
    for piece in steps:
        assert tracker.rows(piece).axes[0][1].tolist() == ids.tolist() and not tracker.rows(piece).mixed
    assert tracker.rows(first).mixed
    assert all(tracker.rows(p).mixed for p in taken)


def test_audit_isolation_finds_a_path_chosen_by_a_batch_wide_condition():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(D, 1)

        def forward(self, x):
            # a batch-wide condition that picks another function for every example
            return self.lin(x) * (2.0 if bool((x > 2.5).any()) else 1.0)

    x = torch.randn(8, D, generator=torch.Generator().manual_seed(3))
    x[2, 1] = 3.0
    model = Branchy().eval()
    with pytest.raises(ExampleMixingError, match="another path"):
        audit_isolation(model, x, lambda m, b: m(b).squeeze(1))
    audit_isolation(nn.Linear(D, 1).eval(), x, lambda m, b: m(b).squeeze(1), atol=1e-6)


class _Leaky(_Body):
    def forward(self, x):
        scale = float(x[0, 0])                 # one example's value, broadcast to all through Python
        return self.head(self.body(x) * scale)


def test_a_value_read_into_python_is_recorded_and_audit_isolation_finds_its_use():
    engine, model, opt, crit, loader = _private(_Leaky())
    for x, y in loader:
        opt.zero_grad()
        crit(model(x), y).backward()
        opt.step()
        break
    assert engine.private_step.tracker.host_reads
    with pytest.raises(ExampleMixingError, match="another path"):
        audit_isolation(model.eval(), x, lambda m, b: m(b).squeeze(1))


def _batch_of_four_or_more(opt, loader):
    """The first drawn batch of at least four rows (a smaller one takes its noise-only step)."""
    for x, y in loader:
        opt.zero_grad()
        if x.shape[0] >= 4:
            return x, y, x.shape[0] // 2
        opt.step()
    raise AssertionError("no batch of four rows in an epoch of batches of sixteen expected")


def test_one_micro_batch_backpropagated_twice_in_a_step_is_refused():
    """Two halves of a drawn batch may be backpropagated separately; the same half twice (with the other never)
    has the right total count, and is refused by the examples themselves."""
    engine, model, opt, crit, loader = _private(_Body(), batch=16)
    x, y, h = _batch_of_four_or_more(opt, loader)
    crit(model(x[:h]), y[:h]).backward()
    with pytest.raises(ExampleMixingError, match="already backpropagated"):
        crit(model(x[:h]), y[:h]).backward()


def test_micro_batches_cut_from_the_batch_by_hand_train_like_the_whole_batch():
    engine, model, opt, crit, loader = _private(_Body(), batch=16)
    x, y, h = _batch_of_four_or_more(opt, loader)
    before = engine.steps
    crit(model(x[:h]), y[:h]).backward()
    crit(model(x[h:]), y[h:]).backward()
    opt.step()
    assert engine.steps == before + 1


class _CompiledLate(_Body):
    mixing = False

    def forward(self, x):
        h = self.body(x)
        if self.mixing:
            h = h - h.mean(0)
        return self.head(h)


def test_a_compiled_model_whose_graph_gains_a_mixing_operation_is_refused_on_that_step():
    torch._dynamo.reset()
    model = _CompiledLate()
    engine, compiled, opt, crit, loader = _private(model)
    compiled = torch.compile(compiled)
    with pytest.raises(ExampleMixingError, match="mean"):
        for _ in range(20):
            for x, y in loader:
                model.mixing = engine.steps >= 2
                opt.zero_grad()
                crit(compiled(x), y).backward()
                opt.step()
    assert engine.steps == 2


def test_class_weights_from_the_batch_are_refused():
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, D, dtype=torch.float64, generator=g), torch.randint(0, 3, (64,), generator=g))

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(D, 3)

        def forward(self, x):
            return self.lin(x)

    engine, model, opt, crit, loader = _private(Head(), data=data)
    for x, y in loader:
        counts = torch.bincount(y, minlength=3).double() + 1   # the batch's class frequencies
        losses = torch.nn.functional.cross_entropy(model(x), y, weight=1 / counts, reduction="none")
        with pytest.raises(ExampleMixingError, match="class weights"):
            engine.private_loss(losses).backward()
        break


def _pad_to_longest(examples):
    """Collation that pads every row to the batch's longest example (with zeros) and a mask."""
    longest = max(len(e) for e in examples)
    x = torch.zeros(len(examples), longest, D)
    mask = torch.zeros(len(examples), longest)
    for i, e in enumerate(examples):
        x[i, :len(e)], mask[i, :len(e)] = e, 1
    return {"x": x, "mask": mask}


class _MeanPool(nn.Module):
    def __init__(self, masked: bool):
        super().__init__()
        self.lin, self.masked = nn.Linear(D, 1), masked

    def forward(self, batch):
        h = self.lin(batch["x"]).squeeze(-1)
        if self.masked:
            return (h * batch["mask"]).sum(1) / batch["mask"].sum(1)
        return h.mean(1)   # the pads enter the mean: a row's result depends on the longest example


def test_audit_isolation_finds_pads_of_the_longest_example_that_reach_the_loss():
    g = torch.Generator().manual_seed(0)
    examples = [torch.randn(n, D, generator=g) for n in (2, 5, 3)]
    with pytest.raises(ExampleMixingError, match="collation"):
        audit_isolation(_MeanPool(masked=False).eval(), examples, lambda m, b: m(b), collate_fn=_pad_to_longest)
    audit_isolation(_MeanPool(masked=True).eval(), examples, lambda m, b: m(b), atol=1e-6,
                    collate_fn=_pad_to_longest)


class _HookMix(_Body):
    """A gradient hook on an activation that centres its gradient over the batch: backward code, which the
    tracker does not follow; the row check of the model's first step (a new layout) sees it."""

    def forward(self, x):
        h = self.body(x)
        if h.requires_grad:
            h.register_hook(lambda g: g - g.mean(0))
        return self.head(h)


def test_a_gradient_hook_that_mixes_the_batch_is_refused_by_the_first_steps_row_check():
    engine, model, opt, crit, loader = _private(_HookMix())
    before = _snapshot(model)
    with pytest.raises(ExampleMixingError):
        _loop(engine, model, opt, crit, loader, lambda m, x: m(x))
    assert _unchanged(model, before) and engine.steps == 0


def _shapes():
    from hypothesis import strategies as st

    def split(dims):
        total = 1
        for x in dims:
            total *= x
        factors, n, f = [], total, 2
        while n > 1:   # the prime factors, regrouped at random below
            while n % f == 0:
                factors.append(f)
                n //= f
            f += 1
        return st.permutations(factors).flatmap(
            lambda p: st.lists(st.integers(0, max(len(p) - 1, 0)), min_size=len(p), max_size=len(p)).map(
                lambda cuts: _group(p, cuts)))
    return st.lists(st.sampled_from([1, 2, 3, 4, 6]), min_size=1, max_size=4).flatmap(
        lambda dims: st.tuples(st.just(dims), split(dims), st.integers(0, len(dims) - 1)))


def _group(factors, cuts):
    out = [1] * (max(cuts, default=0) + 1)
    for f, c in zip(factors, cuts, strict=True):
        out[c] *= f
    return out


def test_a_reshape_of_the_example_axis_lands_where_the_ids_themselves_say_whatever_the_batch():
    # the layout is found once per shape from distinct ids and reused for each batch's ids: it must equal reading the
    # batch's own ids, distinct, repeated or all one example
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from dpsgd.rows import _axis_layout, _reshape_axis

    @settings(max_examples=300, deadline=None)
    @given(shapes=_shapes(), pattern=st.sampled_from(["distinct", "repeated", "one"]), seed=st.integers(0, 99))
    def check(shapes, pattern, seed):
        old, new, d = shapes
        g = torch.Generator().manual_seed(seed)
        size = old[d]
        ids = {"distinct": torch.randperm(64, generator=g)[:size], "one": torch.full((size,), 5),
               "repeated": torch.randint(0, 3, (size,), generator=g)}[pattern]
        got = _reshape_axis(ids, list(old), list(new), d)
        if old[:d + 1] == new[:d + 1]:
            want = (d, ids)
        elif bool((ids == ids[0]).all()):
            want = (0, ids[:1].expand(new[0]))
        else:
            want = _axis_layout(ids, list(old), list(new), d)
        assert (got is None) == (want is None)
        assert got is None or (got[0] == want[0] and torch.equal(got[1], want[1]))

    check()
