"""Stock Hugging Face families, built tiny from their configs with random weights (no download), each with the
per-example loss of its task: ``FAMILIES[name]() -> (model, batch_of(ids) -> inputs, losses(model, inputs))``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .workloads import VOCAB

_DECODER = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=0)


def _token_losses(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy per example, in float32 (also under autocast)."""
    return F.cross_entropy(logits[:, :-1].float().transpose(1, 2), ids[:, 1:], reduction="none").mean(1)


def _lm(model):
    return model, lambda ids: {"input_ids": ids}, lambda m, inp: _token_losses(m(**inp).logits, inp["input_ids"])


def _causal(config_cls: str, model_cls: str, **extra):
    def build():
        import transformers

        cfg = getattr(transformers, config_cls)(**{**_DECODER, **extra})
        return _lm(getattr(transformers, model_cls)(cfg))
    return build


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return _lm(GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                          bos_token_id=0, eos_token_id=0)))


def _neox():
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    return _lm(GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                                num_hidden_layers=2, num_attention_heads=2,
                                                max_position_embeddings=32, bos_token_id=0, eos_token_id=0)))


def opt(dropout: float = 0.1):
    from transformers import OPTConfig, OPTForCausalLM

    return _lm(OPTForCausalLM(OPTConfig(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                        num_attention_heads=2, max_position_embeddings=32, word_embed_proj_dim=32,
                                        pad_token_id=0, bos_token_id=0, eos_token_id=0, dropout=dropout,
                                        attention_dropout=dropout)))


def _masked(config_cls: str, model_cls: str, **cfg):
    def build():
        import transformers

        base = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                    intermediate_size=64, max_position_embeddings=40, pad_token_id=0)
        return _lm(getattr(transformers, model_cls)(getattr(transformers, config_cls)(**{**base, **cfg})))
    return build


def _distilbert():
    from transformers import DistilBertConfig, DistilBertForMaskedLM

    return _lm(DistilBertForMaskedLM(DistilBertConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=2, hidden_dim=64,
                                                      max_position_embeddings=32, pad_token_id=0)))


def _vit():
    from transformers import ViTConfig, ViTForImageClassification

    model = ViTForImageClassification(ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                                intermediate_size=64, image_size=16, patch_size=8, num_channels=3,
                                                num_labels=5))

    def inputs(ids):
        g = torch.Generator().manual_seed(int(ids.sum()))
        return {"pixel_values": torch.randn(ids.shape[0], 3, 16, 16, generator=g), "labels": ids[:, 0] % 5}

    def losses(m, inp):
        return F.cross_entropy(m(pixel_values=inp["pixel_values"]).logits.float(), inp["labels"], reduction="none")
    return model, inputs, losses


def _whisper():
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    cfg = WhisperConfig(vocab_size=VOCAB, num_mel_bins=8, d_model=32, encoder_layers=1, decoder_layers=1,
                        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                        max_source_positions=8, max_target_positions=16, pad_token_id=0, bos_token_id=0,
                        eos_token_id=0, decoder_start_token_id=0)
    model = WhisperForConditionalGeneration(cfg)

    def inputs(ids):
        g = torch.Generator().manual_seed(int(ids.sum()))
        return {"input_features": torch.randn(ids.shape[0], 8, 16, generator=g), "decoder_input_ids": ids}

    def losses(m, inp):
        return _token_losses(m(**inp).logits, inp["decoder_input_ids"])
    return model, inputs, losses


def _seq2seq(config_cls: str, model_cls: str, **cfg):
    def build():
        import transformers

        model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(vocab_size=VOCAB, **cfg))

        def inputs(ids):
            return {"input_ids": ids, "decoder_input_ids": ids}

        def losses(m, inp):
            return _token_losses(m(**inp).logits, inp["decoder_input_ids"])
        return model, inputs, losses
    return build


def _clip():
    from transformers import CLIPConfig, CLIPModel

    model = CLIPModel(CLIPConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=16),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=16, patch_size=8), projection_dim=16))

    def inputs(ids):
        g = torch.Generator().manual_seed(int(ids.sum()))
        return {"input_ids": ids, "pixel_values": torch.randn(ids.shape[0], 3, 16, 16, generator=g)}

    def losses(m, inp):
        # each pair's own similarity (scaled by the model's own logit_scale): the contrastive loss over the batch
        # reads other examples and has no per-example gradient
        return -m(**inp).logits_per_text.diagonal().float()
    return model, inputs, losses


def _lora(build):
    def wrapped():
        from peft import LoraConfig, get_peft_model

        model, inputs, losses = build()
        name = type(model).__name__
        targets = ["c_attn"] if "GPT2" in name else ["q", "v"] if name.startswith("T5") else ["q_proj", "v_proj"]
        return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0,
                                                fan_in_fan_out="GPT2" in type(model).__name__)), inputs, losses
    return wrapped


def _peft(build, config: str, **kw):
    def wrapped():
        import peft

        model, inputs, losses = build()
        return peft.get_peft_model(model, getattr(peft, config)(**kw)), inputs, losses
    return wrapped


def exact_ready(model: nn.Module) -> nn.Module:
    """float64, dropout off (brute force and the private pass must see one function), eager mixture-of-experts
    kernels (the grouped matmul has no float64 kernel on CPU), and every adapter factor non-zero."""
    model = model.double().train()
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
        for name, value in list(vars(m).items()):
            if "dropout" in name and isinstance(value, float):
                setattr(m, name, 0.0)
        cfg = getattr(m, "config", None)
        if cfg is not None and getattr(cfg, "_experts_implementation", None) not in (None, "eager"):
            cfg._experts_implementation = "eager"
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    return model


FAMILIES = {
    "gpt2": _gpt2,
    "llama": _causal("LlamaConfig", "LlamaForCausalLM"),
    "mistral": _causal("MistralConfig", "MistralForCausalLM"),
    "qwen2": _causal("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": _causal("Qwen3Config", "Qwen3ForCausalLM", head_dim=16),
    "phi3": _causal("Phi3Config", "Phi3ForCausalLM"),
    "gpt_neox": _neox,
    "opt": opt,
    "gemma2": _causal("Gemma2Config", "Gemma2ForCausalLM", head_dim=16),
    "gemma3": _causal("Gemma3TextConfig", "Gemma3ForCausalLM", head_dim=16),
    "bert": _masked("BertConfig", "BertForMaskedLM"),
    "roberta": _masked("RobertaConfig", "RobertaForMaskedLM"),
    "distilbert": _distilbert,
    "vit": _vit,
    "whisper": _whisper,
    "mixtral": _causal("MixtralConfig", "MixtralForCausalLM", num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": _causal("Qwen3MoeConfig", "Qwen3MoeForCausalLM", head_dim=16, num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=32),
    "t5": _seq2seq("T5Config", "T5ForConditionalGeneration", d_model=32, d_kv=16, d_ff=64, num_layers=1,
                   num_decoder_layers=1, num_heads=2, decoder_start_token_id=0, pad_token_id=0),
    "bart": _seq2seq("BartConfig", "BartForConditionalGeneration", d_model=32, encoder_layers=1, decoder_layers=1,
                     encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                     max_position_embeddings=32, pad_token_id=0, bos_token_id=0, eos_token_id=0,
                     decoder_start_token_id=0),
    "clip": _clip,
    # parallel attention: the MLP's last linear layer's output is added to in place (mlp_output += attention_output)
    "falcon": _causal("FalconConfig", "FalconForCausalLM", num_kv_heads=1, parallel_attn=True),
    "lora_gpt2": _lora(_gpt2),
    "lora_llama": _lora(_causal("LlamaConfig", "LlamaForCausalLM")),
    "lora_mistral": _lora(_causal("MistralConfig", "MistralForCausalLM")),
    "lora_qwen2": _lora(_causal("Qwen2Config", "Qwen2ForCausalLM")),
    "lora_opt": _lora(opt),
    "lora_t5": _lora(_seq2seq("T5Config", "T5ForConditionalGeneration", d_model=32, d_kv=16, d_ff=64, num_layers=1,
                              num_decoder_layers=1, num_heads=2, decoder_start_token_id=0, pad_token_id=0)),
    # adapters whose parameters sit in nn.ParameterDict children used by the parent's forward
    "ia3_llama": _peft(_causal("LlamaConfig", "LlamaForCausalLM"), "IA3Config",
                       target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"]),
    "lora_embedding_llama": _peft(_causal("LlamaConfig", "LlamaForCausalLM"), "LoraConfig", r=4,
                                  target_modules=["embed_tokens", "q_proj"], lora_dropout=0.0),
}
