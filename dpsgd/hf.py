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
* ``epsilon`` (the accountant's upper bound at ``target_delta``) is added to every log line;
* ``noise_multiplier`` is given, or calibrated from ``target_epsilon`` over the run's steps
  (``args.num_train_epochs``, or ``args.max_steps`` rounded up to whole epochs).

Per-example losses: for a causal LM (labels shaped like ``input_ids``) the next-token cross-entropy, shifted,
averaged over the example's non-ignored (``-100``) tokens; otherwise cross-entropy of ``logits`` against
``labels``.  Override :meth:`DPTrainer.per_example_losses` for anything else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from transformers import Trainer

from .data import EmptyBatch
from .privacy_engine import PrivacyEngine

__all__ = ["DPTrainer", "PrivacyArguments"]


@dataclass(frozen=True)
class PrivacyArguments:
    """The privacy settings of a :class:`DPTrainer` (see :meth:`dpsgd.PrivacyEngine.make_private`).

    ``target_delta`` is also the delta at which ``epsilon`` is logged.
    """

    max_grad_norm: float = 1.0
    noise_multiplier: float | None = None
    target_epsilon: float | None = None
    target_delta: float = 1e-5
    estimator: str = "hutch"
    k: int = 32
    clipping_pass: str = "bookkeeping"
    seed: int | None = None
    secure_mode: bool = False


class DPTrainer(Trainer):
    r"""``transformers.Trainer`` with DP-SGD-RC; everything else (arguments, callbacks, saving) as usual.

    Parameters
    ----------
    *args, **kwargs
        As for ``transformers.Trainer`` (``train_dataset`` and ``args`` are required).
    privacy : PrivacyArguments
        Clipping, noise (or target epsilon), estimator.

    Examples
    --------
    See ``examples/hf_lora_gpt2.py`` and the "Fine-tune a Hugging Face model" page.
    """

    def __init__(self, *args, privacy: PrivacyArguments | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.train_dataset is None:
            raise ValueError("DPTrainer needs a train_dataset")
        self.privacy = privacy or PrivacyArguments()
        self.args.max_grad_norm = 0.0  # every example is clipped by the engine; the Trainer must not re-clip
        self.privacy_engine = PrivacyEngine(secure_mode=self.privacy.secure_mode)
        accumulation = self.args.gradient_accumulation_steps
        logical = DataLoader(self.train_dataset, batch_size=self.args.per_device_train_batch_size * accumulation,
                             collate_fn=self.data_collator)
        epochs = None
        if self.privacy.noise_multiplier is None:
            if self.privacy.target_epsilon is None:
                raise ValueError("PrivacyArguments needs noise_multiplier or target_epsilon")
            steps_per_epoch = math.ceil(len(self.train_dataset) / logical.batch_size)
            epochs = (math.ceil(self.args.max_steps / steps_per_epoch) if self.args.max_steps > 0
                      else math.ceil(self.args.num_train_epochs))
        self.create_optimizer()
        p = self.privacy
        self.model, self.optimizer, _, loader = self.privacy_engine.make_private(
            module=self.model, optimizer=self.optimizer, data_loader=logical, max_grad_norm=p.max_grad_norm,
            noise_multiplier=p.noise_multiplier, target_epsilon=p.target_epsilon if epochs else None,
            target_delta=p.target_delta if epochs else None, epochs=epochs, estimator=p.estimator, k=p.k,
            seed=p.seed, clipping_pass=p.clipping_pass)
        self._dp_loader = loader.in_chunks(accumulation)

    def get_train_dataloader(self) -> DataLoader:
        """The private loader: Poisson logical batches, each as ``gradient_accumulation_steps`` pieces."""
        return self._dp_loader

    def per_example_losses(self, model: torch.nn.Module, inputs: dict) -> torch.Tensor:
        """``(B,)`` losses of one micro-batch (see the module docstring); override for other tasks."""
        inputs = dict(inputs)
        labels = inputs.pop("labels")
        logits = model(**inputs).logits
        if "input_ids" in inputs and labels.shape == inputs["input_ids"].shape:   # causal LM: shift
            logits, labels = logits[:, :-1], labels[:, 1:]
        per = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), reduction="none",
                              ignore_index=-100).reshape(labels.shape[0], -1)
        keep = (labels.reshape(labels.shape[0], -1) != -100).to(per.dtype)
        return (per * keep).sum(1) / keep.sum(1).clamp_min(1)

    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        model.train()
        if isinstance(inputs, EmptyBatch):   # a Poisson micro-batch with no example: nothing to backpropagate
            return torch.zeros((), device=self.args.device)
        inputs = self._prepare_inputs(inputs)
        losses = self.per_example_losses(model, inputs)
        loss = self.privacy_engine.private_loss(losses)
        loss.backward()
        return loss.detach().to(self.args.device) / self.args.gradient_accumulation_steps

    def _get_grad_norm(self, model, grad_norm=None):
        return None  # the clipped sum's norm before noise is not private: never logged

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        if self.privacy_engine.steps:
            logs = {**logs, "epsilon": self.privacy_engine.get_epsilon(self.privacy.target_delta)}
        super().log(logs, *args, **kwargs)
