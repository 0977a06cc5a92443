"""make_private with a target epsilon: the Hutch path against the ghost path, on a tiny GPT-2.

Run: ``OMP_NUM_THREADS=1 python benchmarks/make_private_bench.py`` (needs the ``hf`` extra).  A GPT-2
config with hidden size 64 and 2 layers (random weights), 1000 sequences of 16 tokens, batch 32, 3 epochs,
target epsilon 3 at delta 1e-5.  The two estimators alternate, median of 3 each; each call builds a fresh
model and engine and calibrates sigma from scratch (the "cold" column is each estimator's first call in the
process).  Prints the noise multipliers and the time ratios Hutch / ghost.
"""

from __future__ import annotations

import time
import warnings

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset


def make_private(estimator: str) -> tuple[float, float]:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging

    from dpsgd import PrivacyEngine

    logging.set_verbosity_error()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=2, vocab_size=100, n_positions=32))
    ids = torch.randint(0, 100, (1000, 16))
    loader = DataLoader(TensorDataset(ids, ids), batch_size=32)
    t = time.perf_counter()
    engine = PrivacyEngine()
    engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=loader,
                        max_grad_norm=1.0, target_epsilon=3.0, target_delta=1e-5, epochs=3, estimator=estimator,
                        projection_dim=32, criterion=torch.nn.CrossEntropyLoss())
    return time.perf_counter() - t, engine.noise_multiplier


def main() -> None:
    warnings.simplefilter("ignore")
    times: dict[str, list[float]] = {"ghost": [], "hutch": []}
    sigmas = {}
    for _ in range(3):
        for est in ("ghost", "hutch"):
            seconds, sigmas[est] = make_private(est)
            times[est].append(seconds)
    ghost, hutch = np.median(times["ghost"]), np.median(times["hutch"])
    print(f"{'estimator':>10} {'sigma':>10} {'cold s':>8} {'median s':>9}")
    for est in ("ghost", "hutch"):
        print(f"{est:>10} {sigmas[est]:>10.6f} {times[est][0]:>8.2f} {np.median(times[est]):>9.2f}")
    first = times["hutch"][0] / times["ghost"][0]
    print(f"ratio hutch / ghost (medians): {hutch / ghost:.2f}; first calls: {first:.2f}")


if __name__ == "__main__":
    main()
