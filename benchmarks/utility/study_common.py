"""What the privacy-utility scripts of benchmarks/utility/ share: the machine they ran on, a mean with its
95 % confidence interval over seeds, and the steps a cyclic Poisson run takes."""

from __future__ import annotations

import math
import os
import platform
import statistics

import torch
from scipy import stats


def machine() -> dict:
    """The platform, Python, torch and thread settings a result was measured with."""
    return {"platform": platform.platform(), "processor": platform.processor(), "python": platform.python_version(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"), "cpu_count": os.cpu_count()}


def mean_ci(values: list[float]) -> tuple[float, float | None]:
    """Mean and the half-width of its 95 % confidence interval, ``t_{0.975, n-1} s / sqrt(n)`` (None for n = 1)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, None
    return mean, float(stats.t.ppf(0.975, len(values) - 1)) * statistics.stdev(values) / math.sqrt(len(values))


def planned_steps(groups: int, num_samples: int, batch_size: int, epochs: int) -> int:
    """The steps ``make_private(epochs=epochs)`` counts under ``CyclicPoisson(groups)``: ``epochs`` loops over the
    loader, each ``groups x max(1, round(1 / q))`` steps at ``q = batch_size x groups / num_samples`` (a correlated
    noise strategy is optimized for them)."""
    q = batch_size * groups / num_samples
    return epochs * groups * max(1, round(1 / q))
