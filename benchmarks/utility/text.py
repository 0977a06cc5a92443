r"""Privacy-utility on real English text: does randomized clipping cost a language model perplexity?

Data (real text shipped inside gensim's wheel as test data, read with ``gensim.test.utils.datapath``; nothing is
downloaded): ``lee_background.cor`` (300 ABC news articles, one per line) and ``lee.cor`` (50 more, disjoint).
The first ``PUBLIC`` articles of ``lee_background.cor`` are public; the rest of it and all of ``lee.cor`` are
private, split by article (a fixed shuffle) into private-train and private-test articles.

Tokenizer: character level, the characters that occur in the public articles (sorted) plus id 0 for any
character the public text never shows; nothing is learned from the private part.  Each article is cut into
non-overlapping chunks of ``seq_len`` characters (its tail shorter than a chunk is dropped).  **The unit of
privacy is one chunk** (one row, one loss): a private article spans 13 chunks on average (up to about 60), so an
article's guarantee is only the weaker group-privacy one.

Model: a GPT-2 from ``transformers.GPT2Config`` with random initialization (tied embeddings, no dropout).
Public part: non-private pre-training with AdamW on random ``seq_len`` windows of the public articles for a
fixed number of steps (250 steps of 32 windows, about 10 s: deliberately short, so that the private data still
carries information the public model lacks; after 1500 steps, 95 s, non-private fine-tuning gained at best 0.7 %
of perplexity and private fine-tuning at epsilon 8 at best 0.2 %, too little to tell methods apart).  The weights are
cached in ``OUT/text_pretrained_<key>.pt``, ``<key>`` a hash of the settings and of the public text, and reused by
later runs.  Private part: fine-tuning on the private-train chunks with ``dpsgd.PrivacyEngine.make_private``
(Poisson batches, ``C = 1``, Adam, the same hyper-parameters for every method and epsilon), either of all weights
("full") or of LoRA adapters (peft, rank 8, on the attention projections ``attn.c_attn`` and ``attn.c_proj``; the
pre-trained weights frozen):

* ``exact``, ``ghost``: DP-SGD with exact per-example norms (Gaussian noise, PLD accountant);
* ``hutch``, ``hutchpp``: DP-SGD-RC, norms estimated with ``k = 32`` projections, the noise calibrated over
  the estimator's envelope;
* ``lap2``: Laplace noise on the l2-clipped sum (paper 003), exact (ghost) norms, accounted by its Gaussian
  domination;
* ``non-private``: the same loop, optimizer, steps and Poisson batch sizes, with neither clipping nor noise.

Learning rates (Adam 1e-3 for full fine-tuning, 3e-3 for LoRA; 3 epochs of expected batch 128, 30 steps) were
picked by short checks on this split while developing (pre-training 250 or 500 steps; full: 3e-4 or 1e-3, LoRA: 3e-3
or 1e-2; without privacy and with ``exact`` at epsilon 8 and 1), once for every method and epsilon: those checks
are not private, and they favour no estimator.

``make_private`` calibrates sigma for ``target_epsilon`` at ``delta = 10^floor(log10(N^-1.5))`` (``N`` the
private-train chunks) over the run's steps, on the first seed; later seeds reuse that sigma (the calibration
does not depend on the seed).  The record keeps sigma, the epsilon that ``engine.get_epsilon``
reports after the last step, the test perplexity (per character, ``exp`` of the mean next-character
cross-entropy over every private-test chunk) and the seconds per step.  The pre-trained model's test
perplexity before any fine-tuning ("zero-shot") is the level that every private run should beat or match.
Seeds vary the Poisson batches, projections, noise and the LoRA initialization, never the data split or the
pre-trained model; the summary is the mean over seeds with a 95 % confidence interval from the t
distribution (``t_{0.975, n-1} s / sqrt(n)``), and the paired difference of each randomized estimator's
perplexity to ``exact``'s on the same seed (same batches and noise stream).

    OMP_NUM_THREADS=1 python benchmarks/utility/text.py --small    # the smoke test's setting: 11 s (+ 5 s imports)
    OMP_NUM_THREADS=1 python benchmarks/utility/text.py            # the committed run: about 20 min, one thread
    options: --methods exact hutch ... --epsilons 1 8 --seeds 3 --full | --lora --out DIR

Writes ``DIR/text.json`` (``DIR/text_small.json`` with ``--small``), a PNG plot of the same name (test perplexity
against epsilon per method with 95 % intervals, the zero-shot and non-private levels as horizontal lines, one panel
for full fine-tuning and one for LoRA) and the pre-training cache; ``DIR`` defaults to
``benchmarks/results/utility``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import shlex
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from gensim.test.utils import datapath
from peft import LoraConfig, get_peft_model
from study_common import cached_pretraining, machine, mean_ci, non_private_epochs
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

from dpsgd import PrivacyEngine

logging.getLogger("transformers").setLevel(logging.ERROR)
# peft 0.21 reads transformers 5's deprecated ``is_gradient_checkpointing`` on every get_peft_model
warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)

PUBLIC = 225            # public articles: the first 225 of lee_background.cor's 300
TEST_FRACTION = 0.2     # of the private articles, held out as the private test split
SPLIT_SEED = 1234       # the fixed shuffle of the private articles
PRETRAIN_SEED = 0
MAX_GRAD_NORM = 1.0
K = 32                  # projection dimension of hutch and hutchpp
LORA_TARGETS = r".*\.attn\.(c_attn|c_proj)"
DP_METHODS: dict[str, dict] = {
    "exact": {"estimator": "exact"},
    "ghost": {"estimator": "ghost"},
    "hutch": {"estimator": "hutch", "projection_dim": K},
    "hutchpp": {"estimator": "hutchpp", "projection_dim": K},
    "lap2": {"estimator": "ghost", "noise": "laplace"},
}
METHODS = ("non-private", *DP_METHODS)
MODES = ("full", "lora")
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "results" / "utility"


@dataclass(frozen=True)
class Setting:
    """Everything that fixes a run besides the method, epsilon, seed and mode."""

    seq_len: int
    width: int
    layers: int
    heads: int
    pretrain_steps: int
    pretrain_batch: int
    pretrain_lr: float
    private_articles: int | None   # None: every private article; a number: the first ones of the shuffle
    batch: int                     # expected Poisson batch size
    epochs: int
    lr_full: float
    lr_lora: float
    lora_rank: int


SMALL = Setting(seq_len=32, width=32, layers=1, heads=2, pretrain_steps=30, pretrain_batch=16, pretrain_lr=3e-3,
                private_articles=12, batch=128, epochs=1, lr_full=1e-3, lr_lora=3e-3, lora_rank=4)
DEFAULT = Setting(seq_len=64, width=64, layers=2, heads=4, pretrain_steps=250, pretrain_batch=32, pretrain_lr=3e-3,
                  private_articles=None, batch=128, epochs=3, lr_full=1e-3, lr_lora=3e-3, lora_rank=8)


def read_articles(name: str) -> list[str]:
    """One article per non-empty line (latin-1: ``lee.cor`` has a few bytes beyond ASCII)."""
    with open(datapath(name), encoding="latin-1") as fh:
        return [line.strip() for line in fh if line.strip()]


def file_digest(name: str) -> str:
    return hashlib.sha256(Path(datapath(name)).read_bytes()).hexdigest()


class CharTokenizer:
    """Character-level ids: the public text's characters (sorted) from 1 on, 0 for any other character."""

    def __init__(self, public_text: str) -> None:
        self.chars = sorted(set(public_text))
        self.ids = {c: i + 1 for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars) + 1

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self.ids.get(c, 0) for c in text], dtype=torch.long)


def chunks(ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Non-overlapping ``seq_len`` windows of one article (the tail shorter than a window is dropped)."""
    n = len(ids) // seq_len
    return ids[: n * seq_len].reshape(n, seq_len)


@dataclass
class Corpus:
    tokenizer: CharTokenizer
    public: torch.Tensor     # the public articles' ids, concatenated with newlines
    train: torch.Tensor      # (N, seq_len) private-train chunks
    test: torch.Tensor       # (M, seq_len) private-test chunks
    info: dict


def corpus(setting: Setting) -> Corpus:
    background, lee = read_articles("lee_background.cor"), read_articles("lee.cor")
    public_text = "\n".join(background[:PUBLIC]) + "\n"
    tok = CharTokenizer(public_text)
    private = background[PUBLIC:] + lee
    order = torch.randperm(len(private), generator=torch.Generator().manual_seed(SPLIT_SEED)).tolist()
    if setting.private_articles is not None:
        order = order[: setting.private_articles]
    n_test = max(1, round(TEST_FRACTION * len(order)))
    test_articles, train_articles = [private[i] for i in order[:n_test]], [private[i] for i in order[n_test:]]
    train = torch.cat([chunks(tok.encode(a), setting.seq_len) for a in train_articles])
    test = torch.cat([chunks(tok.encode(a), setting.seq_len) for a in test_articles])
    unknown = sum(int((tok.encode(a) == 0).sum()) for a in train_articles + test_articles)
    info = {"source": "gensim wheel test data: gensim/test/test_data/lee_background.cor and lee.cor (ABC news)",
            "sha256": {n: file_digest(n) for n in ("lee_background.cor", "lee.cor")},
            "tokenizer": "character level: the public articles' characters, id 0 for characters they never show",
            "vocab_size": tok.vocab_size, "seq_len": setting.seq_len,
            "public_articles": PUBLIC, "public_characters": len(public_text),
            "private_train_articles": len(train_articles), "private_test_articles": len(test_articles),
            "private_train_chunks": len(train), "private_test_chunks": len(test),
            "private_characters_unknown_to_the_vocabulary": unknown,
            "privacy_unit": f"one chunk of {setting.seq_len} characters (one row); an article spans several"}
    return Corpus(tok, tok.encode(public_text), train, test, info)


def decoder(vocab: int, setting: Setting) -> GPT2LMHeadModel:
    cfg = GPT2Config(vocab_size=vocab, n_positions=setting.seq_len, n_embd=setting.width, n_layer=setting.layers,
                     n_head=setting.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                     eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def lm_losses(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """``(B,)`` next-character cross-entropy, each the mean over its row's positions."""
    logits = model(ids).logits
    return F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none").mean(1)


@torch.no_grad()
def perplexity(model: nn.Module, ids: torch.Tensor) -> float:
    """Per-character perplexity: ``exp`` of the mean cross-entropy over every predicted position (rows have
    equal length, so this is the mean of the row means)."""
    model.eval()
    total = sum(float(lm_losses(model, ids[i:i + 256]).sum()) for i in range(0, len(ids), 256))
    model.train()
    return math.exp(total / len(ids))


def pretrain(public: torch.Tensor, vocab: int, setting, schedule: Callable[[int], float], reports: int,
             evaluate: Callable[[nn.Module], float] | None = None) -> tuple[dict, dict]:
    """Non-private pre-training of :func:`decoder` from seed ``PRETRAIN_SEED``: ``setting.pretrain_steps`` AdamW steps
    (weight decay 0.01, learning rate ``setting.pretrain_lr`` times ``schedule(step)``) on random windows of
    ``setting.seq_len`` ids of ``public``, ``setting.pretrain_batch`` a step; ``reports`` progress lines, each with
    ``evaluate(model)`` (kept as the record's ``curve``) where given.  The state dict and the record."""
    torch.manual_seed(PRETRAIN_SEED)
    model = decoder(vocab, setting)
    opt = torch.optim.AdamW(model.parameters(), lr=setting.pretrain_lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    gen = torch.Generator().manual_seed(PRETRAIN_SEED)
    span = len(public) - setting.seq_len
    start, tail, curve = time.perf_counter(), [], []
    for step in range(setting.pretrain_steps):
        at = torch.randint(0, span + 1, (setting.pretrain_batch, 1), generator=gen) + torch.arange(setting.seq_len)
        loss = lm_losses(model, public[at]).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        tail.append(float(loss.detach()))
        if (step + 1) % max(1, setting.pretrain_steps // reports) == 0:
            line = f"pre-training step {step + 1}/{setting.pretrain_steps}: loss {statistics.mean(tail[-50:]):.3f}"
            if evaluate is not None:
                curve.append({"step": step + 1, "public_test_ppl": evaluate(model)})
                line += f", public held-out ppl {curve[-1]['public_test_ppl']:.3f}"
            print(f"{line}, {time.perf_counter() - start:.0f} s", flush=True)
    record = {"steps": setting.pretrain_steps, "seconds": time.perf_counter() - start,
              "final_train_loss": statistics.mean(tail[-50:])}
    return model.state_dict(), {**record, "curve": curve} if evaluate is not None else record


def pretraining_key(public: torch.Tensor, vocab_size: int, setting) -> dict:
    """What a pre-trained model depends on (its cache key, shared by the studies): the fields of ``setting`` (a
    study's settings dataclass) that set pre-training and the model, the public text's hash, the vocabulary's size and
    the seed."""
    fields = {k: v for k, v in asdict(setting).items() if k.startswith("pretrain") or k in
              ("seq_len", "width", "layers", "heads")}
    return {**fields, "public": hashlib.sha256(public.numpy().tobytes()).hexdigest(), "vocab": vocab_size,
            "seed": PRETRAIN_SEED}


def pretrained(data: Corpus, setting: Setting, out: Path) -> tuple[dict, dict]:
    """The pre-trained state dict and its record, from the cache when it holds these settings' weights."""
    key = pretraining_key(data.public, data.tokenizer.vocab_size, setting)

    def train() -> tuple[dict, dict]:
        return pretrain(data.public, data.tokenizer.vocab_size, setting, lambda s: 1 - s / setting.pretrain_steps,
                        reports=5)

    return cached_pretraining(out, "text_pretrained", key, train)


def fine_tune_model(state: dict, data: Corpus, setting: Setting, mode: str, seed: int) -> nn.Module:
    """The pre-trained model, whole ("full") or frozen under fresh LoRA adapters ("lora", initialized by ``seed``)."""
    torch.manual_seed(seed)
    model = decoder(data.tokenizer.vocab_size, setting)
    model.load_state_dict(state)
    if mode == "lora":
        model = get_peft_model(model, LoraConfig(r=setting.lora_rank, lora_alpha=2 * setting.lora_rank,
                                                 target_modules=LORA_TARGETS, lora_dropout=0.0,
                                                 fan_in_fan_out=True))
    model.train()
    return model


def run(method: str, mode: str, eps: float | None, seed: int, state: dict, data: Corpus, setting: Setting,
        delta: float, calibrated: dict) -> dict:
    """Fine-tune once; the record of the run (sigma, epsilon reported, test perplexity, seconds per step).

    ``calibrated`` maps ``(mode, method, eps)`` to the sigma and planned steps that ``make_private`` calibrated for
    the first seed; later seeds pass that sigma as ``noise_multiplier`` (the calibration depends on the sampling
    rate, the steps and the envelope, not on the seed, and costs up to seconds a call)."""
    model = fine_tune_model(state, data, setting, mode, seed)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=setting.lr_full if mode == "full" else setting.lr_lora)
    dataset = torch.utils.data.TensorDataset(data.train)
    record = {"method": method, "mode": mode, "epsilon_target": eps, "seed": seed,
              "trainable_parameters": sum(p.numel() for p in params)}
    if method == "non-private":
        start = time.perf_counter()
        steps = non_private_epochs(model, opt, data.train, setting.batch, setting.epochs, seed, lm_losses)
        record.update(sigma=None, epsilon_reported=None, make_private_seconds=0.0)
    else:
        key = (mode, method, eps)
        privacy = ({"noise_multiplier": calibrated[key][0]} if key in calibrated else
                   {"target_epsilon": eps, "target_delta": delta, "epochs": setting.epochs})
        engine = PrivacyEngine()
        start = time.perf_counter()
        model, opt, crit, loader = engine.make_private(
            module=model, optimizer=opt, data_loader=torch.utils.data.DataLoader(dataset, batch_size=setting.batch),
            criterion=nn.CrossEntropyLoss(), max_grad_norm=MAX_GRAD_NORM, seed=seed, **privacy, **DP_METHODS[method])
        record["make_private_seconds"] = time.perf_counter() - start
        calibrated.setdefault(key, (engine.noise_multiplier, engine.planned_steps, seed))
        start = time.perf_counter()
        for _ in range(setting.epochs):
            for (ids,) in loader:
                opt.zero_grad()
                crit(model(ids).logits[:, :-1], ids[:, 1:]).backward()
                opt.step()
        steps = engine.steps
        record.update(sigma=engine.noise_multiplier, sigma_calibrated_by_seed=calibrated[key][2],
                      planned_steps=calibrated[key][1], epsilon_reported=engine.get_epsilon(delta),
                      sample_rate=engine.sample_rate,
                      envelope=None if engine.envelope is None else repr(engine.envelope),
                      accountant=type(engine.accounting.accountant()).__name__)
    seconds = time.perf_counter() - start
    record.update(steps=steps, seconds_per_step=seconds / max(steps, 1), test_ppl=perplexity(model, data.test))
    return record


def summarize(runs: list[dict], against_exact: tuple[str, ...] = ("hutch", "hutchpp")) -> tuple[list[dict], list[dict]]:
    """Per (mode, method, epsilon): mean and 95 % interval over seeds; and the perplexity of each method of
    ``against_exact`` minus exact's on the same seed (paired)."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["mode"], r["method"], r["epsilon_target"]), []).append(r)
    summary = []
    for (mode, method, eps), rs in groups.items():
        mean, ci = mean_ci([r["test_ppl"] for r in rs])
        summary.append({"mode": mode, "method": method, "epsilon_target": eps, "seeds": len(rs), "test_ppl_mean": mean,
                        "test_ppl_ci95": ci, "sigma": rs[0]["sigma"],
                        "epsilon_reported_max": None if eps is None else max(r["epsilon_reported"] for r in rs),
                        "seconds_per_step_median": statistics.median(r["seconds_per_step"] for r in rs)})
    paired = []
    for (mode, method, eps), rs in groups.items():
        base = {r["seed"]: r["test_ppl"] for r in groups.get((mode, "exact", eps), [])}
        diffs = [r["test_ppl"] - base[r["seed"]] for r in rs if r["seed"] in base]
        if method in against_exact and diffs:
            mean, ci = mean_ci(diffs)
            paired.append({"mode": mode, "method": method, "epsilon_target": eps, "seeds": len(diffs),
                           "ppl_minus_exact_mean": mean, "ppl_minus_exact_ci95": ci})
    return summary, paired


def fmt(mean: float, ci: float | None, digits: int = 3) -> str:
    return f"{mean:.{digits}f}" + ("" if ci is None else f" ± {ci:.{digits}f}")


def print_tables(summary: list[dict], paired: list[dict], zero_shot: float, epsilons: list[float]) -> None:
    print(f"\ntest perplexity per character, mean ± 95 % CI (t over seeds); zero-shot (pre-trained) {zero_shot:.3f}")
    print(f"{'mode':>4} {'method':>11} " + " ".join(f"{'eps ' + format(e, 'g'):>15}" for e in epsilons) + "  sigma")
    for s in summary:
        if s["method"] == "non-private":
            print(f"{s['mode']:>4} {s['method']:>11} {fmt(s['test_ppl_mean'], s['test_ppl_ci95']):>15} (no privacy)")
    for mode, method in dict.fromkeys((s["mode"], s["method"]) for s in summary if s["method"] != "non-private"):
        cells = {s["epsilon_target"]: s for s in summary if (s["mode"], s["method"]) == (mode, method)}
        line = " ".join(f"{fmt(cells[e]['test_ppl_mean'], cells[e]['test_ppl_ci95']):>15}" if e in cells
                        else f"{'-':>15}" for e in epsilons)
        sigma = " ".join(f"{cells[e]['sigma']:.3f}" for e in epsilons if e in cells)
        print(f"{mode:>4} {method:>11} {line}  {sigma}")
    if paired:
        print("\nperplexity minus exact's on the same seed (paired), mean ± 95 % CI")
        for p in paired:
            print(f"{p['mode']:>4} {p['method']:>11} eps {p['epsilon_target']:g}: "
                  f"{fmt(p['ppl_minus_exact_mean'], p['ppl_minus_exact_ci95'], 4)}")


def plot(path: Path, summary: list[dict], paired: list[dict], zero_shot: float, modes: list[str], title: str) -> None:
    """Top row: test perplexity against epsilon per method (one panel per mode, own y axis); bottom row, where there
    are paired differences: each paired method's perplexity minus exact's on the same seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = 2 if paired else 1
    fig, axes = plt.subplots(rows, len(modes), figsize=(6 * len(modes), 4 + 3 * (rows - 1)), squeeze=False,
                             height_ratios=[4, 3][:rows])
    dp = list(dict.fromkeys(s["method"] for s in summary if s["method"] != "non-private"))
    colors = {m: f"C{i}" for i, m in enumerate(dp)}
    epsilons = sorted({s["epsilon_target"] for s in summary if s["epsilon_target"] is not None})

    def bars(ax, points: list[tuple[float, float, float | None]], j: int, n: int, method: str) -> None:
        shift = 1.04 ** (j - (n - 1) / 2)   # spread the methods apart on the log axis so the bars stay visible
        pts = sorted(points)
        ax.errorbar([e * shift for e, _, _ in pts], [m for _, m, _ in pts], yerr=[c or 0.0 for _, _, c in pts],
                    marker="o", ms=4, capsize=3, label=method, color=colors[method])

    for col, mode in enumerate(modes):
        ax = axes[0][col]
        cells = [s for s in summary if s["mode"] == mode]
        for j, method in enumerate(dp):
            bars(ax, [(s["epsilon_target"], s["test_ppl_mean"], s["test_ppl_ci95"]) for s in cells
                      if s["method"] == method], j, len(dp), method)
        ax.axhline(zero_shot, color="black", ls="--", lw=1, label="pre-trained (zero-shot)")
        for s in cells:
            if s["method"] == "non-private":
                ax.axhline(s["test_ppl_mean"], color="grey", ls=":", lw=1.5, label="non-private fine-tuned (± CI)")
                if s["test_ppl_ci95"]:
                    ax.axhspan(s["test_ppl_mean"] - s["test_ppl_ci95"], s["test_ppl_mean"] + s["test_ppl_ci95"],
                               color="grey", alpha=0.15)
        ax.set_title("full fine-tuning" if mode == "full" else "LoRA (attention projections)")
        ax.set_ylabel("test perplexity per character\n(mean, 95 % CI over seeds)")
        if rows == 2:
            ax = axes[1][col]
            randomized = list(dict.fromkeys(p["method"] for p in paired if p["mode"] == mode))
            for j, method in enumerate(randomized):
                bars(ax, [(p["epsilon_target"], p["ppl_minus_exact_mean"], p["ppl_minus_exact_ci95"]) for p in paired
                          if p["mode"] == mode and p["method"] == method], j, len(randomized), method)
            ax.axhline(0.0, color="black", lw=1)
            ax.set_ylabel("perplexity minus exact's\n(paired by seed, 95 % CI)")
        for ax in axes[:, col]:
            ax.set_xscale("log")
            ax.set_xticks(epsilons, [f"{e:g}" for e in epsilons])
            ax.minorticks_off()
            ax.set_xlabel("target epsilon")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="the smoke test's tiny setting (seconds)")
    ap.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    ap.add_argument("--epsilons", nargs="+", type=float, default=None, help="default 1 2 4 8 (8 with --small)")
    ap.add_argument("--seeds", type=int, default=None, help="default 3 (2 with --small)")
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--full", dest="modes", action="store_const", const=["full"], help="full fine-tuning only")
    which.add_argument("--lora", dest="modes", action="store_const", const=["lora"], help="LoRA only")
    ap.add_argument("--out", type=Path, default=None, help="directory for the JSON, the PNG and the cache (default "
                    "benchmarks/results/utility; with --small its untracked small/ folder)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    setting = SMALL if args.small else DEFAULT
    epsilons = args.epsilons or ([8.0] if args.small else [1.0, 2.0, 4.0, 8.0])
    seeds = range(args.seeds or (2 if args.small else 3))
    modes = args.modes or list(MODES)
    stem = "text_small" if args.small else "text"
    if args.out is None:   # a smoke run never overwrites the tracked results
        args.out = DEFAULT_OUT / "small" if args.small else DEFAULT_OUT
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()

    data = corpus(setting)
    n = len(data.train)
    delta = 10.0 ** math.floor(math.log10(n ** -1.5))
    print(f"private train {n} chunks of {setting.seq_len} characters ({data.info['private_train_articles']} "
          f"articles), test {len(data.test)} chunks; vocabulary {data.tokenizer.vocab_size}; delta {delta:g}",
          flush=True)
    state, pre = pretrained(data, setting, args.out)
    model = decoder(data.tokenizer.vocab_size, setting)
    model.load_state_dict(state)
    zero_shot = perplexity(model, data.test)
    origin = "from the cache" if pre["cached"] else f"{pre['seconds']:.0f} s"
    print(f"pre-trained model ({origin}): test perplexity {zero_shot:.3f}", flush=True)

    runs, calibrated = [], {}
    for mode in modes:
        for seed in seeds:
            for method in args.methods:
                for eps in [None] if method == "non-private" else epsilons:
                    r = run(method, mode, eps, seed, state, data, setting, delta, calibrated)
                    runs.append(r)
                    eps_txt = "-" if eps is None else f"{eps:g}"
                    reported = "" if r["sigma"] is None else (f"sigma {r['sigma']:.3f}, epsilon "
                                                              f"{r['epsilon_reported']:.3f}, ")
                    print(f"{mode:>4} {method:>11} eps {eps_txt:>3} seed {seed}: {reported}test ppl "
                          f"{r['test_ppl']:.3f}, {r['steps']} steps, {r['seconds_per_step']:.3f} s/step", flush=True)
    summary, paired = summarize(runs)
    print_tables(summary, paired, zero_shot, epsilons)
    total = time.perf_counter() - t0
    print(f"\ntotal {total:.0f} s")
    result = {"study": "privacy-utility of private fine-tuning of a character-level GPT-2 on real news text",
              "command": shlex.join(["python", "benchmarks/utility/text.py", *argv]),
              "machine": machine(), "setting": asdict(setting), "data": data.info, "delta": delta,
              "max_grad_norm": MAX_GRAD_NORM, "k": K, "lora_targets": LORA_TARGETS, "optimizer": "Adam",
              "pretrain": pre, "zero_shot_test_ppl": zero_shot,
              "statistics": "mean over seeds, 95 % CI half-width t_{0.975,n-1} s/sqrt(n); paired: the same seed's "
                            "exact run (same Poisson batches and noise stream) subtracted",
              "runs": runs, "summary": summary, "paired_to_exact": paired, "total_seconds": total}
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(args.out / f"{stem}.png", summary, paired, zero_shot, modes,
         f"char-level GPT-2 ({setting.layers} layers, width {setting.width}) fine-tuned on {n} private chunks, "
         f"delta {delta:g}, {len(seeds)} seeds")
    print(f"wrote {args.out / f'{stem}.json'} and {args.out / f'{stem}.png'}")
    return result


if __name__ == "__main__":
    main()
