"""Private preference optimization with TRL's DPOTrainer: a tiny random GPT-2 with LoRA, on CPU, nothing downloaded.

The task: each prompt is a few words; the chosen completion is the same words reversed, the rejected one the words
as they are.  A preference pair (prompt, chosen, rejected) is one example of the privacy accounting.  The reference
model is the model with its LoRA adapters disabled (TRL's choice for a PEFT model).  The held-out reward accuracy
is the fraction of held-out pairs whose chosen completion the model prefers over the reference more than the
rejected one (0 untrained: with the adapters at zero the
model is the reference, every pair a tie).

    pip install torch==2.13.0 && pip install -e ".[trl]"
    python examples/trl_dpo.py                    # about a minute on 2 cores (epsilon 8, 2 epochs)
    python examples/trl_dpo.py --train 256 --epochs 1
"""

from __future__ import annotations

import argparse
import warnings

import torch
from datasets import Dataset
from peft import LoraConfig
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast
from trl import DPOConfig

from dpsgd.hf import PrivacyArguments
from dpsgd.trl import DPDPOTrainer

WORDS = 24

# TRL calls transformers' gradient-checkpointing helpers by their names before transformers 5 renamed them
warnings.filterwarnings("ignore", message=".*gradient_checkpointing.* is deprecated", category=FutureWarning)


def word_tokenizer() -> PreTrainedTokenizerFast:
    """Words ``w3 .. w{WORDS+2}``, one token each (``[PAD]`` 0, ``[UNK]`` 1, ``[EOS]`` 2), built here."""
    vocab = {"[PAD]": 0, "[UNK]": 1, "[EOS]": 2, **{f"w{i}": i for i in range(3, WORDS + 3)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="[PAD]", unk_token="[UNK]", eos_token="[EOS]")


def tiny_gpt2() -> GPT2LMHeadModel:
    return GPT2LMHeadModel(GPT2Config(vocab_size=WORDS + 3, n_positions=32, n_embd=64, n_layer=2, n_head=4,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=2,
                                      eos_token_id=2, pad_token_id=0))


def preferences(n: int, seed: int) -> Dataset:
    """``n`` pairs: 2 to 5 random words; chosen: reversed, rejected: as they are."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        k = int(torch.randint(2, 6, (), generator=g))
        words = [f"w{int(i)}" for i in torch.randint(3, WORDS + 3, (k,), generator=g)]
        rows.append({"prompt": " ".join(words), "chosen": " " + " ".join(reversed(words)),
                     "rejected": " " + " ".join(words)})
    return Dataset.from_list(rows)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--train", type=int, default=2048)
    ap.add_argument("--epochs", type=float, default=2)
    ap.add_argument("--epsilon", type=float, default=8.0)
    ap.add_argument("--seed", type=int, default=None,
                    help="reproducible batches and noise, for tests: not private against whoever holds the seed")
    ap.add_argument("--out", default="trl-dpo-out")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    config = DPOConfig(output_dir=args.out, per_device_train_batch_size=64, gradient_accumulation_steps=2,
                       num_train_epochs=args.epochs, learning_rate=2e-2, beta=0.5, logging_steps=8,
                       save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, max_length=16)
    trainer = DPDPOTrainer(model=tiny_gpt2(), args=config, train_dataset=preferences(args.train, seed=1),
                           eval_dataset=preferences(256, seed=2), processing_class=word_tokenizer(),
                           peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn", "c_fc"],
                                                  lora_dropout=0.0, fan_in_fan_out=True),
                           privacy=PrivacyArguments(max_grad_norm=1.0, target_epsilon=args.epsilon, seed=args.seed))
    before = trainer.evaluate()
    trainer.train()
    after = trainer.evaluate()
    engine = trainer.privacy_engine
    result = {"loss_before": before["eval_loss"], "loss_after": after["eval_loss"],
              "accuracy_before": before["eval_rewards/accuracies"], "accuracy_after": after["eval_rewards/accuracies"],
              "steps": engine.steps, "epsilon": engine.get_epsilon(1e-5)}
    print(f"held-out DPO loss {result['loss_before']:.3f} -> {result['loss_after']:.3f}, reward accuracy "
          f"{result['accuracy_before']:.3f} -> {result['accuracy_after']:.3f}")
    print(f"steps {engine.steps}, noise multiplier {engine.noise_multiplier:.3f}, "
          f"epsilon {result['epsilon']:.3f} <= {args.epsilon} at delta 1e-5")
    return result


if __name__ == "__main__":
    main()
