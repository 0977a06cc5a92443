"""Peak memory of one linear layer's per-example gradient norms: paper 000's Figure 2 on CPU.

Llama-3.2-1B's linear layers at context T = 4096 and batch B = 2 (the paper's setting): 2048 x 2048
(attention projections), 8192 x 2048 (MLP) and 2048 x 512 (grouped key/value).  The activations A
(B x T x d) and output gradients G (B x T x p) are allocated first (the "inputs", float32 here); each
estimator then computes the B norms in a fresh process (after a warm-up call on tiny inputs), and the
growth of the process's peak resident memory (VmHWM after resetting it; ru_maxrss where /proc is
missing) is its overhead.  "peak" adds the inputs, as the paper's Figure 2 does; the reduction
is against the deterministic baseline that a careful implementation would choose per layer (mixed ghost
clipping: the smaller of exact/FGC, O(B p d), and ghost, O(B T^2)), and against ghost alone.

    OMP_NUM_THREADS=1 python benchmarks/layer_memory.py                  # k = 32
    OMP_NUM_THREADS=1 python benchmarks/layer_memory.py --k 8 32 128 512 --plot docs/_static/layer_memory.png
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time

LAYERS = [(2048, 2048), (8192, 2048), (2048, 512)]   # (p, d): output and input width


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith(field + ":"))


def _reset_peak() -> int:
    """Reset the peak resident set (Linux: ``clear_refs`` 5) and return the current one, in kB."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return _status_kb("VmRSS")
    except OSError:   # no /proc: the peak so far
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _peak_kb() -> int:
    try:
        return _status_kb("VmHWM")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def one(p: int, d: int, t: int, b: int, estimator: str, k: int) -> dict:
    import torch

    from dpsgd.estimators import ESTIMATORS

    torch.manual_seed(0)
    a, g = torch.randn(b, t, d), torch.randn(b, t, p)
    gen = torch.Generator().manual_seed(0)
    fn = ESTIMATORS[estimator]

    def call(x, y):
        return fn(x, y) if estimator in ("exact", "ghost") else fn(x, y, k, gen)
    call(a[:, :8, :8], g[:, :8, :8])   # libraries' first-call buffers are not the estimator's
    base = _reset_peak()
    t0 = time.perf_counter()
    call(a, g)
    seconds = time.perf_counter() - t0
    extra = _peak_kb() - base
    return {"extra_mb": extra / 1024, "inputs_mb": (a.numel() + g.numel()) * 4 / 2**20, "seconds": seconds}


def run(*args) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, __file__, "--one", *map(str, args)], capture_output=True, text=True,
                         env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--k", type=int, nargs="+", default=[32])
    ap.add_argument("--plot", default=None, help="write the reduction against k as a PNG here")
    ap.add_argument("--one", nargs=6)
    args = ap.parse_args()
    if args.one:
        p, d, t, b, est, k = args.one
        print(json.dumps(one(int(p), int(d), int(t), int(b), est, int(k))))
        return
    t, b = args.seq_len, args.batch
    print(f"T = {t}, B = {b}, float32, OMP_NUM_THREADS=1; overhead = growth of peak RSS while computing the B norms "
          f"(MB); peak = inputs + overhead; reduction of peak against the per-layer best deterministic method "
          f"(min of exact and ghost) and against ghost")
    curves = {}
    for p, d in LAYERS:
        res = {est: run(p, d, t, b, est, 0) for est in ("exact", "ghost")}
        for k in args.k:
            for est in ("hutch", "hutchpp"):
                res[f"{est} k={k}"] = run(p, d, t, b, est, k)
        inputs = res["exact"]["inputs_mb"]
        best = min(inputs + res[e]["extra_mb"] for e in ("exact", "ghost"))
        ghost = inputs + res["ghost"]["extra_mb"]
        print(f"\nlayer {p} x {d} (inputs {inputs:.0f} MB)")
        print(f"| {'method':<13} | {'overhead MB':>11} | {'peak MB':>8} | {'vs best':>8} | {'vs ghost':>8} | "
              f"{'s':>7} |")
        print(f"|{'-' * 15}|{'-' * 13}|{'-' * 10}|{'-' * 10}|{'-' * 10}|{'-' * 9}|")
        for name, r in res.items():
            peak = inputs + r["extra_mb"]
            print(f"| {name:<13} | {r['extra_mb']:>11.1f} | {peak:>8.0f} | {1 - peak / best:>8.1%} | "
                  f"{1 - peak / ghost:>8.1%} | {r['seconds']:>7.2f} |", flush=True)
            if name.startswith("hutch"):
                est = name.split()[0]
                curves.setdefault((p, d, est), []).append((int(name.split("=")[1]), 1 - peak / best))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.6))
        layers = list(dict.fromkeys((p, d) for p, d, _ in curves))
        for (p, d, est), pts in curves.items():
            ks, red = zip(*pts, strict=True)
            ax.plot(ks, [100 * r for r in red], marker="o", ls="-" if est == "hutch" else "--",
                    color=f"C{layers.index((p, d))}", label=f"{p} x {d}, {est}")
        ax.axhline(0, color="0.5", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("projection dimension k")
        ax.set_ylabel("peak memory reduction (%)")
        ax.set_title(f"one linear layer, T = {t}, B = {b}: vs min(exact, ghost)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"\nplot: {args.plot}")


if __name__ == "__main__":
    main()
