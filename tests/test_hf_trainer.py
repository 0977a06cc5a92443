"""dpsgd.hf.DPTrainer: the Hugging Face Trainer runs DP-SGD-RC with Poisson logical batches split into
gradient_accumulation_steps micro-batches, one noisy step per logical batch, epsilon in the logs."""

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from transformers import TrainerCallback, TrainingArguments  # noqa: E402

from dpsgd.hf import DPTrainer, PrivacyArguments  # noqa: E402

from .workloads import lora_gpt2  # noqa: E402


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
                        privacy=PrivacyArguments(max_grad_norm=0.5, noise_multiplier=1.0, estimator="hutch", k=32,
                                                 seed=0))
    assert trainer.args.max_grad_norm == 0.0
    trainer.train()
    engine = trainer.privacy_engine
    assert engine.steps == trainer.state.global_step == 48 // 8
    assert engine.sample_rate == pytest.approx(8 / 48)
    assert any("epsilon" in entry for entry in logs.logs)
    assert not any("grad_norm" in entry for entry in logs.logs)
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert moved and all("lora_" in n for n in moved)


def test_trainer_calibrates_noise_from_a_target_epsilon(tmp_path):
    torch.manual_seed(0)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8, num_train_epochs=2,
                             save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True)
    trainer = DPTrainer(model=lora_gpt2(), args=args, train_dataset=_Ids(40),
                        privacy=PrivacyArguments(target_epsilon=4.0, target_delta=1e-5, estimator="exact", seed=0))
    trainer.train()
    assert trainer.privacy_engine.steps == 10
    assert 3.5 < trainer.privacy_engine.get_epsilon(1e-5) <= 4.0
