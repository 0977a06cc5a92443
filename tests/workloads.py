"""Tiny models the trainer must handle, built from configs with random weights (no download), and a brute-force
per-example gradient to compare against."""

from __future__ import annotations

import io
import logging
import math

import torch
import torch.nn.functional as F
from torch import nn

logging.getLogger("transformers").setLevel(logging.ERROR)

VOCAB, T = 40, 8


def lm_losses(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Per-example next-token cross-entropy, mean over positions."""
    out = model(ids)
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none").mean(1)


def gpt2(tied: bool = True) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=tied, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def llama(tied: bool = True, checkpointing: bool = False) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
                      tie_word_embeddings=tied, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = LlamaForCausalLM(cfg)
    if checkpointing:
        # Hugging Face's default: non-reentrant (gradient_checkpointing_enable before transformers' rename)
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable()
    return model


def bert() -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=16, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, pad_token_id=0)
    return BertForMaskedLM(cfg)


def lora_gpt2() -> nn.Module:
    from peft import LoraConfig, get_peft_model

    return get_peft_model(gpt2(), LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"],
                                             lora_dropout=0.0, fan_in_fan_out=True))


class AttentionLM(nn.Module):
    """Embedding, ``nn.MultiheadAttention`` (whose ``out_proj`` is used outside its own forward), head."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.attn = nn.MultiheadAttention(dim, 2, batch_first=True)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, ids):
        x = self.emb(ids)
        mask = torch.triu(torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool, device=ids.device), 1)
        y, _ = self.attn(x, x, x, attn_mask=mask, need_weights=False)
        return self.head(x + y)


class RecurrentLM(nn.Module):
    """Embedding, a batch-first ``nn.LSTM`` (tuple output; the final state feeds the head too), head."""

    def __init__(self, dim: int = 12):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.lstm = nn.LSTM(dim, dim, batch_first=True)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, ids):
        y, (h, _) = self.lstm(self.emb(ids))
        return self.head(y + h[-1].unsqueeze(1))


class TwiceLM(nn.Module):
    """A block called twice in one forward (weight sharing across depth)."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.block = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, ids):
        x = self.emb(ids)
        x = x + torch.tanh(self.block(x))
        x = x + torch.tanh(self.block(x))
        return self.head(x)


class ConvLM(nn.Module):
    """Token embeddings as a one-channel image: ``Conv2d`` (reflect-padded), ``GroupNorm``, a grouped ``Conv2d``,
    a 1x1 ``Conv2d`` back to one channel, head (a CNN with the native convolution and normalization handlers)."""

    def __init__(self, dim: int = 12):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.conv = nn.Conv2d(1, 4, 3, padding="same", padding_mode="reflect")
        self.norm = nn.GroupNorm(2, 4)
        self.grouped = nn.Conv2d(4, 4, 3, padding=1, groups=2)
        self.mix = nn.Conv2d(4, 1, 1)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, ids):
        x = self.emb(ids).unsqueeze(1)                        # (B, 1, T, dim)
        y = torch.tanh(self.norm(self.conv(x)))
        y = self.mix(torch.tanh(self.grouped(y)))
        return self.head((x + y).squeeze(1))


class Conv1dLM(nn.Module):
    """A causal ``Conv1d`` over positions (left padding, dilation 2), ``LayerNorm``, ``RMSNorm``, head."""

    def __init__(self, dim: int = 12):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.conv = nn.Conv1d(dim, dim, 2, dilation=2)
        self.norm = nn.LayerNorm(dim)
        self.rms = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, ids):
        x = self.emb(ids)
        y = self.conv(F.pad(x.transpose(1, 2), (2, 0))).transpose(1, 2)
        return self.head(self.rms(x + self.norm(y)))


WORKLOADS = {
    "gpt2_tied": gpt2,
    "llama_tied": lambda: llama(True),
    "llama_untied": lambda: llama(False),
    "bert": bert,
    "lora_gpt2": lora_gpt2,
    "multihead_attention": AttentionLM,
    "lstm": RecurrentLM,
    "module_called_twice": TwiceLM,
    "cnn_groupnorm": ConvLM,
    "conv1d_layernorm": Conv1dLM,
    "llama_checkpointing": lambda: llama(True, checkpointing=True),
}


def make(name: str, seed: int = 0, dtype=torch.float64) -> nn.Module:
    torch.manual_seed(seed)
    return WORKLOADS[name]().to(dtype).train()


def data(b: int = 3, seed: int = 0) -> torch.Tensor:
    return torch.randint(1, VOCAB, (b, T), generator=torch.Generator().manual_seed(seed))


def brute_force_sq_norms(model: nn.Module, loss_of, b: int) -> torch.Tensor:
    """``||grad L_i||^2`` one example at a time with plain autograd (no hooks involved)."""
    params = [p for p in model.parameters() if p.requires_grad]
    out = []
    for i in range(b):
        grads = torch.autograd.grad(loss_of(model, i), params, allow_unused=True)
        out.append(sum(g.double().square().sum() for g in grads if g is not None))
    return torch.stack(out)


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten().double() for p in model.parameters() if p.requires_grad])


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


def sem(x: torch.Tensor) -> torch.Tensor:
    return x.std(0) / math.sqrt(x.shape[0])


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
        model, opt, _, loader = engine.make_private(
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
    return [engine._sampling_rng, *engine.private_step.generators]


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
