"""Helpers of the trainer tests: private runs set up in one line, one step of the trainer on a whole batch, and the
checks that a state holds no generator."""

from __future__ import annotations

import io

import torch
from torch import nn

from verify.workloads import VOCAB, T, flat_params, make


def private_lora_run(device: str = "cpu", autocast: bool = False):
    """A private training epoch of the LoRA GPT-2 (Hutch, k = 8) on ``device``: ``(engine, model, loader)``."""
    from torch.utils.data import DataLoader, TensorDataset

    from dpsgd import PrivacyEngine

    torch.manual_seed(0)
    model = make("lora_gpt2", dtype=torch.float32).to(device)
    ids = torch.randint(1, VOCAB, (64, T))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    engine = PrivacyEngine()
    same, opt, crit, loader = engine.make_private(
        module=model, optimizer=opt, data_loader=DataLoader(TensorDataset(ids, ids), batch_size=16),
        criterion=nn.CrossEntropyLoss(), max_grad_norm=1.0, noise_multiplier=1.0, estimator="hutch",
        projection_dim=8, seed=0)
    assert same is model
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        opt.zero_grad()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            logits = model(x).logits
        crit(logits[:, :-1].float(), y[:, 1:]).backward()
        opt.step()
    return engine, model, loader


def private_classifier(**kw):
    """``(engine, model, optimizer, criterion, loader)`` of a small tanh MLP on 200 random 3-class examples,
    made private with ghost norms, C = 1, batch 20 and seed 2; ``kw`` overrides ``make_private``'s arguments."""
    from torch.utils.data import DataLoader, TensorDataset

    from dpsgd import PrivacyEngine

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    gen = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(200, 6, generator=gen), torch.randint(0, 3, (200,), generator=gen))
    engine = PrivacyEngine()
    args = dict(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                data_loader=DataLoader(data, batch_size=20), criterion=nn.CrossEntropyLoss(), max_grad_norm=1.0,
                estimator="ghost", seed=2)
    args.update(kw)
    return engine, *engine.make_private(**args)


def one_step_change(model: nn.Module, optimizer, criterion, loader) -> torch.Tensor:
    """The flattened parameter change of one private step on the loader's first batch."""
    before = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    x, y = next(iter(loader))
    optimizer.zero_grad()
    criterion(model(x), y).backward()
    optimizer.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]) - before


def private_update(model: nn.Module, batch: torch.Tensor, losses, *, max_grad_norm: float,
                   noise_multiplier: float = 0.0, optimizer=None, lr: float | None = None, **kw) -> torch.Tensor:
    """One step of the trainer (:class:`dpsgd.PrivacyEngine`) on the whole ``batch``: sampling rate 1, so every row is
    drawn, in order, and the expected batch size is ``len(batch)``.  ``losses(model, rows)`` gives the per-example
    losses.  The optimizer is ``optimizer`` or SGD with ``lr`` (default ``len(batch)``: the update is then the
    clipped sum plus noise, undivided); ``kw`` goes to ``make_private`` (``estimator`` default "exact").  Returns
    the flattened change of the trainable parameters."""
    import warnings

    from torch.utils.data import DataLoader, TensorDataset

    from dpsgd import PrivacyEngine

    n = len(batch)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = optimizer if optimizer is not None else torch.optim.SGD(trainable, lr=float(n if lr is None else lr))
    engine = PrivacyEngine()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # the reproducibility seed's warning
        model, opt, loader = engine.make_private(
            module=model, optimizer=opt, data_loader=DataLoader(TensorDataset(batch), batch_size=n),
            max_grad_norm=max_grad_norm, noise_multiplier=noise_multiplier, **{"estimator": "exact", "seed": 0, **kw})
    before = flat_params(model)
    try:
        (rows,) = next(iter(loader))
        assert torch.equal(rows, batch)
        opt.zero_grad()
        engine.private_loss(losses(model, rows)).backward()
        opt.step()
    finally:
        engine.detach()
    return flat_params(model) - before


def engine_generators(engine):
    """Every generator the engine draws secrets from: batches, projections, twice sampling's masks, noise."""
    step = engine.private_step   # the generators are the step's own: nothing public hands them out
    return [engine._sampling_rng, *(g for rngs in (step._projection_rngs, step._mask_rngs, step._noise_rngs)
                                    for g in rngs.generators)]


def _leaves(obj, path="state"):
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from _leaves(value, f"{path}[{key!r}]")
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _leaves(value, f"{path}[{i}]")
    else:
        yield path, obj


def assert_holds_no_generator_state(state, engine):
    """``state`` (a state_dict, or a loaded checkpoint file) holds plain settings and counts only: no tensor or
    bytes anywhere in it, and no stretch of any of the engine's generator states in its serialized form."""
    for path, leaf in _leaves(state):
        assert leaf is None or isinstance(leaf, (bool, int, float, str)), f"{path} holds a {type(leaf).__name__}"
    buffer = io.BytesIO()
    torch.save(state, buffer)
    saved = buffer.getvalue()
    generators = engine_generators(engine)
    assert len(generators) >= 3
    for g in generators:
        raw = g.get_state().numpy().tobytes()
        middle = raw[len(raw) // 2:len(raw) // 2 + 64] if len(raw) > 64 else raw
        assert middle not in saved
