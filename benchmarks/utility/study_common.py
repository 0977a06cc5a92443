"""What the privacy-utility scripts of benchmarks/utility/ share: the machine they ran on, a mean with its
95 % confidence interval over seeds, the steps a cyclic Poisson run takes, the cache of a pre-trained model and
the non-private baseline's loop."""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
from scipy import stats

from dpsgd.data import PoissonBatchSampler


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


def cached_pretraining(out: Path, prefix: str, key: dict, train: Callable[[], tuple[dict, dict]]) -> tuple[dict, dict]:
    """The state dict and record that ``train()`` returns, kept in ``out/<prefix>_<hash of key>.pt`` and read from
    there when it exists (``record["cached"]`` says which; ``record["cache"]`` names the file)."""
    key_text = json.dumps(key, sort_keys=True)
    path = out / f"{prefix}_{hashlib.sha256(key_text.encode()).hexdigest()[:12]}.pt"
    if path.exists():
        saved = torch.load(path, weights_only=True)
        return saved["state_dict"], {**json.loads(saved["record"]), "cache": path.name, "cached": True}
    state, record = train()
    record = {**record, "settings": json.loads(key_text)}
    out.mkdir(parents=True, exist_ok=True)
    torch.save({"state_dict": state, "record": json.dumps(record)}, path)
    return state, {**record, "cache": path.name, "cached": False}


def non_private_epochs(model: torch.nn.Module, opt: torch.optim.Optimizer, rows: torch.Tensor, batch: int,
                       epochs: int, seed: int, losses: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]) -> int:
    """The non-private baseline: ``epochs`` passes of Poisson batches (expected size ``batch``, drawn by ``seed``)
    over ``rows``, each step the mean of ``losses(model, batch_rows)``, neither clipping nor noise; the steps
    taken.  An empty batch is a step that moves nothing, as a noise-only step would not."""
    sampler = PoissonBatchSampler(len(rows), batch / len(rows), generator=torch.Generator().manual_seed(seed))
    steps = 0
    for _ in range(epochs):
        for index in sampler:
            opt.zero_grad()
            if index:
                losses(model, rows[index]).mean().backward()
                opt.step()
            steps += 1
    return steps
