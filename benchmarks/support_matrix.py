"""The support matrix of docs/huggingface.md, measured: every stock Hugging Face family of ``verify/hf_families.py``
(tiny, random weights, built from its config) and the common idioms of ``tests/dpsgd/test_shared.py`` and
``tests/dpsgd/test_parametrizations.py``.

For each model: how the norm plan reads it (modules per handler; the chi-square terms of ``hutch``), the largest
relative error of exact per-example norms against brute force in float64 at B = 1, 3 and T (T = 8), and whether
three private ``hutch`` steps with the row check on every step train in float32 and under bf16 autocast.  Writes
``benchmarks/results/support_matrix.json``; the docs render it at build time.

    python benchmarks/support_matrix.py            # about a minute on one core
"""

from __future__ import annotations

import json
import logging
import pathlib
import time
import warnings
from collections import Counter

import torch
from torch.utils.data import DataLoader, TensorDataset

from dpsgd import PrivacyEngine, per_sample_sq_norms
from dpsgd.plan import NormPlan
from verify.hf_families import FAMILIES, exact_ready
from verify.workloads import SHARED_OUTPUTS, VOCAB, Parametrized, brute_force_sq_norms, parametrized_losses

ROOT = pathlib.Path(__file__).resolve().parents[1]

OUT = ROOT / "benchmarks" / "results" / "support_matrix.json"
T = 8


def _float64(inputs):
    def cast(x):
        return {k: v.double() if v.is_floating_point() else v for k, v in inputs(x).items()}
    return cast


def exact_error(build, b: int) -> float:
    torch.manual_seed(0)
    model, inputs, losses = build()
    model, inputs = exact_ready(model), _float64(inputs)
    ids = torch.randint(1, VOCAB, (b, T), generator=torch.Generator().manual_seed(b))
    ref = brute_force_sq_norms(model, lambda m, i: losses(m, inputs(ids))[i], b)
    got = per_sample_sq_norms(model, lambda m: losses(m, inputs(ids)), "exact")
    return float(((got - ref).abs() / ref.abs().clamp_min(1e-300)).max())


def trains(build, autocast: bool) -> str:
    torch.manual_seed(0)
    model, inputs, losses = build()
    model.train()
    ids = torch.randint(1, VOCAB, (12, T), generator=torch.Generator().manual_seed(1))
    engine = PrivacyEngine()
    engine.check_every_step = True
    try:
        model, opt, loader = engine.make_private(
            module=model, optimizer=torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1),
            data_loader=DataLoader(TensorDataset(ids), batch_size=4), max_grad_norm=1.0, noise_multiplier=1.0,
            estimator="hutch", projection_dim=8, seed=0, batch_sampling="fixed_size")
        for (x,) in loader:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                per = losses(model, inputs(x))
            engine.private_loss(per.float()).backward()
            opt.step()
        return "yes" if engine.steps == len(loader) else "no"
    except Exception as err:   # noqa: BLE001 -- reported in the matrix
        return f"refused: {type(err).__name__}: {str(err)[:120]}"


def plan_of(model) -> dict:
    plan = NormPlan.build(model, "hutch")
    handlers = Counter(type(u.handler).__name__ for u in plan.units)
    d, exact = plan.envelope_dimension()
    return {"model": type(model).__name__, "handlers": dict(sorted(handlers.items())), "terms": d,
            "exact_parts": exact}


def row(name: str, build) -> dict:
    t0 = time.perf_counter()
    model, *_ = build()
    out = {"name": name, **plan_of(model)}
    out["max_rel_error"] = {f"B={b}": exact_error(build, b) for b in (1, 3, T)}
    out["float32"], out["bf16_autocast"] = trains(build, False), trains(build, True)
    out["seconds"] = round(time.perf_counter() - t0, 2)
    return out


def _idiom(build, losses):
    def wrapped():
        return build(), (lambda ids: {"ids": ids}), (lambda m, inp: losses(m, inp["ids"]))
    return wrapped


def main() -> None:
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    rows = [row(name, build) for name, build in FAMILIES.items()]
    cases = {**SHARED_OUTPUTS, **{kind: (lambda kind=kind: Parametrized(kind), parametrized_losses)
                         for kind in ("weight_norm", "orthogonal")}}
    idioms = [row(name, _idiom(build, losses)) for name, (build, losses) in cases.items()]
    import transformers

    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps({"torch": torch.__version__, "transformers": transformers.__version__, "T": T,
                               "families": rows, "idioms": idioms}, indent=1) + "\n")
    for r in rows + idioms:
        err = max(r["max_rel_error"].values())
        print(f"{r['name']:<22} {r['model']:<36} max rel error {err:.1e}  "
              f"{r.get('float32', '-'):<4} {r.get('bf16_autocast', '-'):<4} {r['seconds']:>6.1f}s")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
