"""Paper 000's Table 4: the training-set size behind sigma = 4.073, and the randomized-clipping rows.

Prints (1) sigma for DP-SGD at epsilon 0.7, delta 1e-5, batch 64, 10 epochs (steps = 10 ceil(n / 64)) for
training-set sizes around the two near misses, (2) the calibrated sigma for Hutch and Hutch++ at
k = 32, d = 2048 and n = 1139, and (3) our [lower, upper] epsilon bracket at the paper's 4.354 and nearby
values, which shows where the paper's number sits between our two bounds.

    python benchmarks/table4.py
"""

import math

from dpmath import calibrate_noise_multiplier, dpsgd_epsilon_bracket, estimator_envelope

EPS, DELTA, BATCH, EPOCHS = 0.7, 1e-5, 64, 10


def sampling(n: int) -> tuple[float, int]:
    return BATCH / n, EPOCHS * math.ceil(n / BATCH)


def main() -> None:
    print("DP-SGD sigma against the training-set size n (target 4.073)")
    for n in list(range(1136, 1143)) + list(range(1166, 1172)):
        q, steps = sampling(n)
        print(f"  n = {n}: steps = {steps}, sigma = {calibrate_noise_multiplier(EPS, DELTA, q, steps, rtol=1e-5):.4f}")
    q, steps = sampling(1139)
    print("n = 1139, k = 32, d = 2048 (paper: 4.354 for both)")
    for est in ("hutch", "hutchpp"):
        sigma = calibrate_noise_multiplier(EPS, DELTA, q, steps, envelope=estimator_envelope(est, 32, 2048))
        print(f"  {est}: sigma = {sigma:.4f}")
    print("Hutch: epsilon bracket [lower, upper] at sigma")
    for sigma in (4.350, 4.354, 4.355, 4.356, 4.3582):
        lo, hi = dpsgd_epsilon_bracket(sigma, q, steps, DELTA, estimator="hutch")
        print(f"  sigma = {sigma}: [{lo:.5f}, {hi:.5f}]")


if __name__ == "__main__":
    main()
