"""Cold calibration and the README's make_private at two checkouts of the library, alternated.

Run: ``python benchmarks/first_contact_bench.py BEFORE_DIR AFTER_DIR [ROUNDS]`` (e.g. a ``git worktree`` of an older
commit, and this checkout).  Each case runs in a fresh process with ``PYTHONPATH`` at the checkout and
``OMP_NUM_THREADS=1``; the table gives the median seconds, the noise multiplier and make_private's last log line.
``benchmarks/results/first_contact.md`` holds a run.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys

CALIBRATE = r"""
import sys, time
from dpmath import HutchEnvelope, HutchPPEnvelope, calibrate_noise_multiplier
cases = {"readme-hutch16": (2.0, 1e-5, 0.05, 60, HutchEnvelope(16, 24)),
         "readme-exact": (2.0, 1e-5, 0.05, 60, None),
         "study": (3.0, 1e-5, 0.032, 96, HutchPPEnvelope(32, 616)),
         "long": (8.0, 1e-5, 0.01, 3000, HutchEnvelope(32, 2048))}
*target, envelope = cases[sys.argv[1]]
t = time.perf_counter()
sigma = calibrate_noise_multiplier(*target, envelope=envelope)
print(time.perf_counter() - t, sigma)
"""

MAKE_PRIVATE = r"""
import io, logging, sys, time
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from dpsgd import PrivacyEngine
log = io.StringIO()
logging.getLogger("dpsgd").addHandler(logging.StreamHandler(log))
logging.getLogger("dpsgd").setLevel(logging.INFO)
torch.manual_seed(0)
data = TensorDataset(torch.randn(1000, 20), torch.randint(0, 2, (1000,)))
kw = {} if sys.argv[1] == "readme" else dict(estimator="hutch", projection_dim=16)
t = time.perf_counter()
engine = PrivacyEngine()
model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 2))
engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
                    data_loader=DataLoader(data, batch_size=50), criterion=nn.CrossEntropyLoss(), max_grad_norm=1.0,
                    target_epsilon=2.0, target_delta=1e-5, epochs=3, **kw)
print(time.perf_counter() - t, engine.noise_multiplier, repr(log.getvalue().splitlines()[-1]))
"""


def run(tree: str, code: str, case: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", code, case], cwd=tree, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "1"})
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    return out.stdout.split(maxsplit=2)


def main() -> None:
    trees = {"before": sys.argv[1], "after": sys.argv[2]}
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    res: dict[tuple[str, str], list[list[str]]] = {}
    for _ in range(rounds):
        for tree, path in trees.items():
            for case in ("readme-hutch16", "readme-exact", "study", "long"):
                res.setdefault((f"calibrate {case}", tree), []).append(run(path, CALIBRATE, case))
            for case in ("readme", "readme-hutch16"):
                res.setdefault((f"make_private {case}", tree), []).append(run(path, MAKE_PRIVATE, case))
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")
    for key in sorted({k for k, _ in res}):
        for tree in trees:
            runs = res[(key, tree)]
            seconds = statistics.median(float(r[0]) for r in runs)
            line = runs[-1][2] if len(runs[-1]) > 2 else ""
            print(f"{key:30} {tree:7} {seconds:7.3f} s  sigma {runs[-1][1]}  {line}")


if __name__ == "__main__":
    main()
