"""Every stock Hugging Face family that trains privately keeps training with the example-isolation check on every
step, in float32 and under bf16 autocast at batches above one (no false refusal of the most common LLM setting)."""

import logging

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from dpsgd import PrivacyEngine

pytest.importorskip("transformers")
pytest.importorskip("peft")

from .hf_families import FAMILIES  # noqa: E402
from .workloads import VOCAB  # noqa: E402

logging.getLogger("transformers").setLevel(logging.ERROR)


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16-autocast"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_stock_family_trains_with_the_row_check_on_every_step(name, autocast):
    torch.manual_seed(0)
    model, inputs, losses = FAMILIES[name]()
    model.train()
    ids = torch.randint(1, VOCAB, (12, 10), generator=torch.Generator().manual_seed(1))
    engine = PrivacyEngine()
    engine.check_every_step = True
    model, opt, _, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1),
        data_loader=DataLoader(TensorDataset(ids), batch_size=4), max_grad_norm=1.0, noise_multiplier=1.0,
        estimator="hutch", k=8, seed=0)
    sizes = []
    for (x,) in loader:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            per = losses(model, inputs(x))
        engine.private_loss(per.float()).backward()
        opt.step()
        sizes.append(x.shape[0])
    assert engine.steps == len(loader) and max(sizes) > 1
