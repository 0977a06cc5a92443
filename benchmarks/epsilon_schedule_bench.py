"""The time of one ``PrivacyEngine.get_epsilon`` per new step count, on the run's ``EpsilonSchedule``.

Run: ``OMP_NUM_THREADS=1 python benchmarks/epsilon_schedule_bench.py``.  An engine with ``hutch`` at k = 16 on a
model whose envelope has dimension 64 (``nn.Linear(63, 64)``: the LoRA example's ``HutchEnvelope(16, 64)``),
sample rate 1/16, calibrated to epsilon 8 at delta 1e-5 for 48 and for 1000 steps (planned steps known, as in
``DPTrainer``), then trained with ``get_epsilon(1e-5)`` asked at every step (48) or every 10th (1000).  "first s"
is the first call (it builds the step and its transform), "after: median / max s" the others but the last (the
calibrated count, a fresh accountant: "last s"), "fresh s" a fresh ``PLDAccountant``'s epsilon at 3 of those
counts (median; what each call cost before), "vs fresh" the largest relative difference of a logged value from
the fresh accountant's at those counts.  Each row is its own process ("peak RSS MB" its own).
"""

from __future__ import annotations

import json
import platform
import resource
import statistics
import subprocess
import sys
import time


def run(steps: int, every: int) -> dict:
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from dpmath import PLDAccountant
    from dpsgd import PrivacyEngine

    torch.manual_seed(0)
    x = torch.randn(160, 63)
    y = torch.randint(0, 64, (160,))
    model = nn.Linear(63, 64)
    engine = PrivacyEngine()
    model, opt, crit, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=10), criterion=nn.CrossEntropyLoss(),
        max_grad_norm=1.0, estimator="hutch", projection_dim=16, target_epsilon=8.0, target_delta=1e-5,
        steps=steps, seed=0)
    times, logged = [], {}
    while engine.steps < steps:
        for xb, yb in loader:
            crit(model(xb), yb).backward()
            opt.step()
            if engine.steps % every == 0 or engine.steps in (1, steps):
                start = time.perf_counter()
                logged[engine.steps] = engine.get_epsilon(1e-5)
                times.append(time.perf_counter() - start)
            if engine.steps == steps:
                break
    mechanism = engine.accountant().events[0][0]
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    counts = sorted(logged)[1:-1]
    probe = [counts[0], counts[len(counts) // 2], counts[-1]]
    fresh, vs = [], 0.0
    for n in probe:
        start = time.perf_counter()
        eps = PLDAccountant().compose(mechanism, n).epsilon(1e-5)
        fresh.append(time.perf_counter() - start)
        vs = max(vs, logged[n] / eps - 1, key=abs)
    after = times[1:-1]
    return {"steps": steps, "calls": len(times), "first": times[0], "median": statistics.median(after),
            "max": max(after), "last": times[-1], "fresh": statistics.median(fresh), "vs": vs, "rss": rss,
            "sigma": mechanism.noise_multiplier, "envelope": repr(mechanism.envelope)}


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--one":
        print(json.dumps(run(int(sys.argv[2]), int(sys.argv[3]))))
        return
    rows = []
    for steps, every in ((48, 1), (1000, 10)):
        out = subprocess.run([sys.executable, __file__, "--one", str(steps), str(every)], capture_output=True,
                             text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"# {platform.processor() or platform.machine()}, python {platform.python_version()}, OMP_NUM_THREADS=1; "
          f"{rows[0]['envelope']}, q = 1/16")
    print(f"{'steps':>5} {'sigma':>6} {'calls':>5} {'first s':>7} {'after: median s':>15} {'max s':>6} {'last s':>6} "
          f"{'fresh s':>7} {'vs fresh':>9} {'peak RSS MB':>11}")
    for r in rows:
        print(f"{r['steps']:>5} {r['sigma']:>6.3f} {r['calls']:>5} {r['first']:>7.3f} {r['median']:>15.3f} "
              f"{r['max']:>6.3f} {r['last']:>6.3f} {r['fresh']:>7.3f} {r['vs']:>9.1e} {r['rss']:>11.0f}")


if __name__ == "__main__":
    main()
