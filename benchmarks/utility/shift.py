r"""Privacy-utility where private fine-tuning matters: a character-level GPT-2 pre-trained on public Wikipedia
text, fine-tuned privately on news, each method tuned on a validation split.

Data (real text shipped inside gensim's wheel as test data, read with ``gensim.test.utils.datapath``; nothing is
downloaded):

* **public**: ``enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2``, 106 English Wikipedia
  articles (the dump's 100 redirects skipped), their wiki markup stripped (:func:`wiki_articles`: references,
  templates, tables, files and categories dropped; links kept as their text), about 3.3M characters; its last
  ``PUBLIC_HELD_OUT`` of articles measure the pre-trained model on its own domain;
* **private**: ABC news, ``lee_background.cor`` (300 articles) and ``lee.cor`` (50 more), split by article (a fixed
  shuffle) into train (60 %), validation (20 %, for tuning) and test (20 %, reported).  Encyclopedic prose to
  news: a shifted domain, where a private fine-tuning has something to learn.

Tokenizer: character level, the characters that occur at least ``MIN_COUNT`` times in the public text plus id 0
for any other; nothing is learned from the private part.  Articles are cut into non-overlapping chunks of
``seq_len`` characters (a tail shorter than a chunk dropped).  **The unit of privacy is one chunk** (one row, one
loss): an article spans several, so an article's guarantee is only the weaker group-privacy one.

Model: GPT-2 from ``transformers.GPT2Config`` (tied embeddings, no dropout), pre-trained without privacy with AdamW
on random windows of the public articles (cached in ``OUT/shift_pretrained_<key>.pt``, ``<key>`` a hash of the
settings and the public text).  Private fine-tuning of all weights with ``dpsgd.PrivacyEngine.make_private``
(Poisson batches, Adam):

* ``exact``, ``ghost``: DP-SGD with exact per-example norms (Gaussian noise, PLD accountant); ``ghost`` computes
  the same norms another way, so it runs with ``exact``'s tuned settings (its rows show the two agree);
* ``hutch``, ``hutchpp``: DP-SGD-RC, norms estimated with ``k = 32`` projections, the noise calibrated over the
  estimator's envelope.  The per-example gradients here have rank up to ``seq_len - 1`` per weight matrix (the
  study measures them, :func:`gradient_ranks`), far above what ``k`` projections capture exactly, so the two
  estimators differ from each other and from exact norms;
* ``banded-b4``: banded matrix-factorization noise (``BandedNoise(BandedStrategy.optimized(4, steps))``) under
  ``CyclicPoisson(4)`` (each example in one of 4 groups; step ``t`` Poisson-samples group ``t mod 4`` at 4 times
  the rate), exact norms, accounted by amplified banded MF: one event per cycle.  Its batches come from another
  sampler, so its paired difference to ``exact`` shares the seed only;
* ``blt-d3``: buffered-linear-Toeplitz noise (``BLTNoise(BLTStrategy.optimized(3, steps, min_separation=4))``)
  under ``CyclicPoisson(4)``, exact norms, accounted **without** amplification (one Gaussian step per cycle: no
  amplification argument for BLT is claimed);
* ``non-private``: the same loop and Poisson batches, neither clipping nor noise (its learning rate tuned too).

**Tuning.**  Each method and epsilon picks its clipping norm ``C`` and learning rate from ``GRID_C x GRID_LR`` by
the validation perplexity of one run each (seed ``TUNE_SEED``); the chosen setting then runs with ``SEEDS``
other seeds and is reported on the test split.  The tuning is not free: every tuning run reads the private train
chunks.  The JSON states, per method and epsilon, the epsilon of the whole procedure (every tuning run and one
reported run composed by the PLD accountant: selecting one of them is post-processing of that composition);
the validation articles are read without privacy (treat them as public or consented data).

``make_private`` calibrates sigma for ``target_epsilon`` at ``delta = 10^floor(log10(N^-1.5))`` (``N`` the
private-train chunks) over the run's steps; runs that share the method and epsilon reuse it (the calibration does
not depend on ``C``, the learning rate or the seed).  The summary is the mean test perplexity over seeds with a 95 %
confidence interval from the t distribution, and each randomized estimator's perplexity minus exact's on the same
seed (paired: same Poisson batches and noise stream; ``banded-b4``, ``blt-d3``: the seed alone).  ``--merge``
runs only ``--methods`` and keeps the other methods' records from ``DIR/shift.json`` (add ``exact`` to check that
its runs reproduce and to pair against them).

    OMP_NUM_THREADS=1 python benchmarks/utility/shift.py --small   # the smoke test's setting: seconds
    OMP_NUM_THREADS=1 python benchmarks/utility/shift.py --jobs 2  # the committed run: 34 min on 2 cores
    OMP_NUM_THREADS=1 python benchmarks/utility/shift.py --jobs 2 --merge --methods exact blt-d3   # its BLT rows
    options: --methods exact hutch ... --epsilons 1 8 --seeds 3 --jobs N --merge --out DIR

Writes ``DIR/shift.json`` (``shift_small.json`` with ``--small``), a PNG plot of the same name and the pre-training
cache; ``DIR`` defaults to ``benchmarks/results/utility`` (``--small``: its untracked ``small/`` folder).
"""

from __future__ import annotations

import argparse
import bz2
import functools
import hashlib
import html
import json
import math
import re
import shlex
import statistics
import sys
import time
import warnings
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from gensim.test.utils import datapath
from study_common import cached_pretraining, machine, non_private_epochs, planned_steps
from text import (
    CharTokenizer,
    chunks,
    decoder,
    lm_losses,
    perplexity,
    plot,
    pretrain,
    pretraining_key,
    print_tables,
    read_articles,
    summarize,
)
from torch import nn

from dpmath import PLDAccountant
from dpmath.correlated import BandedStrategy, BLTStrategy
from dpsgd import PrivacyEngine
from dpsgd.noise import BandedNoise, BLTNoise
from dpsgd.samplers import CyclicPoisson

WIKI = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
PUBLIC_HELD_OUT = 0.05   # the last 5 % of the public articles: the pre-trained model's own-domain perplexity
MIN_COUNT = 50           # a public character seen fewer times is id 0 (unknown)
SPLITS = (0.6, 0.2, 0.2)  # private articles: train, validation, test
SPLIT_SEED = 1234
TUNE_SEED = 100
K = 32
DP_METHODS: dict[str, dict] = {
    "exact": {"estimator": "exact"},
    "ghost": {"estimator": "ghost"},
    "hutch": {"estimator": "hutch", "projection_dim": K},
    "hutchpp": {"estimator": "hutchpp", "projection_dim": K},
    "banded-b4": {"estimator": "exact"},   # and its cyclic sampler and correlated noise (method_kwargs)
    "blt-d3": {"estimator": "exact"},
}
GROUPS = 4   # the correlated methods' CyclicPoisson(4) batches
TUNED_AS = {"ghost": "exact"}   # ghost's norms are exact's: it runs with exact's tuned setting
PAIRED = ("hutch", "hutchpp", "banded-b4", "blt-d3")   # paired to exact by seed in the summary
METHODS = ("non-private", *DP_METHODS)
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "results" / "utility"


@dataclass(frozen=True)
class Setting:
    """Everything that fixes a run besides the method, epsilon, seed, clipping norm and learning rate."""

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
    grid_c: tuple[float, ...]
    grid_lr: tuple[float, ...]


SMALL = Setting(seq_len=32, width=32, layers=1, heads=2, pretrain_steps=40, pretrain_batch=16, pretrain_lr=3e-3,
                private_articles=20, batch=32, epochs=1, grid_c=(0.5, 2.0), grid_lr=(1e-3,))
DEFAULT = Setting(seq_len=128, width=128, layers=2, heads=4, pretrain_steps=4800, pretrain_batch=32, pretrain_lr=3e-3,
                  private_articles=None, batch=64, epochs=2, grid_c=(0.5, 4.0, 8.0), grid_lr=(1e-4, 3e-4, 1e-3, 3e-3))


_DROP_BLOCKS = [re.compile(p, re.S) for p in (r"<ref[^>]*/>", r"<ref[^>]*>.*?</ref>", r"<!--.*?-->",
                                              r"<gallery.*?</gallery>", r"<math.*?</math>")]


def _strip_nested(text: str, open_: str, close: str) -> str:
    """``text`` without its (possibly nested) ``open_ ... close`` spans (templates, tables)."""
    out, depth, i = [], 0, 0
    while i < len(text):
        if text.startswith(open_, i):
            depth, i = depth + 1, i + len(open_)
        elif depth and text.startswith(close, i):
            depth, i = depth - 1, i + len(close)
        else:
            if not depth:
                out.append(text[i])
            i += 1
    return "".join(out)


def clean_wiki(markup: str) -> str:
    """Plain prose from one article's wiki markup: references, comments, templates, tables, files, categories and
    list or heading markers dropped, ``[[target|text]]`` and ``[url text]`` kept as their text."""
    text = html.unescape(markup)
    for pattern in _DROP_BLOCKS:
        text = pattern.sub("", text)
    text = _strip_nested(_strip_nested(text, "{{", "}}"), "{|", "|}")
    text = re.sub(r"\[\[(?:File|Image|Category|[a-z-]{2,}):[^\[\]]*(?:\[\[[^\]]*\]\][^\[\]]*)*\]\]", "", text)
    text = re.sub(r"\[\[(?:[^\]|]*\|)?([^\]]*)\]\]", r"\1", text)
    text = re.sub(r"\[https?://\S+ ?([^\]]*)\]", r"\1", text)
    text = re.sub(r"'{2,}", "", text)
    text = re.sub(r"<[^>]+>", "", text)
    lines = []
    for line in text.splitlines():
        line = line.strip().strip("=").strip()
        line = re.sub(r"^[*#:;]+\s*", "", line)
        if len(line) >= 40:   # prose, not a heading, a bare list item or a leftover of a table
            lines.append(re.sub(r"\s+", " ", line))
    return "\n".join(lines)


def wiki_articles() -> list[str]:
    """The dump's articles (redirects skipped), cleaned by :func:`clean_wiki`, in the dump's order."""
    raw = bz2.open(datapath(WIKI)).read().decode("utf-8")
    out = []
    for page in re.findall(r"<page>.*?</page>", raw, re.S):
        body = re.search(r"<text[^>]*>(.*?)</text>", page, re.S)
        if body is None or re.match(r"\s*#REDIRECT", body.group(1), re.I):
            continue
        text = clean_wiki(body.group(1))
        if text:
            out.append(text)
    return out


@dataclass
class Corpus:
    tokenizer: CharTokenizer
    public: torch.Tensor        # the public pre-training articles' ids, joined by newlines
    public_test: torch.Tensor   # (M, seq_len) chunks of the held-out public articles
    train: torch.Tensor         # (N, seq_len) private chunks
    validation: torch.Tensor
    test: torch.Tensor
    info: dict


def corpus(setting: Setting) -> Corpus:
    wiki = wiki_articles()
    n_held = max(1, round(PUBLIC_HELD_OUT * len(wiki)))
    public_text = "\n".join(wiki[:-n_held]) + "\n"
    counts = Counter(public_text)
    tok = CharTokenizer("".join(c for c, n in counts.items() if n >= MIN_COUNT))
    private = read_articles("lee_background.cor") + read_articles("lee.cor")
    order = torch.randperm(len(private), generator=torch.Generator().manual_seed(SPLIT_SEED)).tolist()
    if setting.private_articles is not None:
        order = order[: setting.private_articles]
    n_val = max(1, round(SPLITS[1] * len(order)))
    n_test = max(1, round(SPLITS[2] * len(order)))
    parts = {"test": order[:n_test], "validation": order[n_test:n_test + n_val], "train": order[n_test + n_val:]}

    def cut(articles: list[str]) -> torch.Tensor:
        return torch.cat([chunks(tok.encode(a), setting.seq_len) for a in articles])

    split = {name: cut([private[i] for i in idx]) for name, idx in parts.items()}
    unknown = sum(int((tok.encode(private[i]) == 0).sum()) for i in order)
    info = {"public_source": f"gensim wheel test data: gensim/test/test_data/{WIKI} (English Wikipedia, markup "
                             "stripped)",
            "private_source": "gensim wheel test data: lee_background.cor and lee.cor (ABC news)",
            "sha256": {n: hashlib.sha256(Path(datapath(n)).read_bytes()).hexdigest()
                       for n in (WIKI, "lee_background.cor", "lee.cor")},
            "tokenizer": f"character level: the public text's characters seen at least {MIN_COUNT} times, id 0 for "
                         "any other",
            "vocab_size": tok.vocab_size, "seq_len": setting.seq_len,
            "public_articles": len(wiki) - n_held, "public_characters": len(public_text),
            "public_held_out_articles": n_held,
            "private_articles": {k: len(v) for k, v in parts.items()},
            "private_chunks": {k: len(v) for k, v in split.items()},
            "private_characters_unknown_to_the_vocabulary": unknown,
            "privacy_unit": f"one chunk of {setting.seq_len} characters (one row); an article spans several"}
    return Corpus(tok, tok.encode(public_text), cut(wiki[-n_held:]), split["train"], split["validation"],
                  split["test"], info)


def pretrained(data: Corpus, setting: Setting, out: Path) -> tuple[dict, dict]:
    """The pre-trained state dict and its record, from the cache when it holds these settings' weights."""
    key = pretraining_key(data.public, data.tokenizer.vocab_size, setting)

    def train() -> tuple[dict, dict]:
        warm = max(1, setting.pretrain_steps // 20)   # a linear warm-up over 5 %, then a cosine decay
        return pretrain(data.public, data.tokenizer.vocab_size, setting,
                        lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * s / setting.pretrain_steps)),
                        reports=8, evaluate=lambda model: perplexity(model, data.public_test))

    return cached_pretraining(out, "shift_pretrained", key, train)


def fresh_model(state: dict, data: Corpus, setting: Setting) -> nn.Module:
    model = decoder(data.tokenizer.vocab_size, setting)
    model.load_state_dict(state)
    model.train()
    return model


def gradient_ranks(state: dict, data: Corpus, setting: Setting, examples: int = 8) -> list[dict]:
    """Per weight matrix of the pre-trained model: the numerical rank of ``examples`` private-train chunks'
    per-example gradients (singular values above ``1e-5`` of the largest, in float64), the ranks that hold 99 % of
    the squared norm, and the share of the squared norm in the top ``K`` singular values (what Hutch++'s sketch can
    hold exactly: it is exact where the rank is at most ``K``)."""
    model = fresh_model(state, data, setting)
    mats = {n: p for n, p in model.named_parameters() if p.dim() == 2}
    per: dict[str, list[tuple[int, int, float]]] = {n: [] for n in mats}
    for i in range(min(examples, len(data.train))):
        model.zero_grad()
        lm_losses(model, data.train[i:i + 1]).sum().backward()
        for n, p in mats.items():
            s = torch.linalg.svdvals(p.grad.double())
            energy = torch.cumsum(s**2, 0) / (s**2).sum()
            per[n].append((int((s > 1e-5 * s[0]).sum()), int((energy < 0.99).sum()) + 1,
                           float(energy[min(K, len(s)) - 1])))
    out = []
    for n, rows in per.items():
        ranks, r99, top = zip(*rows, strict=True)
        out.append({"parameter": n, "shape": list(mats[n].shape), "rank_min": min(ranks),
                    "rank_median": statistics.median(ranks), "rank_max": max(ranks),
                    "rank99_median": statistics.median(r99), "top_k_share_median": statistics.median(top)})
    return out


@functools.lru_cache
def correlated_strategy(method: str, steps: int) -> BandedStrategy | BLTStrategy:
    """banded-b4's 4-band strategy, or blt-d3's 3 buffers for participations ``GROUPS`` steps apart, optimized for
    the run's ``steps`` (once each)."""
    if method == "banded-b4":
        return BandedStrategy.optimized(4, steps)
    return BLTStrategy.optimized(3, steps, min_separation=GROUPS)


def method_kwargs(method: str, data: Corpus, setting: Setting) -> dict:
    """``make_private``'s arguments that define ``method`` (the correlated ones: their sampler, and their strategy
    optimized for the run's steps)."""
    if method in ("banded-b4", "blt-d3"):
        strategy = correlated_strategy(method, planned_steps(GROUPS, len(data.train), setting.batch, setting.epochs))
        noise = BandedNoise(strategy) if method == "banded-b4" else BLTNoise(strategy)
        return {**DP_METHODS[method], "batch_sampling": CyclicPoisson(GROUPS), "noise": noise}
    return DP_METHODS[method]


def _private(model: nn.Module, opt: torch.optim.Optimizer, method: str, privacy: dict, clip: float, seed: int,
             data: Corpus, setting: Setting):
    """``make_private`` as every run calls it: the engine and what it returns."""
    engine = PrivacyEngine()
    with warnings.catch_warnings():   # the study seeds its runs to be reproduced; it releases no model
        warnings.filterwarnings("ignore", message=r"make_private\(seed=", category=UserWarning)
        out = engine.make_private(
            module=model, optimizer=opt,
            data_loader=torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data.train),
                                                    batch_size=setting.batch),
            criterion=nn.CrossEntropyLoss(), max_grad_norm=clip, seed=seed, **privacy,
            **method_kwargs(method, data, setting))
    return engine, *out


def calibrate(method: str, eps: float, state: dict, data: Corpus, setting: Setting, delta: float) -> float:
    """The sigma ``make_private`` calibrates for ``eps`` over the run's steps: it depends on the sampling rate, the
    steps and the estimator's envelope, not on ``C``, the learning rate or the seed, so every run of the cell
    passes it as ``noise_multiplier``."""
    model = fresh_model(state, data, setting)
    engine, *_ = _private(model, torch.optim.Adam(model.parameters()), method,
                          {"target_epsilon": eps, "target_delta": delta, "epochs": setting.epochs}, 1.0, 0, data,
                          setting)
    return engine.noise_multiplier


def gradient_norms(state: dict, data: Corpus, setting: Setting, examples: int = 64) -> dict:
    """10 %, 50 % and 90 % quantiles of the pre-trained model's per-example gradient norms (all weights) on
    ``examples`` held-out public chunks, and on as many private-train chunks: where the clipping norms ``C`` of
    the grid stand against them."""
    model = fresh_model(state, data, setting)
    out = {}
    for name, rows in (("public_held_out", data.public_test), ("private_train", data.train)):
        norms = []
        for i in range(min(examples, len(rows))):
            model.zero_grad()
            lm_losses(model, rows[i:i + 1]).sum().backward()
            norms.append(math.sqrt(sum(float((p.grad ** 2).sum()) for p in model.parameters())))
        q = statistics.quantiles(norms, n=10, method="inclusive")
        out[name] = {"examples": len(norms), "q10": q[0], "median": statistics.median(norms), "q90": q[-1]}
    return out


def run(method: str, eps: float | None, seed: int, clip: float | None, lr: float, sigma: float | None, state: dict,
        data: Corpus, setting: Setting, delta: float, split: str) -> dict:
    """Fine-tune once with noise multiplier ``sigma`` (:func:`calibrate`'s) and measure on ``split``
    ("validation" or "test"); the run's record."""
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    model = fresh_model(state, data, setting)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    record = {"method": method, "epsilon_target": eps, "seed": seed, "max_grad_norm": clip, "lr": lr,
              "split": split}
    if method == "non-private":
        start = time.perf_counter()
        steps = non_private_epochs(model, opt, data.train, setting.batch, setting.epochs, seed, lm_losses)
        record.update(sigma=None, epsilon_reported=None, mechanism=None)
    else:
        engine, model, opt, crit, loader = _private(model, opt, method, {"noise_multiplier": sigma,
                                                                         "epochs": setting.epochs}, clip, seed, data,
                                                    setting)
        start = time.perf_counter()
        for _ in range(setting.epochs):
            for (ids,) in loader:
                opt.zero_grad()
                crit(model(ids).logits[:, :-1], ids[:, 1:]).backward()
                opt.step()
        steps = engine.steps
        record.update(sigma=engine.noise_multiplier, epsilon_reported=engine.get_epsilon(delta),
                      sample_rate=engine.sample_rate,
                      envelope=None if engine.envelope is None else repr(engine.envelope))
        # what the whole tuning procedure composes: this run's events of its mechanism (a cycle of banded-b4's
        # sampler is one event), under its accountant's neighbouring relation
        record.update(mechanism=engine.accounting.mechanism(engine.noise_multiplier),
                      events=engine.accounting.events(steps),
                      neighboring=engine.accounting.accountant().neighboring.value)
    record.update(steps=steps, seconds_per_step=(time.perf_counter() - start) / max(steps, 1),
                  ppl=perplexity(model, getattr(data, split)))
    return record


def grid_end(value: float | None, grid: tuple[float, ...]) -> str:
    """``"lowest"`` or ``"highest"`` where a chosen ``value`` is at that end of a grid of three or more, else ``""``
    (a better value may lie beyond it)."""
    if value is None or len(grid) < 3:
        return ""
    return "lowest" if value == min(grid) else "highest" if value == max(grid) else ""


def execute(tasks: list[tuple], shared: tuple, jobs: int, log) -> list[dict]:
    """``run(*task, *shared)`` for every task, on ``jobs`` processes (one thread each), logged as they finish; in
    the order of ``tasks`` (each run is seeded: the records do not depend on ``jobs``)."""
    if jobs == 1:
        out = []
        for t in tasks:
            out.append(run(*t, *shared))
            log(out[-1])
        return out
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(jobs) as pool:
        pending = [pool.apply_async(run, (*t, *shared), callback=log) for t in tasks]
        return [p.get() for p in pending]


def procedure_epsilon(runs: list[dict], delta: float) -> float:
    """The epsilon of every run in ``runs`` composed (each run's steps of its mechanism): the privacy cost of
    tuning on them and releasing one (selection is post-processing of the composition)."""
    relations = {r["neighboring"] for r in runs}
    if len(relations) != 1:
        raise ValueError(f"runs accounted under different neighbouring relations: {sorted(relations)}")
    acc = PLDAccountant(neighboring=relations.pop())
    for r in runs:
        acc.compose(r["mechanism"], r["events"])
    return acc.epsilon(delta)


def tune(methods: list[str], epsilons: list[float], sigmas: dict, shared: tuple, setting: Setting, jobs: int,
         log) -> tuple[list[dict], dict]:
    """Every grid setting once per method and epsilon on the validation split; the chosen ``(C, lr)`` of each."""
    tasks = []
    for method in methods:
        if method in TUNED_AS:
            continue
        for eps in [None] if method == "non-private" else epsilons:
            grid = [(None, lr) for lr in setting.grid_lr] if method == "non-private" else \
                [(c, lr) for c in setting.grid_c for lr in setting.grid_lr]
            tasks += [(method, eps, TUNE_SEED, clip, lr, sigmas.get((method, eps))) for clip, lr in grid]
    runs = execute(tasks, (*shared, "validation"), jobs, log)
    chosen = {}
    for r in runs:   # the first best of each cell, in the grid's order
        key = (r["method"], r["epsilon_target"])
        if key not in chosen or r["ppl"] < chosen[key][2]:
            chosen[key] = (r["max_grad_norm"], r["lr"], r["ppl"])
    chosen = {k: v[:2] for k, v in chosen.items()}
    for method, src in TUNED_AS.items():
        if method in methods:
            for eps in epsilons:
                if (src, eps) in chosen:
                    chosen[(method, eps)] = chosen[(src, eps)]
    return runs, chosen


def draw(result: dict, path: Path) -> None:
    """The study's plot, from its result (``--replot`` redraws it from the JSON)."""
    setting, levels = result["setting"], result["pretrained_ppl"]
    plot(path, result["summary"], result["paired_to_exact"], levels["test"], ["full"],
         f"char-level GPT-2 ({setting['layers']} layers, width {setting['width']}) pre-trained on Wikipedia\n"
         f"(held-out ppl {levels['public_held_out']:.2f}), fine-tuned on {result['data']['private_chunks']['train']} "
         f"private news chunks;\ndelta {result['delta']:g}, {result['summary'][0]['seeds']} seeds, tuned per method")


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="the smoke test's tiny setting (seconds)")
    ap.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    ap.add_argument("--epsilons", nargs="+", type=float, default=None, help="default 1 8 (8 with --small)")
    ap.add_argument("--seeds", type=int, default=None, help="reported runs per cell: default 3 (1 with --small)")
    ap.add_argument("--out", type=Path, default=None, help="directory for the JSON, the PNG and the cache (default "
                    "benchmarks/results/utility; with --small its untracked small/ folder)")
    ap.add_argument("--jobs", type=int, default=1, help="runs at once, one thread each (the records do not depend "
                    "on it; the seconds per step do)")
    ap.add_argument("--replot", action="store_true", help="redraw the PNG from the JSON of an earlier run")
    ap.add_argument("--merge", action="store_true", help="run --methods only; keep the JSON's other methods")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    setting = SMALL if args.small else DEFAULT
    epsilons = args.epsilons or ([8.0] if args.small else [1.0, 8.0])
    seeds = range(1, 1 + (args.seeds or (1 if args.small else 3)))
    methods = [m for m in METHODS if m in args.methods]
    for method, src in TUNED_AS.items():
        if method in methods and src not in methods:
            ap.error(f"--methods {method} runs with {src}'s tuned setting: add {src}")
    stem = "shift_small" if args.small else "shift"
    if args.out is None:   # a smoke run never overwrites the tracked results
        args.out = DEFAULT_OUT / "small" if args.small else DEFAULT_OUT
    args.out.mkdir(parents=True, exist_ok=True)
    if args.replot:
        result = json.loads((args.out / f"{stem}.json").read_text())
        draw(result, args.out / f"{stem}.png")
        return result
    t0 = time.perf_counter()

    data = corpus(setting)
    n = len(data.train)
    delta = 10.0 ** math.floor(math.log10(n ** -1.5))
    print(f"public {data.info['public_characters']} characters of Wikipedia; private train {n} chunks of "
          f"{setting.seq_len} characters, validation {len(data.validation)}, test {len(data.test)} (news); "
          f"vocabulary {data.tokenizer.vocab_size}; delta {delta:g}", flush=True)
    state, pre = pretrained(data, setting, args.out)
    model = fresh_model(state, data, setting)
    levels = {"public_held_out": perplexity(model, data.public_test), "validation": perplexity(model, data.validation),
              "test": perplexity(model, data.test)}
    origin = "from the cache" if pre["cached"] else f"{pre['seconds']:.0f} s"
    print(f"pre-trained model ({origin}): perplexity per character on held-out Wikipedia "
          f"{levels['public_held_out']:.3f}, on the news test split (zero-shot) {levels['test']:.3f}", flush=True)

    norms = gradient_norms(state, data, setting)
    print("per-example gradient norms (10 % / 50 % / 90 %): " + "; ".join(
        f"{k} {v['q10']:.2f} / {v['median']:.2f} / {v['q90']:.2f}" for k, v in norms.items()), flush=True)
    ranks = gradient_ranks(state, data, setting)
    print(f"\nper-example gradient ranks (8 private-train chunks; numerical rank, ranks holding 99 % of the squared "
          f"norm, share of it in the top {K} singular values), medians:")
    for r in ranks:
        print(f"  {r['parameter']:<32} {str(r['shape']):>12} rank {r['rank_min']}-{r['rank_max']} "
              f"(median {r['rank_median']:g}), 99 %: {r['rank99_median']:g}, top-{K} share "
              f"{r['top_k_share_median']:.3f}", flush=True)

    def log(r: dict) -> None:
        eps_txt = "-" if r["epsilon_target"] is None else f"{r['epsilon_target']:g}"
        dp = "" if r["sigma"] is None else f"C {r['max_grad_norm']:g}, sigma {r['sigma']:.3f}, "
        print(f"{r['split']:>10} {r['method']:>11} eps {eps_txt:>3} seed {r['seed']}: {dp}lr {r['lr']:g}: ppl "
              f"{r['ppl']:.3f}, {r['steps']} steps, {r['seconds_per_step']:.3f} s/step", flush=True)

    sigmas = {(m, e): calibrate(m, e, state, data, setting, delta) for m in methods if m != "non-private"
              for e in epsilons}
    print("\nsigma calibrated by make_private: " + ", ".join(f"{m} eps {e:g}: {v:.4f}" for (m, e), v in sigmas.items()))
    shared = (state, data, setting, delta)
    print("\ntuning on the validation split:", flush=True)
    tuning, chosen = tune(methods, epsilons, sigmas, shared, setting, args.jobs, log)
    print("\nreported runs on the test split:", flush=True)
    tasks = [(method, eps, seed, *chosen[(method, eps)], sigmas.get((method, eps))) for seed in seeds
             for method in methods for eps in ([None] if method == "non-private" else epsilons)]
    runs = [{**r, "mode": "full", "test_ppl": r["ppl"]} for r in execute(tasks, (*shared, "test"), args.jobs, log)]

    kept = {}
    if args.merge:
        kept = json.loads((args.out / f"{stem}.json").read_text())
        fields = ("method", "epsilon_target", "seed", "split", "max_grad_norm", "lr")
        ours = {tuple(r[f] for f in fields): r["ppl"] for r in (*tuning, *runs)}
        again = [(k, r["ppl"], ours[k]) for r in (*kept["tuning"], *kept["runs"])
                 if (k := tuple(r[f] for f in fields)) in ours]
        print(f"\nmerged: {sum(a == b for _, a, b in again)} of {len(again)} runs of the kept file reproduced "
              f"exactly; differing: {[k for k, a, b in again if a != b]}")
        tuning = [r for r in kept["tuning"] if r["method"] not in methods] + tuning
        runs = [r for r in kept["runs"] if r["method"] not in methods] + runs
        methods = [m for m in METHODS if m in methods or any(r["method"] == m for r in runs)]
        runs.sort(key=lambda r: (r["seed"], methods.index(r["method"])))

    procedures = [c for c in kept.get("chosen", []) if c["method"] not in args.methods]
    for (method, eps), (clip, lr) in chosen.items():
        cell = {"method": method, "epsilon_target": eps, "max_grad_norm": clip, "lr": lr}
        if eps is not None:
            src = TUNED_AS.get(method, method)
            tuned = [r for r in tuning if (r["method"], r["epsilon_target"]) == (src, eps)]
            final = next(r for r in runs if (r["method"], r["epsilon_target"]) == (method, eps))
            cell.update(tuning_runs=len(tuned), procedure_epsilon=procedure_epsilon([*tuned, final], delta))
        procedures.append(cell)
    summary, paired = summarize(runs, against_exact=PAIRED)
    print_tables(summary, paired, levels["test"], epsilons)
    print("\nchosen settings (validation perplexity) and the privacy cost of the whole procedure "
          "(every tuning run and one reported run, composed):")
    for p in procedures:
        cost = "" if p["epsilon_target"] is None else \
            f", {p['tuning_runs']} tuning runs + 1: epsilon {p['procedure_epsilon']:.2f} at delta {delta:g}"
        eps_txt = "-" if p["epsilon_target"] is None else f"{p['epsilon_target']:g}"
        edges = [f"{name} at the grid's {end}" for name, value, grid in (("C", p["max_grad_norm"], setting.grid_c),
                                                                         ("lr", p["lr"], setting.grid_lr))
                 if (end := grid_end(value, grid))]
        print(f"  {p['method']:>11} eps {eps_txt:>3}: C {p['max_grad_norm']}, lr {p['lr']:g}"
              f"{' (' + ', '.join(edges) + ')' if edges else ''}{cost}")
    total = time.perf_counter() - t0
    print(f"\ntotal {total:.0f} s")
    for r in (*tuning, *runs):
        if not isinstance(r["mechanism"], str | None):   # (a kept record's is its repr already)
            r["mechanism"] = repr(r["mechanism"])
    result = {"study": "private fine-tuning of a character-level GPT-2 pre-trained on Wikipedia, on news text, each "
                       "method tuned on a validation split",
              "command": shlex.join(["python", "benchmarks/utility/shift.py", *argv]),
              "machine": machine(), "setting": asdict(setting), "data": data.info, "delta": delta, "k": K,
              "optimizer": "Adam", "pretrain": pre, "pretrained_ppl": levels, "gradient_norms": norms,
              "gradient_ranks": ranks,
              "statistics": "mean over seeds, 95 % CI half-width t_{0.975,n-1} s/sqrt(n); paired: the same seed's "
                            "exact run (same Poisson batches and noise stream) subtracted",
              "tuning": tuning, "chosen": procedures, "runs": runs, "summary": summary, "paired_to_exact": paired,
              "total_seconds": total,
              # a merged file's earlier runs: the commands (and their seconds) whose records it keeps
              "earlier_commands": [*kept.get("earlier_commands", []),
                                   {"command": kept["command"], "total_seconds": kept["total_seconds"]}]
              if kept else []}
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    draw(result, args.out / f"{stem}.png")
    print(f"wrote {args.out / f'{stem}.json'} and {args.out / f'{stem}.png'}")
    return result


if __name__ == "__main__":
    main()
