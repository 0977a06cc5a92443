"""Every way a user could make a clipped contribution exceed C raises or is handled exactly; the trainer keeps
PyTorch's and Hugging Face's contracts; bad input gets a clear message."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpsgd import (
    BatchMemoryManager,
    IncompleteGradientError,
    ModuleValidator,
    NormPlan,
    PrivacyEngine,
    per_sample_sq_norms,
)
from dpsgd.capture import Capture
from dpsgd.clipping import clipped_backward
from dpsgd.validator import UnsupportedModuleError
from verify.workloads import VOCAB, TwiceLM, brute_force_sq_norms, data, flat_params, lm_losses

from ..helpers import private_update


def _engine(model=None, n=48, batch=12, noise=0.0, estimator="exact", c=1.0, seed=0, dtype=torch.float64, **kw):
    torch.manual_seed(seed)
    model = (model or TwiceLM()).to(dtype).train()
    ids = torch.randint(1, VOCAB, (n, 8), generator=torch.Generator().manual_seed(seed))
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    engine = PrivacyEngine()
    model, opt, crit, loader = engine.make_private(
        module=model, optimizer=opt, data_loader=DataLoader(TensorDataset(ids), batch_size=batch),
        max_grad_norm=c, noise_multiplier=noise, estimator=estimator, seed=seed,
        **{"criterion": nn.CrossEntropyLoss(), **kw})
    return engine, model, opt, crit, loader


def _lm(engine, model, x):
    return engine.private_loss(lm_losses(model, x))


# --- silent failures of round 1, each now handled or refused ---------------------------------------------------

def test_two_forwards_before_one_backward_count_both():
    """A paired loss from two forwards: the norm is that of the whole per-example gradient (round 1 counted
    only the last forward: 0.68 instead of 3.37)."""
    torch.manual_seed(0)
    model = TwiceLM().double().train()
    a, b = data(3, seed=1), data(3, seed=2)

    def paired(m):
        return lm_losses(m, a) - 0.5 * lm_losses(m, b)
    ref = brute_force_sq_norms(model, lambda m, i: paired(m)[i], 3)
    for estimator in ("exact", "ghost"):
        assert torch.allclose(per_sample_sq_norms(model, paired, estimator), ref, rtol=1e-6)


def test_two_forwards_one_example_update_is_at_most_c():
    engine, model, opt, crit, loader = _engine(n=8, batch=1, c=0.05)
    for (x,) in loader:
        before = flat_params(model)
        losses = lm_losses(model, x) + lm_losses(model, x.flip(1))
        engine.private_loss(losses).backward()
        opt.step()
        # Poisson batches of B examples, expected size 1, lr 1: the update is a sum of B contributions <= C
        assert (flat_params(model) - before).norm().item() <= 0.05 * x.shape[0] * (1 + 1e-9)
    assert engine.steps == len(loader)


def test_naive_accumulation_of_micro_batches_equals_one_backward():
    """Two micro-batches, two backward(), one step(): both micro-batches' clipped sums are used."""
    moved = []
    for split in (False, True):
        engine, model, opt, crit, loader = _engine(seed=4, c=0.1)
        before = flat_params(model)
        (x,) = next(iter(loader))
        if split:
            h = x.shape[0] // 2
            _lm(engine, model, x[:h]).backward()
            _lm(engine, model, x[h:]).backward()
        else:
            _lm(engine, model, x).backward()
        opt.step()
        moved.append(flat_params(model) - before)
    assert torch.allclose(moved[0], moved[1], rtol=1e-9, atol=1e-12)


def test_batch_memory_manager_takes_one_noisy_step_per_logical_batch():
    results = []
    for physical in (None, 3):
        engine, model, opt, crit, loader = _engine(seed=5, c=0.1, n=60, batch=15)
        before = flat_params(model)
        sizes = []
        if physical is None:
            for (x,) in loader:
                opt.zero_grad()
                _lm(engine, model, x).backward()
                opt.step()
        else:
            with BatchMemoryManager(data_loader=loader, max_physical_batch_size=physical, optimizer=opt) as mem:
                for (x,) in mem:
                    sizes.append(x.shape[0])
                    opt.zero_grad()
                    _lm(engine, model, x).backward()
                    opt.step()
            assert max(sizes) <= physical and len(sizes) > len(loader)
        assert engine.steps == len(loader)
        results.append(flat_params(model) - before)
    assert torch.allclose(results[0], results[1], rtol=1e-9, atol=1e-12)


class OutsideUse(nn.Module):
    """The parent's forward uses ``proj.weight`` without calling ``proj``."""

    def __init__(self, both: bool = False):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8)
        self.proj = nn.Linear(8, 8)
        self.head = nn.Linear(8, VOCAB)
        self.both = both

    def forward(self, ids):
        x = self.emb(ids)
        y = F.linear(x, self.proj.weight)
        if self.both:
            y = y + self.proj(x)
        return self.head(torch.tanh(y))


@pytest.mark.parametrize("both", [False, True])
def test_parameter_used_outside_its_module_raises(both):
    model = OutsideUse(both).double().train()
    ids = data(3)
    with pytest.raises(IncompleteGradientError, match=r"proj\.weight"):
        per_sample_sq_norms(model, lambda m: lm_losses(m, ids), "exact")


@pytest.mark.parametrize("make", [
    lambda: nn.BatchNorm1d(4, track_running_stats=False),
    lambda: nn.BatchNorm1d(4).eval(),
    lambda: nn.SyncBatchNorm(4),
    lambda: nn.InstanceNorm1d(4, track_running_stats=True),
])
def test_modules_that_mix_examples_are_refused_with_the_path_and_the_fix(make):
    model = nn.Sequential(nn.Conv1d(2, 4, 3), make(), nn.Flatten(), nn.Linear(20, 2))
    with pytest.raises(UnsupportedModuleError, match=r"^1: .*(GroupNorm|track_running_stats=False)") as err:
        NormPlan.build(model, "hutch")
    assert err.value.path == "1"
    fixed = ModuleValidator.fix(model)
    assert ModuleValidator.is_valid(fixed)
    x = torch.randn(5, 2, 7)
    assert per_sample_sq_norms(fixed.train(), lambda m: m(x).sum(1), "exact").shape == (5,)


def test_batchnorm2d_cnn_is_refused_before_any_torch_func_error_and_fixed_cnn_trains():
    cnn = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 2))
    data_ = TensorDataset(torch.randn(20, 1, 6, 6), torch.randint(0, 2, (20,)))
    kw = dict(optimizer=torch.optim.SGD(cnn.parameters(), lr=0.1), data_loader=DataLoader(data_, batch_size=5),
              max_grad_norm=1.0, noise_multiplier=1.0, seed=0, criterion=nn.CrossEntropyLoss())
    with pytest.raises(UnsupportedModuleError, match="BatchNorm2d"):
        PrivacyEngine().make_private(module=cnn, **kw)
    cnn = ModuleValidator.fix(cnn)
    kw["optimizer"] = torch.optim.SGD(cnn.parameters(), lr=0.1)
    engine = PrivacyEngine()
    cnn, opt, crit, loader = engine.make_private(module=cnn, **kw)
    for x, y in loader:
        crit(cnn(x), y).backward()
        opt.step()
    assert engine.steps == len(loader)


def test_second_backward_of_the_same_batch_is_refused():
    engine, model, opt, crit, loader = _engine()
    # pins the step's row count, the backstop behind the tracker (which refuses the second backward itself:
    # tests/dpsgd/test_isolation_structure.py)
    engine._track_examples = False
    engine._set_checks()
    (x,) = next(iter(loader))
    _lm(engine, model, x).backward()
    _lm(engine, model, x).backward()
    before = flat_params(model)
    with pytest.raises(RuntimeError, match="backpropagated"):
        opt.step()
    assert torch.equal(before, flat_params(model)) and engine.steps == 0


def test_clipped_sum_is_not_exposed_and_clip_grad_norm_has_nothing_to_act_on():
    engine, model, opt, crit, loader = _engine(noise=1.0)
    (x,) = next(iter(loader))
    _lm(engine, model, x).backward()
    assert all(p.grad is None for p in model.parameters())   # the sum before noise is not private
    assert float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)) == 0.0
    opt.step()
    assert engine.steps == 1


def test_grad_written_outside_the_private_backward_is_refused():
    engine, model, opt, crit, loader = _engine()
    (x,) = next(iter(loader))
    _lm(engine, model, x).backward()
    model.eval()
    lm_losses(model, x).sum().backward()   # plain autograd on an unrecorded forward
    before = flat_params(model)
    with pytest.raises(RuntimeError, match="outside the private backward"):
        opt.step()
    assert torch.equal(before, flat_params(model)) and engine.steps == 0


def test_eval_mode_forward_cannot_be_backpropagated_privately():
    engine, model, opt, crit, loader = _engine()
    (x,) = next(iter(loader))
    model.eval()
    with pytest.raises(IncompleteGradientError, match="eval mode"):
        _lm(engine, model, x).backward()


def test_in_place_change_of_a_recorded_output_is_refused():
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(inplace=True), nn.Linear(4, 2)).double()
    x = torch.randn(5, 3, dtype=torch.float64)
    with pytest.raises(IncompleteGradientError, match="in place"):
        per_sample_sq_norms(model, lambda m: m(x).sum(1), "exact")


def test_dropout_inside_an_exactly_recomputed_module_is_refused():
    """A dropout module is refused when the plan is built, with its path; a functional dropout (invisible until
    it runs) when the re-run meets it, with the module's path."""
    model = nn.Sequential(nn.MultiheadAttention(8, 2, dropout=0.5, batch_first=True)).train()
    x = torch.randn(3, 4, 8)

    def loss(m):
        return m[0](x, x, x)[0].sum((1, 2))
    with pytest.raises(UnsupportedModuleError, match="0: MultiheadAttention has dropout"):
        per_sample_sq_norms(model, loss, "exact")

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(8))

        def forward(self, x):
            return F.dropout(x * self.w, 0.5, training=True)
    model = nn.Sequential(Scaled()).train()
    with pytest.raises(RuntimeError, match=r"^0 \(Scaled\) uses randomness"):
        per_sample_sq_norms(model, lambda m: m(x).sum((1, 2)), "exact")


def test_reentrant_checkpointing_gives_a_clear_error():
    from torch.utils.checkpoint import checkpoint

    class Ckpt(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 1)

        def forward(self, x):
            return self.b(checkpoint(self.a, x, use_reentrant=True))
    x = torch.randn(4, 3, requires_grad=True)
    with pytest.raises(IncompleteGradientError, match="reentrant"):
        per_sample_sq_norms(Ckpt(), lambda m: m(x).sum(1), "exact")


# --- PyTorch and Hugging Face contracts ------------------------------------------------------------------------

def test_optimizer_is_a_torch_optimizer_that_schedulers_and_checkpoints_accept():
    engine, model, opt, crit, loader = _engine(noise=1.0)
    assert isinstance(opt, torch.optim.Optimizer)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for (x,) in loader:
        opt.zero_grad()
        _lm(engine, model, x).backward()
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5 ** len(loader))
    state = opt.state_dict()
    opt.load_state_dict(state)
    with pytest.raises(ValueError, match="not in the private model"):
        opt.add_param_group({"params": [nn.Parameter(torch.ones(2))]})


def test_zero_grad_between_backward_and_step_takes_a_noise_only_step():
    engine, model, opt, crit, loader = _engine(noise=1.0)
    (x,) = next(iter(loader))
    _lm(engine, model, x).backward()
    opt.zero_grad()
    before = flat_params(model)
    opt.step()
    assert engine.steps == 1 and not torch.equal(before, flat_params(model))


def test_loss_behaves_like_a_tensor_for_logging_and_refuses_arithmetic():
    engine, model, opt, crit, loader = _engine()
    (x,) = next(iter(loader))
    loss = _lm(engine, model, x)
    ref = lm_losses(model, x).mean().item()
    assert loss.item() == pytest.approx(ref) and float(loss) == pytest.approx(ref)
    assert loss.detach().item() == pytest.approx(ref) and f"{loss:.3f}" == f"{ref:.3f}"
    with pytest.raises(TypeError, match="scaling the loss"):
        loss / 4
    with pytest.raises(TypeError):
        2 * loss
    loss.mean().backward()
    opt.step()
    assert engine.steps == 1


def test_model_keeps_its_identity_state_dict_and_generate():
    pytest.importorskip("transformers")
    from verify.workloads import gpt2

    torch.manual_seed(0)
    model = gpt2().train()
    keys = list(model.state_dict())
    engine, same, opt, crit, loader = _engine(model=model, dtype=torch.float32)
    assert same is model and list(same.state_dict()) == keys
    type(model)(model.config).load_state_dict(same.state_dict())
    model.eval()
    with torch.no_grad():
        out = model.generate(torch.ones(1, 3, dtype=torch.long), max_new_tokens=4, do_sample=False, pad_token_id=0)
        model(data(2))  # an evaluation forward records nothing
    assert out.shape == (1, 7) and not engine.private_step.capture.calls
    engine.detach()
    model.train()
    lm_losses(model, data(2)).sum().backward()  # plain training again, without hooks
    assert all(p.grad is not None for p in model.parameters())


def test_criterion_takes_hf_outputs_and_averages_over_non_ignored_tokens():
    pytest.importorskip("transformers")
    from verify.workloads import gpt2

    engine, model, opt, crit, loader = _engine(model=gpt2(), dtype=torch.float32)
    (x,) = next(iter(loader))
    labels = x.clone()
    labels[0, 3:] = -100
    labels[1, :] = -100
    out = model(x)
    loss = crit(out, labels)
    per_token = F.cross_entropy(out.logits.transpose(1, 2), labels, reduction="none")
    keep = (labels != -100).float()
    expected = (per_token * keep).sum(1) / keep.sum(1).clamp_min(1)
    assert torch.allclose(loss.losses, expected) and loss.losses[1] == 0
    loss.backward()
    opt.step()


def test_bf16_weights_and_autocast_keep_every_clipped_contribution_within_c():
    """One example at a time: the clipped sum, formed in float32 from bf16 (A, G), has norm <= C."""
    pytest.importorskip("transformers")
    from verify.workloads import gpt2

    torch.manual_seed(0)
    ids = data(4)
    for variant in ("bf16", "autocast"):
        model = gpt2().train()
        if variant == "bf16":
            model = model.to(torch.bfloat16)
        plan = NormPlan.build(model, "exact")
        for i in range(4):
            c = 1e-2
            capture = Capture(plan)
            try:
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=variant == "autocast"):
                    losses = lm_losses(model, ids[i:i + 1])
                out = clipped_backward(capture, losses.float(), c, 1, None)
            finally:
                capture.remove()
            total = math.sqrt(sum(float(s.double().square().sum()) for s in out.sums.values()))
            assert all(s.dtype == torch.float32 for s in out.sums.values())
            assert total <= c * (1 + 1e-6), (variant, i, total)


# --- bad input -------------------------------------------------------------------------------------------------

def test_bad_input_gets_a_clear_message():
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kw = dict(module=model, optimizer=opt, max_grad_norm=1.0, noise_multiplier=1.0)
    with pytest.raises(ValueError, match="dataset is empty"):
        PrivacyEngine().make_private(data_loader=DataLoader(TensorDataset(torch.ones(0, 3)), batch_size=2), **kw)
    with pytest.raises(ValueError, match="exceeds the dataset size"):
        PrivacyEngine().make_private(data_loader=DataLoader(TensorDataset(torch.ones(4, 3)), batch_size=8), **kw)
    with pytest.raises(RuntimeError, match="make_private"):
        PrivacyEngine().get_epsilon(1e-5)
    with pytest.raises(ValueError, match="optimizer must be a torch.optim.Optimizer"):
        PrivacyEngine().make_private(**{**kw, "optimizer": object()},
                                     data_loader=DataLoader(TensorDataset(torch.ones(4, 3)), batch_size=2))


def test_a_tiny_target_epsilon_is_met_with_a_large_finite_sigma():
    engine, *_ = _engine(noise=None, target_epsilon=1e-3, target_delta=1e-5, epochs=1)
    assert math.isfinite(engine.noise_multiplier) and engine.noise_multiplier > 100


def test_micro_batched_update_is_the_sum_of_single_example_clipped_updates():
    """BatchMemoryManager with one example per micro-batch, sigma = 0: the logical batch's update is the sum of
    the examples' clipped gradients, each of norm min(||g_i||, C), over the expected batch size."""
    engine, model, opt, crit, loader = _engine(seed=6, c=0.05, n=24, batch=6)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=1, optimizer=opt) as mem:
        examples = []
        for (x,) in mem:
            examples.append(x)
            _lm(engine, model, x).backward()
            opt.step()
            if engine.steps:
                break
    update = flat_params(model) - torch.cat([v.flatten().double() for v in init.values()])
    total = torch.zeros_like(update)
    for x in examples:
        single = TwiceLM().double().train()
        single.load_state_dict(init)
        moved = private_update(single, x, lm_losses, max_grad_norm=0.05)
        assert moved.norm() <= 0.05 * (1 + 1e-9)
        total += moved
    assert torch.allclose(update, total / engine.expected_batch_size, rtol=1e-9, atol=1e-13)


def test_batch_size_comes_from_the_main_input_even_after_a_broadcast_keyword():
    """``position_ids`` of shape (1, T) given before ``input_ids`` must not make the forward's batch size 1."""
    pytest.importorskip("transformers")
    from verify.workloads import gpt2

    model = gpt2().double().train()
    ids = data(3)
    pos = torch.arange(ids.shape[1]).unsqueeze(0)

    def losses(m):
        logits = m(position_ids=pos, input_ids=ids).logits
        return F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none").mean(1)
    ref = brute_force_sq_norms(model, lambda m, i: F.cross_entropy(
        m(position_ids=pos, input_ids=ids[i:i + 1]).logits[:, :-1].transpose(1, 2), ids[i:i + 1, 1:],
        reduction="none").mean(), 3)
    assert torch.allclose(per_sample_sq_norms(model, losses, "exact"), ref, rtol=1e-6)


def test_two_logical_batches_before_one_step_are_refused():
    """Accumulating two Poisson batches into one step would be accounted at rate q while an example may be
    sampled (and clipped) twice: drawing the second batch raises, with nothing accumulated from it; a batch
    that is skipped takes a noise-only step (zero_grad, step)."""
    engine, model, opt, crit, loader = _engine(noise=1.0)
    batches = iter(loader)
    (x1,) = next(batches)
    _lm(engine, model, x1).backward()
    with pytest.raises(RuntimeError, match="before optimizer.step"):
        next(batches)
    opt.step()                               # the first batch's step is still fine
    assert engine.steps == 1
    batches = iter(loader)
    next(batches)                            # a batch drawn and skipped: a noise-only step
    opt.zero_grad()
    opt.step()
    (x4,) = next(batches)
    _lm(engine, model, x4).backward()
    opt.step()
    assert engine.steps == 3


# each change would have the accountant charge the steps already taken (or to come) less than they spend
_UNDER_CHARGING = [("sample_rate", 0.01), ("noise_multiplier", 100.0), ("projection_dim", 4096), ("estimator", "exact"),
                   ("envelope", None), ("max_grad_norm", 10.0), ("expected_batch_size", 1e6),
                   ("planned_steps", 10**9), ("secure_mode", True), ("ledger_path", "elsewhere.jsonl")]


@pytest.mark.parametrize(("name", "value"), _UNDER_CHARGING)
def test_the_engine_settings_cannot_be_changed_after_make_private(name, value):
    """The step and the accountant both read these settings; a change mid-run (a lower sample_rate, a noise
    schedule, a different estimator or envelope) would charge the steps at values they were not taken at: it
    raises, and the step and the accountant keep make_private's values."""
    engine, model, opt, crit, loader = _engine(noise=1.0, estimator="hutch")
    before = {n: getattr(engine, n) for n, _ in _UNDER_CHARGING}
    (x,) = next(iter(loader))
    _lm(engine, model, x).backward()
    opt.step()
    with pytest.raises(AttributeError, match=f"{name} is fixed by make_private"):
        setattr(engine, name, value)
    assert {n: getattr(engine, n) for n, _ in _UNDER_CHARGING} == before
    ((mech, steps),) = engine.accountant().events
    assert mech.sample_rate == before["sample_rate"] and mech.noise_multiplier == 1.0 and steps == 1


def test_the_papers_k_is_no_setting_of_the_engine():
    engine = _engine(noise=1.0, estimator="hutch")[0]
    with pytest.raises(AttributeError, match="PrivacyEngine has no setting 'k'"):
        engine.k = 4096


@pytest.mark.parametrize("name", ["noise_multiplier", "max_grad_norm", "expected_batch_size"])
def test_an_opacus_style_schedule_on_the_optimizer_is_refused_not_ignored(name):
    """Opacus' noise schedulers set ``optimizer.noise_multiplier``; here the step would ignore it (the engine
    holds the value), so it raises instead of silently doing nothing."""
    engine, model, opt, crit, loader = _engine(noise=1.0)
    assert getattr(opt, name) == getattr(engine, name)
    with pytest.raises(AttributeError, match=f"{name} is fixed by make_private"):
        setattr(opt, name, 2.0)


def test_the_loaders_sampling_rate_cannot_be_raised_behind_the_accountant():
    """The Poisson sampler draws at its own rate: raising it would sample more than the accountant charges."""
    engine, model, opt, crit, loader = _engine(noise=1.0)
    for obj in (loader, loader.logical_sampler):
        with pytest.raises(AttributeError):
            obj.sample_rate = 1.0
        assert obj.sample_rate == engine.sample_rate


def _row_models():
    from torch import nn

    torch.manual_seed(0)
    lin = nn.Linear(3, 2).double()

    class Loop(nn.Module):      # once per example, on (T, d) slices with T == B: the shapes look batched
        def __init__(self):
            super().__init__()
            self.lin = lin

        def forward(self, x):
            return torch.stack([self.lin(x[i]) for i in range(x.shape[0])])

    class Permuted(nn.Module):  # the whole batch, rows permuted inside the forward and put back after
        def __init__(self):
            super().__init__()
            self.lin = lin

        def forward(self, x):
            perm = torch.tensor([1, 2, 3, 0])
            return self.lin(x[perm])[torch.argsort(perm)]

    class Rolled(nn.Module):    # each example's loss reads its neighbour's row: the output mixes examples after
        def __init__(self):
            super().__init__()
            self.lin = lin

        def forward(self, x):
            return self.lin(x).roll(1, dims=0)

    return {"loop": Loop(), "permuted": Permuted(), "rolled": Rolled()}


@pytest.mark.parametrize("kind", ["loop", "permuted", "rolled"])
def test_rows_that_are_not_the_examples_are_refused(kind):
    from dpsgd import per_sample_sq_norms
    from dpsgd.isolation import IncompleteGradientError

    model = _row_models()[kind].train()
    x = torch.randn(4, 4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))  # B = T = 4
    with pytest.raises(IncompleteGradientError, match="rows of lin"):
        per_sample_sq_norms(model, lambda m: m(x).square().sum((1, 2)), "exact")


def test_rows_that_are_not_the_examples_are_refused_by_the_engine_before_anything_is_written():
    from torch.utils.data import DataLoader, TensorDataset

    from dpsgd import PrivacyEngine
    from dpsgd.isolation import IncompleteGradientError

    model = _row_models()["permuted"].train()
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(4, 4, 3, dtype=torch.float64))
    engine = PrivacyEngine()
    model, opt, _ = engine.make_private(module=model, optimizer=opt, data_loader=DataLoader(data, batch_size=4),
                                           max_grad_norm=1.0, noise_multiplier=1.0, estimator="hutch", seed=0)
    x = data.tensors[0]
    with pytest.raises(IncompleteGradientError):
        engine.private_loss(model(x).square().sum((1, 2))).backward()
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


def test_the_row_check_runs_once_per_layout_unless_asked_every_step(monkeypatch):
    from torch import nn

    from dpsgd import rowcheck

    ran = []
    real = rowcheck.check_rows
    monkeypatch.setattr(rowcheck, "check_rows", lambda *a, **kw: (ran.append(1), real(*a, **kw)))
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double().train()
    capture = Capture(NormPlan.build(model, "exact"))
    capture.check_rate = 0.0   # no scheduled checks: the first forward (always probed) and new layouts only
    try:
        for b in (5, 7, 5, 6):   # Poisson batches: the size changes, the layout does not
            x = torch.randn(b, 3, dtype=torch.float64)
            clipped_backward(capture, model(x).sum(1), 1.0, 4, None)
        assert len(ran) == 1
        capture.check_every_step = True
        clipped_backward(capture, model(torch.randn(3, 3, dtype=torch.float64)).sum(1), 1.0, 4, None)
        assert len(ran) == 2
    finally:
        capture.remove()


def test_a_loss_that_starts_mixing_examples_after_the_first_step_is_refused():
    """The model's calls keep their layout, but step 2's loss reads a neighbour's output: checked again."""
    from torch import nn

    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double().train()
    capture = Capture(NormPlan.build(model, "exact"))
    try:
        x = torch.randn(5, 3, dtype=torch.float64)
        clipped_backward(capture, model(x).square().sum(1), 1.0, 4, None)
        with pytest.raises(IncompleteGradientError, match="rows of [02]"):
            clipped_backward(capture, model(x).roll(1, dims=0).square().sum(1), 1.0, 4, None)
    finally:
        capture.remove()


def test_under_autocast_each_examples_contribution_to_a_batch_sum_is_within_c():
    """B = 4 under bf16 autocast, exact norms: example j's contribution is the batch's clipped sum minus that of
    the batch without j (clip weights are per example), and its norm is at most C up to float32 rounding of the
    other examples' sums (the norms and the sums read the same (A, G), whichever precision they are in)."""
    pytest.importorskip("transformers")
    from verify.workloads import gpt2

    torch.manual_seed(0)
    ids = data(4)
    model = gpt2().train()
    plan = NormPlan.build(model, "exact")
    c = 1e-2

    def sums(rows):
        capture = Capture(plan)
        try:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                losses = lm_losses(model, ids[rows])
            return clipped_backward(capture, losses.float(), c, 1, None).sums
        finally:
            capture.remove()
    full = sums(list(range(4)))
    for j in range(4):
        rest = sums([i for i in range(4) if i != j])
        diff = math.sqrt(sum(float((full[k].double() - rest[k].double()).square().sum()) for k in full))
        assert diff <= c * (1 + 1e-3), (j, diff)


# --- a step that trains nothing, frozen batch norm, and a trainable set that changes mid-run ---------------------

def _classifier(model=None, n=40, batch=8, noise=0.0, estimator="exact", c=1.0, opt_params=None, **kw):
    torch.manual_seed(0)
    model = model or nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    x = torch.randn(n, *((4,) if kw.get("shape") is None else kw.pop("shape")))
    y = torch.randint(0, 3, (n,))
    opt = torch.optim.SGD(model.parameters() if opt_params is None else opt_params(model), lr=0.5)
    engine = PrivacyEngine()
    model, opt, crit, loader = engine.make_private(
        module=model, optimizer=opt, data_loader=DataLoader(TensorDataset(x, y), batch_size=batch),
        criterion=nn.CrossEntropyLoss(), max_grad_norm=c, noise_multiplier=noise, estimator=estimator, seed=0, **kw)
    return engine, model, opt, crit, loader


def _state(model):
    return [t.detach().clone() for t in (*model.parameters(), *model.buffers())]


def _same(a, b):
    return all(torch.equal(s, t) for s, t in zip(a, b, strict=True))


def test_a_standard_loop_with_the_users_own_criterion_raises_at_step_naming_the_fix():
    """``nn.CrossEntropyLoss()`` of the user's own and a plain ``loss.backward()``: the recorded forward's gradient
    went to the engine's per-call aliases and no private backward formed a clipped sum, so the step would have been
    noise only and trained nothing.  ``step()`` raises, naming the criterion make_private returned and
    ``private_loss``, and neither the model nor the ledger moves."""
    engine, model, opt, crit, loader = _classifier()
    mine = nn.CrossEntropyLoss()
    before = _state(model)
    x, y = next(iter(loader))
    opt.zero_grad()
    mine(model(x), y).backward()
    with pytest.raises(RuntimeError, match=r"criterion returned by make_private.*private_loss"):
        opt.step()
    assert engine.steps == 0 and _same(before, _state(model))
    opt.zero_grad()   # drops that batch: a noise-only step, as the message says
    opt.step()
    assert engine.steps == 1


def test_a_training_forward_without_any_backward_raises_at_step():
    engine, model, opt, crit, loader = _classifier()
    x, y = next(iter(loader))
    opt.zero_grad()
    model(x)
    with pytest.raises(RuntimeError, match="no private backward"):
        opt.step()
    assert engine.steps == 0


def test_deliberate_noise_only_steps_still_work():
    """A skipped batch (no forward), a batch dropped after its forward, and the private loop: none raises."""
    engine, model, opt, crit, loader = _classifier(noise=1.0)
    batches = iter(loader)
    next(batches)
    opt.zero_grad()
    opt.step()                   # skipped without a forward
    x, y = next(batches)
    model(x)                     # e.g. a loss found to be NaN: the batch is dropped
    opt.zero_grad()
    opt.step()
    x, y = next(batches)
    with torch.no_grad():
        model(x)                 # a look at the outputs without gradient records nothing
    opt.zero_grad()
    crit(model(x), y).backward()
    model(x)                     # an extra forward after the private backward (a metric)
    opt.step()
    assert engine.steps == 3



def _frozen_bn_cnn(train_bn=False, affine=True):
    torch.manual_seed(1)
    cnn = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4, affine=affine), nn.ReLU(), nn.Flatten(),
                        nn.Linear(4 * 4 * 4, 3))
    bn = cnn[1]
    bn.running_mean.copy_(torch.randn(4))   # "pretrained" statistics
    bn.running_var.copy_(torch.rand(4) + 0.5)
    bn.requires_grad_(False)
    bn.train(train_bn)
    return cnn


@pytest.mark.parametrize("affine", [True, False])
def test_a_frozen_eval_mode_batch_norm_with_pretrained_statistics_trains(affine):
    """Frozen and in evaluation mode, batch norm is a fixed per-channel affine map of each example alone: it mixes
    nothing and needs no gradient.  It trains (``model.train()`` then ``bn.eval()``, as fine-tuning does), its
    statistics and parameters stay as they were, and every example's update stays within C."""
    engine, model, opt, crit, loader = _classifier(_frozen_bn_cnn(affine=affine), shape=(1, 6, 6), batch=6)
    engine.check_every_step = True
    bn = model[1]
    frozen = _state(bn)
    before = flat_params(model)
    for x, y in loader:
        model.train()
        bn.eval()
        opt.zero_grad()
        crit(model(x), y).backward()
        opt.step()
    assert engine.steps == len(loader) and _same(frozen, _state(bn))
    assert not torch.equal(before, flat_params(model))
    assert "1.weight" not in {r.parameter for r in engine.plan.table()}


def test_a_frozen_batch_norm_in_training_mode_is_refused_at_the_forward_naming_it():
    """In training mode it would normalize with the batch's statistics (mixing examples) and update its running
    statistics: refused at that forward, with its path and the fix, before anything is recorded or changed."""
    engine, model, opt, crit, loader = _classifier(_frozen_bn_cnn(), shape=(1, 6, 6), batch=6)
    model.train()   # also puts the batch norm in training mode
    frozen = _state(model[1])
    x, y = next(iter(loader))
    with pytest.raises(UnsupportedModuleError, match=r"^1: BatchNorm2d .*training mode.*eval\(\)"):
        model(x)
    assert _same(frozen, _state(model[1]))
    model[1].eval()
    crit(model(x), y).backward()
    opt.step()
    assert engine.steps == 1


@pytest.mark.parametrize("make", [
    lambda: nn.BatchNorm2d(4, track_running_stats=False).requires_grad_(False).eval(),   # batch statistics in eval
    lambda: nn.BatchNorm2d(4).eval(),                                                    # trainable
])
def test_batch_norm_that_mixes_or_trains_is_still_refused_by_the_validator(make):
    cnn = nn.Sequential(nn.Conv2d(1, 4, 3), make(), nn.Flatten(), nn.Linear(4 * 4 * 4, 3))
    with pytest.raises(UnsupportedModuleError, match=r"^1: BatchNorm2d"):
        NormPlan.build(cnn, "exact")
    assert isinstance(ModuleValidator.fix(cnn)[1], nn.GroupNorm)


def test_modulevalidator_fix_keeps_a_frozen_batch_norm():
    cnn = _frozen_bn_cnn()
    assert ModuleValidator.is_valid(cnn) and isinstance(ModuleValidator.fix(cnn)[1], nn.BatchNorm2d)


@pytest.mark.parametrize("estimator", ["exact", "ghost"])
def test_unfreezing_a_layer_mid_run_re_plans_and_clips_it(estimator):
    """Exact norms are accounted as DP-SGD whatever trains: the plan is rebuilt at the next training forward, the
    unfrozen layer trains from then on, and each example's update (lr 1, no noise) stays within C."""
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    model[0].requires_grad_(False)
    engine, model, opt, crit, loader = _classifier(model, estimator=estimator, batch=1, c=0.05)
    opt.param_groups[0]["lr"] = 1.0
    first = _state(model[0])
    batches = iter(loader)
    x, y = next(batches)
    crit(model(x), y).backward()
    opt.step()
    assert _same(first, _state(model[0]))
    model[0].requires_grad_(True)
    for x, y in batches:
        before = torch.cat([p.detach().flatten() for p in model.parameters()])
        opt.zero_grad()
        crit(model(x), y).backward()
        opt.step()
        after = torch.cat([p.detach().flatten() for p in model.parameters()])
        assert float((after - before).norm()) <= 0.05 * x.shape[0] * (1 + 1e-6)
    assert not _same(first, _state(model[0]))
    assert "0.weight" in engine.plan.names.values() and engine.envelope is None
    assert engine.steps == len(loader)


def test_freezing_a_layer_mid_run_stops_its_updates():
    engine, model, opt, crit, loader = _classifier(noise=1.0, estimator="hutch")
    envelope = engine.envelope
    batches = iter(loader)
    x, y = next(batches)
    crit(model(x), y).backward()
    opt.step()
    model[0].requires_grad_(False)
    frozen = _state(model[0])
    for x, y in batches:
        opt.zero_grad()
        crit(model(x), y).backward()
        opt.step()
    assert _same(frozen, _state(model[0]))
    # fewer estimated terms: the envelope fixed at make_private (a wider one) still bounds every step
    assert engine.envelope == envelope and engine.plan.envelope(engine.projection_dim).dim < envelope.dim


def test_unfreezing_under_an_estimated_norm_that_would_widen_the_envelope_is_refused():
    """Under ``hutch`` the accountant charges an envelope whose dimension is the plan's chi-square terms at
    make_private; an unfrozen layer adds terms the steps already charged were not accounted for, so the forward
    raises, naming the layer and the fix, and nothing moves."""
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    model[0].requires_grad_(False)
    engine, model, opt, crit, loader = _classifier(model, estimator="hutch", noise=1.0)
    batches = iter(loader)
    x, y = next(batches)
    crit(model(x), y).backward()
    opt.step()
    model[0].requires_grad_(True)
    x, y = next(batches)
    before = _state(model)
    with pytest.raises(RuntimeError, match=r"0\.weight.*envelope.*(exact|ghost)"):
        model(x)
    assert _same(before, _state(model)) and engine.steps == 1
    model[0].requires_grad_(False)   # frozen again: trains on
    opt.zero_grad()
    crit(model(x), y).backward()
    opt.step()
    assert engine.steps == 2


def test_unfreezing_under_an_estimated_norm_trains_when_the_charged_envelope_is_the_limit_form():
    """With an exact part (a LayerNorm) the accountant charges the Hutch++ form ``max(F_{chi2(k)/k}, 1{x >= 1})``,
    the limit of every dimension: an unfrozen estimated layer's new terms stay under it, so it trains."""
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 3))
    model[0].requires_grad_(False)
    engine, model, opt, crit, loader = _classifier(model, estimator="hutch", noise=1.0)
    envelope = engine.envelope
    first = _state(model[0])
    batches = iter(loader)
    x, y = next(batches)
    crit(model(x), y).backward()
    opt.step()
    model[0].requires_grad_(True)
    for x, y in batches:
        opt.zero_grad()
        crit(model(x), y).backward()
        opt.step()
    assert not _same(first, _state(model[0])) and engine.envelope == envelope
    assert engine.plan.envelope(engine.projection_dim).dim > envelope.projection_dim


def test_unfreezing_a_frozen_batch_norm_is_refused_by_the_validator_at_the_next_forward():
    engine, model, opt, crit, loader = _classifier(_frozen_bn_cnn(), shape=(1, 6, 6), batch=6)
    model[1].requires_grad_(True)
    x, y = next(iter(loader))
    model.train()
    model[1].eval()
    with pytest.raises(UnsupportedModuleError, match=r"^1: BatchNorm2d"):
        model(x)


class _Scaled(nn.Module):
    """A parameter of the model itself (not of a submodule), used in its forward."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        return self.lin(x * self.scale)


def test_unfreezing_a_parameter_of_the_model_itself_is_followed_at_zero_grad():
    """The hooks of the model's own parameters run in its own forward, whose hooks are fixed once it starts: the
    change is followed at ``optimizer.zero_grad()``; a forward that finds it first raises, naming the fix."""
    model = _Scaled()
    model.scale.requires_grad_(False)
    engine, model, opt, crit, loader = _classifier(model, noise=1.0)
    batches = iter(loader)
    x, y = next(batches)
    crit(model(x), y).backward()
    opt.step()
    model.scale.requires_grad_(True)
    x, y = next(batches)
    with pytest.raises(RuntimeError, match=r"scale \(unfrozen\).*zero_grad\(\) before this forward"):
        model(x)
    before = model.scale.detach().clone()
    opt.zero_grad()
    crit(model(x), y).backward()
    opt.step()
    assert engine.steps == 2 and not torch.equal(before, model.scale)
