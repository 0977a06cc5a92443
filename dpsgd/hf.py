r"""Hugging Face ``Trainer`` with DP-SGD-RC (optional extra ``hf``: ``pip install -e ".[hf]"``).

:class:`DPTrainer` is a ``transformers.Trainer`` whose training is private:

* batches are **Poisson** samples of expected size ``per_device_train_batch_size x
  gradient_accumulation_steps`` (the logical batch); each logical batch is cut into exactly
  ``gradient_accumulation_steps`` micro-batches, so one optimizer step of the Trainer is one noise draw and
  one accountant step (an empty micro-batch is skipped without calling the model; an empty logical batch
  takes a noise-only step);
* each micro-batch's **per-example losses** are backpropagated by the privacy engine (per-example norms,
  clipping, book-keeping sums); the Trainer's own gradient clipping is turned off
  (``args.max_grad_norm = 0``) and its gradient-norm log is suppressed (it would be a non-private statistic
  of the clipped sum);
* ``epsilon`` (the accountant's upper bound at ``target_delta``, :meth:`dpsgd.PrivacyEngine.get_epsilon`) is
  added to every log line: the step is built once per run and each log costs one FFT pass (tens of
  milliseconds for ``hutch``), so frequent logging stays cheap; ``PrivacyArguments.epsilon_overcount``
  (default 0) may charge up to that fraction more steps than taken before the last step (pessimistic, never
  below the value at the steps taken);
* ``noise_multiplier`` is given, or calibrated from ``target_epsilon`` for exactly the optimizer steps the
  Trainer will take (``args.max_steps``, or ``num_train_epochs`` times the Poisson batches of an epoch,
  rounded up as the Trainer rounds); the engine refuses a step beyond them;
* the logs (and ``trainer_state.json``'s ``log_history`` in every checkpoint) hold the step, ``epsilon``, the
  learning rate, the epoch and evaluation metrics, never the training loss, the tokens seen or the FLOs of the
  private batches (un-noised statistics of the data: one added example changes them), unless
  ``PrivacyArguments(log_nonprivate_metrics=True)`` asks for them;
* every checkpoint the Trainer saves holds the engine's state (``privacy_engine.pt``: the steps taken and the
  settings, no generator state), and ``train(resume_from_checkpoint=...)`` restores it, so a resumed run
  continues the ledger; its batches, projections and noise are drawn afresh (every generator reseeded from
  ``os.urandom``), so nothing in a checkpoint predicts them.

Per-example losses: for a causal LM (labels shaped like ``input_ids``) the next-token cross-entropy, shifted,
averaged over the example's non-ignored (``-100``) tokens; otherwise cross-entropy of ``logits`` against
``labels``; with ``args.label_smoothing_factor = e`` each token's loss is label-smoothed as the Trainer's is,
``(1 - e)`` times its negative log-likelihood plus ``e`` times the mean of ``-log p`` over the classes.
Override :meth:`DPTrainer.per_example_losses` for anything else.

A frozen batch norm (pretrained running statistics, no trainable parameter:
:func:`dpsgd.validator.frozen_batch_norm`) is put back in evaluation mode after the Trainer's ``model.train()``
at every training step: in training mode it would normalize with the batch's statistics, which the engine
refuses.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from transformers import Trainer

from .capture import DEFAULT_CHECK_RATE
from .data import EmptyBatch
from .noise import StepNoise
from .privacy_engine import PrivacyEngine
from .samplers import BatchSampling
from .strategies import HybridClipping, L2Clipping, TwiceSampling
from .validator import BATCH_NORMS, check_positive, frozen_batch_norm

__all__ = ["DPTrainer", "PrivateTrainerMixin", "PrivacyArguments", "PRIVACY_STATE_NAME", "token_losses"]

#: The file, next to ``optimizer.pt`` in each checkpoint folder, that holds ``PrivacyEngine.state_dict()``.
PRIVACY_STATE_NAME = "privacy_engine.pt"

# what the Trainer logs of the private batches themselves, un-noised: left out of the logs (and so of
# trainer_state.json) and of train()'s metrics unless PrivacyArguments(log_nonprivate_metrics=True)
_NONPRIVATE_LOGS = frozenset({"loss", "train_loss", "grad_norm", "num_input_tokens_seen", "total_flos",
                              "train_tokens_per_second"})


# PrivacyArguments' fields by where they go (tests/dpsgd/test_hf.py checks these against make_private's
# signature, so that every option of make_private is one of DPTrainer's and the other way round)
#: the engine's constructor arguments
ENGINE_ARGUMENTS = ("secure_mode", "ledger_path")
#: the engine's settings, changeable at any time
ENGINE_SETTINGS = ("check_every_step", "check_rate")
#: the trainer's own
TRAINER_OPTIONS = ("epsilon_overcount", "log_nonprivate_metrics")
#: make_private's that the trainer derives: the objects it builds, and the steps from ``TrainingArguments``
DERIVED = ("module", "optimizer", "data_loader", "criterion", "epochs", "steps")


def token_losses(logits: torch.Tensor, labels: torch.Tensor, input_ids: torch.Tensor | None = None, *,
                 label_smoothing: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Each row's per-position cross-entropy and which positions count: ``(losses, keep)``, both ``(B, T)``.

    For a causal LM (``labels`` shaped like ``input_ids``) position ``t`` scores token ``t + 1`` (the logits and
    labels are shifted); otherwise ``logits`` are scored against ``labels`` as they are.  Positions labelled
    ``-100`` have ``keep = 0`` (and a zero loss).  With ``label_smoothing = e`` each position's loss is
    :math:`(1 - e)\,(-\log p_y) + e \cdot \mathrm{mean}_c(-\log p_c)`, as the Trainer smooths.  Each row's
    values depend on that row's logits and labels only.

    Examples
    --------
    >>> import torch
    >>> from dpsgd.hf import token_losses
    >>> losses, keep = token_losses(torch.zeros(2, 4, 5), torch.tensor([[1, 2, 3, -100]] * 2),
    ...                             torch.tensor([[1, 2, 3, 0]] * 2))
    >>> keep.tolist()
    [[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]]
    >>> round(float(losses[0, 0]), 4)   # log 5: uniform logits over 5 classes
    1.6094
    """
    if input_ids is not None and labels.shape == input_ids.shape:   # causal LM: shift
        logits, labels = logits[:, -labels.shape[1]:][:, :-1], labels[:, 1:]
    per = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), reduction="none",
                          ignore_index=-100, label_smoothing=label_smoothing).reshape(labels.shape[0], -1)
    return per, (labels.reshape(labels.shape[0], -1) != -100).to(per.dtype)


@dataclass(frozen=True)
class PrivacyArguments:
    """The privacy settings of a :class:`DPTrainer`: every option of :meth:`dpsgd.PrivacyEngine.make_private` (but
    the model, optimizer, loader and loss, which the trainer has, and ``epochs``/``steps``, which
    ``TrainingArguments`` give), of :class:`dpsgd.PrivacyEngine` (``secure_mode``, ``ledger_path``, and its settings
    ``check_every_step``, ``check_rate``), and two of the trainer's own.

    The defaults are ``make_private``'s, but ``max_grad_norm`` (1.0) and ``target_delta`` (``1e-5``, also the delta
    at which ``epsilon`` is logged).  ``user_ids`` labels the examples of ``train_dataset`` in its index order
    (``privacy_unit="user"``: ``per_device_train_batch_size * gradient_accumulation_steps`` is then the expected
    number of users per step).

    ``target_delta`` is also the delta at which ``epsilon`` is logged.  ``ledger_path`` is passed to
    ``PrivacyEngine(ledger_path=...)``: an append-only file with one line per noisy step, flushed to disk
    before the step returns.  A later trainer (or engine) on the same file counts the steps recorded there,
    even those a crash took after the last checkpoint, and refuses a file written with other settings.
    ``check_every_step`` and ``check_rate`` set the engine's row check (example isolation; see
    :attr:`dpsgd.PrivacyEngine.check_rate`).  ``epsilon_overcount`` is the ``overcount`` of the logs'
    epsilon (:meth:`dpsgd.PrivacyEngine.get_epsilon`) before the last step: ``0`` (default) logs the epsilon of
    the steps taken (one FFT pass a log, tens of milliseconds for ``hutch``); ``> 0`` charges the first count at
    or above them on a grid about ``1 + epsilon_overcount`` apart, so a run computes about
    ``log(steps) / log(1 + epsilon_overcount)`` values however small ``logging_steps`` is (pessimistic, never
    below the value at the steps taken; of use only where each value is costly, as with twice sampling's RDP
    accountant).

    ``seed`` is ``make_private``'s reproducibility mode (it warns: the run is not private against whoever holds
    the seed; refused with ``secure_mode``); ``TrainingArguments.seed`` seeds the model's initialization and
    dropout only, never the privacy randomness.  ``log_nonprivate_metrics`` (default ``False``) lets the Trainer
    log the training loss, the tokens seen (``TrainingArguments.include_num_input_tokens_seen``) and the FLOs,
    statistics of the private batches without noise that epsilon does not cover; ``True`` warns so.

    Examples
    --------
    >>> from dpsgd.hf import PrivacyArguments
    >>> PrivacyArguments(target_epsilon=8.0, estimator="hutch", projection_dim=16).epsilon_overcount
    0.0
    """

    max_grad_norm: float = 1.0
    noise_multiplier: float | None = None
    target_epsilon: float | None = None
    target_delta: float = 1e-5
    estimator: str = "auto"
    projection_dim: int = 32
    clipping_pass: str = "bookkeeping"
    seed: int | None = None
    gradient_projection: torch.Tensor | None = None
    noise: StepNoise | str = "gaussian"
    clipping: L2Clipping | TwiceSampling | HybridClipping | None = None
    privacy_unit: str = "example"
    user_ids: object = None
    max_examples_per_user: int | None = None
    batch_sampling: BatchSampling | str = "poisson"
    grad_sample_mode: str | None = None
    secure_mode: bool = False
    ledger_path: str | os.PathLike | None = None
    check_every_step: bool = False
    check_rate: float = DEFAULT_CHECK_RATE
    epsilon_overcount: float = 0.0
    log_nonprivate_metrics: bool = False

    def make_private_options(self) -> dict:
        """The fields that are ``make_private``'s options, by name."""
        skip = {*ENGINE_ARGUMENTS, *ENGINE_SETTINGS, *TRAINER_OPTIONS}
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}


class PrivateTrainerMixin:
    r"""What makes a ``transformers.Trainer`` class private: put it first among the bases,
    ``class DPTrainer(PrivateTrainerMixin, Trainer)``, as :class:`DPTrainer`, :class:`dpsgd.trl.DPSFTTrainer` and
    :class:`dpsgd.trl.DPDPOTrainer` do.

    It builds the privacy engine after the trainer class's own constructor (so a trainer that prepares its dataset,
    as TRL's do, is made private on the prepared examples), replaces the training loader by the private one, runs
    each training step as per-example losses (:meth:`per_example_losses`) through the engine, and keeps the logs,
    checkpoints and metrics as :class:`DPTrainer` describes.  The trainer class's ``compute_loss`` is never called
    in training: a subclass that overrides it is refused (override :meth:`per_example_losses`).  Two hooks are for
    the trainer classes built on it: :meth:`private_collator` (the collation of the private loader, by default the
    trainer's ``data_collator``) and :meth:`check_supported` (refuse settings under which one row is not one
    example, before any calibration).
    """

    def __init__(self, *args, privacy: PrivacyArguments | None = None, **kwargs) -> None:
        base = type(self).__mro__[type(self).__mro__.index(PrivateTrainerMixin) + 1]
        if type(self).compute_loss is not base.compute_loss:
            raise TypeError(f"{type(self).__name__} overrides compute_loss, which DPTrainer never calls: a private "
                            f"step needs one loss per example, not their reduction. Override "
                            f"per_example_losses(model, inputs) -> (B,) instead")
        train, evaluation = kwargs.get("train_dataset"), kwargs.get("eval_dataset")
        evaluated = list(evaluation.values()) if isinstance(evaluation, dict) else [evaluation]
        if train is not None and any(e is train for e in evaluated):
            warnings.warn("eval_dataset is the private train_dataset: its evaluation metrics (loss, and TRL's rewards, "
                          "log-probabilities and accuracies) are logged without noise, so epsilon does not cover them; "
                          "evaluate on held-out data", UserWarning, stacklevel=2)
        super().__init__(*args, **kwargs)
        if self.train_dataset is None:
            raise ValueError(f"{type(self).__name__} needs a train_dataset")
        self.check_supported()
        self.privacy = privacy or PrivacyArguments()
        check_positive(self.privacy.epsilon_overcount, "epsilon_overcount", allow_zero=True)
        if self.privacy.log_nonprivate_metrics:
            warnings.warn("PrivacyArguments(log_nonprivate_metrics=True): the logs, trainer_state.json in every "
                          "checkpoint and train()'s metrics will hold the training loss, the tokens seen and the "
                          "FLOs of the private batches, which are not differentially private (no noise; one added "
                          "example changes them): epsilon does not cover them", UserWarning, stacklevel=2)
        elif self.args.include_num_input_tokens_seen not in ("no", False, None):
            warnings.warn("TrainingArguments(include_num_input_tokens_seen=...) is turned off by DPTrainer: the "
                          "number of tokens in the Poisson batches is not private (one added example changes it). "
                          "PrivacyArguments(log_nonprivate_metrics=True) logs it anyway, outside epsilon",
                          UserWarning, stacklevel=2)
            self.args.include_num_input_tokens_seen = "no"
        self.args.max_grad_norm = 0.0  # every example is clipped by the engine; the Trainer must not re-clip
        # a resumed run draws fresh batches (every generator reseeded), never by replaying batches (class doc)
        self.args.ignore_data_skip = True
        self.privacy_engine = PrivacyEngine(secure_mode=self.privacy.secure_mode,
                                            ledger_path=self.privacy.ledger_path)
        for name in ENGINE_SETTINGS:
            setattr(self.privacy_engine, name, getattr(self.privacy, name))
        accumulation = self.args.gradient_accumulation_steps
        if self.privacy.privacy_unit == "user" and accumulation > 1:
            raise ValueError(f"PrivacyArguments(privacy_unit='user') needs TrainingArguments(gradient_accumulation_"
                             f"steps=1), got {accumulation}: the Trainer draws a step's micro-batches before their "
                             f"backwards, and a user-level engine clips each drawn batch of whole users in the "
                             f"backward before the next draw")
        logical = DataLoader(self.train_dataset, batch_size=self.args.per_device_train_batch_size * accumulation,
                             collate_fn=self.private_collator())
        options = self.privacy.make_private_options()
        if self.privacy.noise_multiplier is None:
            if self.privacy.target_epsilon is None:
                raise ValueError("PrivacyArguments needs noise_multiplier or target_epsilon")
            # the steps train() takes (class Notes), counted by make_private from its own loader's batches
            options.update({"steps": int(self.args.max_steps)} if self.args.max_steps > 0
                           else {"epochs": float(self.args.num_train_epochs)})
        else:   # target_delta is also the delta epsilon is logged at: a given noise multiplier is not calibrated
            options.update(target_epsilon=None, target_delta=None)
        self.create_optimizer()
        self.model, self.optimizer, loader = self.privacy_engine.make_private(
            module=self.model, optimizer=self.optimizer, data_loader=logical, **options)
        self._dp_loader = loader.in_chunks(accumulation)
        self._batch_norms: list | None = None

    def private_collator(self):
        """The ``collate_fn`` of the private loader: the trainer's ``data_collator``.  Each collated tensor's row
        ``i`` must be the ``i``-th example drawn (the engine follows each row as its example)."""
        return self.data_collator

    def check_supported(self) -> None:
        """Refuse, before the engine calibrates, settings of the trainer class under which a row is not one
        example; nothing to refuse for a plain ``Trainer``."""

    def get_train_dataloader(self) -> DataLoader:
        """The private loader: Poisson logical batches, each as ``gradient_accumulation_steps`` pieces."""
        return self._dp_loader

    def per_example_losses(self, model: torch.nn.Module, inputs: dict) -> torch.Tensor:
        """``(B,)`` losses of one micro-batch (see the module docstring); override for other tasks."""
        inputs = dict(inputs)
        labels = inputs.pop("labels")
        per, keep = token_losses(model(**inputs).logits, labels, inputs.get("input_ids"),
                                 label_smoothing=float(self.args.label_smoothing_factor or 0.0))
        return (per * keep).sum(1) / keep.sum(1).clamp_min(1)

    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        model.train()
        if self._batch_norms is None:   # the model's batch norms, found once (a scan of every module costs a step's %)
            self._batch_norms = [m for m in model.modules() if isinstance(m, BATCH_NORMS)]
        for m in self._batch_norms:   # a frozen batch norm trains in evaluation mode only (module docstring)
            if frozen_batch_norm(m):
                m.eval()
        if isinstance(inputs, EmptyBatch):   # a Poisson micro-batch with no example: nothing to backpropagate
            return torch.zeros((), device=self.args.device)
        inputs = self._prepare_inputs(inputs)
        losses = self.per_example_losses(model, inputs)
        loss = self.privacy_engine.private_loss(losses)
        loss.backward()
        return loss.detach().to(self.args.device) / self.args.gradient_accumulation_steps

    def _get_grad_norm(self, model, grad_norm=None):
        return None  # the clipped sum's norm before noise is not private: never logged

    def floating_point_ops(self, inputs: dict) -> int:
        """0 unless ``PrivacyArguments(log_nonprivate_metrics=True)``: the Trainer's count grows with each Poisson
        batch's size, and is saved as ``total_flos`` in ``trainer_state.json``."""
        return super().floating_point_ops(inputs) if self.privacy.log_nonprivate_metrics else 0

    def train(self, *args, **kwargs):
        """``Trainer.train``; unless ``PrivacyArguments(log_nonprivate_metrics=True)``, the returned metrics leave
        out the training loss and FLOs, and ``training_loss`` is ``nan``."""
        output = super().train(*args, **kwargs)
        if self.privacy.log_nonprivate_metrics:
            return output
        metrics = {k: v for k, v in output.metrics.items() if k not in _NONPRIVATE_LOGS}
        return type(output)(output.global_step, float("nan"), metrics)

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        # in place: evaluate() returns the dict it logs, and TRL's trainers add their evaluation metrics to it
        if not self.privacy.log_nonprivate_metrics:
            # the un-noised training loss, token count and FLOs of the private batches: never logged (nor saved in
            # trainer_state.json's log_history); evaluation metrics are kept
            for key in _NONPRIVATE_LOGS.intersection(logs):
                del logs[key]
            train_metrics = getattr(self, "_metrics", {}).get("train")   # TRL's trainers: added to the next log line
            if train_metrics and self.model.training:
                train_metrics.clear()
            if self.args.include_num_input_tokens_seen not in ("no", False, None):   # set after the constructor
                self.args.include_num_input_tokens_seen = "no"
        engine = self.privacy_engine
        if engine.spent_steps:   # spent: a ledger file's earlier steps count too
            # the last log charges the steps taken; earlier ones may charge more (PrivacyArguments.epsilon_overcount)
            last = self.state.max_steps > 0 and self.state.global_step >= self.state.max_steps
            overcount = 0.0 if last else self.privacy.epsilon_overcount
            logs["epsilon"] = engine.get_epsilon(self.privacy.target_delta, overcount=overcount)
        super().log(logs, *args, **kwargs)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        # the Trainer calls this for every resumable checkpoint (not with save_only_model, which cannot be
        # resumed): the privacy state travels with the optimizer state it belongs to
        super()._save_optimizer_and_scheduler(output_dir)
        if self.args.should_save:
            torch.save(self.privacy_engine.state_dict(), os.path.join(output_dir, PRIVACY_STATE_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        # called once on train(resume_from_checkpoint=...), before the first step; the engine state goes
        # before the optimizer's so that a checkpoint without it fails before training state is restored
        if checkpoint is not None:
            path = os.path.join(checkpoint, PRIVACY_STATE_NAME)
            if not os.path.isfile(path):
                raise ValueError(f"checkpoint {checkpoint} holds no privacy state ({PRIVACY_STATE_NAME}): it was "
                                 f"not saved by a DPTrainer, or was saved with save_only_model=True. Resuming from "
                                 f"it would restart the privacy ledger at zero steps and under-report epsilon; "
                                 f"resume from a checkpoint a DPTrainer saved, or start a new run")
            # plain settings and counts only: no pickled code is needed
            self.privacy_engine.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        super()._load_optimizer_and_scheduler(checkpoint)


class DPTrainer(PrivateTrainerMixin, Trainer):
    r"""``transformers.Trainer`` with DP-SGD-RC; everything else (arguments, callbacks, saving) as usual.

    Checkpoints carry the privacy state: each one the Trainer saves holds ``privacy_engine.pt``
    (``PRIVACY_STATE_NAME``), the engine's ``state_dict()`` (steps taken and settings; no generator state, so
    nothing in a checkpoint predicts any step's batch, projections or noise).  ``train(resume_from_checkpoint=...)``
    restores it, so ``epsilon`` counts the steps taken before the interruption, and refuses a checkpoint
    without it (one a plain ``Trainer`` saved, or one saved with ``save_only_model=True``): resuming from it
    would restart the ledger at zero steps.

    ``args.ignore_data_skip`` is set to ``True``.  On resume the Trainer would otherwise replay the first
    batches of the interrupted epoch to skip them; with Poisson sampling a batch is a fresh draw, not a
    position in a fixed order, so there is nothing to skip, and the replayed batches would bypass the engine's
    batch book-keeping.  The resumed trainer draws its batches, projections and noise from generators
    reseeded from ``os.urandom``: it takes as many noisy steps and reports the same ``epsilon`` as the
    uninterrupted run, but not the same steps.  (The Trainer's epoch counter after a mid-epoch resume then
    starts the interrupted epoch over; the run still stops at the same ``max_steps``.)

    The logs hold no un-noised statistic of the private batches unless
    ``PrivacyArguments(log_nonprivate_metrics=True)``: the training loss (``loss``, ``train_loss``), the tokens
    seen (``include_num_input_tokens_seen`` is turned off, with a warning) and the FLOs (``total_flos``, 0) are
    left out of every log line, of ``trainer_state.json`` and of ``train()``'s metrics (its ``training_loss``
    is ``nan``).  Evaluation metrics (``eval_loss`` on an evaluation set) are logged as usual.

    Parameters
    ----------
    *args, **kwargs
        As for ``transformers.Trainer`` (``train_dataset`` and ``args`` are required).
    privacy : PrivacyArguments
        Clipping, noise (or target epsilon), estimator, ledger file.

    Raises
    ------
    ValueError
        Without a ``train_dataset``, or with neither ``noise_multiplier`` nor ``target_epsilon``.

    Notes
    -----
    With ``target_epsilon`` the noise is calibrated, in the constructor, for the optimizer steps that
    ``train()`` will take as ``args`` stand then (kept as the engine's ``planned_steps``): ``args.max_steps`` if
    positive, else ``ceil(num_train_epochs * logical batches an epoch)``, as the Trainer counts them from the private
    loader (whose ``len`` is the logical batches times ``gradient_accumulation_steps`` pieces), fractional epochs and
    a ``max_steps`` that is not whole epochs run as given.  Raising ``args.max_steps`` or ``args.num_train_epochs``
    afterwards makes the engine refuse the first step beyond that count rather than exceed the target.

    Examples
    --------
    See ``examples/hf_lora_gpt2.py`` and the "Fine-tune a Hugging Face model" page.
    """
