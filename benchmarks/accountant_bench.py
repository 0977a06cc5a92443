"""Accountant benchmarks: time to epsilon against dp_accounting, and time to calibrate DP-SGD-RC.

Table 1: the subsampled Gaussian on the configurations of verify.peers.PEER_CONFIGS, our upper bound
(``PLDAccountant.epsilon``) against dp_accounting's PLD accountant at the same discretization 1e-4, both
timed in this run (best of 3); the ratio is ours / theirs.  The accuracy column is our epsilon relative to
theirs (ours is a certified upper bound; theirs is connect-the-dots with an unbounded FFT error).
Table 2: calibrate_sigma for DP-SGD-RC, k = 32, d = 2048, in the Table 4 setting (epsilon 0.7, delta 1e-5,
q = 64/1139, 180 steps): cold (envelope built in the call) and warm (envelope cached).

    pip install dp-accounting && python benchmarks/accountant_bench.py
"""

import math
import time

from dpmath import HutchEnvelope, HutchPPEnvelope, PLDAccountant, SubsampledGaussian, calibrate_sigma
from verify.peers import PEER_CONFIGS


def best_of(fn, repeat=3):
    best, value = math.inf, None
    for _ in range(repeat):
        t = time.perf_counter()
        value = fn()
        best = min(best, time.perf_counter() - t)
    return best, value


def table1() -> None:
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant

    def theirs(sigma, q, steps, delta):
        acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
        ev = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma))
        acc.compose(dp_accounting.SelfComposedDpEvent(ev, steps))
        return acc.get_epsilon(delta)

    def ours(sigma, q, steps, delta):
        return PLDAccountant(1e-4).compose(SubsampledGaussian(sigma, q), steps).epsilon(delta)

    print("Table 1: time to epsilon, subsampled Gaussian, discretization 1e-4 (best of 3)")
    print(f"{'sigma':>6} {'q':>9} {'steps':>6} {'delta':>7} {'epsilon':>11} {'rel. to dp_acc':>14} "
          f"{'ours s':>8} {'dp_acc s':>8} {'ratio':>6}")
    ratios, t_ours, t_theirs = [], 0.0, 0.0
    for c in PEER_CONFIGS:
        to, eo = best_of(lambda c=c: ours(*c))
        tt, et = best_of(lambda c=c: theirs(*c))
        ratios.append(to / tt)
        t_ours += to
        t_theirs += tt
        print(f"{c[0]:>6g} {c[1]:>9.3g} {c[2]:>6d} {c[3]:>7.0e} {eo:>11.5f} {(eo - et) / et:>14.1e} "
              f"{to:>8.3f} {tt:>8.3f} {to / tt:>6.2f}")
    geo = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    print(f"total time: ours {t_ours:.2f} s, dp_accounting {t_theirs:.2f} s, ratio {t_ours / t_theirs:.2f}; "
          f"geometric mean of ratios {geo:.2f}; configurations with ratio > 1: {sum(r > 1 for r in ratios)}")


def table2() -> None:
    q, steps = 64 / 1139, 180
    print()
    print("Table 2: calibrate_sigma for DP-SGD-RC, k = 32, d = 2048, epsilon 0.7, delta 1e-5, q = 64/1139, 180 steps")
    print(f"{'estimator':>10} {'sigma':>9} {'cold s':>8} {'warm s':>8}")
    for name, cls in (("Hutch", HutchEnvelope), ("Hutch++", HutchPPEnvelope)):
        t = time.perf_counter()
        env = cls(32, 2048)
        sigma = calibrate_sigma(0.7, 1e-5, q, steps, envelope=env)
        cold = time.perf_counter() - t
        warm, _ = best_of(lambda env=env: calibrate_sigma(0.7, 1e-5, q, steps, envelope=env), repeat=2)
        print(f"{name:>10} {sigma:>9.4f} {cold:>8.2f} {warm:>8.2f}")
    t, plain = best_of(lambda: calibrate_sigma(0.7, 1e-5, q, steps))
    print(f"{'DP-SGD':>10} {plain:>9.4f} {t:>8.2f} {t:>8.2f}")


if __name__ == "__main__":
    table1()
    table2()
