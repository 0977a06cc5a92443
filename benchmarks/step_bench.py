"""One whole training step on CPU: non-private, DP-SGD with each of our estimators (book-keeping, and Hutchinson
with the two-pass clipped sum), and Opacus' ghost clipping (when opacus is installed).

Models (random weights, built from configs): the tiny Llama-style decoder of ``dpsgd.demo``; tiny Hugging Face
GPT-2 (tied embeddings) and Llama; a Llama-shaped decoder for long contexts (``llama-long``, hidden 256, T up
to 8192); a CNN with Conv2d + GroupNorm on 32x32 images (``cnn``).

Each (model, T, method) runs in a fresh process with OMP_NUM_THREADS=1: two warm-up steps, then ``--steps``
timed steps; the methods are run round-robin (A B C ... A B C ...) for ``--rounds`` rounds, so that load on
the shared machine hits every method alike.  Two times are reported: the **mean** seconds per step over every
timed step of every round (pooled), and the median over rounds of each process's **median** step.  The mean
is the one to read for the private methods: the trainer's row check (one extra backward of a weighted half of
the losses, two on a new layout of calls) runs on a random eighth of the steps by default
(``engine.check_rate``), which the median hides.  ``hutch-every-step`` is hutch with
``engine.check_every_step = True`` (every step checked).  Every private method runs with isolation proved on
every step by the tracker (always on for users) except ``hutch-untracked``, which turns it
off (isolation then only sampled by the row check): their difference is the tracker's cost.
The "checked" column counts the timed steps that ran the row check (over all rounds), and "check s" is the
mean time spent in the check's backward(s) on those steps.  Since the number of checked steps is itself random,
"at rate" gives the expected seconds per step at the default ``check_rate`` r: (1 - r) times the mean of the
unchecked timed steps plus r times the mean of the checked ones (with its ratio to non-private's mean).
"peak MB" is the growth of the process's peak resident memory (``ru_maxrss``, a high-water mark) from just
before the first warm-up step to the end of the last timed step, median over rounds: what the steps add on
top of the model, optimizer and data.  It includes the first step, which the private trainer always checks
(a new layout of calls: two check passes).  Ratios are against the non-private step of the same model and T,
measured in the same run.  Batches come from each method's own
data loader (the private ones: fixed-size batches, ``batch_sampling="fixed_size"``, Opacus' ``poisson_sampling=False``,
so that every step has the same size).

    python benchmarks/step_bench.py                                   # tiny, gpt2, llama, cnn
    python benchmarks/step_bench.py --models llama-long --seq-len 512 2048 4096 --batch 2 --steps 3
    python benchmarks/step_bench.py --models llama-long --seq-len 2048 --batch 2 --steps 3 \
        --methods non-private hutch compiled-non-private compiled-hutch      # torch.compile (inductor)
    python benchmarks/step_bench.py --models mixtral --methods non-private hutch exact   # mixture of experts
    python benchmarks/step_bench.py --models llama-1b-width --batch 1 --steps 2 --rounds 1   # real widths
    python benchmarks/step_bench.py --models gpt2-small-width --batch 4 --steps 2 --rounds 1

``compiled-*`` compiles the model with ``torch.compile`` (inductor) before ``make_private``; the compile happens in
the two warm-up steps and is not timed.  Ratios are against the eager non-private step; compare
``compiled-hutch`` with ``compiled-non-private`` for the privacy overhead under compilation.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
import warnings

METHODS = ["non-private", "exact", "ghost", "hutch", "hutchpp", "hutch-two-pass", "hutch-every-step",
           "hutch-untracked", "opacus-ghost", "compiled-non-private", "compiled-hutch"]
MODELS = {"tiny": "tiny Llama-style decoder (dim 256, 2 layers, vocab 256; dpsgd.demo's classification task)",
          "gpt2": "HF GPT-2 (n_embd 128, 2 layers, vocab 1000, tied)",
          "llama": "HF Llama (hidden 128, 2 layers, vocab 1000, untied)",
          "cnn": "CNN on 32x32 RGB, 10 classes: 4 Conv2d (32-64 channels) each with GroupNorm, SiLU, linear head",
          "llama-long": "HF Llama-shaped decoder (hidden 256, MLP 688, 2 layers, 4 heads, vocab 1000, untied)",
          "mixtral": "HF Mixtral-shaped mixture of experts (hidden 128, 4 experts of MLP 344, top 2, 2 layers, "
                     "vocab 1000)",
          "llama-1b-width": "HF Llama at Llama-3.2-1B widths (hidden 2048, MLP 8192, 32 heads, 8 KV heads, vocab "
                            "32000, untied), 1 layer",
          "gpt2-small-width": "HF GPT-2 at GPT-2-small widths (768, 12 heads, vocab 50257, tied), 2 layers"}


def build(model: str, t: int):
    import torch

    torch.manual_seed(0)
    if model == "cnn":
        from torch import nn

        def block(i, o, s):
            return [nn.Conv2d(i, o, 3, stride=s, padding=1), nn.GroupNorm(8, o), nn.SiLU()]
        return nn.Sequential(*block(3, 32, 1), *block(32, 64, 2), *block(64, 64, 1), *block(64, 64, 2),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10)), 10
    if model == "tiny":
        from dpsgd.demo import TinyLlama

        return TinyLlama(256, t, dim=256, heads=4, layers=2), 256
    import logging

    logging.getLogger("transformers").setLevel(logging.ERROR)
    if model == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        return GPT2LMHeadModel(GPT2Config(vocab_size=1000, n_positions=t, n_embd=128, n_layer=2, n_head=4,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                          eos_token_id=0)), 1000
    from transformers import LlamaConfig, LlamaForCausalLM

    if model == "llama-1b-width":
        return LlamaForCausalLM(LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=8192,
                                            num_hidden_layers=1, num_attention_heads=32, num_key_value_heads=8,
                                            max_position_embeddings=t, tie_word_embeddings=False, bos_token_id=0,
                                            eos_token_id=0)), 32000
    if model == "gpt2-small-width":
        from transformers import GPT2Config, GPT2LMHeadModel

        return GPT2LMHeadModel(GPT2Config(vocab_size=50257, n_positions=t, n_embd=768, n_layer=2, n_head=12,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)), 50257
    if model == "mixtral":
        from transformers import MixtralConfig, MixtralForCausalLM

        return MixtralForCausalLM(MixtralConfig(vocab_size=1000, hidden_size=128, intermediate_size=344,
                                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                                num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=t,
                                                tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)), 1000
    if model == "llama-long":
        return LlamaForCausalLM(LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=688,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                            max_position_embeddings=t, tie_word_embeddings=False, bos_token_id=0,
                                            eos_token_id=0)), 1000
    return LlamaForCausalLM(LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=t,
                                        tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)), 1000


def count_checks() -> list:
    """A list that receives the seconds of every row check the trainer runs from now on (it looks
    ``check_rows`` up in its module on every step)."""
    import dpsgd.rowcheck

    checks: list = []
    check_rows = dpsgd.rowcheck.check_rows

    def counted_check_rows(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return check_rows(*args, **kwargs)
        finally:
            checks.append(time.perf_counter() - t0)
    dpsgd.rowcheck.check_rows = counted_check_rows
    return checks


def endless(loader):
    """The loader's batches, epoch after epoch."""
    while True:
        yield from loader


def lm_loss(method: str, crit, logits, target, vocab: int):
    """Next-token loss as each method's criterion takes it."""
    if method == "non-private":
        return crit(logits.reshape(-1, vocab), target.reshape(-1))
    if method == "opacus-ghost":   # Opacus 1.6: flattened tokens and the logits' shape
        return crit(logits.reshape(-1, vocab), target.reshape(-1), shape=logits.shape)
    return crit(logits, target)    # ours: (B, T, V) logits, (B, T) targets, a mean per example


class LM:
    """Logits of a tiny decoder or an HF causal LM, as a plain tensor."""

    def __init__(self, model):
        self.model = model

    def __call__(self, ids):
        out = self.model(ids)
        return out.logits if hasattr(out, "logits") else out


def one(model_name: str, method: str, t: int, batch: int, steps: int) -> dict:
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from dpsgd import PrivacyEngine

    warnings.filterwarnings("ignore")
    checks = count_checks()
    model, vocab = build(model_name, t)
    model.train()
    if model_name == "tiny":   # the demo's classification task: logits (B, classes), targets (B,)
        from dpsgd.demo import marker_task

        data = marker_task(batch * 16, t, 256, 8, torch.Generator().manual_seed(0))
    elif model_name == "cnn":  # t is the image side
        gen = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(batch * 16, 3, t, t, generator=gen),
                             torch.randint(0, 10, (batch * 16,), generator=gen))
    else:                      # causal LM: next-token targets
        ids = torch.randint(0, vocab, (batch * 16, t), generator=torch.Generator().manual_seed(0))
        data = TensorDataset(ids, ids)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(data, batch_size=batch, shuffle=True)
    crit = nn.CrossEntropyLoss()
    if method.startswith("compiled-"):   # torch.compile (inductor) before make_private; compiled in the warm-up
        model = torch.compile(model)
        method = method.removeprefix("compiled-")
    if method == "opacus-ghost":
        from opacus import PrivacyEngine as OpacusEngine
        model, opt, crit, loader = OpacusEngine().make_private(
            module=model, optimizer=opt, data_loader=loader, criterion=crit, noise_multiplier=1.0,
            max_grad_norm=1.0, grad_sample_mode="ghost", poisson_sampling=False)
    elif method != "non-private":
        estimator = method.removesuffix("-two-pass").removesuffix("-every-step").removesuffix("-untracked")
        two_pass = method.endswith("-two-pass")
        engine = PrivacyEngine()
        model, opt, crit, loader = engine.make_private(
            module=model, optimizer=opt, data_loader=loader, criterion=crit, max_grad_norm=1.0,
            noise_multiplier=1.0, estimator=estimator, projection_dim=32, batch_sampling="fixed_size", seed=0,
            clipping_pass="two-pass" if two_pass else "bookkeeping")
        if method.endswith("-every-step"):
            engine.check_every_step = True
        if method.endswith("-untracked"):   # isolation checked by the sampled row check only
            engine._track_examples = False   # no public switch: the tracker measured off
        engine._set_checks()
    lm = LM(model)
    batches = endless(loader)

    def step():
        x, y = next(batches)
        opt.zero_grad()
        if model_name in ("tiny", "cnn"):
            crit(lm(x), y).backward()
            opt.step()
            return
        lm_loss(method, crit, lm(x)[:, :-1], y[:, 1:], vocab).backward()
        opt.step()
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    step()   # warm-up: a private trainer's first step is always checked (two passes), and counts in the peak
    step()
    times, checked, check_s = [], [], []
    for _ in range(steps):
        n = len(checks)
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
        checked.append(len(checks) > n)
        check_s.append(sum(checks[n:]))
    extra = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base   # the high-water mark over every step
    return {"seconds": statistics.median(times), "times": times, "checked": checked, "check_s": check_s,
            "extra_mb": extra / 1024}


def run(model: str, method: str, t: int, batch: int, steps: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, __file__, "--one", model, method, str(t), str(batch), str(steps)],
                         capture_output=True, text=True, env=env)
    if out.returncode:  # e.g. Opacus' ghost clipping refuses tied parameters
        return {"error": (out.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


DEFAULT_T = {"tiny": 512, "cnn": 32, "llama-long": 2048, "mixtral": 512, "llama-1b-width": 1024,
             "gpt2-small-width": 512}


def main() -> None:
    from dpsgd.capture import DEFAULT_CHECK_RATE as rate

    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["tiny", "gpt2", "llama", "cnn"], choices=list(MODELS))
    ap.add_argument("--seq-len", type=int, nargs="+", default=None,
                    help="T values (default: 512 tiny, 64 HF, 2048 llama-long; the image side for cnn: 32)")
    ap.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per process (after two warm-up steps)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--one", nargs=5)
    args = ap.parse_args()
    if args.one:
        model, method, t, b, steps = args.one
        print(json.dumps(one(model, method, int(t), int(b), int(steps))))
        return
    methods = list(dict.fromkeys(["non-private", *args.methods]))
    try:
        import opacus  # noqa: F401
    except ImportError:
        methods = [m for m in methods if m != "opacus-ghost"]
    print(f"batch {args.batch}, OMP_NUM_THREADS=1, {args.steps} timed steps per process after 2 warm-up steps, "
          f"{args.rounds} round-robin rounds.\n'mean s': the mean seconds per step over all timed steps of all "
          f"rounds; 'median s': the median over rounds of each process's median step; each with its ratio to "
          f"non-private.\n'checked': timed steps that ran the row check / timed steps; 'check s': the mean seconds "
          f"in the check's backward on those steps; 'at rate': the expected seconds per step when a fraction "
          f"{rate} of the steps is checked ((1 - r) x mean unchecked + r x mean checked), and its ratio to "
          f"non-private's mean.\n'peak MB': growth of peak resident memory (ru_maxrss) from "
          f"before the first warm-up step to the end of the timed steps, median over rounds, and its ratio to "
          f"non-private's")
    for model in args.models:
        for t in args.seq_len or [DEFAULT_T.get(model, 64)]:
            rounds = {m: [] for m in methods}
            for _ in range(args.rounds):
                for m in methods:
                    if not any("error" in r for r in rounds[m]):
                        rounds[m].append(run(model, m, t, args.batch, args.steps))
            res = {}
            for m in methods:
                err = next((r for r in rounds[m] if "error" in r), None)
                if err:
                    res[m] = err
                    continue
                times = [x for r in rounds[m] for x in r["times"]]
                checked = [c for r in rounds[m] for c in r["checked"]]
                check_s = [x for r in rounds[m] for x, c in zip(r["check_s"], r["checked"], strict=True) if c]
                on = [x for x, c in zip(times, checked, strict=True) if c]
                off = [x for x, c in zip(times, checked, strict=True) if not c]
                expected = None   # needs both kinds of step (not defined for every-step or non-private)
                if on and off:
                    expected = (1 - rate) * statistics.mean(off) + rate * statistics.mean(on)
                res[m] = {"mean": statistics.mean(times), "expected": expected,
                          "median": statistics.median(r["seconds"] for r in rounds[m]),
                          "extra_mb": statistics.median(r["extra_mb"] for r in rounds[m]),
                          "checked": f"{sum(checked)}/{len(checked)}",
                          "check_s": statistics.mean(check_s) if check_s else None}
            base = res["non-private"]
            print(f"\n{MODELS[model]}, {'image side' if model == 'cnn' else 'T'} = {t}")
            print(f"| {'method':<20} | {'mean s':>8} | {'ratio':>6} | {'median s':>8} | {'ratio':>6} | "
                  f"{'checked':>7} | {'check s':>7} | {'at rate':>7} | {'ratio':>6} | {'peak MB':>8} | {'ratio':>6} |")
            print("|" + "|".join("-" * (w + 2) for w in (20, 8, 6, 8, 6, 7, 7, 7, 6, 8, 6)) + "|")
            for m in methods:
                r = res[m]
                if "error" in r:
                    print(f"| {m:<20} | refused: {r['error'][:90]} |")
                    continue
                check_s = "-" if r["check_s"] is None else f"{r['check_s']:.4f}"
                e = r["expected"]
                at_rate = f"{'-':>7} | {'-':>6}" if e is None else f"{e:>7.4f} | {e / base['mean']:>6.2f}"
                print(f"| {m:<20} | {r['mean']:>8.4f} | {r['mean'] / base['mean']:>6.2f} | {r['median']:>8.4f} | "
                      f"{r['median'] / base['median']:>6.2f} | {r['checked']:>7} | {check_s:>7} | {at_rate} | "
                      f"{r['extra_mb']:>8.0f} | {r['extra_mb'] / base['extra_mb']:>6.2f} |", flush=True)

if __name__ == "__main__":
    main()
