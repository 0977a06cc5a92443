"""Paper 004's gradient-spectrum analysis on a private fine-tuning run, and the cost of the tools.

Run: ``OMP_NUM_THREADS=1 python benchmarks/spectrum_bench.py`` (needs the ``hf`` extra).

1. Trains a GPT-2 config (hidden 64, 2 layers, random weights; 2000 sequences of 16 tokens from a
   repeating-pattern language, batch 64, Hutch++ norms, noise multiplier 1, clipping norm 1) for 200 steps
   with :class:`dpsgd.PrivacyEngine`, recording the *released* (noisy) gradient at every step with
   :class:`dpsgd.spectrum.GradientRecorder` attached to the optimizer (post-processing: no privacy cost).
2. Prints the top 50 singular values' decay fit (paper 004 reports ``sigma_k ~ k^-0.6`` on
   DistilRoBERTa's clipped, non-private gradients) and the restricted-Lipschitz proxies at k = 0, 5, 20, 50,
   for that run and for the same run without noise (the paper's setting; not private).
3. Times :func:`dpsgd.spectrum.top_singular` (Gram matrix, and 10 orthogonal iterations) on the recorded
   matrices and on a synthetic 400 x 250,000 float32 one, against ``torch.linalg.svdvals`` (the full SVD).
"""

from __future__ import annotations

import time
import warnings

import torch
from torch.utils.data import DataLoader, TensorDataset


def train_and_record(noise_multiplier: float, steps: int = 200):
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging

    from dpsgd import PrivacyEngine
    from dpsgd.spectrum import GradientRecorder

    logging.set_verbosity_error()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=2, vocab_size=50, n_positions=32))
    start = torch.randint(0, 50, (2000, 1))
    ids = (start + torch.arange(16) * 3) % 50           # learnable: each token is the previous plus 3
    loader = DataLoader(TensorDataset(ids, ids), batch_size=64)
    engine = PrivacyEngine()
    m, opt, crit, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5), data_loader=loader, max_grad_norm=1.0,
        noise_multiplier=noise_multiplier, estimator="hutchpp", projection_dim=8,
        criterion=torch.nn.CrossEntropyLoss(), seed=0)
    rec = GradientRecorder(model.parameters())
    rec.attach(opt)          # records inside step(), when .grad is the released noisy gradient
    done, losses = 0, []
    t = time.perf_counter()
    while done < steps:
        for x, y in loader:
            opt.zero_grad()
            loss = crit(m(x).logits[:, :-1], y[:, 1:])   # per-example rows: the criterion reduces per sequence
            loss.backward()
            opt.step()
            losses.append(float(loss))
            done += 1
            if done == steps:
                break
    eps = engine.get_epsilon(1e-5) if noise_multiplier > 0 else float("inf")
    return rec.matrix(), time.perf_counter() - t, losses, eps


def analyse(H: torch.Tensor) -> None:
    from dpsgd.spectrum import decay_fit, restricted_lipschitz, top_singular

    t = time.perf_counter()
    top = top_singular(H, 50)                       # auto: the Gram matrix (200 rows)
    t_gram = time.perf_counter() - t
    t = time.perf_counter()
    it = top_singular(H, 50, method="iteration", generator=torch.Generator().manual_seed(0))
    t_it = time.perf_counter() - t
    t = time.perf_counter()
    exact = torch.linalg.svdvals(H.double())[:50]
    t_svd = time.perf_counter() - t
    rel = lambda a: float(((a - exact) / exact).abs().max())   # noqa: E731
    print(f"  top 50: Gram {t_gram:.2f} s (max rel. difference to the full SVD {rel(top.values):.1e}), "
          f"10 orthogonal iterations {t_it:.2f} s ({rel(it.values):.1e}), full SVD {t_svd:.2f} s")
    for ks in ((1, 50), (1, 10), (11, 50)):
        fit = decay_fit(top.values, ks)
        print(f"  decay fit on ranks {ks}: exponent {fit.exponent:.3f} +- {fit.stderr:.3f} "
              f"(95 % [{fit.ci95[0]:.3f}, {fit.ci95[1]:.3f}])")
    g = restricted_lipschitz(H, top.vectors)
    print("  restricted-Lipschitz proxies (max / rms tail norm): " + ", ".join(
        f"k={k}: {float(g['max'][k]):.3f} / {float(g['rms'][k]):.3f}" for k in (0, 5, 20, 50)))


def main() -> None:
    from dpsgd.spectrum import top_singular

    warnings.simplefilter("ignore")
    for sigma, label in ((1.0, "private run, noisy released gradients"),
                         (0.0, "paper 004's setting: clipped gradients without noise (not private)")):
        H, seconds, losses, eps = train_and_record(sigma)
        print(f"{label}: noise multiplier {sigma:g}, {H.shape[0]} steps, {H.shape[1]:,} parameters, {seconds:.1f} s; "
              f"loss {losses[0]:.3f} -> {sum(losses[-10:]) / 10:.3f} (mean of the last 10); epsilon {eps:.2f} at "
              f"delta 1e-5")
        analyse(H)
    # cost at a larger size: 400 float32 gradients of 250,000 parameters
    gen = torch.Generator().manual_seed(1)
    big = torch.randn(400, 250_000, generator=gen) * (torch.arange(1, 401.0) ** -0.6)[:, None]
    timings = []
    for method in ("gram", "iteration"):
        t = time.perf_counter()
        top_singular(big, 50, method=method, generator=gen)
        timings.append(time.perf_counter() - t)
    t = time.perf_counter()
    torch.linalg.svdvals(big)
    print(f"400 x 250,000 (float32), top 50: Gram {timings[0]:.1f} s, 10 orthogonal iterations {timings[1]:.1f} s, "
          f"full SVD {time.perf_counter() - t:.1f} s")


if __name__ == "__main__":
    main()
