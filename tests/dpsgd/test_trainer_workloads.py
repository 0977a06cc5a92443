"""Stock Hugging Face models, PEFT LoRA, attention, recurrent and weight-shared models: per-example norms equal
brute-force per-example gradients, randomized norms are unbiased, and a single example's clipped update is at
most C."""

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from dpsgd import NormPlan, per_sample_sq_norms  # noqa: E402
from verify.workloads import WORKLOADS, brute_force_sq_norms, data, lm_losses, make, sem  # noqa: E402

from ..helpers import private_lora_run, private_update  # noqa: E402


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_exact_and_ghost_norms_equal_brute_force(name):
    model = make(name)
    ids = data(3)
    ref = brute_force_sq_norms(model, lambda m, i: lm_losses(m, ids[i:i + 1])[0], 3)
    for estimator in ("exact", "ghost"):
        got = per_sample_sq_norms(model, lambda m: lm_losses(m, ids), estimator)
        assert torch.allclose(got, ref, rtol=1e-6, atol=0), (estimator, got, ref)
    assert all(p.grad is None for p in model.parameters())


# each estimator on each model in the default run but Hutch++ on the tied GPT-2 and Hutch on LoRA (all with -m slow)
@pytest.mark.parametrize("estimator, name", [
    ("hutch", "gpt2_tied"), pytest.param("hutchpp", "gpt2_tied", marks=pytest.mark.slow),
    pytest.param("hutch", "lora_gpt2", marks=pytest.mark.slow), ("hutchpp", "lora_gpt2"),
    ("hutch", "module_called_twice"), ("hutchpp", "module_called_twice")])
def test_randomized_norms_are_unbiased(name, estimator):
    """Mean of 300 estimates within 5 standard errors of the brute-force norm, for each of 2 examples (a
    two-sided z-test at about 6e-7 per comparison; fixed seeds)."""
    model = make(name, seed=1)
    ids = data(2, seed=1)
    ref = brute_force_sq_norms(model, lambda m, i: lm_losses(m, ids[i:i + 1])[0], 2)
    gen = torch.Generator().manual_seed(2)
    draws = torch.stack([per_sample_sq_norms(model, lambda m: lm_losses(m, ids), estimator, k=2, generator=gen)
                         for _ in range(300)])
    assert torch.all((draws.mean(0) - ref).abs() < 5 * sem(draws) + 1e-9 * ref)


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_one_example_clipped_update_is_at_most_c(name):
    """sigma = 0, SGD with lr 1 and expected batch 1: the update is the clipped gradient, norm min(||g||, C)."""
    ids = data(2, seed=3)
    for i in range(2):
        one = ids[i:i + 1]
        model = make(name, seed=3)
        norm = brute_force_sq_norms(model, lambda m, j, one=one: lm_losses(m, one)[0], 1).sqrt().item()
        c = 0.5 * norm if i == 0 else 2 * norm
        moved = private_update(model, one, lm_losses, max_grad_norm=c).norm().item()
        assert moved <= c * (1 + 1e-9)
        assert moved == pytest.approx(min(norm, c), rel=1e-7)


def test_lora_counts_only_the_adapters():
    model = make("lora_gpt2")
    plan = NormPlan.build(model, "hutch")
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert all("lora_" in n for n in trainable) and len(plan.params) == len(trainable)
    # each adapter is a Linear without bias: A is r x d_in, B is d_out x r, so min(...) = r = 4 per matrix
    assert plan.envelope_dimension() == (4 * len(trainable), False)


def test_hf_training_loop_with_lora_gpt2_reaches_the_ledger():
    engine, model, loader = private_lora_run()
    assert engine.steps == len(loader) == 4 and 0 < engine.get_epsilon(1e-5) < float("inf")


def test_hutch_envelope_dimension_of_a_tied_gpt2_counts_the_shared_weight_once():
    model = make("gpt2_tied")
    plan = NormPlan.build(model, "hutch")
    names = plan.terms
    assert names["transformer.wte.weight"] == 32            # min(V = 40, p = 32), once for both uses
    assert "lm_head.weight" not in names                     # the same parameter
    _, exact = plan.envelope_dimension()
    assert exact                                             # LayerNorms are exact (point masses)


def _private_update(model, ids, clipping_pass, c):
    return private_update(model, ids, lm_losses, max_grad_norm=c, clipping_pass=clipping_pass)


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_bookkeeping_and_two_pass_updates_are_equal(name):
    """sigma = 0 and C at the median norm (half the examples clipped): the same update to 1e-6 relative."""
    ids = data(4, seed=5)
    model = make(name, seed=5)
    c = per_sample_sq_norms(model, lambda m: lm_losses(m, ids), "exact").sqrt().median().item()
    updates = {p: _private_update(make(name, seed=5), ids, p, c) for p in ("bookkeeping", "two-pass")}
    a, b = updates["bookkeeping"], updates["two-pass"]
    assert (a - b).norm() <= 1e-6 * b.norm(), (a - b).norm() / b.norm()


class _Recorder(torch.optim.SGD):
    """SGD that keeps the gradient it was given (float32 parameters round a small update; the gradient does
    not)."""

    def step(self, closure=None):
        self.seen = torch.cat([p.grad.detach().flatten().double() for g in self.param_groups for p in g["params"]])
        return super().step(closure)


def test_two_pass_equals_bookkeeping_on_the_float32_tiny_decoder():
    from dpsgd.demo import TinyLlama

    ids = torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 4, (4,), generator=torch.Generator().manual_seed(1))

    def update(clipping_pass):
        torch.manual_seed(0)
        model = TinyLlama(64, 32, dim=32, heads=2, layers=2).train()
        opt = _Recorder(model.parameters(), lr=1.0)
        private_update(model, ids, lambda m, x: torch.nn.functional.cross_entropy(m(x), y, reduction="none"),
                       max_grad_norm=0.05, optimizer=opt, estimator="hutch", projection_dim=4,
                       clipping_pass=clipping_pass)
        return opt.seen
    a, b = update("bookkeeping"), update("two-pass")
    assert (a - b).norm() <= 1e-6 * b.norm(), (a - b).norm() / b.norm()


def test_two_pass_refuses_half_precision_parameters():
    model = make("gpt2_tied", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="clipping_pass='two-pass'.*half"):
        private_update(model, data(2), lambda m, x: lm_losses(m, x).float(), max_grad_norm=1.0,
                       estimator="hutch", clipping_pass="two-pass")


def test_unknown_clipping_pass_is_refused_by_name():
    with pytest.raises(ValueError, match="clipping_pass must be one of"):
        private_update(make("gpt2_tied"), data(2), lm_losses, max_grad_norm=1.0, clipping_pass="twice")


@pytest.mark.parametrize("name", ["gpt2_tied", "llama_tied", "module_called_twice"])
def test_hutchpp_with_a_sketch_as_wide_as_every_matrix_rank_equals_brute_force_on_shared_weights(name):
    """k = 40 >= min(rows, cols) of every weight (hidden 32, vocabulary 40): Hutch++'s sketch spans each
    per-example gradient, so the estimate is the exact norm, tied and twice-called weights included."""
    model = make(name, seed=4)
    ids = data(3, seed=4)
    ref = brute_force_sq_norms(model, lambda m, i: lm_losses(m, ids[i:i + 1])[0], 3)
    got = per_sample_sq_norms(model, lambda m: lm_losses(m, ids), "hutchpp", k=40,
                              generator=torch.Generator().manual_seed(0))
    assert torch.allclose(got, ref, rtol=1e-8, atol=0), (got, ref)


def test_hutchpp_on_a_tied_embedding_never_forms_the_summed_per_example_gradient(monkeypatch):
    """The tied weight's Hutch++ estimate reads each use only through products with k columns: the V x d
    per-example gradient (B V d numbers, 617 MB at GPT-2-small widths and B = 4) is never formed."""
    from dpsgd.layers import EmbeddingHandler, LinearHandler

    for cls in (EmbeddingHandler, LinearHandler):
        original = cls.per_example

        def guarded(self, call, name, projection, original=original):
            assert projection is not None, "a per-example gradient was materialized"
            return original(self, call, name, projection)
        monkeypatch.setattr(cls, "per_example", guarded)
    model = make("gpt2_tied", seed=4)
    plan = NormPlan.build(model, "hutchpp")
    assert plan.terms["transformer.wte.weight"] == 32        # min(V = 40, d = 32): estimated, not a point mass
    ids = data(2, seed=4)
    got = per_sample_sq_norms(model, lambda m: lm_losses(m, ids), "hutchpp", k=4,
                              generator=torch.Generator().manual_seed(0))
    assert got.shape == (2,) and bool(torch.isfinite(got).all())
