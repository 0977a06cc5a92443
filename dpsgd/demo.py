r"""Train a tiny Llama-style decoder with DP-SGD-RC on a synthetic long-context task (no download).

The task: each sequence holds ``--seq-len`` random filler tokens and ``--copies`` occurrences of one of
four marker tokens at random positions; the label is which marker (chance: 25%).  The model must look back
over the whole context from the last position.  The decoder is built locally with random weights: token embedding, fixed
sinusoidal positions, ``--layers`` blocks of RMSNorm, causal multi-head attention and a SwiGLU MLP, a final RMSNorm
and a linear classification head on the last position.

``sigma`` is calibrated with the PLD accountant for the estimator's envelope so that the whole run spends
at most ``--epsilon`` at ``--delta``; the script prints the calibrated sigma, the epsilon actually spent
and the test accuracy.  Progress goes to stderr as log records of the ``"dpsgd"`` logger: the calibration's
start and seconds, a line per epoch (mean training loss, test accuracy, epsilon spent), and within an epoch
a line every 10 seconds.

    python -m dpsgd.demo                     # hutch, k = 32, epsilon 8
    python -m dpsgd.demo --estimator ghost   # the exact baseline
    python -m dpsgd.demo --estimator auto    # make_private's default: here (width 256, k = 32) every norm exact
"""

from __future__ import annotations

import argparse
import logging
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from .cli import show_progress
from .loss import DPCriterion
from .optimizer import DPOptimizer
from .privacy_engine import PrivacyEngine

MARKERS = 4
PROGRESS_SECONDS = 10.0   # an epoch longer than this logs its progress this often

logger = logging.getLogger("dpsgd")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm, self.mlp_norm = RMSNorm(dim), RMSNorm(dim)
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.gate, self.up = nn.Linear(dim, 2 * dim, bias=False), nn.Linear(dim, 2 * dim, bias=False)
        self.down = nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.attn_norm(x)

        def split(z):
            return z.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        att = F.scaled_dot_product_attention(split(self.q(h)), split(self.k(h)), split(self.v(h)), is_causal=True)
        x = x + self.o(att.transpose(1, 2).reshape(b, t, d))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class TinyLlama(nn.Module):
    """Decoder-only classifier: the last position's hidden state through a linear head."""

    def __init__(self, vocab: int, seq_len: int, dim: int = 32, heads: int = 2, layers: int = 1,
                 classes: int = MARKERS) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        # fixed sinusoidal positions: no parameters, so no noise spent on them
        pos = torch.arange(seq_len).unsqueeze(1) / 10000 ** (torch.arange(0, dim, 2) / dim)
        self.register_buffer("pos", torch.cat([pos.sin(), pos.cos()], dim=1))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x)[:, -1])


def marker_task(n: int, seq_len: int, vocab: int, copies: int, generator: torch.Generator) -> TensorDataset:
    """Filler tokens ``MARKERS+1 .. vocab-1``; marker ``y + 1`` written at ``copies`` random positions; label ``y``."""
    x = torch.randint(MARKERS + 1, vocab, (n, seq_len), generator=generator)
    y = torch.randint(0, MARKERS, (n,), generator=generator)
    for _ in range(copies):
        x[torch.arange(n), torch.randint(0, seq_len - 1, (n,), generator=generator)] = y + 1
    return TensorDataset(x, y)


def train_epoch(model: nn.Module, optimizer: DPOptimizer, criterion: DPCriterion, loader: DataLoader,
                label: str) -> float:
    """One epoch of private steps; the mean of the batches' mean training losses.

    Every :data:`PROGRESS_SECONDS` within the epoch it logs the batches done and the mean loss so far, so a long
    epoch shows it is alive.

    Parameters
    ----------
    model, optimizer, criterion, loader
        What :meth:`dpsgd.PrivacyEngine.make_private` returned.
    label : str
        Names the epoch in the progress records (e.g. ``"epoch 1/3"``).

    Returns
    -------
    float
        ``nan`` if the loader drew no non-empty batch.

    Examples
    --------
    >>> import torch
    >>> from torch.utils.data import DataLoader, TensorDataset
    >>> from dpsgd import PrivacyEngine
    >>> from dpsgd.demo import train_epoch
    >>> model = nn.Linear(4, 2)
    >>> model, opt, crit, loader = PrivacyEngine().make_private(criterion=nn.CrossEntropyLoss(), module=model,
    ...     optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
    ...     data_loader=DataLoader(TensorDataset(torch.randn(40, 4), torch.randint(0, 2, (40,))), batch_size=10),
    ...     max_grad_norm=1.0, noise_multiplier=1.0)
    >>> 0 < train_epoch(model, opt, crit, loader, "epoch 1/1") < 5
    True
    """
    start = last = time.perf_counter()
    total, batches = 0.0, 0
    for i, (xb, yb) in enumerate(loader, 1):
        loss = criterion(model(xb), yb)
        loss.backward()
        optimizer.step()
        total, batches = total + loss.item(), batches + 1
        if time.perf_counter() - last >= PROGRESS_SECONDS:
            last = time.perf_counter()
            logger.info("%s: batch %d/%d, mean loss %.4f (%.0f s)", label, i, len(loader), total / batches,
                        last - start)
    return total / batches if batches else float("nan")


def main(argv: list[str] | None = None) -> float:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--estimator", default="hutch", choices=["hutch", "hutchpp", "ghost", "exact", "auto"])
    ap.add_argument("--projection-dim", type=int, default=32, help="k: random projections per layer")
    ap.add_argument("--epsilon", type=float, default=8.0)
    ap.add_argument("--delta", type=float, default=1e-5)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--train", type=int, default=20000)
    ap.add_argument("--batch-size", type=int, default=512)
    ap.add_argument("--copies", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1.0)
    ap.add_argument("--max-grad-norm", type=float, default=1.0)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0,
                    help="seeds the data and the initial model (the batches and noise come from os.urandom)")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(args.seed)
    vocab = 32
    train = marker_task(args.train, args.seq_len, vocab, args.copies, gen)
    test = marker_task(1000, args.seq_len, vocab, args.copies, gen)
    torch.manual_seed(args.seed)
    model = TinyLlama(vocab, args.seq_len, layers=args.layers)
    engine = PrivacyEngine()
    model, opt, crit, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
        data_loader=DataLoader(train, batch_size=args.batch_size), criterion=nn.CrossEntropyLoss(),
        max_grad_norm=args.max_grad_norm, target_epsilon=args.epsilon, target_delta=args.delta,
        epochs=args.epochs, estimator=args.estimator, projection_dim=args.projection_dim)
    print(f"estimator {args.estimator} (projection_dim = {args.projection_dim}), envelope {engine.envelope}, "
          f"q = {engine.sample_rate:.4g}, "
          f"{args.epochs * len(loader)} steps: sigma = {engine.noise_multiplier:.4f} for epsilon {args.epsilon:g}, "
          f"delta {args.delta:g}")
    for epoch in range(1, args.epochs + 1):
        label = f"epoch {epoch}/{args.epochs}"
        loss = train_epoch(model, opt, crit, loader, label)
        with torch.no_grad():
            acc = (model(test.tensors[0]).argmax(1) == test.tensors[1]).float().mean().item()
        logger.info("%s: training loss %.4f, test accuracy %.3f, epsilon spent %.3f (%.0f s)", label, loss, acc,
                    engine.get_epsilon(args.delta), time.perf_counter() - t0)
    print(f"final: test accuracy {acc:.3f} (chance {1 / MARKERS:.2f}), epsilon {engine.get_epsilon(args.delta):.3f} "
          f"<= {args.epsilon:g}, {time.perf_counter() - t0:.0f} s")
    return acc


if __name__ == "__main__":
    show_progress()
    main()
