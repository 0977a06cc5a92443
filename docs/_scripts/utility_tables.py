"""The tables of docs/utility.md, rendered at build time from the committed results of benchmarks/utility/
(digits.json, text.json, shift.json, canary_audit.json): nothing in them is typed by hand, nothing is re-trained."""

from __future__ import annotations

import json
import pathlib
import shutil

RESULTS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "utility"

def _digits(data: dict) -> list[str]:
    eps = data["settings"]["epsilons"]
    cells = {(r["method"], r["epsilon"]): r for r in data["summary"]}   # the study's own means and intervals
    methods = [m for m in data["settings"]["methods"] if m != "non-private"]
    base = cells[("non-private", None)]
    lines = [f"Test accuracy (%), mean ± 95 % CI over {data['settings']['seeds']} seeds; non-private: "
             f"{100 * base['accuracy_mean']:.1f} ± {100 * base['accuracy_ci95']:.1f}.  Below each cell: the paired "
             f"difference to `exact` (same seed: the same initial weights, and for the Poisson-sampled methods the "
             f"same batches and noise stream; `cyclic` and the `banded` rows draw their own cyclic batches), in "
             f"points.", "",
             "| method | " + " | ".join(f"ε = {e:g}" for e in eps) + " |", "|---" * (len(eps) + 1) + "|"]
    for m in methods:
        row = []
        for e in eps:
            c = cells[(m, e)]
            cell = f"{100 * c['accuracy_mean']:.1f} ± {100 * c['accuracy_ci95']:.1f}"
            if "diff_vs_exact_mean" in c:
                cell += f"<br>({100 * c['diff_vs_exact_mean']:+.1f} ± {100 * c['diff_vs_exact_ci95']:.1f})"
            row.append(cell)
        lines.append(f"| `{m}` | " + " | ".join(row) + " |")
    lines += ["", "The noise each method pays, σ (LAP2: the Laplace scale over C), calibrated to each ε at "
              f"δ = {data['settings']['delta']:g}:", "", "| method | " + " | ".join(f"ε = {e:g}" for e in eps)
              + " | accountant |", "|---" * (len(eps) + 2) + "|"]
    for m in methods:
        by = {s["epsilon"]: s for s in data["summary"] if s["method"] == m}
        lines.append(f"| `{m}` | " + " | ".join(f"{by[e]['sigma']:.3f}" for e in eps)
                     + f" | {by[eps[0]]['accountant']} |")
    # each method's median over all its runs (every epsilon), not the last epsilon's
    by_method: dict[str, list[float]] = {}
    for s in data["summary"]:
        by_method.setdefault(s["method"], []).append(s["s_per_step_median"])
    times = {m: sorted(v)[len(v) // 2] for m, v in by_method.items()}
    lines += ["", "Median over the privacy levels of the median milliseconds per step: "
              + ", ".join(f"`{m}` {1e3 * t:.1f}" for m, t in times.items()) + ".", ""]
    return lines


def _text(data: dict) -> list[str]:
    summary = data["summary"]
    eps = sorted({s["epsilon_target"] for s in summary if s["epsilon_target"] is not None})
    lines = [f"Test perplexity per character, mean ± 95 % CI over {summary[0]['seeds']} seeds; the pre-trained "
             f"model before fine-tuning: {data['zero_shot_test_ppl']:.3f}.  Below each cell: the paired difference "
             f"to `exact`.", ""]
    paired = {(p["mode"], p["method"], p["epsilon_target"]): p for p in data["paired_to_exact"]}
    for mode in ("full", "lora"):
        rows = [s for s in summary if s["mode"] == mode]
        if not rows:
            continue
        base = next(s for s in rows if s["method"] == "non-private")
        lines += [f"**{'Full fine-tuning' if mode == 'full' else 'LoRA'}** (non-private: "
                  f"{base['test_ppl_mean']:.3f} ± {base['test_ppl_ci95']:.3f})", "",
                  "| method | " + " | ".join(f"ε = {e:g}" for e in eps) + " | σ at each ε |",
                  "|---" * (len(eps) + 2) + "|"]
        for m in dict.fromkeys(s["method"] for s in rows if s["method"] != "non-private"):
            by = {s["epsilon_target"]: s for s in rows if s["method"] == m}
            cells = []
            for e in eps:
                cell = f"{by[e]['test_ppl_mean']:.3f} ± {by[e]['test_ppl_ci95']:.3f}"
                p = paired.get((mode, m, e))
                if p is not None:
                    cell += f"<br>({p['ppl_minus_exact_mean']:+.4f} ± {p['ppl_minus_exact_ci95']:.4f})"
                cells.append(cell)
            sig = " / ".join(f"{by[e]['sigma']:.3f}" for e in eps)
            lines.append(f"| `{m}` | " + " | ".join(cells) + f" | {sig} |")
        lines.append("")
    return lines


def _pm(mean: float, ci: float | None, digits: int = 3, sign: str = "") -> str:
    """``mean ± ci`` (the mean alone for one seed, whose interval is None)."""
    return f"{mean:{sign}.{digits}f}" + ("" if ci is None else f" ± {ci:.{digits}f}")


def _shift(data: dict) -> list[str]:
    info, pre, ppl = data["data"], data["pretrain"], data["pretrained_ppl"]
    summary = data["summary"]
    eps = sorted({s["epsilon_target"] for s in summary if s["epsilon_target"] is not None})
    base = next(s for s in summary if s["method"] == "non-private")
    chunks = info["private_chunks"]
    lines = [f"**The pre-trained model** ({pre['steps']} AdamW steps of {data['setting']['pretrain_batch']} windows "
             f"of {info['seq_len']} characters over {info['public_characters']:,} characters of Wikipedia, "
             f"{pre['seconds'] / 60:.0f} min on one thread): perplexity per character "
             f"{ppl['public_held_out']:.3f} on {info['public_held_out_articles']} held-out Wikipedia articles, "
             f"{ppl['test']:.3f} on the news test split before fine-tuning.  News: {chunks['train']} train, "
             f"{chunks['validation']} validation and {chunks['test']} test chunks; δ = {data['delta']:g}.", "",
             f"Test perplexity per character, mean ± 95 % CI over {summary[0]['seeds']} seeds, each method at its own "
             f"tuned C and learning rate; non-private fine-tuning: {_pm(base['test_ppl_mean'], base['test_ppl_ci95'])}."
             f"  Below each cell: the paired difference to `exact` (same seed: same "
             f"batches and noise stream).", "",
             "| method | " + " | ".join(f"ε = {e:g}" for e in eps) + " | σ at each ε |", "|---" * (len(eps) + 2) + "|"]
    paired = {(p["method"], p["epsilon_target"]): p for p in data["paired_to_exact"]}
    for m in dict.fromkeys(s["method"] for s in summary if s["method"] != "non-private"):
        by = {s["epsilon_target"]: s for s in summary if s["method"] == m}
        cells = []
        for e in eps:
            cell = _pm(by[e]['test_ppl_mean'], by[e]['test_ppl_ci95'])
            p = paired.get((m, e))
            if p is not None:
                cell += f"<br>({_pm(p['ppl_minus_exact_mean'], p['ppl_minus_exact_ci95'], 4, '+')})"
            cells.append(cell)
        lines.append(f"| `{m}` | " + " | ".join(cells) + " | " + " / ".join(f"{by[e]['sigma']:.3f}" for e in eps)
                     + " |")
    grid = data["setting"]
    lines += ["", f"The tuning: C in {{{', '.join(f'{c:g}' for c in grid['grid_c'])}}} × learning rate in "
              f"{{{', '.join(f'{x:g}' for x in grid['grid_lr'])}}}, one validation run each; the privacy cost of the "
              f"whole procedure is every tuning run and the reported run composed (PLD accountant, same δ).", "",
              "| method | ε per run | chosen C | chosen learning rate | runs composed | ε of the procedure |",
              "|---|---|---|---|---|---|"]
    def mark(value: float, values: list[float]) -> str:   # a choice at an end of its grid: better may lie beyond
        return f"{value:g}" + (" (the grid's end)" if len(values) > 2 and value in (min(values), max(values)) else "")

    for c in data["chosen"]:
        lr = mark(c["lr"], grid["grid_lr"])
        if c["epsilon_target"] is None:
            lines.append(f"| `{c['method']}` | – | – | {lr} | – | – |")
        else:
            lines.append(f"| `{c['method']}` | {c['epsilon_target']:g} | {mark(c['max_grad_norm'], grid['grid_c'])} | "
                         f"{lr} | {c['tuning_runs'] + 1} | {c['procedure_epsilon']:.2f} |")
    norms = data["gradient_norms"]
    lines += ["", "The pre-trained model's per-example gradient norms (all weights; 10 % / 50 % / 90 % quantiles): "
              + "; ".join(f"{v['q10']:.2f} / {v['median']:.2f} / {v['q90']:.2f} on {v['examples']} "
                          f"{'held-out Wikipedia' if k == 'public_held_out' else 'news train'} chunks"
                          for k, v in norms.items()) + "."]
    lines += ["", f"Per-example gradient ranks of the pre-trained model on {8} news train chunks (numerical rank: "
              f"singular values above 10⁻⁵ of the largest), the ranks that hold 99 % of the squared norm, and the "
              f"share of the squared norm in the top k = {data['k']} singular values (what Hutch++'s sketch can "
              f"hold exactly):", "", "| weight | shape | rank (min–max) | 99 % of the norm² | top-k share |",
              "|---|---|---|---|---|"]
    for r in data["gradient_ranks"]:
        lines.append(f"| `{r['parameter']}` | {' × '.join(map(str, r['shape']))} | {r['rank_min']}–{r['rank_max']} | "
                     f"{r['rank99_median']:g} | {r['top_k_share_median']:.3f} |")
    return lines + [""]


def _canary(data: dict) -> list[str]:
    s = data["settings"]
    lines = [f"q = {s['sample_rate']}, {s['steps']} steps, σ = {s['noise_multiplier']}, C = {s['max_grad_norm']}, "
             f"k = {s['k']}; {s['runs']} runs pooled per method, each with {s['ordinary']} real images, "
             f"{s['canaries']} gradient-canary slots and {s['input_canaries']} mislabeled-image slots (each filled "
             f"with probability 1/2); lower bounds at {s['confidence']:.0%} confidence, ε read at δ = {s['delta']}.",
             "", "| method | reported ε | lower bound: Clopper-Pearson | one run | input canaries | TPR at 1 % FPR "
             "| holds |", "|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        lines.append(f"| `{r['method']}` | {r['reported_epsilon']:.3f} | {r['lower_bound_clopper_pearson']:.3f} | "
                     f"{r['lower_bound_one_run']:.3f} | {r['lower_bound_input_canaries']:.3f} | "
                     f"{r['tpr_at_1pct_fpr']:.3f} | {'yes' if r['holds'] else '**no**'} |")
    return lines + [""]


def main(out_dir: str, static_dir: str) -> None:
    out, static = pathlib.Path(out_dir), pathlib.Path(static_dir)
    out.mkdir(parents=True, exist_ok=True)
    static.mkdir(parents=True, exist_ok=True)
    for name, render in (("digits", _digits), ("text", _text), ("shift", _shift), ("canary_audit", _canary)):
        data = json.loads((RESULTS / f"{name}.json").read_text())
        (out / f"utility_{name}.md").write_text("\n".join(render(data)))
        png = RESULTS / f"{name}.png"
        if png.exists():
            shutil.copy(png, static / f"utility_{name}.png")
