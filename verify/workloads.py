"""Tiny models the trainer must handle, built from configs with random weights (no download), and a brute-force
per-example gradient to compare against."""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrizations as P

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


def sem(x: torch.Tensor) -> torch.Tensor:
    return x.std(0) / math.sqrt(x.shape[0])





def token_losses(logits, ids):
    return F.cross_entropy(logits[:, :-1].float().transpose(1, 2), ids[:, 1:], reduction="none").mean(1)


class NanoPositions(nn.Module):
    """nanoGPT's ``self.wpe(torch.arange(T))``: a ``(T, d)`` output every example reads."""

    def __init__(self):
        super().__init__()
        self.wte, self.wpe, self.head = nn.Embedding(VOCAB, 8), nn.Embedding(16, 8), nn.Linear(8, VOCAB)

    def forward(self, ids):
        return self.head(torch.tanh(self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))))


class OwnParameters(nn.Module):
    """A position table and a temperature kept on the model itself, used by slicing, broadcasting and matmul."""

    def __init__(self):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(16, 8))
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.mix = nn.Parameter(torch.randn(8, 8) / 3)
        self.wte, self.head = nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB)

    def forward(self, ids):
        h = torch.tanh(self.wte(ids) + self.pos[: ids.shape[1]])
        return self.head(h @ self.mix) * self.scale


def t5():
    from transformers import T5Config, T5ForConditionalGeneration

    return T5ForConditionalGeneration(T5Config(vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=1,
                                               num_decoder_layers=1, num_heads=2, dropout_rate=0.0,
                                               decoder_start_token_id=0, pad_token_id=0))


def bart():
    from transformers import BartConfig, BartForConditionalGeneration

    return BartForConditionalGeneration(BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32, dropout=0.0,
        attention_dropout=0.0, pad_token_id=0, bos_token_id=0, eos_token_id=0, decoder_start_token_id=0))


def prompt_tuning():
    import peft
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                                         bos_token_id=0, eos_token_id=0, pad_token_id=0))
    return peft.get_peft_model(model, peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))


def seq2seq_losses(m, ids):
    return token_losses(m(input_ids=ids, decoder_input_ids=ids).logits, ids)


def from_labels_losses(m, ids):
    """Only labels given: the model shifts them right into its decoder inputs (a new tensor, not a view)."""
    logits = m(input_ids=ids, labels=ids).logits
    return F.cross_entropy(logits.float().transpose(1, 2), ids, reduction="none").mean(1)


SHARED_OUTPUTS = {
    "nanogpt-arange": (NanoPositions, lambda m, ids: token_losses(m(ids), ids)),
    "own-parameters": (OwnParameters, lambda m, ids: token_losses(m(ids), ids)),
    "t5-relative-bias": (t5, seq2seq_losses),
    "bart-positions": (bart, seq2seq_losses),
    "prompt-tuning": (prompt_tuning, lambda m, ids: token_losses(m(input_ids=ids).logits[:, 4:], ids)),
    "t5-from-labels": (t5, from_labels_losses),
    "bart-from-labels": (bart, from_labels_losses),
}



class Parametrized(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        wrap = getattr(P, kind)
        self.wte = wrap(nn.Embedding(VOCAB, 8)) if kind != "orthogonal" else nn.Embedding(VOCAB, 8)
        self.conv = wrap(nn.Conv1d(8, 8, 3, padding=1))
        self.lin = wrap(nn.Linear(8, 8))
        self.head = nn.Linear(8, VOCAB)

    def forward(self, ids):
        h = self.conv(self.wte(ids).transpose(1, 2)).transpose(1, 2)
        return self.head(torch.tanh(self.lin(torch.tanh(h))))


def parametrized_losses(m, ids):
    """Next-token cross-entropy of a :class:`Parametrized` model, per example."""
    logits = m(ids)
    return nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none").mean(1)
