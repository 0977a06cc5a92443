"""The cost of epsilon in DPTrainer's logs: one training run per ``logging_steps``, each in a fresh process.

Run: ``OMP_NUM_THREADS=1 python benchmarks/epsilon_logging_bench.py`` (needs the ``hf`` extra).  The run of
``examples/hf_lora_gpt2.py`` (a tiny random GPT-2 with LoRA adapters, 2048 sequences, logical batch 128 as
2 x 64, 3 epochs: 48 noisy steps, ``hutch`` at k = 16, target epsilon 8 at delta 1e-5), trained with
``logging_steps`` 1000 (epsilon logged once, at the end), 8 and 2 at the default
``PrivacyArguments.epsilon_overcount`` (0: each log the epsilon of the steps taken, on the engine's
:class:`dpmath.EpsilonSchedule`), and 2 with ``epsilon_overcount=0.25`` (each log charges a count on a grid
1.25 apart).  Each row is its own process, so its peak RSS is its own; "epsilon s" is the time spent inside
``PrivacyEngine.get_epsilon`` (the logs' epsilon), "compositions" the accountant compositions it ran
(``PLDAccountant.compose`` calls: the calibration's, the schedule's check of its mechanism, the fresh one at
the calibrated count), "ratio" the wall time over the ``logging_steps = 1000`` row's, and "vs fresh" the
largest relative difference of a logged epsilon from a fresh accountant's at the same step count (computed
afterwards, outside the timings; the overcount row charges more steps, so it is above).
"""

from __future__ import annotations

import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run(logging_steps: int, overcount: float) -> dict:
    """One training run in this process; its wall time, peak RSS and time inside ``get_epsilon``."""
    import warnings

    warnings.simplefilter("ignore")
    import torch
    from transformers.utils import logging

    from dpmath import PLDAccountant
    from dpsgd import PrivacyEngine

    logging.set_verbosity_error()
    sys.path.insert(0, str(EXAMPLES))
    import hf_lora_gpt2

    spent = {"calls": 0, "seconds": 0.0, "last": 0.0, "compositions": 0, "logged": {}}
    get_epsilon = PrivacyEngine.get_epsilon

    def timed(engine: PrivacyEngine, delta: float, **kwargs) -> float:
        start = time.perf_counter()
        try:
            spent["last"] = spent["logged"][engine.spent_steps] = get_epsilon(engine, delta, **kwargs)
            return spent["last"]
        finally:
            spent["calls"] += 1
            spent["seconds"] += time.perf_counter() - start

    PrivacyEngine.get_epsilon = timed
    compose = PLDAccountant.compose

    def counted(acc: PLDAccountant, mechanism, count: int = 1) -> PLDAccountant:
        spent["compositions"] += 1
        return compose(acc, mechanism, count)

    PLDAccountant.compose = counted
    training_args, privacy_args = hf_lora_gpt2.TrainingArguments, hf_lora_gpt2.PrivacyArguments
    hf_lora_gpt2.TrainingArguments = lambda *a, **kw: training_args(*a, **{**kw, "logging_steps": logging_steps})
    hf_lora_gpt2.PrivacyArguments = lambda *a, **kw: privacy_args(*a, **{**kw, "epsilon_overcount": overcount})
    torch.manual_seed(0)
    start = time.perf_counter()
    hf_lora_gpt2.main(["--out", "/tmp/epsilon_logging_bench"])
    wall = time.perf_counter() - start
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # KiB on Linux
    return {"logging_steps": logging_steps, "overcount": overcount, "wall_s": wall, "peak_rss_mb": rss,
            "epsilon_calls": spent["calls"], "compositions": spent["compositions"], "epsilon_s": spent["seconds"],
            "final_epsilon": spent["last"], "logged": spent["logged"]}


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--one":
        print(json.dumps(run(int(sys.argv[2]), float(sys.argv[3]))))
        return
    if sys.argv[1:] == ["--mechanism"]:
        _mechanism()
        return
    rows = []
    for steps, overcount in ((1000, 0.0), (8, 0.0), (2, 0.0), (2, 0.25)):
        out = subprocess.run([sys.executable, __file__, "--one", str(steps), str(overcount)], capture_output=True,
                             text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    base = rows[0]["wall_s"]
    fresh = _fresh_epsilons({int(n) for r in rows for n in r["logged"]})
    for r in rows:
        r["vs"] = max((eps / fresh[int(n)] - 1 for n, eps in r["logged"].items()), key=abs)
    print(f"# {platform.processor() or platform.machine()}, python {platform.python_version()}, "
          f"OMP_NUM_THREADS=1, 48 noisy steps")
    print(f"{'logging_steps':>13} {'overcount':>9} {'wall s':>7} {'peak RSS MB':>11} {'epsilon calls':>13} "
          f"{'compositions':>12} {'epsilon s':>9} {'ratio':>5} {'final epsilon':>13} {'vs fresh':>9}")
    for r in rows:
        print(f"{r['logging_steps']:>13} {r['overcount']:>9g} {r['wall_s']:>7.1f} {r['peak_rss_mb']:>11.0f} "
              f"{r['epsilon_calls']:>13} {r['compositions']:>12} {r['epsilon_s']:>9.2f} {r['wall_s'] / base:>5.2f} "
              f"{r['final_epsilon']:>13.6f} {r['vs']:>9.1e}")


def _fresh_epsilons(counts: set[int]) -> dict[int, float]:
    """A fresh accountant's epsilon at each count, for the example's mechanism (its calibrated sigma, read from a
    run that stops at the first log)."""
    out = subprocess.run([sys.executable, __file__, "--mechanism"], capture_output=True, text=True, check=True)
    from dpmath import HutchEnvelope, PLDAccountant, SubsampledGaussian

    sigma, q, k, d = json.loads(out.stdout.strip().splitlines()[-1])
    mechanism = SubsampledGaussian(sigma, q, HutchEnvelope(k, d))
    return {n: PLDAccountant().compose(mechanism, n).epsilon(1e-5) for n in sorted(counts)}


def _mechanism() -> None:
    """Print the example's mechanism (sigma, q, k, d) as JSON: a run stopped at its first epsilon."""
    import warnings

    warnings.simplefilter("ignore")
    from transformers.utils import logging

    from dpsgd import PrivacyEngine

    logging.set_verbosity_error()
    sys.path.insert(0, str(EXAMPLES))
    import hf_lora_gpt2

    def stop(engine: PrivacyEngine, delta: float, **kwargs) -> float:
        m = engine.accountant().events[0][0]
        print(json.dumps([m.noise_multiplier, m.sample_rate, m.envelope.projection_dim, m.envelope.dim]))
        raise SystemExit(0)

    PrivacyEngine.get_epsilon = stop
    hf_lora_gpt2.main(["--out", "/tmp/epsilon_logging_bench"])


if __name__ == "__main__":
    main()
