"""dpsgd.hf.DPTrainer: the Hugging Face Trainer runs DP-SGD-RC with Poisson logical batches split into
gradient_accumulation_steps micro-batches, one noisy step per logical batch, epsilon in the logs."""

import json
import math

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from transformers import TrainerCallback, TrainingArguments  # noqa: E402

from dpsgd.hf import PRIVACY_STATE_NAME, DPTrainer, PrivacyArguments  # noqa: E402
from verify.workloads import lora_gpt2  # noqa: E402

from ..helpers import assert_holds_no_generator_state


class _Ids(torch.utils.data.Dataset):
    def __init__(self, n):
        self.ids = torch.randint(1, 40, (n, 8), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class _Logs(TrainerCallback):
    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kw):
        self.logs.append(dict(logs or {}))


def test_trainer_takes_one_private_step_per_logical_batch_and_logs_epsilon(tmp_path):
    torch.manual_seed(0)
    model = lora_gpt2().train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    logs = _Logs()
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                             num_train_epochs=1, learning_rate=1e-2, logging_steps=6, save_strategy="no",
                             report_to=[], use_cpu=True, disable_tqdm=True, max_grad_norm=1.0)
    trainer = DPTrainer(model=model, args=args, train_dataset=_Ids(48), callbacks=[logs],
                        privacy=PrivacyArguments(max_grad_norm=0.5, noise_multiplier=1.0, estimator="hutch",
                                                 projection_dim=32,
                                                 seed=0))
    assert trainer.args.max_grad_norm == 0.0
    trainer.train()
    engine = trainer.privacy_engine
    assert engine.steps == trainer.state.global_step == 48 // 8
    assert engine.sample_rate == pytest.approx(8 / 48)
    logged = [entry["epsilon"] for entry in logs.logs if "epsilon" in entry]
    assert logged and logged[-1] == engine.get_epsilon(1e-5)   # the last step's log is exact
    assert not any("grad_norm" in entry for entry in logs.logs)
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert moved and all("lora_" in n for n in moved)


def test_the_trainer_chooses_the_norms_by_default_and_lora_adapters_get_exact_ones(tmp_path, caplog):
    import logging

    torch.manual_seed(0)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                             max_steps=2, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True)
    with caplog.at_level(logging.INFO, logger="dpsgd"):
        trainer = DPTrainer(model=lora_gpt2().train(), args=args, train_dataset=_Ids(48),
                            privacy=PrivacyArguments(target_epsilon=4.0, target_delta=1e-5))
    engine = trainer.privacy_engine
    # rank-8 adapters: r * width products per example and token, far below 8 k (r + width)
    assert engine.estimator == "auto" and engine.envelope is None and engine.plan.all_exact
    assert engine.noise_multiplier == engine.exact_noise_multiplier
    assert "norm plan: estimator auto: every norm exact" in caplog.text
    trainer.train()
    assert engine.steps == 2


def test_trainer_calibrates_noise_from_a_target_epsilon(tmp_path):
    torch.manual_seed(0)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8, num_train_epochs=2,
                             save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True)
    trainer = DPTrainer(model=lora_gpt2(), args=args, train_dataset=_Ids(40),
                        privacy=PrivacyArguments(target_epsilon=4.0, target_delta=1e-5, estimator="exact", seed=0))
    trainer.train()
    assert trainer.privacy_engine.steps == 10
    assert 3.5 < trainer.privacy_engine.get_epsilon(1e-5) <= 4.0


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=8, learning_rate=1e-2, report_to=[],
                use_cpu=True, disable_tqdm=True, save_strategy="no")
    return TrainingArguments(**{**base, **kw})


@pytest.mark.parametrize("n, batch, accumulation, schedule", [
    (42, 8, 1, {"max_steps": 6}),             # 5 Poisson batches an epoch: 6 steps are not whole epochs
    (42, 4, 2, {"num_train_epochs": 1.5}),    # N / B = 5.25, a fractional number of epochs, accumulation
])
def test_trainer_calibrates_for_exactly_the_steps_it_takes(tmp_path, n, batch, accumulation, schedule):
    torch.manual_seed(0)
    args = _args(tmp_path, per_device_train_batch_size=batch, gradient_accumulation_steps=accumulation, **schedule)
    trainer = DPTrainer(model=lora_gpt2(), args=args, train_dataset=_Ids(n),
                        privacy=PrivacyArguments(target_epsilon=2.0, target_delta=1e-5, estimator="exact", seed=0))
    trainer.train()
    engine = trainer.privacy_engine
    assert engine.steps == trainer.state.global_step == trainer.state.max_steps == engine.planned_steps
    assert 1.8 < engine.get_epsilon(1e-5) <= 2.0


def _resumable(tmp_path, max_steps, **privacy):
    torch.manual_seed(0)
    args = _args(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=max_steps,
                 save_strategy="steps", save_steps=4)
    settings = {"max_grad_norm": 0.5, "noise_multiplier": 1.0, "estimator": "hutch", "projection_dim": 8}
    return DPTrainer(model=lora_gpt2(), args=args, train_dataset=_Ids(48),
                     privacy=PrivacyArguments(**(settings | privacy)))


def _trained(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_a_resumed_run_continues_the_ledger_with_fresh_randomness_mid_epoch(tmp_path):
    """The checkpoint's privacy_engine.pt holds the steps and settings only (no generator state: the issue
    recovered the next step's un-noised clipped sum from it to 1e-14); two resumes of it take as many noisy steps
    and report the same epsilon, but draw other batches, projections and noise than each other and than the
    uninterrupted run."""
    # 6 logical batches an epoch: the checkpoint at step 4 is mid-epoch, and the run ends in the second epoch
    full = _resumable(tmp_path / "full", max_steps=9)
    full.train()
    saved = torch.load(tmp_path / "full" / "checkpoint-4" / PRIVACY_STATE_NAME, weights_only=True)
    assert saved["steps"] == 4
    assert_holds_no_generator_state(saved, full.privacy_engine)
    finals = [_trained(full.model)]
    for i in range(2):
        resumed = _resumable(tmp_path / f"resumed{i}", max_steps=9)
        resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-4"))
        a, b = full.privacy_engine, resumed.privacy_engine
        assert resumed.state.global_step == full.state.global_step == 9
        assert b.steps == b.spent_steps == a.steps == 9
        assert b.get_epsilon(1e-5) == a.get_epsilon(1e-5)
        finals.append(_trained(resumed.model))
    for i in range(3):
        for j in range(i):
            assert finals[i].keys() == finals[j].keys()
            assert not all(torch.equal(finals[i][n], finals[j][n]) for n in finals[i])


_NONPRIVATE = {"loss", "train_loss", "grad_norm", "num_input_tokens_seen", "total_flos", "train_tokens_per_second"}


def _logged_run(tmp_path, **privacy):
    torch.manual_seed(0)
    logs = _Logs()
    args = _args(tmp_path, per_device_train_batch_size=4, max_steps=4, logging_steps=1, save_strategy="steps",
                 save_steps=2, include_num_input_tokens_seen=True)
    trainer = DPTrainer(model=lora_gpt2(), args=args, train_dataset=_Ids(48), callbacks=[logs],
                        privacy=PrivacyArguments(noise_multiplier=1.0, estimator="ghost", **privacy))
    return trainer, logs, trainer.train()


def test_logs_and_checkpoints_hold_no_training_loss_or_token_counts_by_default(tmp_path):
    """The issue: DPTrainer logged each step's un-noised mean training loss and the tokens seen, which one added
    example changes.  By default the logs, trainer_state.json (in every checkpoint) and train()'s metrics hold
    the steps, epsilon, learning rate and epoch only; the token count asked for is refused with a warning."""
    with pytest.warns(UserWarning, match="include_num_input_tokens_seen.*log_nonprivate_metrics"):
        trainer, logs, result = _logged_run(tmp_path)
    steps = [entry for entry in logs.logs if "epsilon" in entry]
    assert len(steps) >= 4 and all({"learning_rate", "epoch"} <= entry.keys() for entry in steps[:4])
    assert not [entry for entry in logs.logs if entry.keys() & _NONPRIVATE]
    state = json.loads((tmp_path / "checkpoint-4" / "trainer_state.json").read_text())
    assert not [entry for entry in state["log_history"] if entry.keys() & _NONPRIVATE]
    assert state["total_flos"] == 0 and state.get("num_input_tokens_seen", 0) == 0
    assert not result.metrics.keys() & _NONPRIVATE and math.isnan(result.training_loss)
    assert not [entry for entry in trainer.state.log_history if entry.keys() & _NONPRIVATE]


def test_the_training_loss_and_token_counts_are_logged_only_when_asked_for_with_a_warning(tmp_path):
    with pytest.warns(UserWarning, match="log_nonprivate_metrics=True.*not differentially private"):
        trainer, logs, result = _logged_run(tmp_path, log_nonprivate_metrics=True)
    steps = [entry for entry in logs.logs if "epsilon" in entry]
    assert all({"loss", "num_input_tokens_seen"} <= entry.keys() for entry in steps[:4])
    assert result.training_loss > 0 and "train_loss" in result.metrics


def test_resuming_from_a_checkpoint_without_privacy_state_is_refused(tmp_path):
    from transformers import Trainer

    torch.manual_seed(0)
    plain = Trainer(model=lora_gpt2(), args=_args(tmp_path / "plain", max_steps=1, save_strategy="steps",
                                                   save_steps=1), train_dataset=_Ids(48))
    plain.train()
    trainer = _resumable(tmp_path / "dp", max_steps=3, estimator="exact")
    with pytest.raises(ValueError, match="privacy"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "plain" / "checkpoint-1"))
    assert trainer.privacy_engine.steps == 0


def test_a_second_trainer_on_the_same_ledger_counts_the_earlier_steps(tmp_path):
    ledger = tmp_path / "ledger.jsonl"
    first = _resumable(tmp_path / "first", max_steps=3, ledger_path=str(ledger), estimator="exact")
    first.train()
    assert len(ledger.read_text().splitlines()) == 3
    second = _resumable(tmp_path / "second", max_steps=2, ledger_path=str(ledger), estimator="exact")
    second.train()
    engine = second.privacy_engine
    assert engine.steps == 2 and engine.spent_steps == 5
    assert len(ledger.read_text().splitlines()) == 5
    assert engine.get_epsilon(1e-5) > first.privacy_engine.get_epsilon(1e-5)


def test_a_compute_loss_override_is_refused_rather_than_ignored(tmp_path):
    class Custom(DPTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, report_to=[], use_cpu=True)
    with pytest.raises(TypeError, match="per_example_losses"):
        Custom(model=lora_gpt2(), args=args, train_dataset=_Ids(16),
               privacy=PrivacyArguments(noise_multiplier=1.0, estimator="exact"))


def test_the_trainer_with_torch_compile_trains_privately(tmp_path):
    """args.torch_compile=True (aot_eager backend: no C++ toolchain needed): the hooks run eagerly between compiled
    regions, and the row check's retained graph is allowed (no donated buffers)."""
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, report_to=[], use_cpu=True,
                             torch_compile=True, torch_compile_backend="aot_eager", max_steps=3, save_strategy="no")
    trainer = DPTrainer(model=lora_gpt2(), args=args, train_dataset=_Ids(16),
                        privacy=PrivacyArguments(noise_multiplier=1.0, estimator="hutch", check_every_step=True))
    trainer.train()
    assert trainer.privacy_engine.steps == 3



def test_label_smoothing_factor_is_applied_to_each_examples_loss(tmp_path):
    """``TrainingArguments(label_smoothing_factor=...)``: each token's loss is ``(1 - e)`` times its negative
    log-likelihood plus ``e`` times the mean over the vocabulary of ``-log p``, averaged over the example's
    non-ignored (``-100``) tokens, next-token shifted for a causal LM: not silently dropped."""
    torch.manual_seed(0)
    eps = 0.2
    args = _args(tmp_path, max_steps=1, label_smoothing_factor=eps)
    data = _Ids(16)
    trainer = DPTrainer(model=lora_gpt2(), args=args, train_dataset=data,
                        privacy=PrivacyArguments(noise_multiplier=1.0, estimator="exact", seed=0))
    ids = data.ids[:3]
    labels = ids.clone()
    labels[0, 5:] = -100
    labels[2, :] = -100                                   # an example with no token to learn: loss 0
    with torch.no_grad():
        got = trainer.per_example_losses(trainer.model, {"input_ids": ids, "labels": labels})
        logp = torch.log_softmax(trainer.model(input_ids=ids).logits[:, :-1].float(), -1)
    target = labels[:, 1:]
    keep = target != -100
    nll = -logp.gather(-1, target.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    smooth = -logp.mean(-1)
    per_token = ((1 - eps) * nll + eps * smooth) * keep
    want = per_token.sum(1) / keep.sum(1).clamp_min(1)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6) and got[2] == 0
    trainer.train()
    assert trainer.privacy_engine.steps == 1


def test_a_frozen_batch_norm_stays_in_evaluation_mode_under_the_trainer(tmp_path):
    """The Trainer calls ``model.train()`` at every step; a frozen batch norm (pretrained statistics) is put back in
    evaluation mode, so it trains as a fixed map instead of being refused, and its statistics do not move."""
    from types import SimpleNamespace

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn = torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4)
            self.head = torch.nn.Linear(4 * 4 * 4, 3)

        def forward(self, pixel_values):
            h = torch.relu(self.bn(self.conv(pixel_values)))
            return SimpleNamespace(logits=self.head(h.flatten(1)))

    class Images(torch.utils.data.Dataset):
        def __len__(self):
            return 24

        def __getitem__(self, i):
            g = torch.Generator().manual_seed(i)
            return {"pixel_values": torch.randn(1, 6, 6, generator=g), "labels": torch.tensor(i % 3)}

    torch.manual_seed(0)
    net = Net()
    net.bn.running_mean.uniform_(-1, 1)
    net.bn.requires_grad_(False)
    stats = net.bn.running_mean.clone()
    trainer = DPTrainer(model=net, args=_args(tmp_path, max_steps=3, per_device_train_batch_size=6),
                        train_dataset=Images(),
                        privacy=PrivacyArguments(noise_multiplier=1.0, estimator="exact", check_every_step=True))
    trainer.train()
    assert trainer.privacy_engine.steps == 3 and torch.equal(net.bn.running_mean, stats)


def test_privacy_arguments_are_make_privates_options_and_the_engines():
    """One spec: every option of make_private (but what the trainer has or derives) is a field, every field is an
    option of make_private, the engine or the trainer, and the defaults are make_private's (but two)."""
    import dataclasses
    import inspect

    from dpsgd import PrivacyEngine
    from dpsgd.hf import DERIVED, ENGINE_ARGUMENTS, ENGINE_SETTINGS, TRAINER_OPTIONS

    make_private = inspect.signature(PrivacyEngine.make_private).parameters
    options = set(make_private) - {"self", *DERIVED}
    assert set(PrivacyArguments().make_private_options()) == options
    assert set(inspect.signature(PrivacyEngine).parameters) == set(ENGINE_ARGUMENTS)
    assert all(isinstance(getattr(PrivacyEngine, name), property) for name in ENGINE_SETTINGS)
    fields = {f.name: f.default for f in dataclasses.fields(PrivacyArguments)}
    assert set(fields) == options | {*ENGINE_ARGUMENTS, *ENGINE_SETTINGS, *TRAINER_OPTIONS}
    differ = {name for name in options if fields[name] != make_private[name].default}
    assert differ == {"max_grad_norm", "target_delta"}   # make_private has no default C; delta is also the log's


@pytest.mark.parametrize("privacy, scheme, accumulation", [
    ({"batch_sampling": "fixed_size"}, "FixedSize", 2),
    ({"privacy_unit": "user", "user_ids": [i // 2 for i in range(48)]}, "Poisson", 1),
])
def test_the_trainer_reaches_batch_sampling_and_user_level_privacy(tmp_path, privacy, scheme, accumulation):
    torch.manual_seed(0)
    args = _args(tmp_path, per_device_train_batch_size=4 // accumulation, gradient_accumulation_steps=accumulation,
                 num_train_epochs=1)
    trainer = DPTrainer(model=lora_gpt2(), args=args, train_dataset=_Ids(48),
                        privacy=PrivacyArguments(target_epsilon=4.0, estimator="exact", seed=0, **privacy))
    trainer.train()
    engine = trainer.privacy_engine
    assert type(engine.batch_sampling).__name__ == scheme
    assert engine.privacy_unit == privacy.get("privacy_unit", "example")
    assert engine.steps == trainer.state.global_step == engine.planned_steps
    assert engine.get_epsilon(1e-5) <= 4.0


def test_user_level_privacy_with_gradient_accumulation_is_refused_before_training(tmp_path):
    args = _args(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=2, num_train_epochs=1)
    with pytest.raises(ValueError, match="privacy_unit='user'.*gradient_accumulation_steps=1"):
        DPTrainer(model=lora_gpt2(), args=args, train_dataset=_Ids(48),
                  privacy=PrivacyArguments(noise_multiplier=1.0, privacy_unit="user", user_ids=list(range(48))))
