"""Cold noise calibration: ours (randomized clipping and exact norms) against Opacus and dp_accounting.

Run: ``OMP_NUM_THREADS=1 python benchmarks/calibration_bench.py [--rounds 3]`` (Opacus and dp_accounting from the
``test`` extra; a peer that is not installed is skipped).  Each calibration runs in a fresh Python process, so every
time is a *cold* one (no cache of an earlier call), and is measured inside that process from just before the call to
just after it (imports excluded).  The cases alternate within each round; the table prints medians over rounds and
each time's ratio to our exact-norm calibration of the same setting, from the same run.

Settings: the README's (epsilon 2 at delta 1e-5, 60 steps at q = 0.05; its 20-64-2 network under
``estimator="hutch", projection_dim=16`` has the envelope ``HutchEnvelope(16, 24)``), a small study's (a tiny GPT-2
under Hutch++: ``HutchPPEnvelope(32, 616)``, epsilon 3, 96 steps at q = 0.032) and a long run's (``HutchEnvelope(32,
2048)``, epsilon 8, 3000 steps at q = 0.01).  ``make_private`` rows time the README's whole call (model, loader,
calibration; ``"auto"`` also calibrates exact norms to log the estimate's price).  ``--compare DIR`` reruns
our cases with another checkout's library, alternated with this one's (``benchmarks/results/first_contact.md``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

SETTINGS = {
    "readme": dict(eps=2.0, delta=1e-5, q=0.05, steps=60, envelope="HutchEnvelope(16, 24)"),
    "study": dict(eps=3.0, delta=1e-5, q=0.032, steps=96, envelope="HutchPPEnvelope(32, 616)"),
    "long": dict(eps=8.0, delta=1e-5, q=0.01, steps=3000, envelope="HutchEnvelope(32, 2048)"),
}

CODE = {
    "ours, estimated": """
from dpmath import HutchEnvelope, HutchPPEnvelope, calibrate_noise_multiplier
env = {envelope}
t = time.perf_counter()
sigma = calibrate_noise_multiplier({eps}, {delta}, {q}, {steps}, envelope=env)
""",
    "ours, exact": """
from dpmath import calibrate_noise_multiplier
t = time.perf_counter()
sigma = calibrate_noise_multiplier({eps}, {delta}, {q}, {steps})
""",
    "opacus prv": """
from opacus.accountants.utils import get_noise_multiplier
t = time.perf_counter()
sigma = get_noise_multiplier(target_epsilon={eps}, target_delta={delta}, sample_rate={q}, steps={steps},
                             accountant="prv")
""",
    "opacus rdp": """
from opacus.accountants.utils import get_noise_multiplier
t = time.perf_counter()
sigma = get_noise_multiplier(target_epsilon={eps}, target_delta={delta}, sample_rate={q}, steps={steps},
                             accountant="rdp")
""",
    "dp_accounting pld": """
import dp_accounting
from dp_accounting.pld import pld_privacy_accountant
def event(s):
    return dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent({q}, dp_accounting.GaussianDpEvent(s)), {steps})
t = time.perf_counter()
sigma = dp_accounting.calibrate_dp_mechanism(pld_privacy_accountant.PLDAccountant, event, {eps}, {delta})
""",
    "make_private auto": """
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from dpsgd import PrivacyEngine
torch.manual_seed(0)
data = TensorDataset(torch.randn(1000, 20), torch.randint(0, 2, (1000,)))
t = time.perf_counter()
model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 2))
engine = PrivacyEngine()
engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
                    data_loader=DataLoader(data, batch_size=50), criterion=nn.CrossEntropyLoss(), max_grad_norm=1.0,
                    target_epsilon=2.0, target_delta=1e-5, epochs=3)
sigma = engine.noise_multiplier
""",
}
CODE["make_private hutch k=16"] = CODE["make_private auto"].replace("epochs=3)", "epochs=3, estimator='hutch', "
                                                                               "projection_dim=16)")
README_ONLY = ("make_private auto", "make_private hutch k=16")
OURS = ("ours, estimated", "ours, exact", *README_ONLY)   # the cases --compare reruns at another checkout


def run(case: str, setting: str, checkout: str | None = None) -> tuple[float, float] | None:
    """``(seconds, sigma)`` of one cold calibration in a fresh process (importing the library from ``checkout``
    where given), or ``None`` where a peer is missing."""
    body = CODE[case].format(**SETTINGS[setting])
    script = f"import time\n{body}\nprint(time.perf_counter() - t, sigma)\n"
    env = None if checkout is None else {**os.environ, "PYTHONPATH": checkout}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=checkout)
    if out.returncode != 0:
        if "ModuleNotFoundError" in out.stderr:
            return None
        raise RuntimeError(f"{case} on {setting} failed:\n{out.stderr}")
    seconds, sigma = out.stdout.split()[-2:]
    return float(seconds), float(sigma)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--compare", metavar="DIR",
                        help="also run our cases with the library of another checkout (e.g. a git worktree of an "
                             "older commit), alternated with these: rows marked 'at DIR'")
    args = parser.parse_args()
    cases = [(case, None) for case in CODE]
    if args.compare:
        cases += [(case, args.compare) for case in OURS]
    times: dict[tuple[str, str], list[float]] = {}
    sigmas: dict[tuple[str, str], float] = {}
    for _ in range(args.rounds):
        for setting in args.settings:
            for case, checkout in cases:
                if case in README_ONLY and setting != "readme":
                    continue
                got = run(case, setting, checkout)
                if got is not None:
                    label = case if checkout is None else f"{case} at {checkout}"
                    times.setdefault((label, setting), []).append(got[0])
                    sigmas[(label, setting)] = got[1]
    print(f"cold calibration, median of {args.rounds} fresh processes each (cases alternated), imports excluded")
    for setting in args.settings:
        s = SETTINGS[setting]
        print(f"\n{setting}: epsilon {s['eps']:g}, delta {s['delta']:g}, q {s['q']:g}, {s['steps']} steps; "
              f"estimated: {s['envelope']}")
        base = statistics.median(times[("ours, exact", setting)])
        labels = list(dict.fromkeys(label for label, at in times if at == setting))
        w = max(24, *map(len, labels))
        print(f"  {'case':<{w}} {'sigma':>9} {'median s':>9} {'/ ours exact':>13}")
        for label in labels:
            m = statistics.median(times[(label, setting)])
            print(f"  {label:<{w}} {sigmas[(label, setting)]:>9.5f} {m:>9.3f} {m / base:>13.2f}")


if __name__ == "__main__":
    main()
