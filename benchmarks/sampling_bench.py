"""What each batch sampling costs in epsilon at the same noise, and our accountant beside dp_accounting on the
sampling events it has.

Table S1: epsilon after 1, 3 and 10 epochs of MNIST-sized training (N = 60000, B = 256, sigma = 1, delta = 1e-5) for
each ``make_private(batch_sampling=...)`` (:mod:`dpsgd.samplers`), with the relation its epsilon is for (truncated
Poisson at ``max_batch_size = B + 48``, three binomial standard deviations above the mean).
Table S2: truncated Poisson against dp_accounting's ``TruncatedSubsampledGaussianDpEvent`` (its PLD accountant, its
own analysis of truncation) for several ``max_batch_size``; fixed-size batches against dp_accounting's RDP
accountant on ``SampledWithoutReplacementDpEvent`` (whose noise multiplier is over the replacement sensitivity 2 C).
Times are medians of alternating runs (A, B, A, B, ...) in one process; ratios are to dp_accounting in the same run.
Table S3: balls in bins (random allocation, :class:`dpmath.RandomAllocationGaussian`) on its own: the bracket, the
time to build and read it (cold: the epoch's laws are built, once per noise and epoch length; later queries reuse
them), beside Poisson sampling at
rate ``1/t`` with as many steps, the Renyi bound of random allocation (:func:`verify.allocation.allocation_rdp_epsilon`,
the analysis the random_allocation library calls "direct") and one Gaussian step per epoch (no amplification).
No peer library we can install computes random allocation's PLD.
``--json`` writes the curves of the docs' plot (epsilon against epochs) to benchmarks/results/sampling_curves.json.

    OMP_NUM_THREADS=1 python benchmarks/sampling_bench.py --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from dpmath import (
    FixedSizeSubsampledGaussian,
    PLDAccountant,
    RandomAllocationGaussian,
    ShuffledGaussian,
    SubsampledGaussian,
    TruncatedSubsampledGaussian,
)

N, B, SIGMA, DELTA = 60_000, 256, 1.0, 1e-5
Q = B / N
STEPS_PER_EPOCH = round(N / B)
CAP = B + 48   # three binomial standard deviations above the mean batch
RESULTS = os.path.join(os.path.dirname(__file__), "results")


def schemes(epochs: int) -> dict[str, tuple[str, PLDAccountant]]:
    """Each sampling's accountant after ``epochs`` epochs: ``name -> (relation, accountant)``."""
    steps = epochs * STEPS_PER_EPOCH
    replace = "replace one"
    return {
        "Poisson": ("add or remove", PLDAccountant().compose(SubsampledGaussian(SIGMA, Q), steps)),
        f"truncated Poisson (max {CAP})": ("add or remove", PLDAccountant().compose(
            TruncatedSubsampledGaussian(SIGMA, Q, CAP, N), steps)),
        "balls in bins": ("add or remove", PLDAccountant().compose(
            RandomAllocationGaussian(SIGMA, STEPS_PER_EPOCH), epochs)),
        "Poisson, replacing one": (replace, PLDAccountant(neighboring="replace_one").compose(
            SubsampledGaussian(SIGMA, Q), steps)),
        "fixed size": (replace, PLDAccountant(neighboring="replace_one").compose(
            FixedSizeSubsampledGaussian(SIGMA, B, N), steps)),
        "shuffling (bound)": (replace, PLDAccountant(neighboring="replace_one").compose(
            ShuffledGaussian(SIGMA, STEPS_PER_EPOCH), epochs)),
    }


def table_s1() -> None:
    print(f"Table S1: epsilon at delta = {DELTA:g}, sigma = {SIGMA:g}, N = {N}, B = {B} (q = {Q:.5f}, "
          f"{STEPS_PER_EPOCH} steps an epoch); [lower, upper] and seconds")
    print(f"{'batch_sampling':34s} {'relation':14s} " + " ".join(f"{f'{e} epochs':>30s}" for e in (1, 3, 10)))
    rows: dict[str, list[str]] = {}
    for epochs in (1, 3, 10):
        for name, (relation, acc) in schemes(epochs).items():
            t = time.perf_counter()
            lo, hi = acc.epsilon_bracket(DELTA)
            rows.setdefault(name, [relation]).append(f"[{lo:.4f}, {hi:.4f}] {time.perf_counter() - t:5.2f}s")
    for name, (relation, *cells) in rows.items():
        print(f"{name:34s} {relation:14s} " + " ".join(f"{c:>30s}" for c in cells))
    print()


def _median_alternating(a, b, reps: int = 5) -> tuple[float, float, object, object]:
    ta, tb, ra, rb = [], [], None, None
    for _ in range(reps):
        t = time.perf_counter()
        ra = a()
        ta.append(time.perf_counter() - t)
        t = time.perf_counter()
        rb = b()
        tb.append(time.perf_counter() - t)
    return statistics.median(ta), statistics.median(tb), ra, rb


def table_s2() -> None:
    import dp_accounting
    from dp_accounting import dp_event

    from dpmath.interop.dp_accounting import to_dp_event

    steps = 3 * STEPS_PER_EPOCH
    print(f"Table S2: against dp_accounting, {steps} steps (3 epochs), sigma = {SIGMA:g}, delta = {DELTA:g}")
    print(f"{'mechanism':46s} {'ours [lower, upper]':>24s} {'ours s':>8s} {'dp_accounting':>14s} {'theirs s':>9s} "
          f"{'time ratio':>10s}")
    cap0 = TruncatedSubsampledGaussian.max_batch_size_for(Q, N, steps, DELTA / 100)
    for cap in (B + 16, CAP, cap0):
        m = TruncatedSubsampledGaussian(SIGMA, Q, cap, N)

        def theirs(m=m):
            acc = dp_accounting.pld.PLDAccountant()
            acc.compose(to_dp_event(m, steps))
            return acc.get_epsilon(DELTA)
        t_ours, t_theirs, ours, value = _median_alternating(
            lambda m=m: PLDAccountant().compose(m, steps).epsilon_bracket(DELTA), theirs, reps=3)
        print(f"{f'truncated Poisson, max_batch_size {cap}':46s} {f'[{ours[0]:.4f}, {ours[1]:.4f}]':>24s} "
              f"{t_ours:8.3f} {value:14.4f} {t_theirs:9.3f} {t_ours / t_theirs:10.2f}")
    m = FixedSizeSubsampledGaussian(SIGMA, B, N)

    def rdp():
        acc = dp_accounting.rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
        acc.compose(to_dp_event(m, steps))
        return acc.get_epsilon(DELTA)
    t_ours, t_theirs, ours, value = _median_alternating(
        lambda: PLDAccountant(neighboring="replace_one").compose(m, steps).epsilon_bracket(DELTA), rdp, reps=3)
    print(f"{'fixed size (RDP: WOR event at sigma / 2)':46s} {f'[{ours[0]:.4f}, {ours[1]:.4f}]':>24s} "
          f"{t_ours:8.3f} {value:14.4f} {t_theirs:9.3f} {t_ours / t_theirs:10.2f}")
    wrong = dp_accounting.rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    wrong.compose(dp_event.SelfComposedDpEvent(dp_event.SampledWithoutReplacementDpEvent(
        N, B, dp_event.GaussianDpEvent(SIGMA)), steps))
    print(f"{'  (the WOR event at sigma, as for Poisson)':46s} {'':>24s} {'':>8s} {wrong.get_epsilon(DELTA):14.4f}  "
          f"<- below our lower end: under-reported")
    print()


ALLOCATION_CASES = [(1.0, 234, 1), (1.0, 234, 10), (0.6, 100, 10), (1.0, 10, 10), (2.0, 1000, 10), (0.8, 4000, 10),
                    (0.5, 100, 5)]
"""``(sigma, steps per epoch, epochs)`` of Table S3."""


def table_s3(delta: float = DELTA) -> None:
    import math

    from dpmath import Gaussian
    from dpmath.pld.allocation import band_laws, sum_laws
    from verify.allocation import allocation_rdp_epsilon

    print(f"Table S3: balls in bins (random allocation), delta = {delta:g}; [lower, upper], width, seconds (cold: "
          f"the epoch's laws built)")
    print(f"{'sigma':>6s} {'t':>6s} {'epochs':>6s} {'ours [lower, upper]':>24s} {'width':>7s} {'s':>6s} "
          f"{'Poisson 1/t':>11s} {'Renyi':>8s} {'no ampl.':>9s}")
    for sigma, t, epochs in ALLOCATION_CASES:
        sum_laws.cache_clear()   # cold: each row builds its epoch's laws (and their octave bands)
        band_laws.cache_clear()
        start = time.perf_counter()
        lo, hi = PLDAccountant().compose(RandomAllocationGaussian(sigma, t), epochs).epsilon_bracket(delta)
        took = time.perf_counter() - start
        poisson = PLDAccountant().compose(SubsampledGaussian(sigma, 1 / t), t * epochs).epsilon(delta)
        rdp = allocation_rdp_epsilon(sigma, t, epochs, delta)
        plain = PLDAccountant().compose(Gaussian(sigma / math.sqrt(epochs))).epsilon(delta)
        print(f"{sigma:6g} {t:6d} {epochs:6d} {f'[{lo:.4f}, {hi:.4f}]':>24s} {(hi - lo) / hi:7.2%} {took:6.1f} "
              f"{poisson:11.4f} {rdp:8.4f} {plain:9.3f}")
    print()


def curves() -> dict:
    """Upper ends against epochs 1..10, for the docs' plot."""
    out: dict = {"setting": {"N": N, "B": B, "sigma": SIGMA, "delta": DELTA}, "epochs": list(range(1, 11))}
    for epochs in out["epochs"]:
        for name, (relation, acc) in schemes(epochs).items():
            out.setdefault("curves", {}).setdefault(name, {"relation": relation, "epsilon": []})
            out["curves"][name]["epsilon"].append(acc.epsilon(DELTA))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="write the plot's curves to benchmarks/results")
    parser.add_argument("--no-peers", action="store_true", help="skip Table S2 (needs dp-accounting)")
    args = parser.parse_args()
    print(f"# sampling_bench.py, {time.strftime('%Y-%m-%d')}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")
    table_s1()
    if not args.no_peers:
        table_s2()
    table_s3()
    if args.json:
        with open(os.path.join(RESULTS, "sampling_curves.json"), "w") as fh:
            json.dump(curves(), fh, indent=1)
        print("wrote benchmarks/results/sampling_curves.json")


if __name__ == "__main__":
    main()
