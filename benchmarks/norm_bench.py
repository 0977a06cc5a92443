"""Per-layer per-sample norm estimation on CPU: time and peak extra memory of exact, ghost, hutch, hutchpp
(and Opacus' ghost-clipping norm sampler when opacus is installed), with the App. E model's prediction.

Each (method, T, layer) runs in a fresh subprocess: A (B x T x d) and G (B x T p) are allocated, then the
estimator runs once to warm up and is timed on a second run; "extra MB" is the growth of the process's
peak resident memory over its value after allocating the inputs (ru_maxrss), so it is the estimator's
own peak allocation.  Ratios are against ghost clipping measured in the same run.

    python benchmarks/norm_bench.py                       # B = 2, k = 32, T in 512..8192, three layers
    python benchmarks/norm_bench.py --seq-lens 512 4096   # a subset
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time

LAYERS = [(2048, 2048), (8192, 2048), (2048, 512)]  # (p, d)
METHODS = ["exact", "ghost", "hutch", "hutchpp", "opacus"]


def one(method: str, b: int, t: int, d: int, p: int, k: int) -> dict:
    import torch

    from dpsgd.estimators import ESTIMATORS

    torch.set_num_threads(os.cpu_count() or 1)
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(b, t, d, generator=gen)
    g = torch.randn(b, t, p, generator=gen)
    if method == "opacus":
        from opacus.grad_sample.linear import compute_linear_norm_sample
        layer = torch.nn.Linear(d, p, bias=False)

        def run():
            return compute_linear_norm_sample(layer, [a], g)[layer.weight]
    elif method in ("hutch", "hutchpp"):
        def run():
            return ESTIMATORS[method](a, g, k, gen)
    else:
        def run():
            return ESTIMATORS[method](a, g)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    run()
    extra = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base
    t0 = time.perf_counter()
    run()
    return {"seconds": time.perf_counter() - t0, "extra_mb": extra / 1024}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--k", type=int, default=32)
    ap.add_argument("--methods", nargs="+", default=METHODS)
    ap.add_argument("--one", nargs=6)
    args = ap.parse_args()
    if args.one:
        m, b, t, d, p, k = args.one
        print(json.dumps(one(m, int(b), int(t), int(d), int(p), int(k))))
        return
    from dpsgd.cost import memory_model

    try:
        import opacus  # noqa: F401
    except ImportError:
        args.methods = [m for m in args.methods if m != "opacus"]
    print(f"B = {args.batch}, k = {args.k}, float32, {os.cpu_count()} CPU threads; seconds (ratio to ghost) | "
          f"extra MB measured / App. E model (ratio to ghost, measured)")
    for p, d in LAYERS:
        print(f"\nlayer (p, d) = ({p}, {d})")
        print(f"{'T':>6} " + " ".join(f"{m:>30}" for m in args.methods))
        for t in args.seq_lens:
            res = {}
            for m in args.methods:
                out = subprocess.run([sys.executable, __file__, "--one", m, str(args.batch), str(t), str(d), str(p),
                                      str(args.k)], capture_output=True, text=True, check=True)
                res[m] = json.loads(out.stdout.strip().splitlines()[-1])
            gs, gm = res["ghost"]["seconds"], res["ghost"]["extra_mb"]
            cells = []
            for m in args.methods:
                key = {"exact": "fgc", "ghost": "gc", "opacus": "gc"}.get(m, "rc")
                model_mb = memory_model(key, args.batch, t, d, p, args.k)["overhead"] * 4 / 2**20
                r = res[m]
                mem_ratio = f"{r['extra_mb'] / gm:.3f}" if gm >= 16 else "-"  # below the allocator's resolution
                cells.append(f"{r['seconds']:.3f}s ({r['seconds'] / gs:.3f}) | "
                             f"{r['extra_mb']:.0f}/{model_mb:.0f} ({mem_ratio})")
            print(f"{t:>6} " + " ".join(f"{c:>30}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
