r"""TRL's ``SFTTrainer`` and ``DPOTrainer`` with DP-SGD-RC (optional extra ``trl``: ``pip install -e ".[trl]"``).

Both are TRL's trainers made private by :class:`dpsgd.hf.PrivateTrainerMixin`, the machinery of
:class:`dpsgd.hf.DPTrainer`: Poisson logical batches cut into ``gradient_accumulation_steps`` micro-batches, one
noisy step and one accountant step per optimizer step, ``epsilon`` in every log line, the privacy state in every
checkpoint, no un-noised statistic of the private batches in the logs, settings in
:class:`dpsgd.hf.PrivacyArguments`.  TRL prepares the dataset as usual (tokenization, chat templates, completion
masks, precomputed reference log-probabilities); the privacy engine then draws from the prepared examples.

What changes from TRL, so that one example moves a step by at most the clipping norm:

* **One example, one row, one loss.**  :class:`DPSFTTrainer` refuses ``packing`` and ``padding_free`` (both put
  several examples in one row).  Each example's loss is the mean of its own tokens' losses (TRL divides the batch's
  summed token losses by the batch's token count, which depends on the other examples drawn).
* **A preference pair is one example.**  :class:`DPDPOTrainer` collates the chosen and the rejected completion of
  example ``i`` as row ``i`` of two tensors (TRL stacks them as rows ``i`` and ``B + i`` of one) and runs the model
  once on each, so that example ``i``'s loss, and the gradient the engine clips, depend on its two rows only.  Loss
  types that sort across the batch (``aot``, ``aot_unpaired``) are refused: one example's loss would depend on the
  others'.
* A mixture-of-experts router's auxiliary loss (a batch statistic) is refused, as is WPO's ``use_weighting``.

Examples
--------
See ``examples/trl_sft.py`` and ``examples/trl_dpo.py`` and the "Fine-tune with TRL" page.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from trl import DPOTrainer, SFTTrainer
from trl.trainer.dpo_trainer import DataCollatorForPreference
from trl.trainer.utils import use_adapter

from .data import KeepsRowOrder
from .hf import PrivateTrainerMixin, token_losses

__all__ = ["DPSFTTrainer", "DPDPOTrainer", "PairCollator", "preference_losses", "PREFERENCE_LOSSES"]

#: DPO loss types computed per example (``DPOConfig(loss_type=...)``); ``aot`` and ``aot_unpaired`` sort each
#: batch's log-ratios, so one example's loss depends on the others': refused.
PREFERENCE_LOSSES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard",
                     "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm")


class DPSFTTrainer(PrivateTrainerMixin, SFTTrainer):
    r"""TRL's ``SFTTrainer`` with DP-SGD-RC: supervised fine-tuning of a causal LM on private examples.

    Arguments as for ``trl.SFTTrainer`` (``model``, ``args=SFTConfig(...)``, ``train_dataset``,
    ``processing_class``, ``peft_config``, ...) plus ``privacy=PrivacyArguments(...)``.  Everything of
    :class:`dpsgd.hf.DPTrainer` holds: Poisson batches, ``epsilon`` in the logs, checkpoints with the privacy state,
    no training loss, token count or token accuracy in the logs.

    Each example's loss is the mean, over its own tokens whose label is not ``-100`` (the completion only, for a
    prompt-completion dataset with ``completion_only_loss``; the assistant turns with ``assistant_only_loss``), of
    the next-token cross-entropy (``loss_type="nll"``) or of DFT's probability-weighted cross-entropy
    (``loss_type="dft"``: each token's loss times its probability, not differentiated), label-smoothed as the
    Trainer smooths with ``label_smoothing_factor``.

    Raises
    ------
    ValueError
        With ``packing=True`` or ``padding_free=True`` (several examples in one row: one example's tokens would be
        clipped with the others'), or a router auxiliary loss (``output_router_logits``: a statistic of the whole
        batch).

    Examples
    --------
    >>> from dpsgd.trl import DPSFTTrainer   # doctest: +SKIP
    >>> trainer = DPSFTTrainer(model=model, args=SFTConfig(output_dir="out", max_steps=20),  # doctest: +SKIP
    ...                        train_dataset=dataset, processing_class=tokenizer,
    ...                        privacy=PrivacyArguments(target_epsilon=8.0))
    >>> trainer.train()   # doctest: +SKIP

    ``examples/trl_sft.py`` runs in full.
    """

    def check_supported(self) -> None:
        if self.args.packing:
            raise ValueError("SFTConfig(packing=True) is refused by DPSFTTrainer: packing puts several examples in "
                             "one row, and the privacy engine clips one row as one example, so an example packed "
                             "with others would move the step by more than the clipping norm. Use packing=False")
        if self.args.padding_free:
            raise ValueError("SFTConfig(padding_free=True) is refused by DPSFTTrainer: it flattens the batch into "
                             "one row, and the privacy engine clips one row as one example. Use padding_free=False")
        if self.aux_loss_enabled:
            raise ValueError("a router auxiliary loss (model config output_router_logits=True) is refused by "
                             "DPSFTTrainer: the load-balancing loss is a statistic of the whole batch, so one "
                             "example's loss would depend on the others'. Set output_router_logits=False")
        if self.args.loss_type not in ("nll", "dft"):
            raise ValueError(f"SFTConfig(loss_type={self.args.loss_type!r}) is not supported by DPSFTTrainer; "
                             f"use 'nll' or 'dft'")

    def private_collator(self) -> KeepsRowOrder:
        """TRL's collator, declared to keep its rows in order (its language-modeling collator pads each example in
        the order given), so that a batch of users is collated by one call (``privacy_unit="user"``)."""
        return KeepsRowOrder(self.data_collator)

    def per_example_losses(self, model: torch.nn.Module, inputs: dict) -> torch.Tensor:
        """``(B,)``: each example's mean token loss (class docstring)."""
        inputs = dict(inputs)
        labels = inputs.pop("labels")
        per, keep = token_losses(model(**inputs, use_cache=False).logits, labels, inputs["input_ids"],
                                 label_smoothing=float(self.args.label_smoothing_factor or 0.0))
        if self.args.loss_type == "dft":   # DFT: each token's loss weighted by its (undifferentiated) probability
            per = per * torch.exp(-per.detach())
        return (per * keep).sum(1) / keep.sum(1).clamp_min(1)


class PairCollator:
    r"""The private loader's collation of preference pairs: TRL's ``DataCollatorForPreference``, with example
    ``i``'s chosen and rejected sequences as row ``i`` of ``chosen_*`` and ``rejected_*`` tensors (TRL's own
    stacks them as rows ``i`` and ``B + i`` of one batch, which the engine would take as two examples).

    Padding and truncation are TRL's (both halves padded to one length).  The result holds ``chosen_input_ids``,
    ``chosen_attention_mask``, ``chosen_completion_mask``, the same for ``rejected_``, and ``ref_chosen_logps``,
    ``ref_rejected_logps`` when the dataset carries precomputed reference log-probabilities.

    Examples
    --------
    >>> from dpsgd.trl import PairCollator
    >>> batch = PairCollator(pad_token_id=0)([{"prompt_ids": [1, 2], "chosen_ids": [3], "rejected_ids": [4, 5]}])
    >>> batch["chosen_input_ids"].tolist(), batch["rejected_input_ids"].tolist()
    ([[1, 2, 3, 0]], [[1, 2, 4, 5]])
    >>> batch["rejected_completion_mask"].tolist()
    [[0, 0, 1, 1]]
    """

    def __init__(self, pad_token_id: int, max_length: int | None = None, truncation_mode: str = "keep_start",
                 pad_to_multiple_of: int | None = None) -> None:
        self.pairs = DataCollatorForPreference(pad_token_id=pad_token_id, max_length=max_length,
                                               truncation_mode=truncation_mode, pad_to_multiple_of=pad_to_multiple_of)

    def __call__(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        stacked = self.pairs(examples)
        b = len(examples)
        out = {}
        for key in ("input_ids", "attention_mask", "completion_mask"):
            # copies, not views of the stacked tensor: each is a batch of its own rows
            out["chosen_" + key], out["rejected_" + key] = stacked[key][:b].clone(), stacked[key][b:].clone()
        for key in ("ref_chosen_logps", "ref_rejected_logps"):
            if key in stacked:
                out[key] = stacked[key]
        return out


def preference_losses(loss_type: str, chosen_logratios: torch.Tensor, rejected_logratios: torch.Tensor, *,
                      beta: float, label_smoothing: float = 0.0, chosen_tokens: torch.Tensor | None = None,
                      rejected_tokens: torch.Tensor | None = None, chosen_token_mean: torch.Tensor | None = None,
                      f_divergence_type: str = "reverse_kl", f_alpha_divergence_coef: float = 1.0,
                      discopop_tau: float = 0.05) -> torch.Tensor:
    r"""``(B,)`` per-example DPO-family losses from each pair's log-ratios, as TRL defines them.

    With :math:`r^+_i = \log\pi(y^+_i|x_i) - \log\pi_{ref}(y^+_i|x_i)` and :math:`r^-_i` the same for the rejected
    completion, ``"sigmoid"`` (DPO) is :math:`-\log\sigma(\beta(s(r^+_i) - s(r^-_i)))`, where the score ``s`` is
    the identity for ``f_divergence_type="reverse_kl"`` and TRL's :math:`f'` otherwise.  The other types follow
    TRL's ``DPOTrainer``; ``"ipo"`` and ``"sigmoid_norm"`` divide the scores by each completion's token count
    (``chosen_tokens``, ``rejected_tokens``), and ``"sft"`` is each example's own mean negative log-likelihood of
    its chosen tokens (``chosen_token_mean``; TRL's is the batch's token mean).  Each example's loss depends on its
    own pair only.

    Examples
    --------
    >>> import torch
    >>> from dpsgd.trl import preference_losses
    >>> preference_losses("sigmoid", torch.tensor([1.0, 0.0]), torch.tensor([0.0, 0.0]), beta=0.1)
    tensor([0.6444, 0.6931])
    """
    if loss_type not in PREFERENCE_LOSSES:
        raise ValueError(f"loss_type must be one of {PREFERENCE_LOSSES} (computed per example), got {loss_type!r}")
    if f_divergence_type == "reverse_kl" or (f_divergence_type == "alpha_divergence"
                                             and abs(f_alpha_divergence_coef - 1.0) < 1e-6):
        chosen, rejected = chosen_logratios, rejected_logratios
    elif f_divergence_type == "forward_kl":
        chosen, rejected = 1 - torch.exp(-chosen_logratios), 1 - torch.exp(-rejected_logratios)
    elif f_divergence_type == "js_divergence":
        chosen = math.log(2) + F.logsigmoid(chosen_logratios)
        rejected = math.log(2) + F.logsigmoid(rejected_logratios)
    elif f_divergence_type == "alpha_divergence":
        a = f_alpha_divergence_coef - 1.0
        chosen = (torch.exp(torch.clamp(a * chosen_logratios, max=80.0)) - 1.0) / a
        rejected = (torch.exp(torch.clamp(a * rejected_logratios, max=80.0)) - 1.0) / a
    else:
        raise ValueError(f"f_divergence_type must be 'reverse_kl', 'forward_kl', 'js_divergence' or "
                         f"'alpha_divergence', got {f_divergence_type!r}")
    delta = chosen - rejected
    if loss_type == "sigmoid":
        return -F.logsigmoid(beta * delta)
    if loss_type == "hinge":
        return torch.relu(1 - beta * delta)
    if loss_type in ("ipo", "sigmoid_norm"):
        d = chosen / chosen_tokens.clamp(min=1.0) - rejected / rejected_tokens.clamp(min=1.0)
        return (d - 1 / (2 * beta)) ** 2 if loss_type == "ipo" else -F.logsigmoid(beta * d)
    if loss_type == "exo_pair":
        eps = torch.tensor(label_smoothing, device=delta.device, dtype=delta.dtype)
        return (torch.sigmoid(beta * delta) * (F.logsigmoid(beta * delta) - torch.log1p(-eps))
                + torch.sigmoid(-beta * delta) * (F.logsigmoid(-beta * delta) - torch.log(eps)))
    if loss_type == "nca_pair":
        c, r = beta * chosen_logratios, beta * rejected_logratios
        return -F.logsigmoid(c) - 0.5 * F.logsigmoid(-c) - 0.5 * F.logsigmoid(-r)
    if loss_type == "robust":
        return (-(1 - label_smoothing) * F.logsigmoid(beta * delta)
                + label_smoothing * F.logsigmoid(-beta * delta)) / (1 - 2 * label_smoothing)
    if loss_type == "bco_pair":
        return -F.logsigmoid(beta * chosen_logratios) - F.logsigmoid(-beta * rejected_logratios)
    if loss_type == "sppo_hard":
        return (chosen_logratios - 0.5 / beta) ** 2 + (rejected_logratios + 0.5 / beta) ** 2
    if loss_type == "apo_zero":
        return 1 - torch.sigmoid(beta * chosen_logratios) + torch.sigmoid(beta * rejected_logratios)
    if loss_type == "apo_down":
        return torch.sigmoid(beta * chosen_logratios) + 1 - torch.sigmoid(beta * (chosen_logratios
                                                                               - rejected_logratios))
    if loss_type == "discopop":
        logits = beta * delta
        modulation = torch.sigmoid(logits / discopop_tau)
        return -F.logsigmoid(logits) * (1 - modulation) + torch.exp(-logits) * modulation
    return -chosen_token_mean   # "sft"


class DPDPOTrainer(PrivateTrainerMixin, DPOTrainer):
    r"""TRL's ``DPOTrainer`` with DP-SGD-RC: preference optimization on private pairs, one pair one example.

    Arguments as for ``trl.DPOTrainer`` (``model``, ``ref_model``, ``args=DPOConfig(...)``, ``train_dataset`` of
    prompt / chosen / rejected, ``processing_class``, ``peft_config``, ...) plus ``privacy=PrivacyArguments(...)``.
    Everything of :class:`dpsgd.hf.DPTrainer` holds (Poisson batches of pairs, ``epsilon`` in the logs,
    checkpoints); the rewards, margins and accuracies TRL logs are statistics of the private batches and are not
    logged in training.

    Each step's pairs are collated by :class:`PairCollator` and the model runs once on the chosen and once on the
    rejected sequences; the sequence log-probability of a completion is the sum of its tokens' log-probabilities
    (TRL's ``ld_alpha`` weights the tokens beyond the shorter completion's length).  The reference log-probabilities
    come, as in TRL, from the dataset (``precompute_ref_log_probs=True``), from ``ref_model``, or, for a PEFT model
    without one, from its frozen ``"ref"`` adapter where TRL made one (a model whose adapter was trained before) or
    with its adapters disabled, under ``torch.no_grad()``; they are each example's own.
    The loss is :func:`preference_losses` of ``args.loss_type`` (several types add with ``loss_weights``).

    Raises
    ------
    ValueError
        With a loss type outside :data:`PREFERENCE_LOSSES` (``aot``, ``aot_unpaired``: a batch's sorted
        log-ratios), ``use_weighting=True``, or a router auxiliary loss.

    Examples
    --------
    ``examples/trl_dpo.py`` runs in full.
    """

    def check_supported(self) -> None:
        refused = [t for t in self.loss_types if t not in PREFERENCE_LOSSES]
        if refused:
            raise ValueError(f"DPOConfig(loss_type={refused}) is refused by DPDPOTrainer: aot and aot_unpaired sort "
                             f"the batch's log-ratios, so one example's loss depends on the others' and its clipped "
                             f"gradient does not bound its influence. Use one of {PREFERENCE_LOSSES}")
        if self.use_weighting:
            raise ValueError("DPOConfig(use_weighting=True) is not supported by DPDPOTrainer; use False")
        if self.aux_loss_enabled:
            raise ValueError("a router auxiliary loss (model config output_router_logits=True) is refused by "
                             "DPDPOTrainer: the load-balancing loss is a statistic of the whole batch. Set "
                             "output_router_logits=False")

    def private_collator(self) -> KeepsRowOrder:
        """:class:`PairCollator` with the settings of TRL's collator, declared to keep its rows in order (it
        does: row ``i`` of each tensor is the ``i``-th pair given), so that a batch of users is collated by one call
        (``privacy_unit="user"``)."""
        c = self.data_collator
        return KeepsRowOrder(PairCollator(c.pad_token_id, max_length=c.max_length, truncation_mode=c.truncation_mode,
                                          pad_to_multiple_of=c.pad_to_multiple_of))

    def per_example_losses(self, model: torch.nn.Module, inputs: dict) -> torch.Tensor:
        """``(B,)``: each pair's DPO loss (class docstring)."""
        chosen = self._completion_logps(model, inputs, "chosen")
        rejected = self._completion_logps(model, inputs, "rejected")
        if "ref_chosen_logps" in inputs:
            ref_chosen, ref_rejected = inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]
        else:
            with torch.no_grad(), self._reference() as ref:
                ref_chosen = self._completion_logps(ref, inputs, "chosen")[0]
                ref_rejected = self._completion_logps(ref, inputs, "rejected")[0]
        chosen_logps, chosen_tokens, chosen_mean = chosen
        rejected_logps, rejected_tokens, _ = rejected
        loss = 0.0
        for loss_type, weight in zip(self.loss_types, self.loss_weights, strict=True):
            loss = loss + weight * preference_losses(
                loss_type, chosen_logps - ref_chosen.to(chosen_logps), rejected_logps - ref_rejected.to(chosen_logps),
                beta=self.beta, label_smoothing=self.label_smoothing, chosen_tokens=chosen_tokens,
                rejected_tokens=rejected_tokens, chosen_token_mean=chosen_mean,
                f_divergence_type=self.f_divergence_type, f_alpha_divergence_coef=self.f_alpha_divergence_coef,
                discopop_tau=self.args.discopop_tau)
        return loss

    @contextlib.contextmanager
    def _reference(self):
        """The reference model, as TRL chooses it: ``ref_model``; or the PEFT model with its frozen ``"ref"`` adapter
        (TRL adds one when the model's adapter is already trained); or with its adapters disabled."""
        if self.ref_model is not None:
            yield self.ref_model
            return
        with use_adapter(self.model, adapter_name="ref" if "ref" in self.model.peft_config else None):
            yield self.model

    def _completion_logps(self, model: torch.nn.Module, inputs: dict, side: str):
        """Each row's completion log-probability (with ``ld_alpha``'s weights), its completion token count and
        its mean token log-probability, for the ``chosen`` or ``rejected`` side."""
        ids, mask = inputs[f"{side}_input_ids"], inputs[f"{side}_completion_mask"]
        logits = model(input_ids=ids, attention_mask=inputs[f"{side}_attention_mask"], use_cache=False).logits
        logits = logits[:, -ids.shape[1]:][:, :-1].float()
        completion = mask[:, 1:].to(logits.dtype)
        per = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1) * completion
        tokens = completion.sum(1)
        if self.ld_alpha is None:
            logps = per.sum(1)
        else:   # LD-DPO: tokens beyond the pair's shorter completion weigh ld_alpha
            other = inputs[f"{'rejected' if side == 'chosen' else 'chosen'}_completion_mask"][:, 1:].sum(1)
            shared = torch.minimum(tokens, other.to(tokens))
            position = completion.cumsum(1)
            tail = (position > shared[:, None]).to(per.dtype)
            logps = (per * (1 - tail)).sum(1) + self.ld_alpha * (per * tail).sum(1)
        return logps, tokens, per.sum(1) / tokens.clamp(min=1.0)
