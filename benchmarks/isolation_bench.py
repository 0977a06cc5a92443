"""Cost of example isolation by structure: a training step (forward and backward, non-private) with and without
the ExampleTracker following the batch through the forward, on Hugging Face decoders built from configs.

Alternates A (plain) and B (tracked) steps and prints median times and their ratio, per model.  The tracker's
cost is Python work per ATen operation of the forward (the backward runs outside it), so it shrinks with width
and sequence length.

    OMP_NUM_THREADS=1 python benchmarks/isolation_bench.py            # CPU, tiny widths
    python benchmarks/isolation_bench.py --device cuda --real         # GPT-2 small and Llama-1B widths
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

from dpsgd.isolation import ExampleTracker


def _models(real: bool):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    if real:
        yield "gpt2-small T1024 B8", lambda: GPT2LMHeadModel(GPT2Config(n_positions=1024)), 8, 1024, 50257
        for t in (2048, 4096):
            yield (f"llama-1B T{t} B1", lambda t=t: LlamaForCausalLM(LlamaConfig(
                vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=t)), 1, t, 32000)
    else:
        yield "gpt2 w128 T64 B8", lambda: GPT2LMHeadModel(GPT2Config(n_embd=128, n_layer=2, n_head=2,
                                                                      n_positions=64, vocab_size=1000)), 8, 64, 1000
        yield "llama w128 T128 B4", lambda: LlamaForCausalLM(LlamaConfig(
            vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128)), 4, 128, 1000


def _step(model, ids, tracker):
    if tracker is not None:
        tracker.push()
        tracker.register(ids)
    try:
        loss = model(input_ids=ids, labels=ids).loss
    finally:
        if tracker is not None:
            tracker.pop()
    loss.backward()
    model.zero_grad(set_to_none=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--real", action="store_true", help="GPT-2 small and Llama-1B widths (a GPU)")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    print(f"device {device} ({torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}), {dtype}")
    print(f"{'model':24s} {'plain s':>9s} {'tracked s':>10s} {'ratio':>6s}")
    for name, build, b, t, vocab in _models(args.real):
        torch.manual_seed(0)
        model = build().to(device=device, dtype=dtype).train()
        ids = torch.randint(0, vocab, (b, t), device=device)
        tracker = ExampleTracker()
        times = {"plain": [], "tracked": []}
        for i in range(args.repeats + 2):
            for key, tr in (("plain", None), ("tracked", tracker)):
                if device.type == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                _step(model, ids, tr)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                if i >= 2:
                    times[key].append(time.perf_counter() - start)
        plain, tracked = statistics.median(times["plain"]), statistics.median(times["tracked"])
        print(f"{name:24s} {plain:9.4f} {tracked:10.4f} {tracked / plain:6.2f}")
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
