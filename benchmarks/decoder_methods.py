"""A tiny decoder trained privately with each method of the library, at one epsilon, on CPU.

Task (synthetic, nothing downloaded): sequences of 12 tokens over a vocabulary of 16 that follow a fixed
random permutation, x_{t+1} = perm[x_t], from a random first token.  The score is next-token accuracy on
held-out sequences (positions 2..12); a uniform guess scores 1/16 = 6 %.

Methods, each calibrated to a target epsilon (8, 1 and 0.2) at delta = 1e-5 over the same 4 epochs of Poisson
batches (4096 examples, expected batch 256, 64 steps), C = 1, Adam at lr 1e-2:

* dp-sgd: exact (ghost) norms, Gaussian noise, PLD accountant;
* dp-sgd-rc: Hutchinson norm estimates (k = 16), Gaussian noise, the randomized-clipping PLD accountant;
* lap2: exact norms, Laplace noise (paper 003), accounted by its Gaussian domination;
* twice: twice sampling (paper 002) with coordinate rate 1/2 and l-infinity bound 0.05, RDP accountant;
* hybrid: hybrid clipping (paper 002, Thm 5.6): the token and position embeddings clipped to l2 0.6 and the
  rest to 0.8 (overall C = 1), l-infinity 0.05 for both, coordinate rate 1/2, Thm 4.6's noise shape, RDP;
* subspace: the clipped sum projected on the top-64 singular vectors of per-example gradients of *public*
  sequences (same rule, another seed) along a short non-private run on them (paper 004), Gaussian noise, PLD;
* non-private: the same loop without clipping or noise (the ceiling).

    OMP_NUM_THREADS=1 python benchmarks/decoder_methods.py [--seeds 1] [--epsilons 8 1 0.2] [--methods ...]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from dpsgd import PrivacyEngine
from dpsgd.noise import LaplaceNoise
from dpsgd.spectrum import top_singular
from dpsgd.strategies import HybridClipping, TwiceSampling

logging.getLogger("transformers").setLevel(logging.ERROR)

VOCAB, T, N, BATCH, EPOCHS, DELTA = 16, 12, 4096, 256, 4, 1e-5
METHODS = ("non-private", "dp-sgd", "dp-sgd-rc", "lap2", "twice", "hybrid", "subspace")


def sequences(n: int, perm: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.empty(n, T, dtype=torch.long)
    ids[:, 0] = torch.randint(0, VOCAB, (n,), generator=g)
    for t in range(1, T):
        ids[:, t] = perm[ids[:, t - 1]]
    return ids


def decoder(seed: int) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                      eos_token_id=0))


def losses(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids).logits
    return F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none").mean(1)


@torch.no_grad()
def accuracy(model: torch.nn.Module, ids: torch.Tensor) -> float:
    model.eval()
    pred = model(ids).logits[:, :-1].argmax(-1)
    model.train()
    return float((pred == ids[:, 1:]).double().mean())


def public_basis(seed: int, public: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k right singular vectors of clipped per-example gradients of public sequences, taken along a short
    non-private training run on them (64 gradients at each of steps 0, 10, 20, 30; paper 004's subspace)."""
    model = decoder(seed)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=1e-2)
    rows = []
    for step in range(31):
        if step % 10 == 0:
            for i in range(64):
                g = torch.autograd.grad(losses(model, public[i:i + 1]).sum(), params)
                flat = torch.cat([x.reshape(-1) for x in g]).double()
                rows.append(flat / max(1.0, float(flat.norm())))
        optimizer.zero_grad()
        losses(model, public).mean().backward()
        optimizer.step()
    return top_singular(torch.stack(rows), k).vectors.float()


def run(method: str, seed: int, eps: float, train: torch.Tensor, test: torch.Tensor, public: torch.Tensor) -> dict:
    model = decoder(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    loader = DataLoader(TensorDataset(train), batch_size=BATCH)
    start = time.perf_counter()
    if method == "non-private":
        g = torch.Generator().manual_seed(seed)
        for _ in range(EPOCHS * N // BATCH):
            batch = train[torch.randint(0, N, (BATCH,), generator=g)]
            optimizer.zero_grad()
            losses(model, batch).mean().backward()
            optimizer.step()
        return {"method": method, "sigma": "-", "eps": "-", "accountant": "-", "acc": accuracy(model, test),
                "s": time.perf_counter() - start}
    kw = dict(estimator="ghost")
    if method == "dp-sgd-rc":
        kw = dict(estimator="hutch", projection_dim=16)
    elif method == "lap2":
        kw["noise"] = LaplaceNoise()
    elif method == "twice":
        kw["clipping"] = TwiceSampling(coordinate_rate=0.5, max_grad_coordinate=0.05)
    elif method == "hybrid":
        kw["clipping"] = HybridClipping({"transformer.wte": (0.6, 0.05), "transformer.wpe": (0.6, 0.05),
                                         "": (0.8, 0.05)}, coordinate_rate=0.5)
        kw["max_grad_norm"] = kw["clipping"].overall_norm()
    elif method == "subspace":
        kw["gradient_projection"] = public_basis(seed, public, 64)
    engine = PrivacyEngine()
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=loader, target_epsilon=eps, target_delta=DELTA,
        epochs=EPOCHS, seed=seed, **{"max_grad_norm": 1.0, **kw})
    for _ in range(EPOCHS):
        for (batch,) in loader:
            optimizer.zero_grad()
            engine.private_loss(losses(model, batch)).backward()
            optimizer.step()
    return {"method": method, "sigma": f"{engine.noise_multiplier:.3f}", "eps": f"{engine.get_epsilon(DELTA):.3f}",
            "accountant": type(engine.accountant()).__name__, "acc": accuracy(model, test),
            "s": time.perf_counter() - start}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--epsilons", type=float, nargs="+", default=[8.0, 1.0, 0.2])
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    args = ap.parse_args(argv)
    perm = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))
    train, test, public = sequences(N, perm, 1), sequences(1024, perm, 2), sequences(256, perm, 3)
    print(f"tiny GPT-2 (2 layers, width 32), {N} sequences, expected batch {BATCH}, {EPOCHS} epochs "
          f"({EPOCHS * N // BATCH} steps), delta {DELTA}; next-token accuracy on 1024 held-out sequences "
          f"(uniform guess 6.2 %)")
    for eps in args.epsilons:
        print(f"target epsilon {eps:g}")
        print(f"{'method':>12} {'sigma':>7} {'epsilon':>8} {'accountant':>14} {'accuracy %':>11} {'seconds':>8}")
        for method in args.methods:
            rows = [run(method, seed, eps, train, test, public) for seed in range(args.seeds)]
            acc = [100 * r["acc"] for r in rows]
            spread = f" ({min(acc):.1f}-{max(acc):.1f})" if len(acc) > 1 else ""
            print(f"{method:>12} {rows[0]['sigma']:>7} {rows[0]['eps']:>8} {rows[0]['accountant']:>14} "
                  f"{statistics.mean(acc):>11.1f}{spread} {statistics.median(r['s'] for r in rows):>8.1f}", flush=True)


if __name__ == "__main__":
    main()
