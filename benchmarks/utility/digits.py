"""Privacy-utility on real data: a small CNN on scikit-learn's digits, trained with each DP-SGD method of the library.

Data: ``sklearn.datasets.load_digits`` (1,797 real 8x8 handwritten digits, 10 classes, shipped inside the
scikit-learn wheel: nothing is downloaded).  Pixels are scaled by the fixed constant 1/16 (their range),
never by statistics of the data, so preprocessing spends no privacy.  One stratified split, seeded: 1,437
training and 360 test images.  Hyperparameters are chosen on a validation split carved out of the training
images (stratified, 288 of them), never on the test images.

Model: two blocks of Conv2d(3x3, padding 1) + GroupNorm(4 groups) + Tanh + AvgPool2d(2) (16 and 32
channels, 8x8 -> 4x4 -> 2x2), then a linear head: 6,186 parameters.  GroupNorm because batch norm mixes
examples (the library refuses it); Tanh because bounded activations train better under clipping and noise
(Papernot et al., "Tempered sigmoid activations", 2021).

Methods (every private one: the same epochs, batch, optimizer, learning rate and clipping norm C, and the same
seed; all but the three cyclic ones below use Poisson sampling, so the Poisson batches, the model's
initialization and the noise generator's stream are common to those methods of one seed and their differences
are paired):

* ``non-private``: the same loop without clipping or noise (shuffled batches of the expected batch size);
* ``exact``, ``ghost``: DP-SGD with exact per-example norms (two computations of the same norms: a consistency
  check), Gaussian noise, PLD accountant;
* ``hutch-k8``, ``hutch-k32``: DP-SGD-RC, Hutchinson norm estimates with k = 8 and 32, Gaussian noise, the
  randomized-clipping PLD accountant (a larger sigma: the "envelope");
* ``hutchpp-k32``: DP-SGD-RC with Hutch++ (k = 32);
* ``lap2``: exact norms, Laplace noise (``noise="laplace"``, paper 003), accounted by its Gaussian domination;
  its "sigma" is the Laplace scale b / C;
* ``twice``: twice sampling (paper 002, ``TwiceSampling``) with coordinate rate 1/2 and l-infinity bound C/20,
  RDP accountant;
* ``hybrid``: hybrid clipping (paper 002, Thm 5.6, ``HybridClipping``): the two conv blocks clipped to l2 0.6 C,
  the head to 0.8 C (overall C), l-infinity C/20 each, coordinate rate 1/2, Thm 4.6's noise shape, RDP.
  The constants of ``twice`` and ``hybrid`` are the ones of ``benchmarks/decoder_methods.py``, fixed before
  any run here and not tuned.
* ``cyclic``: exact norms and independent Gaussian noise as ``exact``, but cyclic Poisson sampling
  (``CyclicPoisson(4)``: each example in one of 4 groups at random, step t Poisson-samples group t mod 4 at
  q = 128 x 4 / 1437 = 0.356), accounted as one subsampled-Gaussian step per cycle of 4 steps: it separates the
  sampler's effect from the correlated noise's;
* ``banded-b4``: banded matrix-factorization noise (DP-FTRL, ``BandedNoise``) with the 4-band Toeplitz strategy
  ``BandedStrategy.optimized(4, steps)`` (optimized for the prefix-sum workload over the run's steps) under
  ``CyclicPoisson(4)``, exact norms, accounted by ``BandedMatrixFactorization`` (one subsampled-Gaussian step at
  sigma / ||c|| per cycle);
* ``banded-b8``: the same with 8 bands, ``BandedStrategy.optimized(8, steps)``, under ``CyclicPoisson(8)``
  (q = 0.713; groups must keep q = B groups / N <= 1, at most 11 here).
* ``blt-d3``: buffered-linear-Toeplitz noise (``BLTNoise``) with ``BLTStrategy.optimized(3, steps,
  min_separation=4)`` (3 buffers, optimized for participations 4 steps apart) under ``CyclicPoisson(4)``, exact
  norms, accounted without amplification (one Gaussian step per cycle at sigma / sqrt(per), ``per`` the
  strategy's sensitivity per participation): a BLT holds 3 parameter-sized buffers where ``banded-b4`` holds 3
  past noises, with no amplification to lean on.

  The run's ``steps`` are what ``make_private(epochs=...)`` counts: a loop over a cyclic loader is
  ``groups x max(1, round(1 / q))`` steps (``planned_steps``), so 20 epochs are 240 steps for ``cyclic`` and
  ``banded-b4`` (3 cycles of 4 a loop) and 160 for ``banded-b8`` (1 cycle of 8 a loop: an example is eligible
  20 times, about 14 expected passes over the data instead of 20), against 220 for the Poisson methods.
  Their batches are drawn by another sampler, so they differ from the Poisson methods' even at the same seed:
  their pairing with ``exact`` is by seed, i.e. by the model's initialization only (and ``cyclic``,
  ``banded-b4`` share their groups and batches, seed by seed).  Their optimizer is the study's, unchanged: SGD
  with momentum 0.9, which filters the noise of consecutive steps before the model sees it, so it interacts
  with the noise's correlations (matrix-factorization strategies are usually optimized for, and evaluated
  with, plain SGD or with the momentum folded into the workload); neither is done here.  Their "sigma" is
  the multiplier of the fresh draws z (``make_private``'s ``noise_multiplier``, ``||c||`` times the
  accountant's ``sigma / ||c||``; the JSON records both).

Twice sampling and hybrid clipping apply to this model (they need exact norms, Gaussian noise and one
process; a 6k-parameter CNN's per-example gradients are small).  The combinations the library refuses
(Laplace noise or twice sampling with estimated norms) are tried once and their errors recorded in the JSON
(``refused``).

Privacy: target epsilon in {0.5, 1, 2, 4, 8} at delta = 1e-5, a little below 1/N^1.5 = 1.8e-5 for N = 1,437
(and far below 1/N, the usual rule).  For each (method, epsilon), ``make_private(target_epsilon=...,
target_delta=1e-5, epochs=...)`` calibrates sigma on the first seed; the other seeds pass that same sigma as
``noise_multiplier`` (sigma depends on the method, epsilon and schedule, not on the seed, and calibrating
``hutch-k8`` takes 10-30 s each time).  Every run records ``engine.get_epsilon(delta)`` after its last step
(PLD upper bound, RDP for twice/hybrid), which must be at most the target.  The hyperparameter search itself
is not accounted (common practice; it reads the private training images).

Hyperparameters: SGD with momentum 0.9, expected batch 128 (q = 128/1437), 20 epochs of 11 Poisson batches
(220 steps; the cyclic methods' counts are above); batch and epochs were chosen so that the default grid of
the first nine methods fits in about 20 minutes of one thread, after a look at a few settings for ``exact`` at
epsilon 4 on the validation split (batch 64 and 40 epochs were worse).  The clipping norm C and learning rate
are tuned ONCE, for ``exact`` at epsilon 4 on the validation split (mean accuracy of 2 seeds), over the grid
C in {0.3, 1, 3} x lr in {0.1, 0.3, 1}, and reused unchanged by every private method (the cyclic ones
included), so the comparison is fair to the exact baseline and, if anything, favours it.  The
non-private run takes its own lr from the same lr grid (its unclipped gradients diverge at the private lr).
The search is part of the default run and recorded in the JSON (``tuning``); in the committed run it chose
C = 0.3, lr = 1 (a corner of the grid, 86.6 % on validation; C = 1, lr = 0.3, the same product lr C, scored
85.1 %) and lr 0.1 for the non-private run.

Statistics: each cell is the mean over seeds +- the 95 % confidence interval of the mean, t distribution
with (seeds - 1) degrees of freedom; differences against ``exact`` are paired by seed, with the same interval.

Commands (one CPU thread; the JSON and PNG go to ``--out`` and ``--out`` with the suffix .png):

    OMP_NUM_THREADS=1 python benchmarks/utility/digits.py --small        # seconds: 1 seed, 2 epsilons, 3 methods
    OMP_NUM_THREADS=1 python benchmarks/utility/digits.py                # tuning + the full grid, 5 seeds
    OMP_NUM_THREADS=1 python benchmarks/utility/digits.py --merge --methods exact cyclic banded-b4 banded-b8
    OMP_NUM_THREADS=1 python benchmarks/utility/digits.py --merge --methods exact blt-d3

The default writes ``benchmarks/results/utility/digits.json`` and ``digits.png`` (left: test accuracy against
epsilon per method, non-private as a band; right: each method's sigma over exact's); ``--small`` writes
``benchmarks/results/utility/small/digits_small.json`` and ``.png`` (untracked: a smoke run never overwrites the
results).  ``--lr``, ``--max-grad-norm`` and ``--lr-non-private``
given skip the tuning.  Default run: 1,136 s (19 min) on one thread, measured while the machine's two cores
were shared with other work; ``--small``: about 10 s with the imports.

``--merge`` adds methods to a committed result instead of overwriting it: it runs ``--methods`` only, at the
file's epsilons, seeds, epochs, batch, C and learning rates (no tuning; a different value given is refused),
and writes the file back with those methods' runs replaced or added and every other method's runs kept; the
summary, tables and plot are recomputed from all the runs, and ``merges`` in the JSON records each merge's
command, methods, machine and seconds, with, for each method it replaced, the largest change of a run's
accuracy (0 when the rerun reproduces the file's runs; ``exact`` is rerun with the new methods so that their
paired differences use runs made with the same code).  The cyclic rows were added so:
``--merge --methods exact cyclic banded-b4 banded-b8`` (288 s on one thread, the two cores shared; every
``exact`` run reproduced), and the BLT row by ``--merge --methods exact blt-d3`` (98 s; every ``exact`` run
reproduced).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
import time
from pathlib import Path

import matplotlib
import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from study_common import machine, mean_ci, planned_steps
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpmath.correlated import BandedStrategy, BLTStrategy
from dpsgd import PrivacyEngine
from dpsgd.noise import BandedNoise, BLTNoise
from dpsgd.samplers import CyclicPoisson
from dpsgd.strategies import HybridClipping, TwiceSampling

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

RESULTS = Path(__file__).resolve().parents[1] / "results" / "utility"
DELTA = 1e-5
TEST_SIZE, VALIDATION_SIZE = 360, 288
SPLIT_SEED, VALIDATION_SEED = 0, 1
TUNING_EPSILON = 4.0
TUNING_SEEDS = (0, 1)
GRID_C = (0.3, 1.0, 3.0)
GRID_LR = (0.1, 0.3, 1.0)
MOMENTUM = 0.9
COORDINATE_RATE = 0.5          # twice and hybrid: q2
COORDINATE_BOUND = 1 / 20      # twice and hybrid: c_inf in units of C (at most 400 coordinates reach it)
HYBRID_SPLIT = {"features.": 0.6, "head.": 0.8}   # l2 bound per group, in units of C (0.6^2 + 0.8^2 = 1)
# method: (groups, correlated noise, its bands or buffers)
CYCLIC = {"cyclic": (4, None, None), "banded-b4": (4, "banded", 4), "banded-b8": (8, "banded", 8),
          "blt-d3": (4, "blt", 3)}
METHODS = ("non-private", "exact", "ghost", "hutch-k8", "hutch-k32", "hutchpp-k32", "lap2", "twice", "hybrid",
           *CYCLIC)
EPSILONS = (0.5, 1.0, 2.0, 4.0, 8.0)
SMALL = {"methods": ["exact", "hutch-k32", "banded-b4"], "epsilons": [1.0, 8.0], "seeds": 1, "epochs": 1, "lr": 0.3,
         "max_grad_norm": 1.0, "lr_non_private": 0.1}
FULL = {"methods": list(METHODS), "epsilons": list(EPSILONS), "seeds": 5, "epochs": 20, "lr": None,
        "max_grad_norm": None, "lr_non_private": None}


class DigitsCNN(nn.Module):
    """Two Conv2d + GroupNorm + Tanh + AvgPool blocks (8x8 -> 4x4 -> 2x2) and a linear head."""

    def __init__(self, width: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1), nn.GroupNorm(4, width), nn.Tanh(), nn.AvgPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.GroupNorm(4, 2 * width), nn.Tanh(), nn.AvgPool2d(2))
        self.head = nn.Linear(2 * width * 2 * 2, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


Split = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def digits_split(validation: bool) -> Split:
    """``(x_train, y_train, x_eval, y_eval)``: the 1,437 / 360 train/test split, or with ``validation`` the
    training images split again into 1,149 / 288 for tuning (both stratified, fixed seeds)."""
    data = load_digits()
    x = (data.images / 16.0).astype(np.float32)[:, None]
    x_tr, x_te, y_tr, y_te = train_test_split(x, data.target, test_size=TEST_SIZE, stratify=data.target,
                                              random_state=SPLIT_SEED)
    if validation:
        x_tr, x_te, y_tr, y_te = train_test_split(x_tr, y_tr, test_size=VALIDATION_SIZE, stratify=y_tr,
                                                  random_state=VALIDATION_SEED)
    return torch.from_numpy(x_tr), torch.from_numpy(y_tr), torch.from_numpy(x_te), torch.from_numpy(y_te)


@functools.lru_cache
def cyclic_strategy(method: str, steps: int) -> BandedStrategy | BLTStrategy:
    """The correlated-noise strategy of a cyclic ``method`` for a run of ``steps`` (computed once each): the
    optimized banded or BLT one, or the identity (independent noise)."""
    groups, kind, size = CYCLIC[method]
    if kind == "banded":
        return BandedStrategy.optimized(size, steps)
    if kind == "blt":
        return BLTStrategy.optimized(size, steps, min_separation=groups)
    return BandedStrategy((1.0,))


def private_kwargs(method: str, c: float, *, num_samples: int | None = None, batch_size: int | None = None,
                   epochs: int | None = None) -> dict:
    """``make_private`` arguments that define ``method`` at clipping norm ``c``.  The cyclic methods need the
    schedule (training examples, expected batch, epochs): their strategy is optimized for the run's steps."""
    if method in CYCLIC:
        groups, kind, _ = CYCLIC[method]
        kwargs = {"estimator": "exact", "max_grad_norm": c, "batch_sampling": CyclicPoisson(groups)}
        if kind is not None:
            if None in (num_samples, batch_size, epochs):
                raise ValueError(f"{method} needs num_samples, batch_size and epochs (its strategy's steps)")
            strategy = cyclic_strategy(method, planned_steps(groups, num_samples, batch_size, epochs))
            kwargs["noise"] = BandedNoise(strategy) if kind == "banded" else BLTNoise(strategy)
        return kwargs
    if method in ("exact", "ghost"):
        return {"estimator": method, "max_grad_norm": c}
    if method.startswith("hutch"):
        estimator, k = method.split("-k")
        return {"estimator": estimator, "projection_dim": int(k), "max_grad_norm": c}
    if method == "lap2":
        return {"estimator": "exact", "noise": "laplace", "max_grad_norm": c}
    if method == "twice":
        return {"estimator": "exact", "max_grad_norm": c,
                "clipping": TwiceSampling(coordinate_rate=COORDINATE_RATE, max_grad_coordinate=COORDINATE_BOUND * c)}
    if method == "hybrid":
        sampling = HybridClipping({p: (s * c, COORDINATE_BOUND * c) for p, s in HYBRID_SPLIT.items()},
                                  coordinate_rate=COORDINATE_RATE)
        return {"estimator": "exact", "max_grad_norm": sampling.overall_norm(), "sampling": sampling}
    raise ValueError(f"unknown method {method!r}")


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    acc = float((model(x).argmax(1) == y).double().mean())
    model.train()
    return acc


def train_once(method: str, epsilon: float | None, seed: int, split: Split, epochs: int, batch: int, lr: float,
               c: float, sigma: float | None = None) -> dict:
    """Train one model and return its record (sigma, reported epsilon, accuracy, seconds per step).  ``sigma``:
    a noise multiplier already calibrated by ``make_private`` for this method, epsilon and schedule (it does not
    depend on the seed), passed as ``noise_multiplier`` instead of calibrating again."""
    x_tr, y_tr, x_ev, y_ev = split
    torch.manual_seed(seed)   # the same initialization for every method of a seed
    model = DigitsCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=MOMENTUM)
    data = TensorDataset(x_tr, y_tr)
    record: dict = {"method": method, "epsilon": epsilon, "seed": seed}
    start = time.perf_counter()
    if method == "non-private":
        loader = DataLoader(data, batch_size=batch, shuffle=True, drop_last=True,
                            generator=torch.Generator().manual_seed(seed))
        criterion, engine = nn.CrossEntropyLoss(), None
        record.update(sigma=0.0, calibrated=False, accountant=None, calibration_s=0.0)
    else:
        engine = PrivacyEngine()
        noise = ({"target_epsilon": epsilon, "target_delta": DELTA, "epochs": epochs} if sigma is None
                 else {"noise_multiplier": sigma})
        model, optimizer, criterion, loader = engine.make_private(
            module=model, optimizer=optimizer, data_loader=DataLoader(data, batch_size=batch),
            criterion=nn.CrossEntropyLoss(), seed=seed, **noise,
            **private_kwargs(method, c, num_samples=len(x_tr), batch_size=batch, epochs=epochs))
        record.update(sigma=engine.noise_multiplier, calibrated=sigma is None,
                      accountant=type(engine.accountant()).__name__, calibration_s=time.perf_counter() - start)
        if method in CYCLIC:
            groups, kind, _ = CYCLIC[method]
            strategy = cyclic_strategy(method, planned_steps(groups, len(x_tr), batch, epochs))
            if kind == "blt":   # one Gaussian step per cycle at sigma / sqrt(per): no amplification
                record.update(groups=groups, weights=list(strategy.weights), decays=list(strategy.decays),
                              accounting_noise_multiplier=engine.noise_multiplier
                              / math.sqrt(strategy.sensitivity_per_participation(groups)))
            else:
                record.update(groups=groups, coefficients=list(strategy.coefficients),
                              accounting_noise_multiplier=engine.noise_multiplier / strategy.column_norm)
    steps, loop_start = 0, time.perf_counter()
    for _ in range(epochs):
        for xb, yb in loader:
            optimizer.zero_grad()
            criterion(model(xb), yb).backward()
            optimizer.step()
            steps += 1
    record["s_per_step"] = (time.perf_counter() - loop_start) / steps
    record["steps"] = steps
    if method in CYCLIC and steps != planned_steps(CYCLIC[method][0], len(x_tr), batch, epochs):
        raise RuntimeError(f"{method} ran {steps} steps, its strategy was optimized for "
                           f"{planned_steps(CYCLIC[method][0], len(x_tr), batch, epochs)}")
    record["epsilon_reported"] = None if engine is None else engine.get_epsilon(DELTA)
    record["accuracy"] = accuracy(model, x_ev, y_ev)
    if engine is not None:
        engine.detach()
    return record


def tune(args: argparse.Namespace) -> dict:
    """The grid search on the validation split: C x lr for ``exact`` at epsilon 4, and lr alone for the
    non-private run (whose unclipped gradients take another step size); returns its record."""
    split = digits_split(validation=True)
    rows = []
    grid = [("exact", c, lr) for c in GRID_C for lr in GRID_LR] + [("non-private", None, lr) for lr in GRID_LR]
    for method, c, lr in grid:
        accs = [train_once(method, TUNING_EPSILON, s, split, args.epochs, args.batch_size, lr, c or 1.0)["accuracy"]
                for s in TUNING_SEEDS]
        rows.append({"method": method, "max_grad_norm": c, "lr": lr, "validation_accuracy": accs,
                     "mean": statistics.fmean(accs)})
        print(f"tune  {method:>11}  C {c or '-':<4}  lr {lr:<4g} validation accuracy {100 * rows[-1]['mean']:.1f} %",
              flush=True)
    best = max((r for r in rows if r["method"] == "exact"), key=lambda r: r["mean"])
    best_np = max((r for r in rows if r["method"] == "non-private"), key=lambda r: r["mean"])
    return {"epsilon": TUNING_EPSILON, "seeds": list(TUNING_SEEDS),
            "split": f"{len(split[0])} train / {len(split[2])} validation images, from the training split",
            "grid": {"max_grad_norm": list(GRID_C), "lr": list(GRID_LR)}, "results": rows,
            "chosen": {"max_grad_norm": best["max_grad_norm"], "lr": best["lr"], "lr_non_private": best_np["lr"]}}


def refused_combinations(split: Split, batch: int) -> dict[str, str]:
    """The library's error for each combination of methods it does not cover (recorded, not worked around)."""
    tries = {"lap2 with hutch": {"estimator": "hutch", "noise": "laplace"},
             "twice with hutch": {"estimator": "hutch", "clipping": TwiceSampling(COORDINATE_RATE, COORDINATE_BOUND)},
             "twice with laplace": {"estimator": "exact", "noise": "laplace",
                                    "clipping": TwiceSampling(COORDINATE_RATE, COORDINATE_BOUND)}}
    out = {}
    for name, kw in tries.items():
        model = DigitsCNN()
        try:
            PrivacyEngine().make_private(
                module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                data_loader=DataLoader(TensorDataset(split[0], split[1]), batch_size=batch), max_grad_norm=1.0,
                target_epsilon=1.0, target_delta=DELTA, epochs=1, **kw)
            out[name] = "accepted"
        except ValueError as err:
            out[name] = f"ValueError: {err}"
    return out


def summarize(runs: list[dict], methods: list[str], epsilons: list[float]) -> list[dict]:
    """Per (method, epsilon): accuracy mean +- CI, sigma, the largest reported epsilon, seconds per step, and the
    accuracy difference against ``exact`` paired by seed."""
    by = {(r["method"], r["epsilon"], r["seed"]): r for r in runs}
    out = []
    for method in methods:
        for eps in [None] if method == "non-private" else epsilons:
            rows = [r for r in runs if r["method"] == method and r["epsilon"] == eps]
            mean, ci = mean_ci([r["accuracy"] for r in rows])
            cell = {"method": method, "epsilon": eps, "seeds": len(rows), "accuracy_mean": mean, "accuracy_ci95": ci,
                    "sigma": rows[0]["sigma"], "accountant": rows[0]["accountant"],
                    "epsilon_reported_max": max((r["epsilon_reported"] or 0.0) for r in rows) if eps else None,
                    "s_per_step_median": statistics.median(r["s_per_step"] for r in rows)}
            pairs = [r["accuracy"] - by[("exact", eps, r["seed"])]["accuracy"] for r in rows
                     if method != "exact" and ("exact", eps, r["seed"]) in by]
            if pairs:
                cell["diff_vs_exact_mean"], cell["diff_vs_exact_ci95"] = mean_ci(pairs)
            out.append(cell)
    return out


def fmt(mean: float, ci: float | None, scale: float = 100.0) -> str:
    return f"{scale * mean:5.1f}" + ("" if ci is None else f" ± {scale * ci:4.1f}")


def print_tables(summary: list[dict], methods: list[str], epsilons: list[float]) -> None:
    cells = {(s["method"], s["epsilon"]): s for s in summary}
    head = f"{'method':>12} " + " ".join(f"{'eps ' + format(e, 'g'):>13}" for e in epsilons)
    print("\ntest accuracy %, mean ± 95 % CI over seeds (t distribution)")
    print(head)
    for m in methods:
        if m == "non-private":
            s = cells[(m, None)]
            print(f"{m:>12} {fmt(s['accuracy_mean'], s['accuracy_ci95']):>13} (no privacy, all epsilons)")
            continue
        print(f"{m:>12} " + " ".join(f"{fmt(cells[(m, e)]['accuracy_mean'], cells[(m, e)]['accuracy_ci95']):>13}"
                                     for e in epsilons))
    if any("diff_vs_exact_mean" in s for s in summary):
        print("\naccuracy minus exact's, percentage points, paired by seed, mean ± 95 % CI")
        print(head)
        for m in methods:
            if m in ("non-private", "exact"):
                continue
            print(f"{m:>12} " + " ".join(
                f"{fmt(cells[(m, e)]['diff_vs_exact_mean'], cells[(m, e)]['diff_vs_exact_ci95']):>13}"
                if "diff_vs_exact_mean" in cells[(m, e)] else f"{'-':>13}" for e in epsilons))
    print("\nnoise each method pays: sigma (noise std / C; lap2: Laplace scale b / C; banded: the fresh draws', "
          "||c|| x the accountant's sigma) and its accountant")
    print(head + f" {'accountant':>24}")
    for m in methods:
        if m != "non-private":
            print(f"{m:>12} " + " ".join(f"{cells[(m, e)]['sigma']:>13.4f}" for e in epsilons)
                  + f" {cells[(m, epsilons[0])]['accountant']:>24}")
    print("\nseconds per step (median over seeds and epsilons)")
    for m in methods:
        per = [s["s_per_step_median"] for s in summary if s["method"] == m]
        print(f"{m:>12} {1000 * statistics.median(per):8.1f} ms")


def plot(summary: list[dict], methods: list[str], epsilons: list[float], path: Path, title: str) -> None:
    """Test accuracy against epsilon (log x), one line per method with 95 % CI bars; non-private as a band."""
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5))
    private = [m for m in methods if m != "non-private"]
    cells = {(s["method"], s["epsilon"]): s for s in summary}
    for i, m in enumerate(private):
        shift = 1.02 ** (i - (len(private) - 1) / 2)   # spread the markers so the bars do not overlap
        xs = [e * shift for e in epsilons]
        ys = [100 * cells[(m, e)]["accuracy_mean"] for e in epsilons]
        err = [100 * (cells[(m, e)]["accuracy_ci95"] or 0.0) for e in epsilons]
        style = {"color": f"C{i % 10}", "ls": ("-", "--", ":")[i // 10 % 3]}   # 10 colours, then dashed
        ax.errorbar(xs, ys, yerr=err, marker="o", ms=4, capsize=3, label=m, **style)
        if "exact" in methods:
            bx.plot(epsilons, [cells[(m, e)]["sigma"] / cells[("exact", e)]["sigma"] for e in epsilons],
                    marker="o", ms=4, label=m, **style)
    if "non-private" in methods:
        s = cells[("non-private", None)]
        ci = s["accuracy_ci95"] or 0.0
        ax.axhspan(100 * (s["accuracy_mean"] - ci), 100 * (s["accuracy_mean"] + ci), color="grey", alpha=0.3)
        ax.axhline(100 * s["accuracy_mean"], color="grey", lw=1, label="non-private (band: 95 % CI)")
    ax.axhline(10.0, color="black", ls=":", lw=1, label="chance (10 %)")
    ax.set(xscale="log", xlabel="target epsilon (delta = 1e-5)", ylabel="test accuracy %", title=title)
    bx.set(xscale="log", xlabel="target epsilon", ylabel="sigma / exact's sigma",
           title="noise each method pays (lap2: b/C; twice, hybrid: RDP;\nbanded: the fresh draws' sigma, "
                 "||c|| x the accountant's)")
    for axis in (ax, bx):
        axis.minorticks_off()   # the log axis' minor labels would overprint the epsilon ticks
        axis.set_xticks(epsilons, [f"{e:g}" for e in epsilons])
        axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


MERGE_FIXED = ("epsilons", "seeds", "epochs", "batch_size", "lr", "max_grad_norm", "lr_non_private")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="the smoke-test setting: " + json.dumps(SMALL))
    ap.add_argument("--methods", nargs="+", choices=METHODS)
    ap.add_argument("--epsilons", type=float, nargs="+")
    ap.add_argument("--seeds", type=int, help="seeds 0 .. SEEDS-1 (default 5)")
    ap.add_argument("--epochs", type=int, help="default 20")
    ap.add_argument("--batch-size", type=int, help="expected (Poisson) batch size (default 128)")
    ap.add_argument("--lr", type=float, help="the private methods' (default: tuned)")
    ap.add_argument("--max-grad-norm", type=float, help="C (default: tuned)")
    ap.add_argument("--lr-non-private", type=float, help="default: tuned")
    ap.add_argument("--out", type=Path, help="the JSON path; the plot goes beside it with the suffix .png")
    ap.add_argument("--merge", action="store_true",
                    help="run --methods only, at the settings of the existing --out, and merge their runs into it "
                         "(replacing that file's runs of the same methods, keeping the others')")
    args = ap.parse_args(argv)
    if args.out is None:
        args.out = RESULTS / "small" / "digits_small.json" if args.small else RESULTS / "digits.json"
    previous = None
    if args.merge:
        if not args.methods:
            ap.error("--merge needs --methods: the methods to run and merge")
        if not args.out.exists():
            ap.error(f"--merge merges into an existing result; {args.out} does not exist")
        previous = json.loads(args.out.read_text())
        for key in MERGE_FIXED:   # the pairing and the tables need the file's settings
            fixed, given = previous["settings"][key], getattr(args, key)
            if given is not None and given != fixed:
                ap.error(f"--merge: {args.out} has {key} = {fixed!r}, not {given!r}")
            setattr(args, key, fixed)
    for key, value in (SMALL if args.small else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.batch_size is None:
        args.batch_size = 128
    torch.set_num_threads(1)   # the timings are one thread's; the machine is shared
    start = time.perf_counter()
    args.out.parent.mkdir(parents=True, exist_ok=True)

    tuning = None
    if args.lr is None or args.max_grad_norm is None or (args.lr_non_private is None and "non-private" in args.methods):
        tuning = tune(args)
        for key, value in tuning["chosen"].items():   # values given on the command line are kept
            if getattr(args, key) is None:
                setattr(args, key, value)
        print(f"chosen: C = {args.max_grad_norm:g}, lr = {args.lr:g} for every private method; non-private lr "
              f"{args.lr_non_private:g}", flush=True)
    split = digits_split(validation=False)
    print(f"digits: {len(split[0])} train / {len(split[2])} test; DigitsCNN "
          f"{sum(p.numel() for p in DigitsCNN().parameters())} parameters; expected batch {args.batch_size}, "
          f"{args.epochs} epochs, SGD momentum {MOMENTUM}, lr {args.lr:g}, C {args.max_grad_norm:g}, "
          f"delta {DELTA:g}, {args.seeds} seeds", flush=True)
    runs = []
    for method in args.methods:
        for eps in [None] if method == "non-private" else args.epsilons:
            sigma = None   # calibrated by make_private on the first seed, reused by the others (calibrating
            # hutch-k8 takes 15-30 s each time; the value does not depend on the seed)
            for seed in range(args.seeds):
                lr = args.lr_non_private if method == "non-private" else args.lr
                r = train_once(method, eps, seed, split, args.epochs, args.batch_size, lr, args.max_grad_norm, sigma)
                sigma = r["sigma"] if method != "non-private" else None
                runs.append(r)
                eps_txt = "-" if eps is None else f"{eps:g} (spent {r['epsilon_reported']:.4f})"
                print(f"{method:>12} eps {eps_txt:<20} seed {seed}  sigma {r['sigma']:.4f}  "
                      f"acc {100 * r['accuracy']:5.1f} %  {1000 * r['s_per_step']:6.1f} ms/step "
                      f"({r['steps']} steps, calibration {r['calibration_s']:.1f} s)", flush=True)
    command = " ".join(["OMP_NUM_THREADS=1 python benchmarks/utility/digits.py",
                        *(sys.argv[1:] if argv is None else argv)])
    methods = list(args.methods)
    replaced: dict[str, float] = {}
    if previous is not None:
        for m in args.methods:   # how far a rerun method moved from the file's runs (0: reproduced)
            before = {(r["epsilon"], r["seed"]): r["accuracy"] for r in previous["runs"] if r["method"] == m}
            if before:
                replaced[m] = max(abs(r["accuracy"] - before[(r["epsilon"], r["seed"])])
                                  for r in runs if r["method"] == m)
                print(f"{m}: replaces the file's runs; largest change of a run's accuracy {100 * replaced[m]:.2f} "
                      f"points", flush=True)
        methods = [m for m in METHODS if m in {*previous["settings"]["methods"], *args.methods}]
        runs = sorted([r for r in previous["runs"] if r["method"] not in args.methods] + runs,
                      key=lambda r: methods.index(r["method"]))
    summary = summarize(runs, methods, args.epsilons)
    print_tables(summary, methods, args.epsilons)
    elapsed = time.perf_counter() - start
    print(f"\ntotal {elapsed:.0f} s")
    settings = {"methods": methods, "epsilons": args.epsilons, "delta": DELTA, "seeds": args.seeds,
                "epochs": args.epochs, "batch_size": args.batch_size,
                "sample_rate": args.batch_size / len(split[0]),
                "optimizer": f"SGD(momentum={MOMENTUM})", "lr": args.lr, "max_grad_norm": args.max_grad_norm,
                "lr_non_private": args.lr_non_private,
                "train": len(split[0]), "test": len(split[2]), "model": "DigitsCNN",
                "parameters": sum(p.numel() for p in DigitsCNN().parameters()),
                "twice": {"coordinate_rate": COORDINATE_RATE, "max_grad_coordinate_over_C": COORDINATE_BOUND},
                "hybrid": {"l2_over_C": HYBRID_SPLIT, "max_grad_coordinate_over_C": COORDINATE_BOUND,
                           "coordinate_rate": COORDINATE_RATE},
                "cyclic": {m: {"groups": g, "bands" if kind != "blt" else "buffers": b,
                               "noise": "gaussian" if kind is None else
                               f"BandedNoise(BandedStrategy.optimized({b}, steps))" if kind == "banded" else
                               f"BLTNoise(BLTStrategy.optimized({b}, steps, min_separation={g}))",
                               "sample_rate": args.batch_size * g / len(split[0]),
                               "steps": planned_steps(g, len(split[0]), args.batch_size, args.epochs)}
                           for m, (g, kind, b) in CYCLIC.items() if m in methods},
                "ci": "95 % confidence interval of the mean over seeds, t distribution, seeds - 1 dof"}
    sigmas = {m: {f"{s['epsilon']:g}": s["sigma"] for s in summary if s["method"] == m}
              for m in methods if m != "non-private"}
    if previous is None:
        result = {
            "description": __doc__.splitlines()[0], "machine": machine(), "command": command,
            "settings": settings, "tuning": tuning, "refused": refused_combinations(split, args.batch_size),
            "runs": runs, "summary": summary, "sigma": sigmas, "total_s": elapsed,
        }
    else:   # the first run's command, machine, tuning and time stay; each merge is recorded beside them
        result = {**previous, "settings": settings, "runs": runs, "summary": summary, "sigma": sigmas}
        result["merges"] = [*previous.get("merges", []),
                            {"command": command, "methods": args.methods, "machine": machine(), "total_s": elapsed,
                             "replaced_max_accuracy_change": replaced}]
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    png = args.out.with_suffix(".png")
    plot(summary, methods, args.epsilons, png, f"digits CNN, {args.seeds} seed(s), {args.epochs} epochs")
    print(f"wrote {args.out} and {png}")
    return result


if __name__ == "__main__":
    main()
