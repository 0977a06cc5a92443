"""Cost of example isolation by structure: a training step (forward and backward, non-private) with and without
the ExampleTracker following the batch through the forward, on Hugging Face decoders built from configs.

Alternates plain steps, steps under a dispatch mode that does nothing (the floor of any per-operation Python
check), and tracked steps; prints median times and the ratios to plain, per model.  The tracker's cost is
Python work per ATen operation of the forward (the backward runs outside it): where the plain step is already
bound by the host launching kernels (a GPU at batch 1), every microsecond per operation shows.

    OMP_NUM_THREADS=1 python benchmarks/isolation_bench.py            # CPU, tiny widths
    python benchmarks/isolation_bench.py --device cuda --real         # GPT-2 small and Llama-1B widths
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dpsgd.isolation import ExampleTracker


class _Null(TorchDispatchMode):
    """A dispatch mode that only runs each operation: the cost every per-operation Python check pays."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **kwargs) if kwargs else func(*args)


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


def _step(model, ids, mode):
    if isinstance(mode, ExampleTracker):
        mode.push()
        mode.register(ids)
    elif mode is not None:
        mode.__enter__()
    try:
        loss = model(input_ids=ids).logits.float().mean()
    finally:
        if isinstance(mode, ExampleTracker):
            mode.pop()
        elif mode is not None:
            mode.__exit__(None, None, None)
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
    print(f"{'model':24s} {'plain s':>9s} {'null mode':>10s} {'tracked s':>10s} {'null/plain':>10s} "
          f"{'tracked/plain':>13s}")
    for name, build, b, t, vocab in _models(args.real):
        torch.manual_seed(0)
        model = build().to(device=device, dtype=dtype).train()
        ids = torch.randint(0, vocab, (b, t), device=device)
        modes = (("plain", None), ("null", _Null()), ("tracked", ExampleTracker()))
        times = {key: [] for key, _ in modes}
        for i in range(args.repeats + 2):
            for key, tr in modes:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                _step(model, ids, tr)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                if i >= 2:
                    times[key].append(time.perf_counter() - start)
        plain, null, tracked = (statistics.median(times[k]) for k in ("plain", "null", "tracked"))
        print(f"{name:24s} {plain:9.4f} {null:10.4f} {tracked:10.4f} {null / plain:10.2f} {tracked / plain:13.2f}")
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
