"""Common PyTorch idioms that the trainer cannot take are refused with one sentence naming the module or call, the
reason and the fix, before any error from inside torch; and a user run emits no warning of ours.  dpmath's inputs
that its checks once let through to a Python or NumPy error are refused the same way."""

import functools
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpmath
from dpmath import HutchEnvelope, PLDAccountant, SubsampledGaussian
from dpsgd import PrivacyEngine
from dpsgd.validator import UnsupportedModuleError


def _private(model, x, batch=4, **kw):
    engine = PrivacyEngine()
    out = engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                              data_loader=DataLoader(TensorDataset(x, torch.zeros(len(x), dtype=torch.long)),
                                                     batch_size=batch),
                              max_grad_norm=1.0, noise_multiplier=1.0, estimator="exact", seed=0,
                              **{"criterion": nn.CrossEntropyLoss(), **kw})
    return engine, *out


def test_a_private_loss_is_backpropagated_once_and_takes_no_backward_arguments():
    model = nn.Linear(3, 2)
    engine, model, opt, crit, loader = _private(model, torch.randn(16, 3))
    x, y = next(iter(loader))
    loss = crit(model(x), y)
    with pytest.raises(TypeError, match="retain_graph"):
        loss.backward(retain_graph=True)
    loss.backward()
    with pytest.raises(RuntimeError, match="already backpropagated"):
        loss.backward()
    opt.step()
    assert engine.steps == 1


def test_make_private_twice_on_one_model_names_the_fix_and_works_after_detach():
    """A re-run notebook cell: a second engine on a model that still carries the first one's hooks."""
    model = nn.Linear(3, 2)
    first, *_ = _private(model, torch.randn(16, 3))
    with pytest.raises(RuntimeError, match=r"another PrivacyEngine.*detach\(\)"):
        _private(model, torch.randn(16, 3))
    first.detach()
    second, model, opt, crit, loader = _private(model, torch.randn(16, 3))
    x, y = next(iter(loader))
    crit(model(x), y).backward()
    opt.step()
    assert second.steps == 1


def test_logits_whose_class_dimension_is_ambiguous_are_refused():
    """(B, n, n) logits with (B, n) token targets fit both layouts: no silent guess."""
    model = nn.Linear(5, 5)
    engine, model, opt, crit, loader = _private(model, torch.randn(16, 5, 5))
    x, _ = next(iter(loader))
    with pytest.raises(ValueError, match="ambiguous"):
        crit(model(x), torch.zeros(x.shape[0], 5, dtype=torch.long))


def test_dropout_in_a_module_on_the_exact_fallback_is_refused_at_make_private_with_its_path():
    model = nn.Sequential(nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), nn.Linear(8, 2))
    with pytest.raises(UnsupportedModuleError, match=r"0.self_attn: .*dropout.*dropout=0.0"):
        _private(model, torch.randn(16, 5, 8))
    model = nn.Sequential(nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True), nn.Linear(8, 2))
    _private(model, torch.randn(16, 5, 8))


def test_the_norm_plan_prints_as_a_table():
    engine, *_ = _private(nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2)), torch.randn(16, 3))
    text = str(engine.plan)
    assert text.splitlines()[0].split() == ["parameter", "module", "shape", "handler", "norm", "terms"]
    assert "1.weight   LayerNorm  4      NormalizationHandler  exact      0" in text
    assert text.splitlines()[-1] == "estimator exact: every norm exact, accounted as DP-SGD (no envelope)"
    rows = engine.plan.table()
    assert rows[0] == ("0.weight", "Linear", (4, 3), "LinearHandler", "exact", 0) and rows[0].shape == (4, 3)
    assert str(rows) == text.rsplit("\n", 1)[0]


def test_a_run_through_the_exact_fallback_emits_no_warning_of_ours():
    """dpsgd/layers.py converted a tensor that requires grad to a float on every call (torch's UserWarning)."""
    from verify.workloads import VOCAB, RecurrentLM, lm_losses

    torch.manual_seed(0)
    model = RecurrentLM().train()
    engine = PrivacyEngine()
    ids = torch.randint(1, VOCAB, (16, 8))
    model, opt, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(ids), batch_size=4), max_grad_norm=1.0, noise_multiplier=1.0,
        estimator="exact", seed=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for (x,) in loader:
            engine.private_loss(lm_losses(model, x)).backward()
            opt.step()
    assert not [w for w in caught if "dpsgd" in w.filename]


def test_an_exact_re_run_neither_warns_nor_trips_over_the_precision_settings():
    """A module on the exact fallback (nn.MultiheadAttention: SDPA has no batching rule) is re-run per example with
    cuDNN off inside the norms' full-float32 settings: torch 2.13 raised reading the legacy TF32 switch there, and
    torch's notice of a kernel without a batching rule appeared at every step."""

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn, self.head = nn.MultiheadAttention(8, 2, batch_first=True), nn.Linear(8, 2)

        def forward(self, x):
            return self.head(self.attn(x, x, x, need_weights=False)[0].mean(1))

    torch.manual_seed(0)
    engine, model, opt, crit, loader = _private(Attention(), torch.randn(16, 5, 8))
    enabled = torch.backends.cudnn.enabled
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, y in loader:
            crit(model(x), y).backward()
            opt.step()
    assert engine.steps == 4 and torch.backends.cudnn.enabled == enabled
    assert not [w for w in caught if "batching rule" in str(w.message)]


class _Teacher(nn.Module):
    """The encoder runs once under no_grad (a pseudo-label) and once with gradient: it trains."""

    def __init__(self):
        super().__init__()
        self.enc, self.head = nn.Linear(3, 3), nn.Linear(3, 2)

    def forward(self, x):
        with torch.no_grad():
            target = self.enc(x)
        return self.head(self.enc(x) + target)


def test_a_module_run_under_no_grad_and_again_with_gradient_trains():
    engine, model, opt, crit, loader = _private(_Teacher(), torch.randn(16, 3))
    before = model.enc.weight.detach().clone()
    x, y = next(iter(loader))
    crit(model(x), y).backward()
    opt.step()
    assert engine.steps == 1 and not torch.equal(before, model.enc.weight)


def test_the_leak_message_suggests_a_handler_that_exists():
    from dpsgd import IncompleteGradientError

    class Outside(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 2)

        def forward(self, x):
            return torch.nn.functional.linear(x, self.lin.weight)

    engine, model, opt, crit, loader = _private(Outside(), torch.randn(16, 3))
    x, y = next(iter(loader))
    with pytest.raises(IncompleteGradientError, match=r"recursive = True.*register_handler") as err:
        crit(model(x), y).backward()
    assert "FunctionalHandler() with recursive" not in str(err.value)


@pytest.mark.parametrize(("call", "message"), [
    (lambda: SubsampledGaussian(np.array([1.0, 2.0]), 0.01),
     r"noise_multiplier must be a real number, got an array of shape \(2,\)"),
    (lambda: SubsampledGaussian(1.0, np.array([0.01, 0.02])), r"sample_rate must be a real number, got an array"),
    (lambda: PLDAccountant().compose(SubsampledGaussian(1.0, 0.01), np.array([3])),
     r"count must be a positive integer \(>= 1\), got an array of shape \(1,\).*count=int\(x\[0\]\)"),
    (lambda: PLDAccountant().compose(SubsampledGaussian(1.0, 0.01)).epsilon(np.array([1e-5])),
     r"delta must be a real number, got an array of shape \(1,\)"),
    (lambda: PLDAccountant(np.array([1e-4, 1e-3])), r"discretization must be a real number"),
    (lambda: dpmath.dpsgd_epsilon(1.0, 0.01, np.array([10, 20]), 1e-5), r"steps must be a positive integer"),
    (lambda: HutchEnvelope(np.array([32, 64]), 2048), r"projection_dim must be a positive integer"),
    (lambda: dpmath.calibrate_noise_multiplier([1.0, 2.0], 1e-5, 0.01, 10),
     r"target_epsilon must be a real number, got a sequence of shape \(2,\)"),
])
def test_an_array_where_dpmath_takes_one_number_is_refused_naming_the_argument_and_its_shape(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_numpy_scalars_and_zero_dimensional_arrays_are_numbers_to_dpmath():
    plain = PLDAccountant().compose(SubsampledGaussian(1.0, 0.01), 3).epsilon(1e-5)
    acc = PLDAccountant().compose(SubsampledGaussian(np.float32(1.0), np.array(0.01)), np.array(3))
    assert acc.epsilon(np.array(1e-5)) == acc.epsilon(np.float64(1e-5)) == plain
    assert acc.events[0][1] == 3 and type(acc.events[0][1]) is int
    assert PLDAccountant().compose(SubsampledGaussian(1.0, 0.01), np.int64(3)).epsilon(1e-5) == plain
    with pytest.raises(ValueError, match="count must be a positive integer"):
        PLDAccountant().compose(SubsampledGaussian(1.0, 0.01), np.array(True))


def test_an_accountant_refuses_a_count_beyond_a_floats_range_by_name():
    from dpmath import PLDAccountant, SubsampledGaussian

    with pytest.raises(ValueError, match="count must be at most 1e"):
        PLDAccountant().compose(SubsampledGaussian(1.0, 0.01), 10**400)


class _PackedLSTM(nn.Module):
    """Sequences of several lengths, packed for the LSTM."""

    def __init__(self, cell=nn.LSTM):
        super().__init__()
        self.rnn, self.head = cell(4, 8, batch_first=True), nn.Linear(8, 2)

    def forward(self, x, lengths):
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        out = self.rnn(packed)[1]
        return self.head((out[0] if isinstance(out, tuple) else out)[-1])


@pytest.mark.parametrize("cell", [nn.LSTM, nn.GRU])
def test_a_recurrent_layer_on_a_packed_sequence_is_refused_naming_it_and_padding(cell):
    """A PackedSequence interleaves the examples by time step: its rows are not the examples, so per-example
    gradients cannot be read from them.  Refused at the forward, naming the module and the fix (pad), not an
    AssertionError from inside the engine; the padded form of the same model trains."""
    torch.manual_seed(0)
    x, lengths = torch.randn(16, 5, 4), torch.randint(1, 6, (16,))
    engine = PrivacyEngine()
    model = _PackedLSTM(cell)
    model, opt, crit, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, lengths, torch.zeros(16, dtype=torch.long)), batch_size=4),
        max_grad_norm=1.0, noise_multiplier=1.0, estimator="exact", seed=0, criterion=nn.CrossEntropyLoss())
    xb, lb, yb = next(iter(loader))
    with pytest.raises(UnsupportedModuleError, match=rf"^rnn: {cell.__name__} .*PackedSequence.*pad"):
        model(xb, lb)
    assert engine.steps == 0

    class Padded(nn.Module):   # the fix: run on the padded batch, read each example's last valid step
        def __init__(self):
            super().__init__()
            self.rnn, self.head = cell(4, 8, batch_first=True), nn.Linear(8, 2)

        def forward(self, x, lengths):
            out = self.rnn(x)[0]
            return self.head(out[torch.arange(x.shape[0]), lengths - 1])
    engine = PrivacyEngine()
    model = Padded()
    model, opt, crit, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, lengths, torch.zeros(16, dtype=torch.long)), batch_size=4),
        max_grad_norm=1.0, noise_multiplier=1.0, estimator="exact", seed=0, criterion=nn.CrossEntropyLoss())
    for xb, lb, yb in loader:
        crit(model(xb, lb), yb).backward()
        opt.step()
    assert engine.steps == len(loader)


def _one_step(criterion, targets=None):
    torch.manual_seed(0)
    x = torch.randn(16, 3)
    y = torch.randint(0, 3, (16,)) if targets is None else targets
    model = nn.Linear(3, 3)
    engine = PrivacyEngine()
    model, opt, crit, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=8), criterion=criterion, max_grad_norm=0.1,
        noise_multiplier=0.0, estimator="exact", seed=0)
    xb, yb = next(iter(loader))
    loss = crit(model(xb), yb)
    loss.backward()
    opt.step()
    return loss.losses.detach(), torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.parametrize(("function", "module"), [
    (F.cross_entropy, nn.CrossEntropyLoss()),
    (functools.partial(F.cross_entropy, label_smoothing=0.2), nn.CrossEntropyLoss(label_smoothing=0.2)),
    (functools.partial(F.cross_entropy, reduction="sum"), nn.CrossEntropyLoss(reduction="sum")),
    (F.nll_loss, nn.NLLLoss()),
])
def test_a_functional_criterion_trains_like_its_loss_module(function, module):
    """``criterion=F.cross_entropy`` (a function, not a module): called with ``reduction="none"``, its own default
    reduction and ``ignore_index`` read from its signature; the same per-example losses and step as the module."""
    assert all(torch.equal(a, b) for a, b in zip(_one_step(function), _one_step(module), strict=True))


def test_a_functional_criterion_skips_ignored_targets_like_its_module():
    targets = torch.randint(0, 3, (16, 1)).repeat(1, 4)
    targets[::2, 1:] = -100
    x = torch.randn(16, 4, 3, generator=torch.Generator().manual_seed(0))   # (B, 4, 3) logits, targets (B, 4)
    out = []
    for criterion in (F.cross_entropy, nn.CrossEntropyLoss()):
        torch.manual_seed(0)
        engine, model, opt, crit, loader = _private(nn.Linear(3, 3), x, criterion=criterion)
        xb, _ = next(iter(loader))
        out.append(crit(model(xb), targets[:xb.shape[0]]).losses.detach())
    assert torch.equal(out[0], out[1])


def test_a_criterion_function_without_a_reduction_is_refused_naming_the_fix():
    def mine(logits, target):
        return F.cross_entropy(logits, target)
    with pytest.raises(TypeError, match=r"reduction.*private_loss"):
        _private(nn.Linear(3, 2), torch.randn(16, 3), criterion=mine)
