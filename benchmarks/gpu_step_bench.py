"""One whole training step on a CUDA GPU at Llama-3.2-1B widths: non-private, DP-SGD with each of our estimators,
and Opacus' ghost clipping (when opacus is installed), in bf16.

The model is Hugging Face's Llama at Llama-3.2-1B's shape (hidden 2048, MLP 8192, 32 heads, 8 KV heads, head
dimension 64, vocabulary 128256, tied embeddings, RoPE theta 500000), with ``--layers`` decoder layers (16 is the
whole model) and random weights, built on the GPU.  Precision, ``--precision``:

* ``autocast``: float32 parameters under ``torch.autocast("cuda", torch.bfloat16)`` (what Hugging Face's
  ``Trainer(bf16=True)`` runs);
* ``bf16``: bfloat16 parameters, no autocast (the clipped sums are float32 in the private step: rounding a sum to
  bf16 before the noise could move it by more than the clip bound).

Causal-LM next-token losses, one mean per example, SGD.  Every (T, precision, method) is measured in this one
process, method after method (round-robin over ``--rounds``): the model and optimizer are built anew, two warm-up
steps (a private trainer's first step always runs its row check), then ``--steps`` timed steps, each ended by
``torch.cuda.synchronize()``.  "mean s" pools every timed step of every round; "at rate" is the expected seconds
per step with a fraction ``check_rate`` of the steps checked, as in ``step_bench.py``.  Memory is
``torch.cuda.max_memory_allocated`` above what is allocated just before the first warm-up step (the model, the
optimizer and the batch): "peak GB" over all steps including the warm-up's checked first step, "steady GB" over
the timed steps only.  Ratios are against non-private of the same T and precision, in the same run.

    python benchmarks/gpu_step_bench.py --layers 16 --seq-len 2048 8192 --batch 4 1 --precision autocast bf16
"""

import argparse
import gc
import statistics
import sys
import time
import warnings

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from step_bench import LM, count_checks, endless, lm_loss  # noqa: E402

METHODS = ["non-private", "hutch", "hutchpp", "ghost", "exact", "hutch-untracked", "opacus-ghost"]


def build(layers: int, t: int, device: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=layers,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, rope_theta=500000.0,
                         max_position_embeddings=max(t, 2048), tie_word_embeddings=True, bos_token_id=0,
                         eos_token_id=0, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM(config)


class _NoMemory:
    """The CPU dry run's stand-in for torch.cuda's memory counters."""

    @staticmethod
    def memory_allocated() -> int:
        return 0

    max_memory_allocated = memory_allocated

    @staticmethod
    def reset_peak_memory_stats() -> None:
        pass


def one(method: str, layers: int, t: int, batch: int, steps: int, precision: str, check_times: list,
        device: str) -> dict:
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from dpsgd import PrivacyEngine

    model = build(layers, t, device)
    cuda = device == "cuda"
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    model.train()
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (batch * 8, t), generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(ids, ids), batch_size=batch, shuffle=True)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    crit = nn.CrossEntropyLoss()
    if method == "opacus-ghost":
        from opacus import PrivacyEngine as OpacusEngine
        model, opt, crit, loader = OpacusEngine().make_private(
            module=model, optimizer=opt, data_loader=loader, criterion=crit, noise_multiplier=1.0,
            max_grad_norm=1.0, grad_sample_mode="ghost", poisson_sampling=False)
    elif method != "non-private":
        engine = PrivacyEngine()
        model, opt, crit, loader = engine.make_private(
            module=model, optimizer=opt, data_loader=loader, criterion=crit, max_grad_norm=1.0,
            noise_multiplier=1.0, estimator=method.removesuffix("-untracked"), projection_dim=32,
            batch_sampling="fixed_size", seed=0)
        # every private method proves isolation on every step (the tracker) but hutch-untracked, which only samples
        # it with the row check: their difference is the tracker's cost
        engine._track_examples = not method.endswith("-untracked")   # no public switch: the tracker measured off
        engine._set_checks()
    lm = LM(model)
    batches = endless(loader)

    def step():
        x, y = next(batches)
        x, y = x.to(device), y.to(device)
        opt.zero_grad()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=precision == "autocast"):
            logits = lm(x)[:, :-1]
        lm_loss(method, crit, logits, y[:, 1:], vocab).backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize()

    memory = torch.cuda if cuda else _NoMemory
    base = memory.memory_allocated()
    memory.reset_peak_memory_stats()
    step()
    step()
    warm_peak = memory.max_memory_allocated() - base
    memory.reset_peak_memory_stats()
    times, checked = [], []
    for _ in range(steps):
        n = len(check_times)
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
        checked.append(len(check_times) > n)
    steady = memory.max_memory_allocated() - base
    return {"times": times, "checked": checked, "peak_gb": max(warm_peak, steady) / 2**30, "steady_gb": steady / 2**30}


def main() -> None:
    import torch

    from dpsgd.capture import DEFAULT_CHECK_RATE as rate

    warnings.filterwarnings("ignore")
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--seq-len", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--batch", type=int, nargs="+", default=[4, 1], help="one batch size per T")
    ap.add_argument("--precision", nargs="+", default=["autocast"], choices=["autocast", "bf16"])
    ap.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script (memory columns read 0)")
    args = ap.parse_args()
    if len(args.batch) != len(args.seq_len):
        ap.error("--batch takes one batch size per --seq-len")
    methods = list(dict.fromkeys(["non-private", *args.methods]))
    try:
        import opacus  # noqa: F401
    except ImportError:
        methods = [m for m in methods if m != "opacus-ghost"]
    check_times = count_checks()
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    if args.device == "cuda":   # whether half-precision clipped sums run on the half-precision kernel
        from dpsgd.handler import wide_kernel_available

        dev = torch.device("cuda", torch.cuda.current_device())
        name += f" (bf16 kernel with a float32 result: {wide_kernel_available(dev, torch.bfloat16)})"
    print(f"{name}, torch {torch.__version__}; {args.steps} timed steps per run after 2 "
          f"warm-up steps, {args.rounds} round-robin rounds; 'at rate': expected s/step with a fraction {rate} of "
          f"the steps checked; memory: torch.cuda.max_memory_allocated above the model, optimizer and batch",
          flush=True)
    for t, b in zip(args.seq_len, args.batch, strict=True):
        for precision in args.precision:
            runs = {m: [] for m in methods}
            for _ in range(args.rounds):
                for m in methods:
                    if runs[m] and "error" in runs[m][-1]:
                        continue
                    try:
                        runs[m].append(one(m, args.layers, t, b, args.steps, precision, check_times, args.device))
                        r = runs[m][-1]
                        print(f"  {m} T={t} B={b} {precision}: steps " + " ".join(f"{x:.3f}" for x in r["times"]) +
                              f" s, peak {r['peak_gb']:.2f} GB, steady {r['steady_gb']:.2f} GB", flush=True)
                    except Exception as e:  # noqa: BLE001 - a refusal or an out-of-memory is a row of the table
                        runs[m].append({"error": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"})
                    gc.collect()
                    if args.device == "cuda":
                        torch.cuda.empty_cache()
            print(f"\nLlama-3.2-1B widths, {args.layers} layers, T = {t}, B = {b}, {precision}")
            print(f"| {'method':<12} | {'mean s':>7} | {'ratio':>5} | {'checked':>7} | {'at rate':>7} | {'ratio':>5} | "
                  f"{'peak GB':>7} | {'ratio':>5} | {'steady GB':>9} | {'ratio':>5} |")
            print("|" + "|".join("-" * (w + 2) for w in (12, 7, 5, 7, 7, 5, 7, 5, 9, 5)) + "|")
            res = {}
            for m in methods:
                if "error" in runs[m][-1]:
                    res[m] = runs[m][-1]
                    continue
                times = [x for r in runs[m] for x in r["times"]]
                checked = [c for r in runs[m] for c in r["checked"]]
                on = [x for x, c in zip(times, checked, strict=True) if c]
                off = [x for x, c in zip(times, checked, strict=True) if not c]
                res[m] = {"mean": statistics.mean(times), "checked": f"{sum(checked)}/{len(checked)}",
                          "expected": (1 - rate) * statistics.mean(off) + rate * statistics.mean(on)
                          if on and off else None,
                          "peak": statistics.median(r["peak_gb"] for r in runs[m]),
                          "steady": statistics.median(r["steady_gb"] for r in runs[m])}
            base = res.get("non-private", {})
            for m in methods:
                r = res[m]
                if "error" in r or "error" in base:
                    print(f"| {m:<12} | failed: {r.get('error', base.get('error'))} |")
                    continue
                e = r["expected"]
                at_rate = f"{'-':>7} | {'-':>5}" if e is None else f"{e:>7.4f} | {e / base['mean']:>5.2f}"
                print(f"| {m:<12} | {r['mean']:>7.4f} | {r['mean'] / base['mean']:>5.2f} | {r['checked']:>7} | "
                      f"{at_rate} | {r['peak']:>7.2f} | {r['peak'] / max(base['peak'], 1e-9):>5.2f} | "
                      f"{r['steady']:>9.2f} | {r['steady'] / max(base['steady'], 1e-9):>5.2f} |", flush=True)


if __name__ == "__main__":
    main()
