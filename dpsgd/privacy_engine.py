r"""``PrivacyEngine.make_private``: the Opacus-style entry point of DP-SGD-RC.

An Opacus user with ghost clipping writes::

    model, optimizer, criterion, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=loader, criterion=nn.CrossEntropyLoss(),
        max_grad_norm=1.0, target_epsilon=8.0, target_delta=1e-5, epochs=3, estimator="hutch", k=32)
    for x, y in loader:
        loss = criterion(model(x), y)   # per-example losses, kept for the two backward passes
        loss.backward()                 # first pass: norms; second pass: the clipped sum into .grad
        optimizer.step()                # noise sigma C, / expected batch size, the wrapped optimizer's step
    engine.get_epsilon(1e-5)

The accountant (:class:`dpmath.PLDAccountant`) sees one mechanism per step: ``SubsampledGaussian(sigma,
q)`` for ``exact``/``ghost``, ``RandomizedClipGaussian(sigma, q, envelope)`` for ``hutch``/``hutchpp``.
The envelope's dimension is ``D = sum_l min(p_l, d_l)`` over the layers estimated with random
projections (biases count 1, embeddings ``min(V, p)``): the model's estimate mixes that many
``chi2(k)/k`` terms.  Exactly-computed parts (modules without a handler, and embeddings under
``hutchpp``) are point masses in that mixture, the ``d -> inf`` limit of the family, so with ``hutch``
they switch the envelope to that limit, ``max(F_{chi2(k)/k}, 1{x >= 1})`` (the :class:`~dpmath.HutchPPEnvelope`
form).  Every step is recorded in the ledger *after* the optimizer's step succeeded.

Under ``torch.distributed`` (initialized before ``make_private``) each rank passes a loader over its own
shard; per-example norms and clipping stay local, the clipped sums are all-reduced, and the same noise
(one generator seeded identically on all ranks) is added once, so every rank takes the same step and the
noise has standard deviation ``sigma C`` in total, not ``sqrt(world) sigma C``.  The sampling rate is each
shard's ``batch_size / len(shard)``; the expected batch size is the sum over ranks.  Wrap nothing in
``DistributedDataParallel``: the optimizer does the reduction.
"""

from __future__ import annotations

import json
import math
import os

import torch
from torch import nn
from torch.utils.data import DataLoader

from dpmath import PLDAccountant, RandomizedClipGaussian, SubsampledGaussian, calibrate_sigma, estimator_envelope

from .data import private_data_loader
from .engine import _Capture, _check_estimator, _check_model, _clipped_sum, _noisy, _norms, _own_params
from .layers import HANDLERS, embedding_norms, is_conv1d, linear_norms

__all__ = ["PrivacyEngine", "envelope_dimension"]


def envelope_dimension(module: nn.Module, estimator: str) -> tuple[int, bool]:
    """``(D, has_exact_parts)``: chi-square terms of the model's estimate and whether some part is exact.

    Examples
    --------
    >>> from torch import nn
    >>> from dpsgd.privacy_engine import envelope_dimension
    >>> envelope_dimension(nn.Sequential(nn.Linear(8, 3), nn.LayerNorm(3), nn.Linear(3, 2)), "hutch")
    (7, True)
    """
    total, exact = 0, False
    for m in module.modules():
        own = _own_params(m)
        if not own:
            continue
        handler = HANDLERS.get(type(m))
        if is_conv1d(m) or handler is linear_norms:
            w = m.weight
            total += min(w.shape) if w.requires_grad else 0
            total += 1 if getattr(m, "bias", None) is not None and m.bias.requires_grad else 0
        elif handler is embedding_norms:
            if estimator == "hutch":
                total += min(m.weight.shape)
            else:
                exact = True
        elif handler is None:
            exact = True
        else:  # a user handler: its law is not known here, so take the largest D and the d -> inf limit
            total += sum(p.numel() for p in own)
            exact = True
    return max(total, 1), exact


def _rank_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _broadcast_int(value: int) -> int:
    """Rank 0's ``value`` on every rank (identity without torch.distributed)."""
    if _rank_world()[1] == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    torch.distributed.broadcast(t, src=0)
    return int(t.item())


def _all_sum(value: float) -> float:
    if _rank_world()[1] == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    torch.distributed.all_reduce(t)
    return float(t.item())


class PrivateModule(nn.Module):
    """The wrapped model: its forward records what the first backward pass needs."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self._module = module
        self._capture = _Capture(_check_model(module))

    def forward(self, *args, **kwargs):
        self._capture.records.clear()
        return self._module(*args, **kwargs)


class DPLoss:
    """Per-example losses of one batch; ``backward()`` writes the clipped gradient sum into ``.grad``."""

    def __init__(self, losses: torch.Tensor, engine: PrivacyEngine) -> None:
        self.losses = losses
        self._engine = engine

    def item(self) -> float:
        """Mean per-example loss (for logging)."""
        return float(self.losses.detach().mean()) if self.losses.numel() else float("nan")

    def backward(self) -> None:
        e = self._engine
        first = _norms(e._module._capture, self.losses, e.estimator, e.k, e._projection_rng)
        grads, weights = _clipped_sum(first, e._params, e.max_grad_norm)
        for p, g in zip(e._params, grads, strict=True):
            p.grad = g
        e._pending = (first.losses.shape[0], float((weights < 1).float().mean()) if weights.numel() else 0.0)


class DPCriterion:
    """Wraps a loss module: ``criterion(output, target)`` returns a :class:`DPLoss` of per-example losses."""

    def __init__(self, criterion: nn.Module, engine: PrivacyEngine) -> None:
        self._criterion = criterion
        self._engine = engine
        self._reduce = "mean" if getattr(criterion, "reduction", "mean") == "mean" else "sum"

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> DPLoss:
        old = getattr(self._criterion, "reduction", None)
        self._criterion.reduction = "none"
        try:
            per_element = self._criterion(output, target)
        finally:
            self._criterion.reduction = old
        flat = per_element.reshape(per_element.shape[0], math.prod(per_element.shape[1:]))
        return DPLoss(flat.mean(1) if self._reduce == "mean" else flat.sum(1), self._engine)


class DPOptimizer:
    """Wraps a torch optimizer: ``step()`` adds noise to the clipped sum, normalizes, steps, and records."""

    def __init__(self, optimizer: torch.optim.Optimizer, engine: PrivacyEngine) -> None:
        self.original_optimizer = optimizer
        self._engine = engine

    @property
    def param_groups(self):
        return self.original_optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.original_optimizer.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        e = self._engine
        if e._pending is None:
            raise RuntimeError("optimizer.step() without loss.backward() on a private loss of this batch")
        sums = [p.grad for p in e._params]
        if _rank_world()[1] > 1:  # per-example norms stay local; the clipped sums add up across ranks
            sums = [g.clone() for g in sums]
            for g in sums:
                torch.distributed.all_reduce(g)
        noisy = _noisy(sums, e.noise_multiplier * e.max_grad_norm, e.expected_batch_size, e._noise_rng)
        for p, g in zip(e._params, noisy, strict=True):
            p.grad = g
        self.original_optimizer.step()
        e._record_step()  # the ledger: only after the step has happened
        e._pending = None
        self.original_optimizer.zero_grad(set_to_none=True)

    def state_dict(self) -> dict:
        return self.original_optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.original_optimizer.load_state_dict(state)


class PrivacyEngine:
    r"""Makes a model, optimizer, loss and data loader private with DP-SGD-RC, and keeps the privacy ledger.

    Parameters
    ----------
    secure_mode : bool
        Seed the noise generator from ``os.urandom`` (its state is then not saved in checkpoints).
    ledger_path : str or os.PathLike, optional
        An append-only file with one line per noisy step, flushed to disk before ``step()`` returns.  A
        crash loses no spent privacy: a new engine on the same file counts the steps already recorded
        there (more than a checkpoint may hold) and refuses a file written with other settings.

    Examples
    --------
    >>> import torch
    >>> from torch import nn
    >>> from torch.utils.data import DataLoader, TensorDataset
    >>> from dpsgd import PrivacyEngine
    >>> data = TensorDataset(torch.randn(200, 4), torch.randint(0, 2, (200,)))
    >>> model = nn.Linear(4, 2)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> engine = PrivacyEngine()
    >>> model, opt, crit, loader = engine.make_private(module=model, optimizer=opt,
    ...     data_loader=DataLoader(data, batch_size=20), criterion=nn.CrossEntropyLoss(), max_grad_norm=1.0,
    ...     noise_multiplier=1.0, estimator="hutch", k=4, seed=0)
    >>> for x, y in loader:
    ...     crit(model(x), y).backward()
    ...     opt.step()
    >>> engine.steps, round(engine.get_epsilon(1e-5), 2) > 0
    (10, True)
    """

    def __init__(self, secure_mode: bool = False, ledger_path: str | os.PathLike | None = None) -> None:
        self.secure_mode = bool(secure_mode)
        self.ledger_path = ledger_path
        self._steps = 0
        self._recorded = 0  # steps in the ledger file from earlier runs
        self._resumed = 0   # steps already counted by the checkpoint this run resumed from
        self._pending = None
        self._mechanism = None

    def make_private(self, *, module: nn.Module, optimizer: torch.optim.Optimizer, data_loader: DataLoader,
                     criterion: nn.Module, max_grad_norm: float, noise_multiplier: float | None = None,
                     target_epsilon: float | None = None, target_delta: float | None = None,
                     epochs: int | None = None, estimator: str = "hutch", k: int = 32, poisson_sampling: bool = True,
                     seed: int | None = None) -> tuple[PrivateModule, DPOptimizer, DPCriterion, DataLoader]:
        r"""Wrap for private training; either ``noise_multiplier`` or ``(target_epsilon, target_delta, epochs)``.

        Parameters
        ----------
        module, optimizer, data_loader, criterion
            Model, any torch optimizer over its parameters, a loader with a fixed ``batch_size`` (its
            expected batch size), and a loss module with a ``reduction`` attribute.
        max_grad_norm : float
            Clipping threshold ``C > 0``.
        noise_multiplier : float, optional
            ``sigma >= 0``; or calibrate it from the three targets.
        target_epsilon, target_delta, epochs
            Calibrate ``sigma`` with the PLD accountant for this estimator so that after ``epochs`` passes
            the upper bound on epsilon is at most ``target_epsilon``.
        estimator : {"hutch", "hutchpp", "ghost", "exact"}
            Per-sample norm estimator.
        k : int
            Projection dimension.
        poisson_sampling : bool
            Poisson batches (default); ``False`` warns that the accounting assumes Poisson sampling.
        seed : int, optional
            Seeds the sampling, projection and noise generators (noise from ``os.urandom`` in secure mode).

        Returns
        -------
        tuple
            ``(module, optimizer, criterion, data_loader)``.
        """
        _check_estimator(estimator, k)
        c = float(max_grad_norm)
        if not (math.isfinite(c) and c > 0):
            raise ValueError(f"max_grad_norm must be positive (> 0), got {max_grad_norm!r}")
        rank, world = _rank_world()
        # one seed for the whole run (rank 0's, or os.urandom's in secure mode), shared by all ranks
        root = seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 2
        base = torch.Generator().manual_seed(_broadcast_int(root))
        seeds = torch.randint(2**62, (3 + world,), generator=base).tolist()
        self._sampling_rng = torch.Generator().manual_seed(seeds[3 + rank])   # each rank samples its own shard
        self._projection_rng = torch.Generator().manual_seed(seeds[1] + rank)
        noise_seed = _broadcast_int(int.from_bytes(os.urandom(8), "little") >> 2) if self.secure_mode else seeds[2]
        self._noise_rng = torch.Generator().manual_seed(noise_seed)              # the same noise on every rank
        loader = private_data_loader(data_loader, poisson=poisson_sampling, generator=self._sampling_rng)
        n = len(data_loader.dataset)
        self.sample_rate = min(data_loader.batch_size / n, 1.0)
        self.expected_batch_size = _all_sum(self.sample_rate * n)
        self.estimator, self.k, self.max_grad_norm = estimator, k, c
        self._module = PrivateModule(module)
        self._params = [p for p in module.parameters() if p.requires_grad]
        self.envelope = self._envelope(module)
        if noise_multiplier is not None:
            sigma = float(noise_multiplier)
            if not (math.isfinite(sigma) and sigma >= 0):
                raise ValueError(f"noise_multiplier must be non-negative (>= 0), got {noise_multiplier!r}")
            if target_epsilon is not None:
                raise ValueError("give either noise_multiplier or target_epsilon, not both")
        else:
            if target_epsilon is None or target_delta is None or epochs is None:
                raise ValueError("without noise_multiplier, target_epsilon, target_delta and epochs are required")
            steps = int(epochs) * len(loader)
            sigma = calibrate_sigma(target_epsilon, target_delta, self.sample_rate, steps, envelope=self.envelope)
        self.noise_multiplier = sigma
        self._settings = {"estimator": estimator, "k": k, "max_grad_norm": c, "noise_multiplier": sigma,
                          "sample_rate": self.sample_rate, "poisson": bool(poisson_sampling)}
        self._read_ledger()
        return self._module, DPOptimizer(optimizer, self), DPCriterion(criterion, self), loader

    def _read_ledger(self) -> None:
        if self.ledger_path is None or not os.path.exists(self.ledger_path):
            return
        with open(self.ledger_path) as fh:
            lines = [json.loads(line) for line in fh if line.strip()]
        for rec in lines:
            if rec["settings"] != self._settings:
                raise ValueError(f"ledger {self.ledger_path} was written with different privacy settings "
                                 f"({rec['settings']}); use a new ledger file")
        self._recorded = len(lines)

    def _record_step(self) -> None:
        self._steps += 1
        if self.ledger_path is not None and _rank_world()[0] == 0:
            with open(self.ledger_path, "a") as fh:
                fh.write(json.dumps({"step": self._steps, "settings": self._settings}) + "\n")
                fh.flush()
                os.fsync(fh.fileno())

    def _envelope(self, module: nn.Module):
        if self.estimator in ("exact", "ghost"):
            return None
        d, exact = envelope_dimension(module, self.estimator)
        if exact:  # point masses: the d -> inf limit, which is the Hutch++ envelope's form with d > k
            return estimator_envelope("hutchpp", self.k, max(d, self.k + 1))
        return estimator_envelope(self.estimator, self.k, d)

    @property
    def steps(self) -> int:
        """Noisy steps of this run (from a resumed checkpoint on)."""
        return self._steps

    @property
    def spent_steps(self) -> int:
        """Noisy steps whose privacy is spent: this run's, or the ledger file's count if that is larger."""
        return max(self._steps, self._recorded + self._steps - self._resumed)

    def accountant(self) -> PLDAccountant:
        """A fresh :class:`dpmath.PLDAccountant` holding every step taken so far."""
        acc = PLDAccountant()
        if self.spent_steps:
            if self.noise_multiplier == 0:
                raise ValueError("noise_multiplier is 0: no privacy guarantee")
            mech = SubsampledGaussian(self.noise_multiplier, self.sample_rate) if self.envelope is None else \
                RandomizedClipGaussian(self.noise_multiplier, self.sample_rate, self.envelope)
            acc.compose(mech, self.spent_steps)
        return acc

    def get_epsilon(self, delta: float) -> float:
        """Upper bound on epsilon spent so far at ``delta`` (0 before the first step)."""
        return self.accountant().epsilon(delta) if self.spent_steps else 0.0

    def state_dict(self) -> dict:
        """The ledger, the settings and the generators' states (the noise generator's only outside secure mode)."""
        return {"settings": dict(self._settings), "steps": self._steps,
                "sampling_rng": self._sampling_rng.get_state(), "projection_rng": self._projection_rng.get_state(),
                "noise_rng": None if self.secure_mode else self._noise_rng.get_state()}

    def load_state_dict(self, state: dict) -> None:
        """Resume: the settings must equal this engine's (else ValueError); the ledger and generators continue."""
        if state["settings"] != self._settings:
            saved = state["settings"]
            diff = {k: (saved.get(k), v) for k, v in self._settings.items() if saved.get(k) != v}
            raise ValueError(f"checkpoint was made with different privacy settings (saved, now): {diff}")
        self._steps = self._resumed = int(state["steps"])
        self._sampling_rng.set_state(state["sampling_rng"])
        self._projection_rng.set_state(state["projection_rng"])
        if state["noise_rng"] is not None and not self.secure_mode:
            self._noise_rng.set_state(state["noise_rng"])
