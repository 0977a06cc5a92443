"""One whole training step of the tiny Llama-style decoder (dpsgd.demo.TinyLlama) on CPU: non-private,
DP-SGD with each of our estimators, and Opacus' ghost clipping (when opacus is installed).

Each (method, T) runs in a fresh process: two warm-up steps, then the median time of three; "extra MB" is
the growth of the process's peak resident memory from just before the first step (ru_maxrss).  Ratios
are against the non-private step measured in the same way.

    python benchmarks/step_bench.py                       # dim 256, 2 layers, B = 4, T in 512 2048
    python benchmarks/step_bench.py --seq-lens 512
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time
import warnings

METHODS = ["non-private", "exact", "ghost", "hutch", "hutchpp", "opacus-ghost"]


def one(method: str, t: int, batch: int, dim: int, layers: int) -> dict:
    import torch
    from torch import nn
    from torch.utils.data import DataLoader

    from dpsgd import PrivacyEngine
    from dpsgd.demo import TinyLlama, marker_task

    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    data = marker_task(batch * 8, t, 256, 8, torch.Generator().manual_seed(0))
    model = TinyLlama(256, t, dim=dim, heads=4, layers=layers)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(data, batch_size=batch)
    crit = nn.CrossEntropyLoss()
    if method == "opacus-ghost":
        from opacus import PrivacyEngine as OpacusEngine
        model, opt, crit, loader = OpacusEngine().make_private(
            module=model, optimizer=opt, data_loader=loader, criterion=crit, noise_multiplier=1.0,
            max_grad_norm=1.0, grad_sample_mode="ghost", poisson_sampling=False)
    elif method != "non-private":
        model, opt, crit, loader = PrivacyEngine().make_private(
            module=model, optimizer=opt, data_loader=loader, criterion=crit, max_grad_norm=1.0,
            noise_multiplier=1.0, estimator=method, k=32, poisson_sampling=False, seed=0)
    x, y = data.tensors[0][:batch], data.tensors[1][:batch]  # the same fixed-size batch for every method

    def step():
        opt.zero_grad()
        crit(model(x), y).backward()
        opt.step()
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    step()
    step()
    extra = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return {"seconds": sorted(times)[1], "extra_mb": extra / 1024}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--one", nargs=5)
    args = ap.parse_args()
    if args.one:
        m, t, b, d, n = args.one
        print(json.dumps(one(m, int(t), int(b), int(d), int(n))))
        return
    methods = list(METHODS)
    try:
        import opacus  # noqa: F401
    except ImportError:
        methods.remove("opacus-ghost")
    print(f"tiny decoder: dim {args.dim}, {args.layers} layers, batch {args.batch}, {os.cpu_count()} CPU threads; "
          f"seconds per step (ratio to non-private) | extra MB")
    print(f"{'T':>6} " + " ".join(f"{m:>24}" for m in methods))
    for t in args.seq_lens:
        res = {}
        for m in methods:
            out = subprocess.run([sys.executable, __file__, "--one", m, str(t), str(args.batch), str(args.dim),
                                  str(args.layers)], capture_output=True, text=True, check=True)
            res[m] = json.loads(out.stdout.strip().splitlines()[-1])
        base = res["non-private"]["seconds"]
        print(f"{t:>6} " + " ".join(f"{res[m]['seconds']:.3f}s ({res[m]['seconds'] / base:.2f}) | "
                                    f"{res[m]['extra_mb']:.0f}".rjust(24) for m in methods), flush=True)


if __name__ == "__main__":
    main()
