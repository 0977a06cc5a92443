r"""End-to-end audits of the trainer: ``dpsgd`` itself trains on data with canaries, and the canaries' scores
give epsilon lower bounds that must stay below the epsilon the :class:`dpsgd.PrivacyEngine` reports.

**Canaries.** Each run trains a real model (the tiny decoder of :mod:`dpsgd.demo` or a tiny Hugging Face
Llama built from a config, on random tokens; or the privacy-utility study's CNN on real handwritten digits)
on ordinary examples plus ``m`` canary slots. The model carries a *probe*, an
``nn.Embedding(m + 1, 1, padding_idx=0)`` looked up at ``j + 1`` for canary ``j`` and at the padding row (no
gradient) for everything else. Canary ``j``'s per-example loss is ``s * probe(j + 1)`` with ``s`` far above
``C`` (a *gradient canary*, a Dirac gradient on its own coordinate), so its clipped contribution is about
``C`` along coordinate ``j`` and no other example touches that coordinate. Each slot holds its canary with
probability 1/2 (decided before training); an empty slot holds an example of zero gradient, so the dataset
size and the sampling rate ``q`` are the same in every run and "slot empty" is the mechanism without the
canary. The ordinary examples train the backbone with the usual cross-entropy through the same private loss,
so the step runs the trainer's whole machinery (hooks, handlers, estimators, the loader, accumulation).

**Scores.**  The auditor sees every noisy update (the threat model of DP-SGD's accounting): after each step
it reads coordinate ``j`` of the probe's update, ``x_t = -Delta w_j * qN / (lr sigma C)`` (plain SGD), and
scores canary ``j`` with the log-likelihood ratio of the subsampled Gaussian,
``sum_t log(1 - q + q exp(x_t / sigma - 1 / (2 sigma^2)))``.  Canaries' scores are independent (their
coordinates, coins and noise are), so scores of all canaries of all runs are pooled and given to
:class:`verify.auditing.CanaryScoreAuditor`: many-run Clopper-Pearson with a split-chosen threshold, and
the one-run bound of Steinke, Nasr and Jagielski (2023) on the first run alone.

**Power.**  The same audit with a deliberately broken step must fail: ``"unclipped"`` (every contribution
left unclipped), ``"half-noise"`` (the noise's standard deviation halved, the accounting unchanged),
``"microbatch-rate"`` (the accountant charged at a micro-batch's sampling rate, a quarter of the logical
batch's).  :func:`trainer_audit` runs the configurations and the broken variants.

**Users.**  A configuration with ``examples_per_user = m > 1`` audits user-level privacy
(``make_private(privacy_unit="user")``): every slot is a user of ``m`` rows (copies of its example), users are
sampled at ``q``, and a canary is a whole user whose ``m`` examples all carry the canary's probe.  The score is
the same, at the user rate; the reported epsilon is per user.  Its broken variants (:data:`USER_BREAKS`) are
``"example-rate"`` (the accountant charged at the example rate ``q / m``) and ``"per-example-clipping"`` (each
example clipped alone, so a user moves the sum by up to ``m C``); :func:`user_audit` runs them.

**Banded noise.**  A configuration with ``noise="banded"`` trains with correlated noise
(:class:`dpsgd.noise.BandedNoise` of ``BandedStrategy.sqrt_prefix_sum(groups)``) under cyclic Poisson sampling
(:class:`dpsgd.samplers.CyclicPoisson` with ``groups`` groups, each eligible example drawn at ``q``).  The probe's
updates then carry ``x_t = 1[canary drawn at t] / sigma + w_t`` with ``w = C^{-1} z``, so the auditor whitens them,
``v = C x = C 1[drawn] / sigma + z`` with ``z`` independent, and scores each participation's window of rows
``t .. t + b - 1`` (disjoint: a canary's steps are ``groups >= b`` apart) by its subsampled log-likelihood ratio
``log(1 - q + q exp(sum_j c_j v_{t+j} / sigma - sum_j c_j^2 / (2 sigma^2)))``, summed over the steps of the canary's
group (read from the sampler: the accounting holds given every example's group, so an auditor who knows them is
within its threat model; the coins of each step stay secret).  This is the Neyman-Pearson statistic of the
accountant's own dominating pair, one subsampled Gaussian at ``sigma / ||c||`` per cycle.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from dataclasses import dataclass
from unittest import mock

import numpy as np

from .auditing import CanaryScoreAuditor
from .result import INSTALL, AuditResult, Figure, skipped_without

__all__ = ["TrainerConfig", "canary_scores", "audit_config", "trainer_audit", "user_audit", "sampler_audit", "BREAKS",
           "USER_BREAKS", "SAMPLER_BREAKS", "CONFIGS", "USER_CONFIGS", "SAMPLER_CONFIGS"]

BREAKS = ("unclipped", "half-noise", "microbatch-rate")
"""The deliberately broken steps that the audit must catch."""

USER_BREAKS = ("example-rate", "per-example-clipping")
"""The deliberately broken user-level steps that the audit of a configuration with users must catch."""

SAMPLER_BREAKS = {"truncated_poisson": "quarter-rate", "fixed_size": "as-poisson", "balls_in_bins": "one-epoch",
                  "shuffling": "as-poisson", "cyclic_poisson": "one-cycle"}
"""The deliberately wrong accounting the audit of each non-Poisson ``batch_sampling`` must catch: ``"as-poisson"``
(the run charged as Poisson sampling at the loader's rate for adding or removing one example, Opacus' silent
mismatch), ``"one-epoch"`` (the epochs begun forgotten: the whole run charged as one epoch), ``"quarter-rate"``
(the truncated steps charged at a quarter of their rate), ``"one-cycle"`` (cyclic Poisson with banded noise: the
cycles begun forgotten, the whole run charged as one cycle)."""

# breaks of the accounting: the reported epsilon is not the sound run's
_ACCOUNTING_BREAKS = ("microbatch-rate", "example-rate", "as-poisson", "one-epoch", "quarter-rate", "one-cycle")


@dataclass(frozen=True)
class TrainerConfig:
    """One audited trainer configuration.

    Attributes
    ----------
    name : str
    backbone : str
        ``"tiny"`` (:class:`dpsgd.demo.TinyLlama`), ``"hf-llama"`` (a tiny ``LlamaForCausalLM``), both on
        random tokens, or ``"digits-cnn"`` (the privacy-utility study's CNN on scikit-learn's real digits).
    estimator : str
    accumulation : int
        Micro-batches per logical batch (:class:`dpsgd.BatchMemoryManager`; 1: none).  The per-example losses
        (cross-entropy, or the canary's probe term) go through :meth:`dpsgd.PrivacyEngine.private_loss`.
    examples_per_user : int
        ``1``: example-level privacy.  ``m > 1``: user-level (``privacy_unit="user"``), every slot a user of
        ``m`` rows, a canary a whole user.
    batch_sampling : str
        ``make_private``'s ``batch_sampling`` by name (:mod:`dpsgd.samplers`; a canary slot's example and its empty
        twin keep the data-set size, so the run audits both neighbouring relations); ``"cyclic_poisson"`` is
        :class:`dpsgd.samplers.CyclicPoisson` with ``groups`` groups, each eligible example drawn at the audit's
        ``sample_rate``.
    noise : str
        ``"gaussian"``, or ``"banded"``: :class:`dpsgd.noise.BandedNoise` of ``BandedStrategy.sqrt_prefix_sum(groups)``
        (needs ``batch_sampling="cyclic_poisson"``).
    groups : int
        Cyclic Poisson's groups, and the banded strategy's bands.
    """

    name: str
    backbone: str = "tiny"
    estimator: str = "hutch"
    accumulation: int = 1
    examples_per_user: int = 1
    batch_sampling: str = "poisson"
    noise: str = "gaussian"
    groups: int = 2


CONFIGS = (
    TrainerConfig("tiny decoder, hutch", "tiny", "hutch"),
    TrainerConfig("tiny decoder, hutchpp, 2 micro-batches", "tiny", "hutchpp", accumulation=2),
    TrainerConfig("tiny decoder, exact", "tiny", "exact"),
    TrainerConfig("HF Llama, ghost", "hf-llama", "ghost"),
    TrainerConfig("HF Llama, hutch, 4 micro-batches", "hf-llama", "hutch", accumulation=4),
)

USER_CONFIGS = (
    TrainerConfig("tiny decoder, exact, users of 4 examples", "tiny", "exact", examples_per_user=4),
    TrainerConfig("tiny decoder, hutch, users of 4 examples, 2 micro-batches", "tiny", "hutch", accumulation=2,
                  examples_per_user=4),
)

SAMPLER_CONFIGS = (
    TrainerConfig("tiny decoder, hutch, truncated Poisson, padded", "tiny", "hutch",
                  batch_sampling="truncated_poisson"),
    TrainerConfig("tiny decoder, hutch, fixed-size batches", "tiny", "hutch", batch_sampling="fixed_size"),
    TrainerConfig("tiny decoder, exact, balls in bins", "tiny", "exact", batch_sampling="balls_in_bins"),
    TrainerConfig("tiny decoder, exact, shuffling", "tiny", "exact", batch_sampling="shuffling"),
    TrainerConfig("tiny decoder, exact, banded noise b=2, cyclic Poisson", "tiny", "exact",
                  batch_sampling="cyclic_poisson", noise="banded", groups=2),
)
"""One configuration per non-Poisson batch sampling (:mod:`dpsgd.samplers`), the last with banded correlated
noise."""

_VOCAB, _LEN, _CLASSES = 32, 8, 4
_DIGIT_CLASSES = 10


def _backbone(kind: str):

    if kind == "tiny":
        from dpsgd.demo import TinyLlama

        return TinyLlama(_VOCAB, _LEN, dim=16, heads=2, layers=1, classes=_CLASSES)
    if kind == "digits-cnn":
        from torch import nn

        # the privacy-utility study's model: convolutions with GroupNorm on 8 x 8 handwritten digits
        return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.SiLU(),
                             nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.GroupNorm(4, 16), nn.SiLU(),
                             nn.Flatten(), nn.Linear(16 * 4 * 4, _DIGIT_CLASSES))
    if kind == "hf-llama":
        import logging

        from transformers import LlamaConfig, LlamaForCausalLM

        logging.getLogger("transformers").setLevel(logging.ERROR)
        cfg = LlamaConfig(vocab_size=_VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=_LEN,
                          tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
        return LlamaForCausalLM(cfg)
    raise ValueError(f"backbone must be 'tiny', 'hf-llama' or 'digits-cnn', got {kind!r}")


def _examples(kind: str, n: int, gen):
    """``n`` inputs and labels: random tokens and labels, or (``"digits-cnn"``) real images of scikit-learn's
    bundled handwritten digits (1,797 of them, drawn with replacement) with their true labels."""
    import torch

    if kind != "digits-cnn":
        return (torch.randint(1, _VOCAB, (n, _LEN), generator=gen),
                torch.randint(0, _CLASSES, (n,), generator=gen))
    from sklearn.datasets import load_digits

    digits = load_digits()
    rows = torch.randint(0, len(digits.target), (n,), generator=gen)
    images = torch.as_tensor(digits.images, dtype=torch.float32)[rows].unsqueeze(1) / 16.0
    return images, torch.as_tensor(digits.target)[rows]


def _model(kind: str, m: int):
    import torch
    from torch import nn

    class CanaryModel(nn.Module):
        """A backbone and the canaries' probe; returns per-example logits and probe outputs."""

        def __init__(self):
            super().__init__()
            self.backbone = _backbone(kind)
            self.probe = nn.Embedding(m + 1, 1, padding_idx=0)
            nn.init.zeros_(self.probe.weight)

        def forward(self, ids, slot):
            out = self.backbone(ids)
            logits = out.logits if hasattr(out, "logits") else out
            return logits, self.probe(slot).squeeze(1)

    torch.manual_seed(0)
    return CanaryModel().train()


def _losses(logits, probe, ids, label, is_canary, scale):
    import torch
    import torch.nn.functional as F

    if logits.dim() == 3:   # causal LM: mean next-token cross-entropy per example
        ce = F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none").mean(1)
    else:
        ce = F.cross_entropy(logits, label, reduction="none")
    # a canary's loss is its probe term only: no gradient reaches the backbone from it (and none reaches the
    # probe from an ordinary example, which looks up the padding row)
    return torch.where(is_canary, scale * probe, ce)


def _scheme(name: str, batch: int, n: int, steps: int, delta: float, groups: int = 2):
    """``make_private``'s ``batch_sampling`` for ``name``: truncated Poisson (padded) at the smallest ``max_batch_size``
    whose overflow has probability at most ``delta / 1000``; cyclic Poisson with ``groups`` groups."""
    if name == "cyclic_poisson":
        from dpsgd.samplers import CyclicPoisson

        return CyclicPoisson(groups)
    if name != "truncated_poisson":
        return name
    from dpmath import TruncatedSubsampledGaussian
    from dpsgd.samplers import TruncatedPoisson

    # padded to a fixed size: the filler rows repeat drawn examples (canaries too), and must add nothing
    return TruncatedPoisson(TruncatedSubsampledGaussian.max_batch_size_for(batch / n, n, steps, delta / 1000), pad=True)


def _noise(config: TrainerConfig):
    """``make_private``'s ``noise`` for ``config``: ``None`` (Gaussian, the default) or banded noise."""
    if config.noise == "gaussian":
        return None
    if config.noise != "banded":
        raise ValueError(f"noise must be 'gaussian' or 'banded', got {config.noise!r}")
    from dpmath.correlated import BandedStrategy
    from dpsgd.noise import BandedNoise

    return BandedNoise(BandedStrategy.sqrt_prefix_sum(config.groups))


def _cyclic_groups(loader, n: int) -> np.ndarray:
    """Each example's group (``n``,) under cyclic Poisson sampling, read from the loader's sampler once it has
    drawn: the accounting holds given the groups, so an auditor may know them (not the steps' coins)."""
    sampler = loader
    while sampler is not None and getattr(sampler, "members", None) is None:
        inner = getattr(sampler, "logical_sampler", None)
        sampler = getattr(sampler, "sampler", None) if inner is None else inner
    if sampler is None:
        raise RuntimeError("the loader's cyclic Poisson sampler (and its groups) was not found")
    group = np.full(n, -1)
    for j, members in enumerate(sampler.members):
        group[members.numpy()] = j
    return group


def _banded_llr(x: np.ndarray, c: tuple[float, ...], sigma: float, q: float, group: np.ndarray,
                groups: int) -> np.ndarray:
    """Per-step log-likelihood ratios (``steps``, ``m``) of canaries under banded noise ``c`` and cyclic Poisson
    sampling: ``x = 1[drawn] / sigma + C^{-1} z`` whitened to ``v = C x``; at each step ``t`` of a canary's group,
    the subsampled ratio of its window of rows ``t .. t + b - 1`` (those of the run), ``log(1 - q + q exp(sum_j c_j
    v_{t+j} / sigma - sum_j c_j^2 / (2 sigma^2)))``; 0 at the other steps."""
    steps, b = x.shape[0], len(c)
    v = c[0] * x
    for j in range(1, b):
        v[j:] += c[j] * x[:-j]
    llr = np.zeros_like(x)
    for t in range(steps):
        cw = np.asarray(c[:min(b, steps - t)])
        window = (cw[:, None] * v[t:t + len(cw)]).sum(0) / sigma - (cw ** 2).sum() / (2 * sigma ** 2)
        if q < 1:
            window = np.logaddexp(np.log1p(-q), np.log(q) + window)
        llr[t] = np.where(group == t % groups, window, 0.0)
    return llr


def _charged_at(fraction: float):
    """The run's accounting broken: each event charged at ``fraction`` of the rate its batches are drawn at (the
    engine's settings are read-only, so the accounting's mechanism is patched)."""
    from dpsgd.accounting import RunAccounting

    original = RunAccounting.mechanism

    def mechanism(self, noise_multiplier):
        lower = dataclasses.replace(self.sampling, sample_rate=self.sampling.sample_rate * fraction)
        return original(dataclasses.replace(self, sampling=lower), noise_multiplier)
    return mock.patch.object(RunAccounting, "mechanism", mechanism)


@contextlib.contextmanager
def _broken(kind: str | None, engine, examples_per_user: int = 1):
    """The deliberately broken step ``kind`` (see the module docstring), or nothing."""
    import dpsgd.step as ps  # the step looks them up in its module

    if kind in USER_BREAKS and examples_per_user == 1:
        raise ValueError(f"break {kind!r} needs a configuration with users (examples_per_user > 1)")
    if kind is None:
        yield
    elif kind == "per-example-clipping":
        original = ps.clipped_backward

        def per_example(capture, losses, max_grad_norm, k, generator, groups=None, **kw):
            return original(capture, losses, max_grad_norm, k, generator, **kw)   # the users' rows forgotten
        with mock.patch.object(ps, "clipped_backward", per_example):
            yield
    elif kind in ("one-epoch", "quarter-rate"):
        from dpsgd.samplers import BoundSampling, TruncatedPoisson

        if kind == "one-epoch":
            patch = mock.patch.object(BoundSampling, "events", lambda self, steps, sampler=None: 1)
        else:
            original = TruncatedPoisson.make_mechanism

            def quarter(self, bound, s, noise, env):
                m = original(self, bound, s, noise, env)
                return type(m)(m.noise_multiplier, m.sample_rate / 4, m.max_batch_size, m.dataset_size, m.envelope)
            patch = mock.patch.object(TruncatedPoisson, "make_mechanism", quarter)
        with patch:
            yield
    elif kind == "as-poisson":
        from dpmath import PLDAccountant
        from dpsgd.samplers import BoundSampling

        if engine.batch_sampling.name == "poisson":
            raise ValueError("break 'as-poisson' needs a configuration with a non-Poisson batch_sampling")
        with mock.patch.object(BoundSampling, "mechanism",
                               lambda self, s, noise, env: noise.mechanism(s, self.sample_rate, env)), \
                mock.patch.object(BoundSampling, "events", lambda self, steps, sampler=None: steps), \
                mock.patch.object(BoundSampling, "accountant", lambda self: PLDAccountant()):
            yield
    elif kind == "one-cycle":
        from dpsgd.samplers import BoundSampling

        if engine.batch_sampling.name != "cyclic_poisson":
            raise ValueError("break 'one-cycle' needs a configuration with batch_sampling='cyclic_poisson'")
        with mock.patch.object(BoundSampling, "events", lambda self, steps, sampler=None: 1):
            yield
    elif kind == "example-rate":
        with _charged_at(1 / examples_per_user):
            yield
    elif kind == "unclipped":
        original = ps.clipped_backward

        def unclipped(capture, losses, max_grad_norm, k, generator, **kw):
            return original(capture, losses, math.inf, k, generator, **kw)
        with mock.patch.object(ps, "clipped_backward", unclipped):
            yield
    elif kind == "half-noise":
        original = ps.noisy_gradients

        def half(sums, noise_std, *a, **kw):
            half_std = [v / 2 for v in noise_std] if isinstance(noise_std, list) else noise_std / 2
            return original(sums, half_std, *a, **kw)
        with mock.patch.object(ps, "noisy_gradients", half):
            yield
    elif kind == "microbatch-rate":
        with _charged_at(1 / 4):   # a micro-batch's rate is charged
            yield
    else:
        raise ValueError(f"break must be one of {BREAKS + USER_BREAKS + tuple(SAMPLER_BREAKS.values())} or None, "
                         f"got {kind!r}")


def canary_scores(config: TrainerConfig, *, canaries: int = 4000, input_canaries: int = 200, ordinary: int = 64,
                  sample_rate: float = 0.5, steps: int = 2, noise_multiplier: float = 1.0, max_grad_norm: float = 1.0,
                  k: int = 32, delta: float = 0.05, seed: int = 0, broken: str | None = None,
                  report: bool = True) -> dict:
    """Train once with ``dpsgd`` and return the canaries' scores and the epsilon the engine reports.

    Parameters
    ----------
    config : TrainerConfig
    canaries : int
        Gradient-canary slots ``m``, each filled with probability 1/2.
    input_canaries : int
        Input-canary slots, each filled with probability 1/2 by an ordinary-looking example (random tokens,
        a random label) whose score is the trained model's log-likelihood of its label (a black-box
        membership score; these canaries share the backbone, so only the one-run bound applies to them).
    ordinary : int
        Ordinary training examples.
    sample_rate, steps, noise_multiplier, max_grad_norm, k
        The private training run (``q``, noisy steps, ``sigma``, ``C``, projection dimension); under cyclic Poisson
        ``q`` is the rate of the step's group (a loader batch of ``q N / groups``).
    delta : float
        The delta at which the reported epsilon is read.
    seed : int
    broken : str, optional
        One of :data:`BREAKS`: train with that step deliberately broken.
    report : bool
        Read the reported epsilon (a PLD computation of a few seconds); ``None`` otherwise.

    Returns
    -------
    dict
        ``in_scores`` and ``out_scores`` (numpy arrays: gradient canaries), ``input_in`` and ``input_out``
        (input canaries), ``epsilon`` (reported by the engine after the run at ``delta``, with the
        accounting as trained), ``steps``.
    """
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from dpsgd import BatchMemoryManager, PrivacyEngine
    from dpsgd.samplers import as_batch_sampling

    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    m, u = canaries, input_canaries
    n = ordinary + u + m
    included = rng.random(m) < 0.5
    typed = rng.random(u) < 0.5                                 # input canaries that are in
    ids, label = _examples(config.backbone, n, gen)
    if config.backbone == "digits-cnn":   # input canaries: real images with random labels (mislabeled examples)
        label[ordinary:ordinary + u] = torch.randint(0, _DIGIT_CLASSES, (u,), generator=gen)
    cyclic = config.batch_sampling == "cyclic_poisson"
    # cyclic Poisson: each eligible example (its group's, one step in groups) drawn at sample_rate
    batch = max(1, round(sample_rate * n / (config.groups if cyclic else 1)))
    scheme = _scheme(config.batch_sampling, batch, n, steps, delta, config.groups)
    banded = _noise(config)
    # a scheme accounted for replacing one example: an empty slot holds the canary's opposite (its probe's gradient
    # -C where the canary's is +C), so the two neighbours differ by 2 C, as replacing one example can
    replace = as_batch_sampling(scheme).neighboring == "replace_one"
    sign = torch.ones(n)
    slot = torch.zeros(n, dtype=torch.long)                     # ordinary examples and empty slots: row 0
    if replace:
        slot[ordinary + u:] = torch.arange(1, m + 1)
        sign[ordinary + u + np.flatnonzero(~included)] = -1.0
    else:
        slot[ordinary + u + np.flatnonzero(included)] = torch.as_tensor(np.flatnonzero(included) + 1)
    is_canary = torch.zeros(n, dtype=torch.bool)                # probe loss (zero for row 0: an empty slot)
    is_canary[ordinary + u:] = True
    is_canary[ordinary + np.flatnonzero(~typed)] = True         # an empty input-canary slot
    per = config.examples_per_user
    # users: slot i becomes user i, with per copies of its row (a canary user: per rows carrying its canary)
    users = torch.arange(n).repeat_interleave(per)
    data = TensorDataset(ids[users], label[users], slot[users], is_canary[users], sign[users])
    by_user = {} if per == 1 else {"privacy_unit": "user", "user_ids": users}
    model = _model(config.backbone, m)
    lr = 1.0
    base_opt = torch.optim.SGD(model.parameters(), lr=lr)
    track = [model.probe.weight.detach()[1:, 0].clone()]
    base_opt.register_step_post_hook(lambda *_: track.append(model.probe.weight.detach()[1:, 0].clone()))
    engine = PrivacyEngine()
    model, opt, loader = engine.make_private(
        module=model, optimizer=base_opt, data_loader=DataLoader(data, batch_size=batch),
        max_grad_norm=max_grad_norm, noise_multiplier=noise_multiplier, estimator=config.estimator, projection_dim=k,
        seed=int(rng.integers(2**62)), batch_sampling=scheme, **by_user,
        **({} if banded is None else {"noise": banded}))
    scale = 1e3 * max_grad_norm   # a canary's gradient norm: far above C, clipped to about C
    with _broken(broken, engine, per):
        micro = max(per, math.ceil(batch * per / config.accumulation))
        manager = (BatchMemoryManager(data_loader=loader, max_physical_batch_size=micro, optimizer=opt)
                   if config.accumulation > 1 else contextlib.nullcontext(loader))
        with manager as batches:
            while engine.steps < steps:
                for x, y, s, c, g in batches:
                    opt.zero_grad()
                    logits, probe = model(x, s)
                    losses = _losses(logits, probe, x, y, c, scale * g)
                    engine.private_loss(losses).backward()
                    opt.step()
                    if engine.steps >= steps:
                        break
        eps = engine.get_epsilon(delta) if report else None
    model.eval()
    with torch.no_grad():   # input canaries: the trained model's log-likelihood of each one's label
        cid, clab = ids[ordinary:ordinary + u], label[ordinary:ordinary + u]
        logits, _ = model(cid, torch.zeros(u, dtype=torch.long))
        nll = _losses(logits, torch.zeros(u), cid, clab, torch.zeros(u, dtype=torch.bool), scale)
    model.train()
    input_score = -nll.double().numpy()
    w = torch.stack(track).double().numpy()[: steps + 1]       # (steps + 1, m)
    sigma, q = noise_multiplier, engine.sample_rate
    x = -np.diff(w, axis=0) * engine.expected_batch_size / (lr * sigma * max_grad_norm)   # (steps, m)
    if banded is not None:   # whitened (v = C x), each participation's window scored, in the canary's group's steps
        llr = _banded_llr(x, banded.strategy.coefficients, sigma, q, _cyclic_groups(loader, n)[ordinary + u:],
                          config.groups)
    else:
        llr = x / sigma - 1 / (2 * sigma ** 2)
        if q < 1:
            llr = np.logaddexp(np.log1p(-q), np.log(q) + llr)
    if replace:   # the canary's step (+1) against its opposite's (-1): the replaced pair's log-likelihood ratio
        out = -x / sigma - 1 / (2 * sigma ** 2)
        llr = llr - (np.logaddexp(np.log1p(-q), np.log(q) + out) if q < 1 else out)
    score = llr.sum(0)
    return {"in_scores": score[included], "out_scores": score[~included], "input_in": input_score[typed],
            "input_out": input_score[~typed], "epsilon": eps, "steps": engine.steps}


def audit_config(config: TrainerConfig, *, runs: int = 1, delta: float = 0.05, confidence: float = 0.95,
                 seed: int = 0, broken: str | None = None, reported: float | None = None, **kw) -> dict:
    """Pool the canaries' scores of ``runs`` runs; Clopper-Pearson on the pool, one-run on the first run.

    ``reported``: the engine's epsilon if already known for these settings (skips its PLD computation)."""
    t0 = time.perf_counter()
    results = [canary_scores(config, delta=delta, seed=seed * 1000 + r, broken=broken,
                             report=r == 0 and reported is None, **kw) for r in range(runs)]
    pool = CanaryScoreAuditor(np.concatenate([r["in_scores"] for r in results]),
                              np.concatenate([r["out_scores"] for r in results]))
    first = CanaryScoreAuditor(results[0]["in_scores"], results[0]["out_scores"])
    return {"clopper_pearson": pool.epsilon_clopper_pearson(delta, confidence, seed=seed),
            "one_run": first.epsilon_one_run(delta, confidence),
            "input_one_run": CanaryScoreAuditor(results[0]["input_in"], results[0]["input_out"]).epsilon_one_run(
                delta, confidence),
            "tpr_at_1pct_fpr": pool.tpr_at_fpr(0.01),
            "reported": results[0]["epsilon"] if reported is None else reported,
            "seconds": time.perf_counter() - t0}


def trainer_audit(configs: tuple[TrainerConfig, ...] = (CONFIGS[0], CONFIGS[3]), *,
                  breaks: tuple[str, ...] = BREAKS, break_config: TrainerConfig = CONFIGS[2], runs: int = 1,
                  delta: float = 0.05, confidence: float = 0.95, seed: int = 0, **kw) -> AuditResult:
    """Audit ``dpsgd`` end to end: each configuration's lower bound must stay at or below the epsilon its
    engine reports, and each broken step (on ``break_config``) must be caught (lower bound above it).

    The comparison is at ``delta`` (default 0.05, where a few thousand canaries can come close to the
    reported curve; a sound trainer satisfies its reported ``(epsilon(delta), delta)`` at every delta).  The
    sound configurations' check holds with probability ``>= confidence`` (the Clopper-Pearson bound is a
    valid lower bound with that probability); a broken step is "caught" when its lower bound, which holds
    with the same probability, exceeds the reported epsilon.  Without torch it is ``SKIPPED``; without
    transformers its Hugging Face configurations are (the summary says so).
    """
    if (missing := skipped_without("torch", "trainer")) is not None:
        return missing
    rows, points = [], []

    def row(config, what, r, must_exceed):
        cp, one = r["clopper_pearson"], r["one_run"]
        inp = r["input_one_run"]
        holds = (cp.epsilon > r["reported"] if must_exceed
                 else max(cp.epsilon, one.epsilon, inp.epsilon) <= r["reported"])
        rows.append({"configuration": config.name, "step": what, "lower bound (Clopper-Pearson)": round(cp.epsilon, 3),
                     "lower bound (one run)": round(one.epsilon, 3),
                     "lower bound (input canaries, one run)": round(inp.epsilon, 3),
                     "reported epsilon": round(r["reported"], 3),
                     "delta": delta, "confidence": confidence, "TPR at 1% FPR": round(r["tpr_at_1pct_fpr"], 3),
                     "seconds": round(r["seconds"], 1), "holds": bool(holds)})
        points.append((r["reported"], cp.epsilon, what))

    import importlib.util

    skipped = []
    for cfg in configs:
        if cfg.backbone == "hf-llama" and importlib.util.find_spec("transformers") is None:
            skipped.append(cfg.name)
            continue
        row(cfg, "as shipped", audit_config(cfg, runs=runs, delta=delta, confidence=confidence, seed=seed, **kw),
            False)
    if breaks:
        sound = audit_config(break_config, runs=runs, delta=delta, confidence=confidence, seed=seed, **kw)
        if break_config not in configs:
            row(break_config, "as shipped", sound, False)
        for b in breaks:
            # the noise and clipping breaks do not change the accounting: reuse the reported epsilon
            known = None if b in _ACCOUNTING_BREAKS else sound["reported"]
            r = audit_config(break_config, runs=runs, delta=delta, confidence=confidence, seed=seed, broken=b,
                             reported=known, **kw)
            row(break_config, f"BROKEN: {b}", r, True)
    shipped = [r for r in rows if r["step"] == "as shipped"]
    caught = [r for r in rows if r["step"] != "as shipped"]
    holds = all(r["holds"] for r in rows)
    summary = (f"{sum(r['holds'] for r in shipped)}/{len(shipped)} trainer configurations keep the audited lower "
               f"bound below the reported epsilon (delta = {delta:g}); {sum(r['holds'] for r in caught)}/"
               f"{len(caught)} deliberately broken steps caught")
    if skipped:
        summary += f"; SKIPPED {', '.join(skipped)}: needs transformers, which is not installed: {INSTALL}"

    def draw(ax):
        top = max(max(p[0], p[1]) for p in points) * 1.15 + 0.1
        ax.plot([0, top], [0, top], color="0.4", lw=1, label="lower bound = reported")
        ax.fill_between([0, top], [0, top], [top, top], color="tab:red", alpha=0.08, label="violation region")
        for rep, lb, what in points:
            broken = what.startswith("BROKEN")
            ax.scatter(rep, lb, marker="x" if broken else "o", color="tab:red" if broken else "tab:blue", zorder=3)
            ax.annotate(what.replace("BROKEN: ", "") if broken else "", (rep, lb), fontsize=7,
                        xytext=(4, 4), textcoords="offset points")
        ax.set_xlim(0, top)
        ax.set_ylim(0, top)
        ax.set_xlabel(f"epsilon reported by PrivacyEngine (delta = {delta:g})")
        ax.set_ylabel(f"audited lower bound ({confidence:.0%} confidence)")
        ax.set_title("dpsgd end to end: o as shipped (must be below), x broken (must be above)", fontsize=8)
        ax.legend(fontsize=7, loc="upper left")

    return AuditResult("trainer", "check", holds, summary, rows,
                       [Figure("trainer-canary-audit", "Each trainer configuration's audited epsilon lower bound "
                               "against the epsilon its engine reports; broken steps must land above the diagonal.",
                               draw)])


def user_audit(config: TrainerConfig = USER_CONFIGS[0], *, breaks: tuple[str, ...] = USER_BREAKS, **kw) -> AuditResult:
    """The audit of user-level privacy: ``config`` (a configuration with users) as shipped, whose lower bound must
    stay below the epsilon per user that its engine reports, and each of ``breaks`` (:data:`USER_BREAKS`), which
    must be caught; ``kw`` as for :func:`trainer_audit` and :func:`canary_scores` (``canaries=`` sets the number
    of canary users).

    Examples
    --------
    >>> from verify.training import user_audit
    >>> result = user_audit(canaries=1000, input_canaries=0, ordinary=16)   # doctest: +SKIP
    >>> result.holds                                                        # doctest: +SKIP
    True
    """
    if config.examples_per_user < 2:
        raise ValueError(f"config must have users (examples_per_user > 1), got {config.examples_per_user}")
    return trainer_audit((), breaks=breaks, break_config=config, **kw)


def sampler_audit(configs: tuple[TrainerConfig, ...] = SAMPLER_CONFIGS, *, steps: int = 8, **kw) -> AuditResult:
    """The audit of each non-Poisson batch sampling (:mod:`dpsgd.samplers`): each configuration as shipped, whose
    lower bound must stay below the epsilon its engine reports, and its deliberately wrong accounting
    (:data:`SAMPLER_BREAKS`), which must be caught; ``kw`` as for :func:`trainer_audit` and :func:`canary_scores`.

    Eight steps at the default ``q = 1/2`` are four epochs of balls in bins, so that charging one epoch is caught;
    a scheme accounted for replacing one example is audited with canaries whose empty twin is their opposite.
    Cyclic Poisson runs ``steps`` cycles (16 steps at 2 groups: eight accounted events, as Poisson's eight steps),
    each eligible example drawn at ``q``, so that charging one cycle is caught.

    Examples
    --------
    >>> from verify.training import sampler_audit
    >>> sampler_audit(canaries=1000, input_canaries=0, ordinary=16).holds   # doctest: +SKIP
    True
    """
    if (missing := skipped_without("torch", "samplers")) is not None:
        return missing
    parts = [trainer_audit((), breaks=(SAMPLER_BREAKS[c.batch_sampling],), break_config=c,
                           steps=steps * (c.groups if c.batch_sampling == "cyclic_poisson" else 1), **kw)
             for c in configs]
    rows = [row for p in parts for row in p.rows]
    shipped = [r for r in rows if r["step"] == "as shipped"]
    caught = [r for r in rows if r["step"] != "as shipped"]
    summary = (f"{sum(r['holds'] for r in shipped)}/{len(shipped)} batch samplings keep the audited lower bound "
               f"below the reported epsilon; {sum(r['holds'] for r in caught)}/{len(caught)} wrong accountings "
               f"caught")

    def draw(ax):
        top = max(max(r["reported epsilon"], r["lower bound (Clopper-Pearson)"]) for r in rows) * 1.15 + 0.1
        ax.plot([0, top], [0, top], color="0.4", lw=1)
        ax.fill_between([0, top], [0, top], [top, top], color="tab:red", alpha=0.08, label="violation region")
        for r in rows:
            broken = r["step"] != "as shipped"
            ax.scatter(r["reported epsilon"], r["lower bound (Clopper-Pearson)"], marker="x" if broken else "o",
                       color="tab:red" if broken else "tab:blue", zorder=3)
            ax.annotate(r["configuration"].split(", ")[-1] + (" (wrong accounting)" if broken else ""),
                        (r["reported epsilon"], r["lower bound (Clopper-Pearson)"]), fontsize=6,
                        xytext=(4, 4), textcoords="offset points")
        ax.set_xlim(0, top)
        ax.set_ylim(0, top)
        ax.set_xlabel("epsilon reported by PrivacyEngine")
        ax.set_ylabel("audited lower bound")
        ax.set_title("batch samplings: o as shipped (must be below), x wrong accounting (must be above)", fontsize=8)
        ax.legend(fontsize=7, loc="upper left")

    return AuditResult("samplers", "check", all(r["holds"] for r in rows), summary, rows,
                       [Figure("sampler-canary-audit", "Each batch sampling's audited epsilon lower bound against "
                               "the epsilon its engine reports; its wrong accounting must land above the diagonal.",
                               draw)])
