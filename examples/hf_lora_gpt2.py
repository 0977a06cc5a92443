"""Fine-tune a tiny random GPT-2 with LoRA and DP-SGD-RC through the Hugging Face Trainer, on CPU.

Synthetic text: each example repeats a short random "phrase" of token ids; a model that learns the task
predicts the second half of every example from its first.  Nothing is downloaded.

    pip install torch==2.13.0 && pip install -e ".[hf]"
    python examples/hf_lora_gpt2.py            # about 16 seconds on 2 cores (epsilon 8, 48 steps)
"""

from __future__ import annotations

import argparse
import math

import torch
from peft import LoraConfig, get_peft_model
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

from dpsgd.hf import DPTrainer, PrivacyArguments

VOCAB = 16


class Repeats(Dataset):
    """``n`` sequences ``[phrase, phrase]`` of random token ids (labels = input ids: causal LM)."""

    def __init__(self, n: int, vocab: int, half: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        phrase = torch.randint(1, vocab, (n, half), generator=g)
        self.ids = torch.cat([phrase, phrase], dim=1)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main(argv: list[str] | None = None) -> float:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--train", type=int, default=2048)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--epsilon", type=float, default=8.0)
    ap.add_argument("--out", default="hf-lora-gpt2-out")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=64, n_layer=2, n_head=4,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                       eos_token_id=0))
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn", "c_fc"],
                                             lora_dropout=0.0, fan_in_fan_out=True))
    train, held_out = Repeats(args.train, VOCAB, 4, seed=1), Repeats(256, VOCAB, 4, seed=2)
    training_args = TrainingArguments(output_dir=args.out, per_device_train_batch_size=64,
                                      gradient_accumulation_steps=2, num_train_epochs=args.epochs,
                                      learning_rate=2e-2, logging_steps=8, save_strategy="no", report_to=[],
                                      use_cpu=True, disable_tqdm=True)
    trainer = DPTrainer(model=model, args=training_args, train_dataset=train,
                        privacy=PrivacyArguments(max_grad_norm=1.0, target_epsilon=args.epsilon,
                                                 target_delta=1e-5, estimator="hutch", projection_dim=16))
    trainer.train()
    engine = trainer.privacy_engine
    # the loss on held-out examples: the training loss is a statistic of the private batches without noise, which
    # DPTrainer does not log (PrivacyArguments(log_nonprivate_metrics=True) would, outside epsilon)
    held_out_loss = trainer.evaluate(eval_dataset=held_out)["eval_loss"]
    print(f"held-out loss {held_out_loss:.3f} (a uniform guess scores ln {VOCAB} = {math.log(VOCAB):.3f})")
    eps = engine.get_epsilon(1e-5)
    print(f"steps {engine.steps}, noise multiplier {engine.noise_multiplier:.3f}, "
          f"epsilon {eps:.3f} <= {args.epsilon} at delta 1e-5")
    return eps


if __name__ == "__main__":
    main()
