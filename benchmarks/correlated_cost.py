"""What correlated noise (banded and BLT) costs on CPU, against Gaussian noise measured in the same run: one thread.

1. **The noise step alone**: ``dpsgd.noise.noisy_gradients(..., in_place=True)`` on zero tensors of the parameter
   shapes of GPT-2 small (n_embd 768, 12 layers, vocab 50257, 1024 positions, tied head: 124.4 M coordinates;
   ``--quick``: one block and the embeddings, 46.5 M), with Gaussian noise and with
   ``BandedNoise(BandedStrategy.sqrt_prefix_sum(b))``, b in {2, 4, 8}, each banded run with its own
   ``CorrelatedStream``, and with ``BLTNoise(BLTStrategy.optimized(3, 1000, min_separation=4))`` (3 buffers,
   its ``BufferedStream``).  Each noise first takes ``max(2, b)`` untimed steps (its stream's history full; BLT:
   2); then ``--rounds`` rounds alternate the five (G, b2, b4, b8, blt, G, ...), one step each, the sums zeroed
   (untimed) before each step; the median over rounds is reported, with its ratio to Gaussian's.  "correlate s" is the
   median time spent in ``CorrelatedStream.correlate`` (the ``b - 1`` multiply-adds and the history's copy);
   "extra ns/coord" is the step's time over Gaussian's per coordinate, and per band (divided by ``b - 1``).
   Memory: "history MB" counts the bytes of the stream's tensors (``(b - 1)`` x the parameters' bytes),
   "RSS +MB" is the growth of the resident set (``/proc/self/statm``) over the warm-up steps that fill it.
   Part 3 times each operation of the step alone on one chunk (the draws, the add into the sum, one band's
   ``sub_``, the ``div_`` by ``c_0``, the history's ``clone``) and splits ``correlate``'s time into them.
2. **A whole private training step** of an HF ``GPT2LMHeadModel`` built from a config (n_embd 768, 2 layers,
   12 heads, vocab 50257, tied; sequence length 64; ``--quick``: n_embd 192, vocab 2048) through
   ``PrivacyEngine.make_private`` (``estimator="auto"``, ``noise_multiplier=1``, SGD): Gaussian noise with the
   default Poisson sampling (the baseline), Gaussian with ``CyclicPoisson(4)`` (the sampler's cost), and
   ``BandedNoise(sqrt_prefix_sum(4))`` with ``CyclicPoisson(4)``.  The sampling rate is 1 so that batch sizes are
   not random: Poisson over 8 examples draws all 8 every step; ``CyclicPoisson(4)`` over 32 examples draws its
   whole group each step, so each cycle of 4 steps is exactly 32 examples, a mean batch of 8 (both cyclic setups
   get the same partition, from the same seed).  The samplers run the same code (a Bernoulli draw per example)
   as at a rate below 1.  A round times one whole cycle (4 steps, each with its batch drawn from the private
   loader, forward, backward, ``optimizer.step()``) of each setup in turn; the median over ``--cycles`` rounds of
   the mean step, after one untimed cycle (the first step of a model runs the row check).  The sampled row check
   is off (``engine.check_rate = 0``: its cost depends on neither noise nor sampling, and it would add a random
   extra backward to an eighth of the steps); "checked" counts the timed steps that ran it anyway.

    OMP_NUM_THREADS=1 python benchmarks/correlated_cost.py            # under 4 minutes, writes the results file
    OMP_NUM_THREADS=1 python benchmarks/correlated_cost.py --quick    # under 30 s, prints only

The default run writes benchmarks/results/correlated_cost.md (``--out`` elsewhere; ``--quick`` writes only with
``--out``).
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import pathlib
import platform
import resource
import statistics
import sys
import time
import warnings

import torch

from dpmath.correlated import BandedStrategy, BLTStrategy
from dpsgd.noise import BandedNoise, BLTNoise, GaussianNoise, noisy_gradients

RESULTS = pathlib.Path(__file__).resolve().parent / "results" / "correlated_cost.md"
BANDS = (2, 4, 8)
BLT_BUFFERS = 3   # the BLT row: BLTStrategy.optimized(3, 1000, min_separation=4), the studies' blt-d3


def gpt2_shapes(layers: int, vocab: int = 50257, n_embd: int = 768, positions: int = 1024) -> list[tuple]:
    """The parameter shapes of an HF GPT-2 (Conv1D weights are (in, out); the head is tied to ``wte``)."""
    shapes = [(vocab, n_embd), (positions, n_embd)]
    for _ in range(layers):
        shapes += [(n_embd,), (n_embd,),                         # ln_1
                   (n_embd, 3 * n_embd), (3 * n_embd,),          # attn.c_attn
                   (n_embd, n_embd), (n_embd,),                  # attn.c_proj
                   (n_embd,), (n_embd,),                         # ln_2
                   (n_embd, 4 * n_embd), (4 * n_embd,),          # mlp.c_fc
                   (4 * n_embd, n_embd), (n_embd,)]              # mlp.c_proj
    return shapes + [(n_embd,), (n_embd,)]                       # ln_f


def rss_bytes() -> int:
    """The resident set now (not the high-water mark)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def history_bytes(stream) -> int:
    """The bytes of the tensors a noise stream holds: a ``CorrelatedStream``'s history of the last ``b - 1`` steps,
    a ``BufferedStream``'s ``d`` buffers."""
    if stream is None:
        return 0
    held = stream._past if hasattr(stream, "_past") else stream._buffers
    return sum(t.numel() * t.element_size() for past in held.values() for t in past)


def timed_correlate(stream, spent: list) -> None:
    """Make ``stream.correlate`` add its seconds to ``spent[-1]``."""
    correlate = stream.correlate

    def wrapped(key, z):
        t0 = time.perf_counter()
        try:
            return correlate(key, z)
        finally:
            spent[-1] += time.perf_counter() - t0
    stream.correlate = wrapped


def noise_step_cost(layers: int, vocab: int, rounds: int) -> dict:
    """Part 1: seconds per ``noisy_gradients`` step and memory held, Gaussian and banded b in :data:`BANDS`."""
    sums = [torch.zeros(s) for s in gpt2_shapes(layers, vocab)]
    coords = sum(t.numel() for t in sums)
    param_bytes = sum(t.numel() * t.element_size() for t in sums)
    # (name, noise, bands b: its b - 1 multiply-adds; BLT: None), the warm-up's untimed steps
    setups = [("gaussian", GaussianNoise(), 1, 2),
              *((f"banded b={b}", BandedNoise(BandedStrategy.sqrt_prefix_sum(b)), b, max(2, b)) for b in BANDS),
              (f"blt d={BLT_BUFFERS}", BLTNoise(BLTStrategy.optimized(BLT_BUFFERS, 1000, min_separation=4)), None, 2)]
    runs = {}
    for i, (name, noise, b, warm) in enumerate(setups):
        runs[name] = {"b": b, "warm": warm, "noise": noise, "stream": noise.stream(),
                      "gen": torch.Generator().manual_seed(i + 1), "times": [], "correlate": []}

    def step(r: dict) -> float:
        for t in sums:
            t.zero_()
        r["correlate"].append(0.0)
        t0 = time.perf_counter()
        noisy_gradients(sums, 1.0, 8.0, r["gen"], noise=r["noise"], in_place=True, stream=r["stream"])
        return time.perf_counter() - t0

    for r in runs.values():   # warm-up: the history filled (each stream keeps it, so all are held from here on)
        if r["stream"] is not None:
            timed_correlate(r["stream"], r["correlate"])
        before = rss_bytes()
        for _ in range(r["warm"]):
            step(r)
        r["rss_growth"] = rss_bytes() - before
        r["correlate"].clear()
    for _ in range(rounds):
        for r in runs.values():
            r["times"].append(step(r))
    base = statistics.median(runs["gaussian"]["times"])
    rows = []
    for name, r in runs.items():
        s = statistics.median(r["times"])
        extra_ns = (s - base) / coords * 1e9
        rows.append({"noise": name, "b": r["b"], "seconds": s, "ratio": s / base, "extra_s": s - base,
                     "correlate_s": statistics.median(r["correlate"]) if r["stream"] is not None else 0.0,
                     "extra_ns_per_coord": extra_ns,
                     "extra_ns_per_band": extra_ns / (r["b"] - 1) if r["b"] and r["b"] > 1 else None,
                     "history_mb": history_bytes(r["stream"]) / 2**20,
                     "history_x_params": history_bytes(r["stream"]) / param_bytes,
                     "rss_growth_mb": r["rss_growth"] / 2**20})
    return {"coords": coords, "param_mb": param_bytes / 2**20, "tensors": len(sums), "rounds": rounds,
            "rows": rows}


def primitive_costs(repeats: int) -> dict:
    """Part 3: nanoseconds per coordinate of the operations of a noise step, on chunks of
    :data:`dpsgd.noise.NOISE_CHUNK` float32: the draws ``z`` one chunk, the other operand each time another of 8
    chunks (128 MB, out of cache, as the sums and the history are in a real step); median of ``repeats`` timings
    of 3 passes over the 8."""
    from dpsgd.noise import NOISE_CHUNK

    n, k = NOISE_CHUNK, 8
    g = torch.Generator().manual_seed(0)
    z = torch.randn(n, generator=g)
    sums, older, kept = ([torch.randn(n, generator=g) for _ in range(k)] for _ in range(3))
    histories = [[torch.randn(n, generator=g)] for _ in range(k)]

    def clone_dropping_oldest():   # CorrelatedStream's pattern: a new copy per key, the oldest freed
        for past in histories:
            past.append(z.clone())
            del past[0]
    ops = {"normal_ (the draws)": lambda: [z.normal_(generator=g) for _ in range(k)],
           "add_(xi, alpha=std) into the sum": lambda: [t.add_(z, alpha=1.0) for t in sums],
           "sub_(w, alpha=c_j): one band": lambda: [z.sub_(t, alpha=0.5) for t in older],
           "div_(c_0)": lambda: [z.div_(1.0) for _ in range(k)],
           "clone(), the oldest freed": clone_dropping_oldest,
           "copy_() into a kept tensor": lambda: [t.copy_(z) for t in kept]}
    out = {}
    for name, op in ops.items():
        op()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(3):
                op()
            times.append((time.perf_counter() - t0) / (3 * k * n) * 1e9)
        out[name] = statistics.median(times)
    return out


STEP_SETUPS = ("gaussian, poisson (baseline)", "gaussian, cyclic_poisson(4)", "banded b=4, cyclic_poisson(4)")


def count_checks() -> list:
    """A list that receives one entry per row check the trainer runs from now on (it looks ``check_rows`` up in
    its module on every step)."""
    import dpsgd.rowcheck

    checks: list = []
    check_rows = dpsgd.rowcheck.check_rows

    def counted(*args, **kwargs):
        checks.append(1)
        return check_rows(*args, **kwargs)
    dpsgd.rowcheck.check_rows = counted
    return checks


def private_setup(setup: str, n_embd: int, layers: int, vocab: int, seq_len: int, batch: int,
                  estimator: str) -> dict:
    """One model, optimizer and private loader of :data:`STEP_SETUPS`, sampling at rate 1 (see the docstring)."""
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    from transformers import GPT2Config, GPT2LMHeadModel

    from dpsgd import PrivacyEngine
    from dpsgd.samplers import CyclicPoisson

    groups = 4
    cyclic = "cyclic" in setup
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=seq_len, n_embd=n_embd, n_layer=layers,
                                       n_head=12, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                       eos_token_id=0))
    model.train()
    n = batch * groups if cyclic else batch
    ids = torch.randint(0, vocab, (n, seq_len), generator=torch.Generator().manual_seed(0))
    options = {}
    if cyclic:
        options["batch_sampling"] = CyclicPoisson(groups)
    if setup.startswith("banded"):
        options["noise"] = BandedNoise(BandedStrategy.sqrt_prefix_sum(groups))
    engine = PrivacyEngine()
    model, opt, crit, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
        data_loader=DataLoader(TensorDataset(ids, ids), batch_size=batch), criterion=nn.CrossEntropyLoss(),
        max_grad_norm=1.0, noise_multiplier=1.0, estimator=estimator, seed=0, **options)
    engine.check_rate = 0.0

    def batches():
        while True:
            yield from loader
    return {"engine": engine, "model": model, "opt": opt, "crit": crit, "batches": batches(),
            "cycle": groups, "times": [], "sizes": [], "checked": 0}


def train_step(s: dict) -> tuple[float, int]:
    t0 = time.perf_counter()
    x, y = next(s["batches"])
    s["opt"].zero_grad()
    s["crit"](s["model"](x).logits[:, :-1], y[:, 1:]).backward()
    s["opt"].step()
    return time.perf_counter() - t0, len(x)


def whole_step_cost(n_embd: int, layers: int, vocab: int, seq_len: int, batch: int, cycles: int,
                    estimator: str) -> dict:
    """Part 2: seconds per private training step of each of :data:`STEP_SETUPS`, alternated a cycle at a time."""
    logging.getLogger("transformers").setLevel(logging.ERROR)
    checks = count_checks()
    setups = {name: private_setup(name, n_embd, layers, vocab, seq_len, batch, estimator) for name in STEP_SETUPS}
    params = sum(p.numel() for p in next(iter(setups.values()))["model"].parameters())
    for s in setups.values():   # untimed: one cycle (the model's first step runs the row check)
        for _ in range(s["cycle"]):
            train_step(s)
    for _ in range(cycles):
        for s in setups.values():
            n = len(checks)
            spent, sizes = zip(*(train_step(s) for _ in range(s["cycle"])), strict=True)
            s["times"].append(sum(spent) / len(spent))
            s["sizes"] += sizes
            s["checked"] += len(checks) - n
    base = statistics.median(setups[STEP_SETUPS[0]]["times"])
    rows = []
    for name, s in setups.items():
        sec = statistics.median(s["times"])
        rows.append({"setup": name, "seconds": sec, "ratio": sec / base, "extra_s": sec - base,
                     "mean_batch": statistics.mean(s["sizes"]), "checked": f"{s['checked']}/{len(s['sizes'])}"})
    return {"params": params, "cycles": cycles, "rows": rows}


def machine() -> dict:
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"nproc": len(os.sched_getaffinity(0)), "cpu": cpu, "torch": torch.__version__,
            "python": platform.python_version(), "threads": torch.get_num_threads(),
            "omp": os.environ.get("OMP_NUM_THREADS", "unset"),
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "load": " ".join(f"{x:.2f}" for x in os.getloadavg())}


def report(command: str, m: dict, load_end: str, noise: dict, step: dict, primitives: dict, args,
           seconds: float) -> str:
    lines = [
        "# Cost of correlated noise, banded and BLT (benchmarks/correlated_cost.py)", "",
        f"- command: `{command}`",
        f"- machine: nproc {m['nproc']}, CPU {m['cpu']}; torch {m['torch']} ({m['threads']} thread, "
        f"OMP_NUM_THREADS={m['omp']}), Python {m['python']}",
        f"- date: {m['date']}; load average {m['load']} at the start, {load_end} at the end; {seconds:.0f} s; "
        f"peak RSS {peak_rss_mb():.0f} MB", "",
        f"## 1. The noise step alone: `noisy_gradients(in_place=True)`, {noise['coords'] / 1e6:.1f} M coordinates",
        "",
        f"GPT-2 small parameter shapes ({noise['tensors']} tensors, {args.noise_layers} layer(s), vocab "
        f"{args.noise_vocab}, n_embd 768; {noise['param_mb']:.0f} MB in float32); median of {noise['rounds']} "
        f"alternated rounds after the warm-up that fills each history; ratios to Gaussian's median.", "",
        "| noise | s/step | ratio | extra s | correlate s | extra ns/coord | per band | history MB | "
        "x params | RSS +MB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in noise["rows"]:
        band = "-" if r["extra_ns_per_band"] is None else f"{r['extra_ns_per_band']:.2f}"
        lines.append(f"| {r['noise']} | {r['seconds']:.4f} | {r['ratio']:.2f} | {r['extra_s']:+.4f} | "
                     f"{r['correlate_s']:.4f} | {r['extra_ns_per_coord']:.2f} | {band} | {r['history_mb']:.0f} | "
                     f"{r['history_x_params']:.2f} | {r['rss_growth_mb']:.0f} |")
    lines += [
        "", f"## 2. A whole private training step: HF GPT-2, n_embd {args.step_embd}, {args.step_layers} layers, "
        f"vocab {args.step_vocab}, T = {args.seq_len}, batch {args.batch} ({step['params'] / 1e6:.1f} M parameters)",
        "",
        f"make_private(estimator={args.estimator!r}, noise_multiplier=1), SGD; sampling rate 1 (a mean batch of "
        f"{args.batch} exactly over each cycle of 4 steps); median over {step['cycles']} alternated rounds of the "
        f"mean step of one cycle; check_rate 0; ratios to the baseline's median.", "",
        "| setup | s/step | ratio | extra s | mean batch | checked |",
        "|---|---:|---:|---:|---:|---:|"]
    for r in step["rows"]:
        lines.append(f"| {r['setup']} | {r['seconds']:.4f} | {r['ratio']:.3f} | {r['extra_s']:+.4f} | "
                     f"{r['mean_batch']:.2f} | {r['checked']} |")
    sub = primitives["sub_(w, alpha=c_j): one band"]
    lines += [
        "", "## 3. Where the noise step's time goes (ns per coordinate)", "",
        "Each operation alone on chunks of 2^22 float32 (`dpsgd.noise.NOISE_CHUNK`), its other operand out of cache "
        f"(one of 8 chunks in turn), median of {args.rounds} timings:", "",
        "| operation | ns/coord |", "|---|---:|"]
    lines += [f"| {name} | {ns:.3f} |" for name, ns in primitives.items()]
    lines += [
        "", "`CorrelatedStream.correlate` in part 1 (its measured time per coordinate) against its arithmetic: "
        "(b - 1) `sub_` as timed above (no `div_`: these strategies have c_0 = 1, which the stream skips); the rest "
        "is roughly the history's copy (`copy_()` into the oldest step's tensor, reused):", "",
        "| noise | correlate | (b-1) sub_ | rest: the copy | step over Gaussian |",
        "|---|---:|---:|---:|---:|"]
    for r in noise["rows"][1:]:
        if r["b"] is None:   # BLT: d buffers, each updated and read every step (no history copy)
            continue
        c = r["correlate_s"] / noise["coords"] * 1e9
        lines.append(f"| {r['noise']} | {c:.3f} | {(r['b'] - 1) * sub:.3f} | "
                     f"{c - (r['b'] - 1) * sub:.3f} | {r['extra_ns_per_coord']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes and fewer rounds (under 30 s)")
    ap.add_argument("--rounds", type=int, help="part 1: alternated rounds (default 11; quick 3)")
    ap.add_argument("--noise-layers", type=int, help="part 1: GPT-2 small blocks (default 12; quick 1)")
    ap.add_argument("--noise-vocab", type=int, default=50257)
    ap.add_argument("--cycles", type=int, help="part 2: timed cycles of 4 steps per setup (default 6; quick 2)")
    ap.add_argument("--step-embd", type=int, help="part 2: n_embd, a multiple of 12 (default 768; quick 192)")
    ap.add_argument("--step-layers", type=int, default=2)
    ap.add_argument("--step-vocab", type=int, help="part 2: vocabulary (default 50257; quick 2048)")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--estimator", default="auto", choices=["auto", "exact", "ghost", "hutch"])
    ap.add_argument("--out", type=pathlib.Path, help=f"the markdown file (default {RESULTS}; --quick: none)")
    args = ap.parse_args(argv)
    quick = args.quick
    for name, full, small in (("rounds", 11, 3), ("noise_layers", 12, 1), ("cycles", 6, 2), ("step_embd", 768, 192),
                              ("step_vocab", 50257, 2048)):
        if getattr(args, name) is None:
            setattr(args, name, small if quick else full)
    out = args.out if args.out is not None or quick else RESULTS

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")   # the seed's UserWarning (a benchmark: the noise need not be secret)
    command = "OMP_NUM_THREADS=1 python benchmarks/correlated_cost.py" + "".join(
        f" {a}" for a in (sys.argv[1:] if argv is None else argv))
    m = machine()
    t0 = time.perf_counter()
    noise = noise_step_cost(args.noise_layers, args.noise_vocab, args.rounds)
    primitives = primitive_costs(args.rounds)
    step = whole_step_cost(args.step_embd, args.step_layers, args.step_vocab, args.seq_len, args.batch, args.cycles,
                           args.estimator)
    load_end = " ".join(f"{x:.2f}" for x in os.getloadavg())
    text = report(command, m, load_end, noise, step, primitives, args, time.perf_counter() - t0)
    print(text, end="", flush=True)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        print(f"\nwritten to {out}")
    return {"machine": m, "noise_step": noise, "training_step": step, "out": str(out) if out else None}


if __name__ == "__main__":
    main()
