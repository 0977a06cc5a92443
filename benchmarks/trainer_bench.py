"""DPTrainer against the plain ``transformers.Trainer`` on the docs' tiny model: seconds per step of a short run.

Run: ``OMP_NUM_THREADS=1 python benchmarks/trainer_bench.py [--steps 20] [--rounds 3]`` (needs the ``hf`` extra).
The model, data and arguments are the "Fine-tune a Hugging Face model" page's: GPT-2 (vocabulary 1000, 64
positions, 2 layers, width 64, 4 heads) with LoRA rank 8 on ``c_attn``, 256 sequences of 32 tokens, micro-batches of
32, 2 accumulation steps, learning rate 5e-3, a log line every 2 steps (DPTrainer's holds epsilon), no checkpoints,
no progress bar.  ``PrivacyArguments(target_epsilon=8)`` with the default estimator.  Each run trains ``--steps``
optimizer steps in a fresh process; plain and private alternate, ``--rounds`` times.  A run's time is ``train()``'s
wall time (the first step's checks included, construction and calibration excluded; the last column adds them for
the private run), divided by the steps; medians over rounds, and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

SCRIPT = r"""
import json, sys, time, warnings
import torch
warnings.simplefilter("ignore")
from peft import LoraConfig, get_peft_model
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from transformers.utils import logging
logging.set_verbosity_error()
private, steps, out, extra = sys.argv[1] == "private", int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
torch.manual_seed(0)
gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=1000, n_positions=64, n_layer=2, n_embd=64, n_head=4))
model = get_peft_model(gpt2, LoraConfig(r=8, target_modules=["c_attn"], fan_in_fan_out=True, lora_dropout=0.0))
tokens = torch.randint(0, 1000, (256, 32))
examples = [{"input_ids": row, "labels": row} for row in tokens]
args = TrainingArguments(output_dir=out, per_device_train_batch_size=32, gradient_accumulation_steps=2,
                         max_steps=steps, learning_rate=5e-3, logging_steps=2, save_strategy="no", report_to=[],
                         use_cpu=True, disable_tqdm=True)
start = time.perf_counter()
if private:
    from dpsgd.hf import DPTrainer, PrivacyArguments
    trainer = DPTrainer(model=model, args=args, train_dataset=examples,
                        privacy=PrivacyArguments(max_grad_norm=1.0, target_epsilon=8.0, target_delta=1e-5, **extra))
else:
    trainer = Trainer(model=model, args=args, train_dataset=examples)
built = time.perf_counter()
trainer.train()
done = time.perf_counter()
print(json.dumps({"train": done - built, "build": built - start}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--privacy", default="{}", metavar="JSON",
                        help='more PrivacyArguments, e.g. \'{"estimator": "hutch", "projection_dim": 16}\'')
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {"plain": [], "private": []}
    for _ in range(args.rounds):
        for kind in runs:
            out = subprocess.run([sys.executable, "-c", SCRIPT, kind, str(args.steps), "/tmp/trainer_bench_out",
                                  args.privacy],
                                 capture_output=True, text=True, check=True)
            runs[kind].append(json.loads(out.stdout.strip().splitlines()[-1]))
    per = {k: statistics.median(r["train"] for r in v) / args.steps for k, v in runs.items()}
    build = statistics.median(r["build"] for r in runs["private"])
    print(f"docs' tiny GPT-2 + LoRA r8, {args.steps} optimizer steps (2 micro-batches of 32), log every 2 steps; "
          f"median of {args.rounds} fresh processes each, alternated; PrivacyArguments extra: {args.privacy}")
    print(f"{'trainer':<12} {'s / step':>9} {'ratio':>6}  {'construction s':>15}")
    print(f"{'Trainer':<12} {per['plain']:>9.4f} {1.0:>6.2f}")
    print(f"{'DPTrainer':<12} {per['private']:>9.4f} {per['private'] / per['plain']:>6.2f}  {build:>15.2f}")


if __name__ == "__main__":
    main()
