"""Generate the benchmarks page's tables from ``benchmarks/results/`` at docs build time.

Each entry of :data:`TASKS` names one question a user asks, the command that answers it, the machine it
ran on and the result file.  A result file may hold earlier runs above the current one (each run appends):
the page shows the *last* printed occurrence of each named table, or the file's last run (what follows
its last ``# `` header line), so the page is always the newest measurement and never hand-copied.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
RESULTS = os.path.join(ROOT, "benchmarks", "results")

CPU = "the project's shared 2-core CPU machine, torch 2.13.0+cpu, one thread per process (`OMP_NUM_THREADS=1`)"
H200 = "one NVIDIA H200 (a lent machine), torch 2.11.0+cu130"


@dataclass(frozen=True)
class Task:
    section: str
    title: str
    what: str
    command: str
    machine: str
    file: str
    tables: tuple[str, ...] = field(default_factory=tuple)   # line prefixes of the tables to show; () = last run


TASKS = [
    Task("Accountants", "DP-SGD ε against peers and the referee",
         "Our bracket (the coarse single grid, `bracket_rtol=None`, and refined to 0.1 %), dp_accounting, "
         "prv_accountant and the referee's enclosure of the true ε, with times; ratios are to dp_accounting in the "
         "same run.",
         "python benchmarks/accountant_bench.py --tables 1", CPU, "accountant_bench.txt", ("Table 1:",)),
    Task("Accountants", "The default bracket",
         "What `PLDAccountant()` answers (`bracket_rtol=\"auto\"`): the default bracket's width against the "
         "coarse grid's, and the default `epsilon` and `epsilon_bracket` timed against the coarse `epsilon` and "
         "dp_accounting, alternated, medians of 5.",
         "python benchmarks/accountant_bench.py --tables 6 --no-prv", CPU, "accountant_bench.txt", ("Table 6:",)),
    Task("Accountants", "DP-SGD-RC ε brackets",
         "Randomized clipping (Hutch, k = 32, d = 2048): the default bracket and one refined to 0.5 %, cold and "
         "warm.", "python benchmarks/accountant_bench.py --tables 2 --no-prv", CPU, "accountant_bench.txt",
         ("Table 2:",)),
    Task("Accountants", "Calibrating the noise multiplier",
         "The noise multiplier for ε = 0.7 at paper 000's Table 4 setting, per estimator.",
         "python benchmarks/accountant_bench.py --tables 3 --no-prv", CPU, "accountant_bench.txt", ("Table 3:",)),
    Task("Accountants", "One DP-SGD-RC step against the referee",
         "Three one-step randomized-clipping cases: the referee's enclosure of the truth and our brackets.",
         "python benchmarks/accountant_bench.py --tables 4 --no-prv", CPU, "accountant_bench.txt", ("Table 4:",)),
    Task("Accountants", "Tiny sampling rates",
         "DP-SGD at very small q: our bracket against dp_accounting.",
         "python benchmarks/accountant_bench.py --tables 5 --no-prv", CPU, "accountant_bench.txt", ("Table 5:",)),
    Task("Accountants", "Randomized-clipping brackets and calibration, old against new",
         "The randomized-clipping queries timed against the previous implementation, alternated.",
         "python benchmarks/rc_bracket_bench.py", CPU, "rc_bracket_bench.txt"),
    Task("Accountants", "What each batch sampling costs, and its peers",
         "ε after 1, 3 and 10 epochs for each `batch_sampling` at the same noise (Table S1); truncated Poisson and "
         "fixed-size batches beside dp_accounting on the same events (Table S2); balls in bins (random allocation) "
         "beside Poisson sampling at 1/t, the Rényi bound of random allocation and no amplification (Table S3).",
         "python benchmarks/sampling_bench.py --json", CPU, "sampling_bench.txt",
         ("Table S1:", "Table S2:", "Table S3:")),
    Task("Accountants", "Every mechanism family's default bracket, before and after",
         "One accounting call per row, `PLDAccountant(...).compose(mechanism, count).epsilon_bracket(delta)` with the "
         "default `bracket_rtol` unless the row names one, each in a fresh process (cold time, peak RSS): DP-SGD, "
         "randomized clipping, random allocation (one and k participations), fixed-size and truncated Poisson "
         "batches, and the cost rows.  \"before\" is the checkout named in the run's header, alternated row by row "
         "with \"after\" in one run.",
         "python benchmarks/dpmath_widths.py --compare DIR", CPU, "dpmath_widths.md"),
    Task("Accountants", "Random allocation's octave bands as fine as the epochs need",
         "The table's random-allocation and cost rows, the bands built first on 2^18 points and again finer only where "
         "the composed epochs' width would show, against the checkout before, alternated row by row in one run.",
         "python benchmarks/dpmath_widths.py --families alloc cost --compare DIR", CPU, "dpmath_alloc_bands.md"),
    Task("Accountants", "Random allocation's doubled sums trimmed to their mass",
         "The table's random-allocation and cost rows, a removing epoch's doubled sums reaching only as high as their "
         "mass and the finest build capped by the doublings of its sum, against the checkout before, alternated row "
         "by row in one run.",
         "python benchmarks/dpmath_widths.py --families alloc cost --compare DIR", CPU, "dpmath_alloc_trim.md"),
    Task("Accountants", "One large FFT plan a precision",
         "Every other family of the table, with at most one large FFT plan kept in each precision, against the "
         "checkout before, alternated row by row in one run: the same brackets, the fine-grid query's peak memory.",
         "python benchmarks/dpmath_widths.py --families dpsgd rc fixed truncated cost --compare DIR", CPU,
         "dpmath_fft_plans.md"),
    Task("Accountants", "A pass's powers in place",
         "The table's cost rows with one large FFT plan a precision and a pass's powers taken in place on its own "
         "transforms, against the checkout before, alternated row by row in one run.",
         "python benchmarks/dpmath_widths.py --families cost --compare DIR", CPU, "dpmath_pass_memory.md"),
    Task("Accountants", "A heavy tail's scale bins one step wide",
         "The table's randomized-clipping and truncated rows and the sweep's randomized-clipping rows, with the scale "
         "grid's tail bins holding a 1/256 decade of mass (one scale step from Hutch k 4 on) and the atoms three FFT "
         "budgets, against the checkout before, alternated row by row in one run each.",
         "python benchmarks/dpmath_widths.py --families rc truncated --compare DIR", CPU, "dpmath_tail_bins.md",
         ("Table S1:", "Table S2:")),
    Task("Accountants", "A band of loss points over a large scale's own losses",
         "The same rows and the cost rows, with a band of evenly spaced loss points where a large scale puts the "
         "example's own mass far beyond the points near zero, and the agreement check's last grid read without its "
         "lower end, against the checkout before, alternated row by row in one run each.",
         "python benchmarks/dpmath_widths.py --families rc truncated cost --compare DIR", CPU, "dpmath_sparse_band.md",
         ("Table S1:", "Table S2:")),
    Task("Accountants", "Random allocation, cold and warm",
         "The table's random-allocation rows, each call timed cold (a new process: the epoch's laws built) and again "
         "on a new accountant in the same process (warm: the laws cached for that noise, epoch length and count).",
         "python benchmarks/dpmath_widths.py --families alloc --warm", CPU, "dpmath_alloc_warm.md"),
    Task("Accountants", "Default brackets off the table",
         "The same calls at random settings: DP-SGD (σ 0.3 to 3, q 1e-5 to 0.1, half of them round numbers, 10 to "
         "3·10⁵ steps, δ 1e-12 to 1e-4) and randomized clipping (Hutch k 4 to 64, d 64 to 2048, σ 0.6 to 3, q 3e-4 to "
         "0.05, 10 to 10⁵ steps, δ 1e-9 to 1e-5).  Heavy-tailed envelopes (k 4 and 8) are the wide and costly rows.",
         "python benchmarks/dpmath_widths.py --sweep 12 --seed 1 --compare DIR", CPU, "dpmath_sweep.md"),
    Task("Accountants", "Heavy tails split at their large losses, against the cut",
         "Random Hutch settings, each composed on one grid and read twice: split at the large losses (the terms with "
         "one large loss exact) and cut (the largest losses charged whole).  Both are valid brackets of the same "
         "steps, so neither lower end may pass the other's upper end; the width ratio is what the exact terms buy "
         "(Table S1).  `delta(epsilon(d)) <= d` at the sweep's far-tail rows (Table S2).",
         "python benchmarks/split_bench.py --settings 14 --seed 1", CPU, "split_bench.txt", ("Table S1:", "Table S2:")),
    Task("Accountants", "epsilon and delta agree; k of T steps against its own pair",
         "`delta(epsilon(d)) / d - 1` on the issue's cases and 20 random DP-SGD settings, with the epsilon query's "
         "time, against an earlier checkout (Table A1); the k-of-T allocation bound against a Monte Carlo delta of the "
         "k-of-T pair itself and Poisson sampling at k / T (Table A2).",
         "python benchmarks/agreement_bench.py --compare DIR", CPU, "agreement_bench.txt"),
    Task("Accountants", "The two-scale lower end",
         "The lower end of the bracket at tiny sampling rates.", "python benchmarks/two_scale_bench.py", CPU,
         "two_scale_bench.txt"),
    Task("Accountants", "Noise calibration inside make_private",
         "What `make_private(target_epsilon=...)` spends calibrating, per estimator.",
         "python benchmarks/make_private_bench.py", CPU, "make_private_bench.txt"),
    Task("Mathematics", "The envelope",
         "The Hutch envelope for k = 32, d = 2048 on a 10,000-point grid (Table 1), its cost against d "
         "(Table 2), and paper 000's brute force, measured and extrapolated (Table 3).",
         "python benchmarks/envelope_bench.py", CPU, "envelope_bench.txt", ("Table 1:", "Table 2:", "Table 3:")),
    Task("Mathematics", "The envelope at huge d",
         "The crossing point x₊ and its excess over a heavy-light member for d up to 10⁹.",
         "python benchmarks/envelope_huge_d.py", CPU, "envelope_huge_d.txt"),
    Task("Mathematics", "Chi-square mixtures over any spread",
         "float64 CDFs against mpmath for weights spread over up to 12 decades.",
         "python benchmarks/chi2mix_spread.py", CPU, "chi2mix_spread.txt"),
    Task("Trainer", "Per-sample norms of one layer",
         "Seconds and extra memory of each norm method for one linear layer, with the memory model of paper "
         "000's App. E; ratios to ghost.", "python benchmarks/norm_bench.py", CPU, "norm_bench.txt"),
    Task("Trainer", "Peak memory of one layer's norms",
         "Paper 000's Figure 2 on CPU.",
         "python benchmarks/layer_memory.py --k 8 32 128 512 --plot docs/_static/layer_memory.png", CPU,
         "layer_memory.txt"),
    Task("Trainer", "The step at Llama-3.2-1B widths",
         "One decoder layer at Llama-3.2-1B's widths, T = 1024, B = 1: time and peak memory of a whole step "
         "against the non-private step, and Opacus' ghost clipping.",
         "python benchmarks/step_bench.py --models llama-1b-width --batch 1 --steps 3 --rounds 2 "
         "--methods non-private hutch hutchpp opacus-ghost", CPU, "step_bench_llama_1b_width_final.txt"),
    Task("Trainer", "The step at GPT-2-small widths",
         "Two GPT-2 layers at GPT-2-small's widths (tied embeddings), T = 512, B = 4.",
         "python benchmarks/step_bench.py --models gpt2-small-width --batch 4 --steps 3 --rounds 2 "
         "--methods non-private hutch hutchpp", CPU, "step_bench_gpt2_small_width_final.txt"),
    Task("Trainer", "Long contexts",
         "A Llama-shaped decoder at T = 2048 and 4096.",
         "python benchmarks/step_bench.py --models llama-long --seq-len 2048 4096 --batch 2 --steps 3 --rounds 2 "
         "--methods non-private hutch", CPU,
         "step_bench_long_final.txt"),
    Task("Trainer", "A CNN with Conv2d and GroupNorm", "Batch 64 of 32x32 images.",
         "python benchmarks/step_bench.py --models cnn --batch 64 --steps 5 --rounds 4 "
         "--methods non-private exact ghost hutch", CPU,
         "step_bench_cnn_b64_ghost_exact.txt"),
    Task("Trainer", "A mixture of experts",
         "A Hugging Face `MixtralForCausalLM` from a config (hidden 128, 4 experts, top 2, 2 layers), T = 512, B = 4.",
         "python benchmarks/step_bench.py --models mixtral --methods non-private hutch exact --rounds 3", CPU,
         "step_bench_mixtral_512.txt"),
    Task("Trainer", "`torch.compile`",
         "The long-context decoder compiled with `torch.compile` (inductor, CPU) before `make_private`, T = 2048; "
         "compilation is in the untimed warm-up steps.",
         "python benchmarks/step_bench.py --models llama-long --seq-len 2048 --batch 2 --steps 3 --rounds 3 "
         "--methods non-private hutch compiled-non-private compiled-hutch", CPU,
         "step_bench_compile_llama_long_2048.txt"),
    Task("Trainer", "Drawing the noise", "Gaussian noise for 192 M coordinates.",
         "python benchmarks/noise_bench.py", CPU, "noise_bench.txt"),
    Task("Trainer", "ε at every log", "What `get_epsilon` costs when a trainer logs often: the LoRA example's "
         "run at several `logging_steps`.", "python benchmarks/epsilon_logging_bench.py", CPU,
         "epsilon_logging_bench.txt"),
    Task("Trainer", "One ε query after the first", "The time of each `get_epsilon` after the first, against a "
         "fresh accountant per call.", "python benchmarks/epsilon_schedule_bench.py", CPU,
         "epsilon_schedule_bench.txt"),
    Task("Trainer", "On a GPU: Llama-3.2-1B's shape",
         "16 layers at Llama-3.2-1B's widths under bf16 autocast, per method (measured before the step's "
         "real-width optimizations; see the CPU tables for the current step).",
         "python benchmarks/gpu_step_bench.py --layers 16 --seq-len 2048 8192 --batch 4 1 --precision autocast "
         "--methods hutch ghost exact hutchpp --steps 6 --rounds 1", H200, "gpu_step_bench_h200.txt"),
    Task("Methods", "One tiny decoder, every method",
         "Next-token accuracy of each method at ε = 8, 1, 0.2 on a tiny GPT-2.",
         "python benchmarks/decoder_methods.py --seeds 3", CPU, "decoder_methods.txt"),
    Task("Methods", "Gradient spectra (paper 004)", "The spectra of per-example gradients.",
         "python benchmarks/spectrum_bench.py", CPU, "spectrum_bench.txt"),
    Task("Methods", "The geometric-median task (paper 004)", "Excess loss against dimension.",
         "python benchmarks/geometric_median.py", CPU, "geometric_median.txt"),
]


def _is_header(line: str) -> bool:
    return line.startswith("# ")


def current(lines: list[str], prefixes: tuple[str, ...]) -> list[str]:
    """The newest output in a result file: the last occurrence of each named table, or the last run."""
    if not prefixes:
        starts = [i for i, line in enumerate(lines) if _is_header(line)]
        return lines[starts[-1] + 1:] if starts else lines
    shown: list[str] = []
    for prefix in prefixes:
        starts = [i for i, line in enumerate(lines) if line.startswith(prefix)]
        if not starts:
            raise ValueError(f"no table starting with {prefix!r}")
        end = starts[-1] + 1
        while end < len(lines) and lines[end].strip() and not lines[end].startswith("Table ") \
                and not _is_header(lines[end]):
            end += 1
        shown += lines[starts[-1]:end] + [""]
    return shown


def noise_tables(out_dir: str) -> None:
    """The noise multiplier against k and against d (``benchmarks/noise_curves.py``'s committed JSON) as two
    markdown tables, for the accountants page."""
    with open(os.path.join(RESULTS, "noise_curves.json")) as f:
        curves = json.load(f)
    parts = [f"DP-SGD needs σ = {curves['dpsgd']:.4f}.\n"]
    for key, axis, fixed in (("by_k", "k", "d"), ("by_d", "d", "k")):
        table = curves[key]
        order = sorted(range(len(table[axis])), key=lambda i: table[axis][i])
        head = f"| {axis} ({fixed} = {table[fixed]}) | " + " | ".join(str(table[axis][i]) for i in order) + " |"
        rows = [head, "|---" * (len(order) + 1) + "|"]
        for estimator, name in (("hutch", "Hutch"), ("hutchpp", "Hutch++")):
            rows.append(f"| {name} | " + " | ".join(f"{table[estimator][i]:#.4g}" for i in order) + " |")
        parts.append("\n".join(rows) + "\n")
    with open(os.path.join(out_dir, "noise_curves.md"), "w") as f:
        f.write("\n".join(parts))


def main(out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    noise_tables(out_dir)
    parts, section = [], None
    for task in TASKS:
        path = os.path.join(RESULTS, task.file)
        if task.section != section:
            section = task.section
            parts.append(f"## {section}\n")
        parts.append(f"### {task.title}\n\n{task.what}\n\n`{task.command}`  \nMachine: {task.machine}.  "
                     f"Result file: `benchmarks/results/{task.file}`.\n")
        if not os.path.exists(path):
            parts.append("Not measured yet.\n")
            continue
        with open(path) as f:
            body = current(f.read().rstrip("\n").split("\n"), task.tables)
        parts.append("```text\n" + "\n".join(body).rstrip() + "\n```\n")
    with open(os.path.join(out_dir, "benchmarks.md"), "w") as f:
        f.write("\n".join(parts))


if __name__ == "__main__":
    main(os.path.join(ROOT, "docs", "_generated"))
