"""Example isolation and honest sampling, enforced: each way a user could let one example move another's clipped
contribution, or have a step use examples the accountant does not charge, raises with the module, parameter or
batch named and the fix; or is handled exactly."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpsgd import ExampleMixingError, IncompleteGradientError, ModuleValidator, PrivacyEngine, StateChangedError
from dpsgd.validator import UnsupportedModuleError


def _private(model, n=40, batch=8, d=4, every_step=True, seed=0, **kw):
    torch.manual_seed(seed)
    model = model.double().train()
    x = torch.randn(n, d, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    y = torch.randn(n, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 1))
    engine = PrivacyEngine()
    # these tests pin the gradient row check, which guards isolation when the tracker is off;
    # tests/dpsgd/test_isolation_structure.py pins the tracker on the same and more cases
    engine._track_examples = False
    engine._set_checks()
    engine.check_every_step = every_step
    noise = dict(target_epsilon=2.0, target_delta=1e-5) if "steps" in kw else dict(noise_multiplier=0.0)
    model, opt, crit, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=batch), criterion=nn.MSELoss(),
        max_grad_norm=1.0, estimator="exact", seed=seed, **noise, **kw)
    return engine, model, opt, crit, loader


def _train(engine, model, opt, crit, loader, steps=3):
    done = 0
    for x, y in loader:
        opt.zero_grad()
        crit(model(x), y).backward()
        opt.step()
        done += 1
        if done == steps:
            return


class _Centred(nn.Module):
    """``x - x.mean(0)`` before the first layer: parameter-free, so every per-example gradient is right."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x):
        return self.lin(x - x.mean(0))


class _MixedBetween(nn.Module):
    """Two linear layers with a parameter-free operation ``mix`` between them."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 1)

    def forward(self, x):
        return self.b(self.mix(self.a(x)))


class _BatchNormed(_MixedBetween):
    """``F.batch_norm`` with batch statistics between two layers: no module, no parameter of its own."""

    def mix(self, h):
        return F.batch_norm(h, None, None, training=True)


class _BatchSoftmax(_MixedBetween):
    """Softmax over the batch dimension (attention across examples)."""

    def mix(self, h):
        return h * torch.softmax(h, dim=0)


class _MixUpInside(_MixedBetween):
    """MixUp done inside the forward (manifold mixup): each example mixed with a permuted partner."""

    def mix(self, h):
        return 0.7 * h + 0.3 * h[torch.arange(h.shape[0]).roll(1)]


class _WeakMix(nn.Module):
    """A module with a parameter of its own whose output mixes examples by ``1e-5`` of the batch mean."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 1))

    def forward(self, x):
        y = x @ self.w
        return y + 1e-5 * y.mean(0)


class _Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.mix = _WeakMix()

    def forward(self, x):
        return self.mix(x)


@pytest.mark.parametrize("model", [_Centred, _BatchNormed, _BatchSoftmax, _MixUpInside, _Outer])
def test_a_forward_that_mixes_examples_is_refused_before_anything_is_written(model):
    """Issue cases 1 and 10: each per-example gradient matches brute force (the row check passes), but adding one
    example moves every other's: refused at the backward, parameters and ``.grad`` untouched."""
    engine, m, opt, crit, loader = _private(model())
    before = [p.detach().clone() for p in m.parameters()]
    x, y = next(iter(loader))
    with pytest.raises(ExampleMixingError, match="depend on rows of"):
        crit(m(x), y).backward()
    assert all(p.grad is None for p in m.parameters())
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), before, strict=True))
    assert engine.steps == 0


def test_a_loss_that_reads_other_examples_is_refused():
    """An in-batch contrastive term: the loss of example i reads example j's output."""
    engine, m, opt, crit, loader = _private(nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)))
    x, _ = next(iter(loader))
    z = m(x)
    losses = z.square().sum(1) - torch.logsumexp(z @ z.T, dim=1)
    with pytest.raises(ExampleMixingError, match="rows of 2's output"):
        engine.private_loss(losses).backward()


def test_a_mixing_term_switched_on_after_the_first_step_is_refused_on_the_step_it_appears():
    """Issue case 6: weight 0 on step 1 (the same graph, an exact zero cross-example gradient), 1 from step 2."""
    engine, m, opt, crit, loader = _private(nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)))
    weights = iter([0.0, 1.0])
    steps = 0
    with pytest.raises(ExampleMixingError):
        for x, _ in loader:
            z = m(x)
            w = next(weights)
            losses = z.square().sum(1) - w * torch.logsumexp(z @ z.T, dim=1)
            engine.private_loss(losses).backward()
            opt.step()
            steps += 1
    assert steps == 1 and engine.steps == 1


def test_the_default_schedule_catches_a_late_violation_within_its_stated_miss_probability():
    """Without check_every_step a step is checked with probability ``check_rate`` (secret randomness), and a
    checked step catches a violation between two given examples with probability at least 1/4: the miss
    probability over m violating steps is at most ``(1 - rate/4)^m``; at rate 1/2, 60 steps: 5e-4."""
    engine, m, opt, crit, loader = _private(_Centred(), n=400, batch=40, every_step=False)
    assert engine.check_rate == 0.125
    engine.check_rate = 0.5
    with pytest.raises(ExampleMixingError):
        for _ in range(60):
            _train(engine, m, opt, crit, loader, steps=1)


def _train_lm(model, batch, autocast=False):
    """An epoch of 24 random 8-token sequences with hutch and the row check on every step (bf16 autocast
    optional): ``(engine, loader)``."""
    from verify.workloads import VOCAB, lm_losses

    engine = PrivacyEngine()
    engine.check_every_step = True
    ids = torch.randint(1, VOCAB, (24, 8), generator=torch.Generator().manual_seed(0))
    model, opt, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(ids), batch_size=batch), max_grad_norm=1.0, noise_multiplier=1.0,
        estimator="hutch", seed=0)
    for (x,) in loader:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            losses = lm_losses(model, x)
        engine.private_loss(losses.float()).backward()
        opt.step()
    return engine, loader


def test_ordinary_models_pass_the_isolation_check_on_every_step():
    """Row-wise models (attention within an example, layer norm over features, dropout, a causal LM's shifted
    loss) give exact zeros in other examples' rows: never refused."""
    from verify.workloads import WORKLOADS, make

    for name in WORKLOADS:
        engine, loader = _train_lm(make(name).train(), batch=4)
        assert engine.steps == len(loader)


def test_the_mixing_check_of_the_exact_fallback_is_relative_to_each_row():
    """A re-run that differs by 1e-5 of a row's own scale is refused even when another row is 1e6 times larger
    (a tolerance relative to the batch's largest output let it pass)."""
    from dpsgd.handler import Call
    from dpsgd.materialized import _check_per_example

    full = torch.tensor([[1e6, 1e6], [1.0, -1.0], [2.0, 0.5]])
    per = full.clone()
    per[1] += 1e-3                                   # float32 tolerance 1e-3 of the row's scale 1.0: refused
    call = Call(nn.Linear(2, 2), (), {}, [full], {}, 3)
    with pytest.raises(UnsupportedModuleError, match="depends on other examples"):
        _check_per_example(call, (per.unsqueeze(1),), [0])
    _check_per_example(call, (full.unsqueeze(1),), [0])


def test_a_target_epsilon_is_calibrated_for_the_steps_given_and_never_exceeded():
    """make_private(steps=...) calibrates for exactly that many steps; the step after them is refused."""
    engine, m, opt, crit, loader = _private(nn.Linear(4, 1), n=40, batch=8, every_step=False, steps=7)
    assert engine.planned_steps == 7
    with pytest.raises(RuntimeError, match="calibrated for 7 steps"):
        for _ in range(3):
            _train(engine, m, opt, crit, loader, steps=5)
    assert engine.steps == 7 and engine.get_epsilon(1e-5) <= 2.0


class _SequenceMajor(nn.Module):
    """A linear layer on ``(T * B, d)`` rows flattened sequence-major (row r is example r % B), while the handler
    reads flattened rows example-major: every output ends up with the right example, so only the row check can
    see that the layer's per-example gradients would be read from the wrong rows."""

    def __init__(self):
        super().__init__()
        self.lin, self.head = nn.Linear(4, 3), nn.Linear(3, 1)

    def forward(self, x):                     # x: (B, T, 4)
        b, t, d = x.shape
        h = self.lin(x.transpose(0, 1).reshape(t * b, d)).reshape(t, b, -1).transpose(0, 1)
        return self.head(h).sum(1)


def test_rows_flattened_in_another_order_are_refused_on_the_first_step():
    """Flattened ``(B * T, d)`` rows are read as B examples of T rows; rows in any other order are refused by the
    row check, which every new layout runs, before anything is written."""
    torch.manual_seed(0)
    model = _SequenceMajor().double().train()
    x = torch.randn(40, 5, 4, dtype=torch.float64)
    engine = PrivacyEngine()
    model, opt, crit, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, torch.randn(40, 1, dtype=torch.float64)), batch_size=8),
        criterion=nn.MSELoss(), max_grad_norm=1.0, noise_multiplier=0.0, estimator="exact", seed=0)
    before = [p.detach().clone() for p in model.parameters()]
    xb, yb = next(iter(loader))
    assert xb.shape[0] > 1
    with pytest.raises(IncompleteGradientError, match="lin"):
        crit(model(xb), yb).backward()
    assert engine.steps == 0 and all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


# --- honest sampling ----------------------------------------------------------------------------------------------

def test_drawing_a_second_batch_before_the_step_of_the_first_is_refused():
    """Issue case 2: two Poisson batches concatenated into one step would be charged at rate q while run at 2q."""
    engine, m, opt, crit, loader = _private(nn.Linear(4, 1))
    it = iter(loader)
    x1, y1 = next(it)
    with pytest.raises(RuntimeError, match="drawn .* before optimizer.step"):
        next(it)
    crit(m(x1), y1).backward()
    opt.step()
    assert engine.steps == 1
    next(iter(loader))   # after the step the next batch is fine (the refused iterator has ended)


def test_a_step_on_fewer_rows_than_examples_drawn_is_refused():
    """Issue case 7: a collate_fn that packs two examples into one row; the accountant charges per example."""
    def packing(batch):
        x = torch.stack([b[0] for b in batch])
        y = torch.stack([b[1] for b in batch])
        h = x.shape[0] // 2 * 2
        return x[:h].reshape(-1, 2, 4).sum(1), y[:h].reshape(-1, 2, 1).sum(1)

    torch.manual_seed(0)
    model = nn.Linear(4, 1).double()
    data = TensorDataset(torch.randn(40, 4, dtype=torch.float64), torch.randn(40, 1, dtype=torch.float64))
    engine = PrivacyEngine()
    model, opt, crit, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(data, batch_size=8, collate_fn=packing), criterion=nn.MSELoss(), max_grad_norm=1.0,
        noise_multiplier=1.0, estimator="exact", seed=0)
    x, y = next(iter(loader))
    crit(model(x), y).backward()
    with pytest.raises(RuntimeError, match=r"losses \(rows\) were backpropagated for"):
        opt.step()
    assert engine.steps == 0


# --- state that leaks ---------------------------------------------------------------------------------------------

def test_embedding_max_norm_is_refused_by_the_validator_with_the_fix():
    """Issue case 4: max_norm renormalizes the looked-up rows of the real weight in place during forward."""
    model = nn.Sequential(nn.Embedding(10, 4, max_norm=1.0), nn.Linear(4, 1))
    errors = ModuleValidator.validate(model)
    assert [e.path for e in errors] == ["0"] and "max_norm=None" in str(errors[0])
    with pytest.raises(UnsupportedModuleError, match="max_norm"):
        _private(model)


class _RunningMean(nn.Module):
    """Issue case 5: a normalizer that keeps a running mean of the private inputs in a buffer."""

    def __init__(self):
        super().__init__()
        self.register_buffer("mean", torch.zeros(4))
        self.lin = nn.Linear(4, 1)

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                self.mean.mul_(0.9).add_(0.1 * x.mean(0))
        return self.lin(x - self.mean)


class _Reassigned(_RunningMean):
    def forward(self, x):
        if self.training:
            self.mean = 0.9 * self.mean + 0.1 * x.mean(0).detach()
        return self.lin(x - self.mean)


@pytest.mark.parametrize("model", [_RunningMean, _Reassigned])
def test_a_buffer_written_during_a_training_forward_is_refused_with_its_name(model):
    engine, m, opt, crit, loader = _private(model())
    x, y = next(iter(loader))
    with pytest.raises(StateChangedError, match="buffer mean"):
        m(x)


def test_a_parameter_changed_during_a_training_forward_is_refused():
    class Renorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 1)

        def forward(self, x):
            with torch.no_grad():
                self.lin.weight.clamp_(-0.1, 0.1)
            return self.lin(x)

    engine, m, opt, crit, loader = _private(Renorm())
    x, y = next(iter(loader))
    with pytest.raises(StateChangedError, match="parameter lin.weight"):
        m(x)


# --- the row check's tolerance ------------------------------------------------------------------------------------

def test_bf16_autocast_on_a_float32_model_trains_at_batch_above_one():
    """The row check compares in the dtype the backward ran in (bf16 under autocast), not the parameters'."""
    from verify.workloads import make

    engine, loader = _train_lm(make("llama_tied", dtype=torch.float32).train(), batch=8, autocast=True)
    assert engine.steps == len(loader)
