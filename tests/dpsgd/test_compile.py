"""torch.compile before or after make_private: the engine's hooks run eagerly between compiled regions (graph breaks),
the per-call aliases are inputs of the compiled graphs (no recompilation per step), and the row check may
backpropagate a compiled graph twice.  Per-example norms equal the eager model's; training runs with the row check
on every step.  The aot_eager backend keeps the test free of a C++ toolchain; benchmarks/step_bench.py measures
inductor."""

import logging

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from dpsgd import PrivacyEngine, per_sample_sq_norms
from dpsgd.clipping import clipped_backward

pytest.importorskip("transformers")
logging.getLogger("transformers").setLevel(logging.ERROR)


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                                        use_cache=False)).train()


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=40, n_positions=32, n_embd=32, n_layer=1, n_head=2, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)).train()


def _losses(m, x):
    logits = m(input_ids=x).logits
    return F.cross_entropy(logits[:, :-1].float().transpose(1, 2), x[:, 1:], reduction="none").mean(1)


@pytest.mark.parametrize("build", [_llama, _gpt2], ids=["llama", "gpt2-shared-positions"])
@pytest.mark.parametrize("when", ["before", "after"])
def test_a_compiled_model_trains_privately_with_the_eager_per_example_norms(when, build):
    ids = torch.randint(1, 40, (32, 10), generator=torch.Generator().manual_seed(0))
    model = build()
    eager = per_sample_sq_norms(model, lambda m: _losses(m, ids[:6]), "exact")
    engine = PrivacyEngine()
    engine.check_every_step = True
    if when == "before":
        model = torch.compile(model, backend="aot_eager")
    model, opt, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        data_loader=DataLoader(TensorDataset(ids), batch_size=8), max_grad_norm=1.0, noise_multiplier=1.0,
        estimator="exact", seed=0)
    if when == "after":
        model = torch.compile(model, backend="aot_eager")
    for (x,) in loader:
        engine.private_loss(_losses(model, x)).backward()
        opt.step()
    assert engine.steps == len(loader)
    got = clipped_backward(engine.private_step.capture, _losses(model, ids[:6]), 1.0, 1, None, norms_only=True).sq_norms
    assert torch.allclose(got.double(), eager.double(), rtol=1e-4, atol=0)
