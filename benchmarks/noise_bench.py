"""The private step's noise draw on CPU: ``dpsgd.noise.noisy_gradients`` (drawn in place into one reused buffer)
against a fresh ``torch.randn`` per tensor, on the parameter shapes of one Llama-3.2-1B-width decoder layer with
an untied 32000-token vocabulary (191 M coordinates).  One thread, the two alternated, median of ``--rounds``.

    OMP_NUM_THREADS=1 python benchmarks/noise_bench.py
"""

import argparse
import statistics
import time

import torch

from dpsgd.noise import noisy_gradients

SHAPES = [(32000, 2048)] * 2 + [(2048, 2048)] * 2 + [(512, 2048)] * 2 + [(8192, 2048)] * 3 + [(2048,)] * 3


def fresh_per_tensor(sums, generator):
    for t in sums:
        xi = torch.randn(t.shape, generator=generator)
        t.add_(xi)
        del xi
        t.div_(4.0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    sums = [torch.zeros(s) for s in SHAPES]
    g = torch.Generator().manual_seed(0)
    fresh, reused = [], []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        fresh_per_tensor(sums, g)
        fresh.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        noisy_gradients(sums, 1.0, 4.0, g, in_place=True)
        reused.append(time.perf_counter() - t0)
    a, b = statistics.median(fresh), statistics.median(reused)
    print(f"{sum(t.numel() for t in sums) / 1e6:.0f} M coordinates, {args.rounds} rounds, medians: fresh torch.randn "
          f"per tensor {a:.3f} s, noisy_gradients (reused buffer, with its finiteness check) {b:.3f} s, "
          f"ratio {b / a:.2f}")


if __name__ == "__main__":
    main()
