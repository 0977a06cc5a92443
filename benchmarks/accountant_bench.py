"""Accountant benchmarks: epsilon brackets and time against dp_accounting and prv_accountant, a referee, and
the randomized-clipping accountant.

Table 1 (DP-SGD, Poisson-subsampled Gaussian, add-or-remove): for each configuration of the reference set and the
peer disagreements, our ``[lower, upper]`` bracket at discretization 1e-4, dp_accounting's pessimistic PLD
epsilon at 1e-4 and prv_accountant's ``[lower, upper]`` at ``eps_error = 0.01``, each timed in this run
(ours and dp_accounting alternate, median of 3; prv once), and the referee's enclosure of the true epsilon
(:mod:`dpmath.referee`, Laplace inversion with an error bound, independent of any loss grid).
Table 2: randomized clipping (Hutch, k = 32, d = 2048): our bracket and warm time per epsilon.
Table 3: calibrate_noise_multiplier for DP-SGD-RC in the Table 4 setting of paper 000, cold and warm.
Table 4: one randomized-clipping step (Hutch) at three cases: the referee's enclosure of the truth
(:func:`dpmath.referee.referee_rc_epsilon`) beside our default and refined (``bracket_rtol=5e-3``) brackets; not
in the default run (``--tables 4``, about a minute).
Table 5: DP-SGD at very small q, the coarse grid against dp_accounting (``--tables 5``).
Table 6: the default bracket (``bracket_rtol="auto"``) on Table 1's configurations: its width against the coarse
grid's, and the default's ``epsilon`` and ``epsilon_bracket`` timed against dp_accounting (alternated, median of 5;
``--tables 6 --no-prv``).  Tables 1, 2, 4 and 5 show the coarse single grid (``bracket_rtol=None``) as "ours".
Table 7: the batch samplings' mechanisms beside the dp_accounting events that describe them (truncated Poisson,
fixed-size batches): :func:`sampling_bench.table_s2`, timed the same way, and balls in bins beside Poisson sampling
and the Renyi bound of random allocation (:func:`sampling_bench.table_s3`; ``--tables 7 --no-prv``).

    OMP_NUM_THREADS=1 python benchmarks/accountant_bench.py [--tables 1 2 3 4 5 6 7] [--no-prv]
"""

import argparse
import math
import statistics
import time

from dpmath import (
    HutchEnvelope,
    HutchPPEnvelope,
    PLDAccountant,
    SubsampledGaussian,
    calibrate_noise_multiplier,
)
from dpmath.referee import referee_epsilon, referee_rc_epsilon

CONFIGS = [   # (sigma, q, steps, delta): the reference configurations, then the peer disagreement at (0.9, 0.1, 3000)
    (1.1, 256 / 60000, 14063, 1e-5),
    (0.8, 1e-3, 50000, 1e-6),
    (1.5, 0.05, 1000, 1e-6),
    (4.073, 64 / 1150, 180, 1e-5),
    (0.6, 0.01, 100000, 1e-8),
    (2.0, 1e-3, 1000000, 1e-9),
    (0.9, 0.1, 3000, 1e-5),
]
RC_CONFIGS = [(0.8, 1e-3, 50000, 1e-6), (0.6, 0.01, 100000, 1e-8), (2.0, 1e-3, 1000000, 1e-9)]


def timed(fn):
    t = time.perf_counter()
    value = fn()
    return time.perf_counter() - t, value


def ours(sigma, q, steps, delta):
    """The coarse single grid (Tables 1 and 5 compare it with the refined bracket and the peers)."""
    return PLDAccountant(1e-4, bracket_rtol=None).compose(SubsampledGaussian(sigma, q), steps).epsilon_bracket(delta)


def default(sigma, q, steps, delta, bracket=True):
    """What ``PLDAccountant()`` answers: the default bracket (``bracket_rtol="auto"``), or its upper end alone."""
    acc = PLDAccountant().compose(SubsampledGaussian(sigma, q), steps)
    return acc.epsilon_bracket(delta) if bracket else acc.epsilon(delta)


def refined(sigma, q, steps, delta):
    return PLDAccountant(1e-4, bracket_rtol=1e-3).compose(SubsampledGaussian(sigma, q), steps).epsilon_bracket(delta)


def dp_accounting_eps(sigma, q, steps, delta):
    from verify.peers import dp_accounting_epsilon

    return dp_accounting_epsilon(sigma, q, steps, delta)


def prv(sigma, q, steps, delta):
    from verify.peers import prv_bracket

    return prv_bracket(sigma, q, steps, delta)


def table1(use_prv: bool) -> None:
    print("Table 1: DP-SGD epsilon.  ours: discretization 1e-4; refined: bracket_rtol = 1e-3 (finer grids until the")
    print("bracket is 0.1 % wide); dp_acc: dp_accounting's PLD at 1e-4; prv: prv_accountant at eps_error 0.01;")
    print("referee: dpmath.referee's enclosure of the true epsilon.  Times: ours, refined and dp_accounting")
    print("alternated, median of 3 (prv once); ratios to dp_accounting.")
    print(f"{'sigma':>6} {'q':>8} {'steps':>8} {'delta':>6} | {'referee [low, high]':>28} | "
          f"{'ours [lower, upper]':>22} {'width%':>7} | {'refined [lower, upper]':>22} {'width%':>7} | "
          f"{'dp_acc':>9} | {'prv [lower, upper]':>20} | {'ours s':>6} {'ref. s':>6} {'dp s':>6} "
          f"{'ratio':>5} {'ref.r':>5} {'prv s':>6}")
    ratios, refined_ratios = [], []
    for c in CONFIGS:
        t_ours, t_ref, t_dp = [], [], []
        for _ in range(3):
            t, (lo, hi) = timed(lambda c=c: ours(*c))
            t_ours.append(t)
            t, (rlo_, rhi_) = timed(lambda c=c: refined(*c))
            t_ref.append(t)
            t, theirs = timed(lambda c=c: dp_accounting_eps(*c))
            t_dp.append(t)
        to, tr, td = (statistics.median(x) for x in (t_ours, t_ref, t_dp))
        ratios.append(to / td)
        refined_ratios.append(tr / td)
        if use_prv:
            tp, (plo, phi) = timed(lambda c=c: prv(*c))
            prv_txt, tp_txt = f"[{plo:.4f}, {phi:.4f}]", f"{tp:6.1f}"
        else:
            prv_txt, tp_txt = "-", "-"
        elo, ehi = referee_epsilon([(c[0], c[1], c[2])], c[3], guess=hi)
        flag = "" if elo <= hi and lo <= ehi and elo <= rhi_ and rlo_ <= ehi else " !"
        print(f"{c[0]:>6g} {c[1]:>8.3g} {c[2]:>8d} {c[3]:>6.0e} | [{elo:.8f}, {ehi:.8f}]{flag} | "
              f"[{lo:.5f}, {hi:.5f}] {100 * (hi - lo) / hi:>7.4f} | [{rlo_:.5f}, {rhi_:.5f}] "
              f"{100 * (rhi_ - rlo_) / rhi_:>7.4f} | {theirs:>9.5f} | {prv_txt:>20} | {to:>6.2f} {tr:>6.2f} {td:>6.2f} "
              f"{to / td:>5.2f} {tr / td:>5.2f} {tp_txt:>6}", flush=True)

    def geo(xs):
        return math.exp(sum(math.log(r) for r in xs) / len(xs))
    print(f"geometric mean of time ratios to dp_accounting: ours {geo(ratios):.2f}, refined {geo(refined_ratios):.2f}")


def table2() -> None:
    print()
    print("Table 2: randomized clipping (Hutch, k = 32, d = 2048), discretization 1e-4, and refined to a 0.5 % bracket")
    print(f"{'sigma':>6} {'q':>8} {'steps':>8} {'delta':>6} | {'ours [lower, upper]':>21} {'width%':>7} "
          f"{'cold s':>6} {'warm s':>6} | {'refined [lower, upper]':>22} {'width%':>7} {'s':>6}")
    env = HutchEnvelope(32, 2048)
    for sigma, q, steps, delta in RC_CONFIGS:
        def run(rtol=None, sigma=sigma, q=q, steps=steps, delta=delta):
            acc = PLDAccountant(1e-4, bracket_rtol=rtol).compose(SubsampledGaussian(sigma, q, env), steps)
            return acc.epsilon_bracket(delta)
        cold, (lo, hi) = timed(run)
        warm = statistics.median(timed(run)[0] for _ in range(3))
        tr, (rlo, rhi) = timed(lambda run=run: run(5e-3))
        print(f"{sigma:>6g} {q:>8.3g} {steps:>8d} {delta:>6.0e} | [{lo:.4f}, {hi:.4f}] {100 * (hi - lo) / hi:>7.3f} "
              f"{cold:>6.2f} {warm:>6.2f} | [{rlo:.4f}, {rhi:.4f}] {100 * (rhi - rlo) / rhi:>7.3f} {tr:>6.1f}",
              flush=True)


def table3() -> None:
    q, steps = 64 / 1139, 180
    print()
    print("Table 3: calibrate_noise_multiplier for DP-SGD-RC, k = 32, d = 2048, epsilon 0.7, delta 1e-5, q = 64/1139, "
          "180 steps")
    print(f"{'estimator':>10} {'sigma':>9} {'cold s':>8} {'warm s':>8}")
    for name, cls in (("Hutch", HutchEnvelope), ("Hutch++", HutchPPEnvelope)):
        t = time.perf_counter()
        env = cls(32, 2048)
        sigma = calibrate_noise_multiplier(0.7, 1e-5, q, steps, envelope=env)
        cold = time.perf_counter() - t
        warm = statistics.median(timed(lambda env=env: calibrate_noise_multiplier(0.7, 1e-5, q, steps, envelope=env))[0]
                                 for _ in range(2))
        print(f"{name:>10} {sigma:>9.4f} {cold:>8.2f} {warm:>8.2f}")
    t, plain = timed(lambda: calibrate_noise_multiplier(0.7, 1e-5, q, steps))
    print(f"{'DP-SGD':>10} {plain:>9.4f} {t:>8.2f} {t:>8.2f}")


ONE_STEP = [(8, 200, 0.8, 0.3, 1e-8), (4, 8, 3.0, 0.1, 1e-6), (32, 2048, 1.0, 0.05, 1e-6)]


def table4() -> None:
    print()
    print("Table 4: one randomized-clipping step (Hutch) at three cases, against the referee's enclosure "
          "of the truth (dpmath.referee.referee_rc_epsilon)")
    print(f"{'k':>3} {'d':>5} {'sigma':>5} {'q':>5} {'delta':>6} | {'referee [low, high]':>24} {'s':>5} | "
          f"{'ours [lower, upper]':>22} {'width%':>7} {'s':>5} | {'refined [lower, upper]':>22} {'width%':>7} {'s':>5}")
    for k, d, sigma, q, delta in ONE_STEP:
        t, (r_lo, r_hi) = timed(lambda k=k, d=d, sigma=sigma, q=q, delta=delta:
                                referee_rc_epsilon(sigma, q, HutchEnvelope(k, d), 1, delta))
        exact = f"[{r_lo:.5f}, {r_hi:.5f}] {t:>5.1f}"
        cells = []
        for rtol in (None, 5e-3):
            acc = PLDAccountant(bracket_rtol=rtol).compose(SubsampledGaussian(sigma, q, HutchEnvelope(k, d)), 1)
            t, (lo, hi) = timed(lambda acc=acc, delta=delta: acc.epsilon_bracket(delta))
            cells.append(f"[{lo:.4f}, {hi:.4f}] {100 * (hi - lo) / hi:>7.3f} {t:>5.1f}")
        print(f"{k:>3} {d:>5} {sigma:>5g} {q:>5g} {delta:>6.0e} | {exact} | {cells[0]} | {cells[1]}", flush=True)


SMALL_Q = [(0.5, 1e-5, 10000, 1e-8), (0.5, 1e-6, 10000, 1e-9), (0.5, 1e-6, 100000, 1e-8), (1.0, 1e-6, 1000, 1e-5)]


def table5() -> None:
    print()
    print("Table 5: DP-SGD at very small q (discretization 1e-4; each run once): our bracket against dp_accounting's")
    print("estimate, which does not bound floating-point error")
    print(f"{'sigma':>5} {'q':>6} {'steps':>7} {'delta':>6} | {'ours [lower, upper]':>26} {'s':>6} | "
          f"{'upper only':>10} {'s':>6} | {'dp_acc':>9} {'s':>6}")
    for c in SMALL_Q:
        sigma, q, steps, delta = c
        t, (lo, hi) = timed(lambda c=c: ours(*c))
        t_up, up = timed(lambda c=c: PLDAccountant(1e-4, bracket_rtol=None).compose(SubsampledGaussian(c[0], c[1]),
                                                                                       c[2]).epsilon(c[3]))
        t_dp, theirs = timed(lambda c=c: dp_accounting_eps(*c))
        print(f"{sigma:>5g} {q:>6g} {steps:>7} {delta:>6.0e} | [{lo:.6f}, {hi:.6f}] {t:>6.2f} | {up:>10.6f} "
              f"{t_up:>6.2f} | {theirs:>9.6f} {t_dp:>6.2f}", flush=True)


def table6(rounds: int = 5) -> None:
    print()
    print("Table 6: the default bracket (PLDAccountant(), bracket_rtol='auto': 0.1 % within a budget of 2^23 FFT")
    print("points) on Table 1's configurations, against the coarse single grid (bracket_rtol=None).  Times: the")
    print("coarse grid's epsilon, the default's epsilon (the published number), its epsilon_bracket and")
    print(f"dp_accounting's PLD epsilon at 1e-4, alternated, median of {rounds}; ratios (default epsilon, bracket) to")
    print("dp_accounting.")
    print(f"{'sigma':>6} {'q':>8} {'steps':>8} {'delta':>6} | {'coarse width%':>13} | {'default [lower, upper]':>22} "
          f"{'width%':>7} | {'coarse':>6} {'eps s':>6} {'brkt s':>6} {'dp s':>6} {'ratio':>5} {'b.rat':>5}")
    ratios, bracket_ratios = [], []
    for c in CONFIGS:
        t_eps, t_brk, t_dp, t_coarse = [], [], [], []
        for _ in range(rounds):
            t, up = timed(lambda c=c: default(*c, bracket=False))
            t_eps.append(t)
            t, _ = timed(lambda c=c: PLDAccountant(bracket_rtol=None).compose(SubsampledGaussian(c[0], c[1]),
                                                                             c[2]).epsilon(c[3]))
            t_coarse.append(t)
            t, theirs = timed(lambda c=c: dp_accounting_eps(*c))
            t_dp.append(t)
            t, (lo, hi) = timed(lambda c=c: default(*c))
            t_brk.append(t)
        assert up == hi   # epsilon alone is the bracket's upper end
        te, tb, td, tc = (statistics.median(x) for x in (t_eps, t_brk, t_dp, t_coarse))
        ratios.append(te / td)
        bracket_ratios.append(tb / td)
        c_lo, c_hi = ours(*c)
        print(f"{c[0]:>6g} {c[1]:>8.3g} {c[2]:>8d} {c[3]:>6.0e} | {100 * (c_hi - c_lo) / c_hi:>13.4f} | "
              f"[{lo:.5f}, {hi:.5f}] {100 * (hi - lo) / hi:>7.4f} | {tc:>6.2f} {te:>6.2f} {tb:>6.2f} {td:>6.2f} "
              f"{te / td:>5.2f} {tb / td:>5.2f}", flush=True)

    def geo(xs):
        return math.exp(sum(math.log(r) for r in xs) / len(xs))
    print(f"geometric mean of time ratios to dp_accounting: epsilon {geo(ratios):.2f}, epsilon_bracket "
          f"{geo(bracket_ratios):.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--no-prv", action="store_true", help="skip prv_accountant (slow at many steps)")
    args = parser.parse_args()
    if 1 in args.tables:
        table1(not args.no_prv)
    if 2 in args.tables:
        table2()
    if 3 in args.tables:
        table3()
    if 4 in args.tables:
        table4()
    if 5 in args.tables:
        table5()
    if 6 in args.tables:
        table6()
    if 7 in args.tables:
        from sampling_bench import table_s2, table_s3  # benchmarks/, this script's folder

        print("Table 7: batch samplings' mechanisms beside dp_accounting and balls in bins (sampling_bench.py's "
              "Tables S2, S3)")
        table_s2()
        table_s3()
