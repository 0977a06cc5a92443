"""dpsgd.trl: TRL's SFTTrainer and DPOTrainer made private; one example (a prompt and completion, a preference pair)
is one row of the private batch and one clipped contribution; the settings that break that are refused before
anything is calibrated; the examples run."""

import importlib.util
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("peft")

from peft import LoraConfig  # noqa: E402
from trl import DPOConfig, SFTConfig  # noqa: E402
from trl.trainer.dpo_trainer import DataCollatorForPreference  # noqa: E402

from dpsgd.hf import PrivacyArguments  # noqa: E402
from dpsgd.trl import PREFERENCE_LOSSES, DPDPOTrainer, DPSFTTrainer, PairCollator, preference_losses  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _example(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SFT, DPO = _example("trl_sft"), _example("trl_dpo")
LORA = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0, fan_in_fan_out=True)


def _common(tmp_path, **kw):
    settings = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                    max_steps=3, logging_steps=1, learning_rate=1e-2, save_strategy="no", report_to=[], use_cpu=True,
                    disable_tqdm=True, max_length=16)
    return {**settings, **kw}


def _sft(tmp_path, privacy=None, n=32, **kw):
    return DPSFTTrainer(model=SFT.tiny_gpt2(), args=SFTConfig(**_common(tmp_path, **kw)),
                        train_dataset=SFT.reversals(n, seed=1), processing_class=SFT.word_tokenizer(),
                        peft_config=LORA, privacy=privacy or PrivacyArguments(noise_multiplier=1.0))


def _dpo(tmp_path, privacy=None, n=32, peft=True, **kw):
    model = DPO.tiny_gpt2()
    extra = {"peft_config": LORA} if peft else {"ref_model": DPO.tiny_gpt2()}
    return DPDPOTrainer(model=model, args=DPOConfig(**_common(tmp_path, **kw)),
                        train_dataset=DPO.preferences(n, seed=1), processing_class=DPO.word_tokenizer(),
                        privacy=privacy or PrivacyArguments(noise_multiplier=1.0), **extra)


class _Logs:
    def __init__(self, trainer):
        self.lines = []
        original = trainer.log

        def log(logs, *args, **kwargs):
            original(logs, *args, **kwargs)
            self.lines.append(dict(logs))
        trainer.log = log


def test_sft_trains_padded_prompt_completion_examples_with_poisson_batches_and_logs_only_epsilon(tmp_path):
    trainer = _sft(tmp_path)
    logs = _Logs(trainer)
    trainer.train()
    engine = trainer.privacy_engine
    assert engine.steps == trainer.state.global_step == 3
    assert engine.sample_rate == pytest.approx(8 / 32)
    train_lines = [line for line in logs.lines if "train_runtime" not in line]
    assert train_lines and all(set(line) <= {"epsilon", "learning_rate", "epoch"} for line in train_lines)
    assert train_lines[-1]["epsilon"] == engine.get_epsilon(1e-5)


def test_sft_per_example_loss_is_the_mean_over_the_examples_own_completion_tokens(tmp_path):
    trainer = _sft(tmp_path)
    rows = [trainer.train_dataset[i] for i in range(3)]
    batch = trainer.data_collator(rows)
    model = trainer.model
    with torch.no_grad():
        losses = trainer.per_example_losses(model, dict(batch))
        for i, row in enumerate(rows):
            ids = torch.tensor([row["input_ids"]])
            labels = torch.tensor(row["labels"])
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
            keep = labels[1:] != -100
            own = -logp[keep.nonzero()[:, 0], labels[1:][keep]].mean()
            assert 0 < int(keep.sum()) < len(row["input_ids"]) - 1   # the completion only
            assert float(losses[i]) == pytest.approx(float(own), rel=1e-5)


@pytest.mark.parametrize("setting", [{"packing": True}, {"padding_free": True}])
def test_sft_settings_that_put_several_examples_in_one_row_are_refused_before_calibration(tmp_path, setting):
    with pytest.raises(ValueError, match=next(iter(setting))):
        _sft(tmp_path, privacy=PrivacyArguments(target_epsilon=1.0), **setting)


def test_pair_collator_makes_each_pair_one_row_of_chosen_and_rejected_tensors_as_trl_pads_them():
    rows = [{"prompt_ids": [3, 4], "chosen_ids": [5], "rejected_ids": [6, 7, 8]},
            {"prompt_ids": [9], "chosen_ids": [10, 11], "rejected_ids": [12]}]
    ours, trl = PairCollator(pad_token_id=0)(rows), DataCollatorForPreference(pad_token_id=0)(rows)
    for key in ("input_ids", "attention_mask", "completion_mask"):
        assert torch.equal(torch.cat([ours["chosen_" + key], ours["rejected_" + key]]), trl[key])
        assert ours["chosen_" + key].data_ptr() != ours["rejected_" + key].data_ptr()


def test_dpo_sigmoid_loss_matches_trls_batch_loss_as_the_mean_of_per_pair_losses(tmp_path):
    trainer = _dpo(tmp_path, peft=False)
    rows = [trainer.train_dataset[i] for i in range(4)]
    model = trainer.model
    with torch.no_grad():
        ours = trainer.per_example_losses(model, PairCollator(0)(rows))
        theirs = trainer.compute_loss(model, DataCollatorForPreference(pad_token_id=0)(rows))
    assert ours.shape == (4,)
    assert float(ours.mean()) == pytest.approx(float(theirs), rel=1e-5)


@pytest.mark.parametrize("reference", ["peft", "ref_model", "precomputed"])
def test_dpo_trains_one_pair_per_example_with_each_reference(tmp_path, reference):
    kw = {"peft": reference == "peft"}
    if reference == "precomputed":
        kw.update(peft=True, precompute_ref_log_probs=True)
    trainer = _dpo(tmp_path, **kw)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    engine = trainer.privacy_engine
    assert engine.steps == 3 and engine.sample_rate == pytest.approx(8 / 32)   # pairs are the examples
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters() if n in before)
    assert math.isfinite(engine.get_epsilon(1e-5))


@pytest.mark.parametrize("setting", [{"loss_type": ["aot"]}, {"loss_type": ["sigmoid", "aot_unpaired"]},
                                     {"use_weighting": True}])
def test_dpo_losses_that_depend_on_other_pairs_are_refused_before_calibration(tmp_path, setting):
    with pytest.raises(ValueError, match="aot|use_weighting"):
        _dpo(tmp_path, privacy=PrivacyArguments(target_epsilon=1.0), **setting)


@pytest.mark.parametrize("loss_type", PREFERENCE_LOSSES)
def test_each_preference_loss_of_one_pair_ignores_the_other_pairs(loss_type):
    g = torch.Generator().manual_seed(0)
    chosen, rejected = torch.randn(5, generator=g), torch.randn(5, generator=g)
    tokens = torch.randint(1, 6, (2, 5), generator=g).float()
    kw = dict(beta=0.3, label_smoothing=0.1, chosen_tokens=tokens[0], rejected_tokens=tokens[1],
              chosen_token_mean=-torch.rand(5, generator=g))
    whole = preference_losses(loss_type, chosen, rejected, **kw)
    alone = torch.stack([preference_losses(loss_type, chosen[i:i + 1], rejected[i:i + 1],
                                           **{k: (v[i:i + 1] if torch.is_tensor(v) else v) for k, v in kw.items()})[0]
                         for i in range(5)])
    assert whole.shape == (5,) and torch.isfinite(whole).all()
    assert torch.allclose(whole, alone)


def test_the_sft_example_runs_and_lowers_the_held_out_completion_loss(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # a seeded run (the examples' reproducibility mode): 4 noisy steps of 256 examples learn in expectation, not in
    # every draw of the batches and the noise
    result = SFT.main(["--train", "256", "--epochs", "2", "--seed", "0", "--out", str(tmp_path / "out")])
    assert result["steps"] == 4 and result["epsilon"] <= 8.0
    assert result["loss_after"] < result["loss_before"]


def test_the_dpo_example_runs_and_prefers_the_chosen_completions(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # seeded: unseeded, 4 noisy steps of 256 pairs end at a held-out reward accuracy of 0.50 to 0.60 (0.55 on average)
    result = DPO.main(["--train", "256", "--epochs", "2", "--seed", "0", "--out", str(tmp_path / "out")])
    assert result["steps"] == 4 and result["epsilon"] <= 8.0
    assert result["loss_after"] < result["loss_before"] and result["accuracy_after"] > 0.5


@pytest.mark.parametrize("reference", ["peft", "ref_model"])
def test_dpo_per_pair_gradient_norms_over_two_forwards_and_a_reference_pass_equal_brute_force(tmp_path, reference):
    """Each pair's loss runs the model twice (chosen, rejected) and, for a PEFT model without ``ref_model``, a third
    time with the adapters disabled under ``no_grad``: the engine's exact per-pair norms equal one backward per
    pair with plain autograd."""
    from types import SimpleNamespace

    from peft import get_peft_model

    from dpsgd import per_sample_sq_norms
    from verify.workloads import brute_force_sq_norms

    trainer = _dpo(tmp_path, peft=reference == "peft")
    torch.manual_seed(1)
    model = get_peft_model(DPO.tiny_gpt2().double(), LoraConfig(r=4, target_modules=["c_attn"], lora_dropout=0.0,
                                                                 fan_in_fan_out=True, init_lora_weights=False))
    model.train()
    ref = None if reference == "peft" else DPO.tiny_gpt2().double().eval()
    own = SimpleNamespace(model=model, ref_model=ref, loss_types=["sigmoid", "ipo"], loss_weights=[1.0, 0.5],
                          beta=0.5, label_smoothing=0.0, f_divergence_type="reverse_kl", f_alpha_divergence_coef=1.0,
                          args=trainer.args, ld_alpha=0.5)
    own._reference = lambda: DPDPOTrainer._reference(own)
    own._completion_logps = lambda m, inputs, side: DPDPOTrainer._completion_logps(own, m, inputs, side)
    batch = PairCollator(0)([trainer.train_dataset[i] for i in range(5)])

    def losses(m):
        return DPDPOTrainer.per_example_losses(own, m, batch)
    got = per_sample_sq_norms(model, losses, "exact")
    expected = brute_force_sq_norms(model, lambda m, i: losses(m)[i], 5)
    assert bool((expected > 0).all())
    assert torch.allclose(got, expected, rtol=1e-4, atol=0), (got, expected)


def test_dpo_on_a_peft_model_with_a_trained_adapter_uses_trls_frozen_ref_adapter_as_the_reference(tmp_path):
    """A PEFT model whose adapter is not zero: TRL keeps a frozen "ref" copy of it as the reference, so at the start
    the reference log-probabilities are the policy's (disabling the adapters would score with the bare base model)."""
    from peft import get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(DPO.tiny_gpt2(), LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True,
                                                       lora_dropout=0.0, init_lora_weights=False))
    trainer = DPDPOTrainer(model=model, args=DPOConfig(**_common(tmp_path)), train_dataset=DPO.preferences(32, seed=1),
                           processing_class=DPO.word_tokenizer(), privacy=PrivacyArguments(noise_multiplier=1.0))
    assert "ref" in trainer.model.peft_config
    batch = trainer.private_collator()([trainer.train_dataset[i] for i in range(4)])
    with torch.no_grad():
        with trainer._reference() as ref:
            reference = trainer._completion_logps(ref, batch, "chosen")[0]
        policy = trainer._completion_logps(trainer.model, batch, "chosen")[0]
    assert torch.allclose(reference, policy)


def test_trls_training_metrics_never_reach_a_log_line_even_when_a_subclass_fills_them(tmp_path):
    class Chatty(DPSFTTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            self._metrics["train"]["mean_token_accuracy"].append(0.5)   # as TRL's compute_loss would
            return super().training_step(model, inputs, num_items_in_batch)

    trainer = Chatty(model=SFT.tiny_gpt2(), args=SFTConfig(**_common(tmp_path)), train_dataset=SFT.reversals(32, 1),
                     processing_class=SFT.word_tokenizer(), peft_config=LORA,
                     privacy=PrivacyArguments(noise_multiplier=1.0))
    logs = _Logs(trainer)
    trainer.train()
    assert logs.lines and not any("mean_token_accuracy" in line for line in logs.lines)


def test_evaluating_on_the_private_training_data_warns_that_its_metrics_are_not_private(tmp_path):
    data = SFT.reversals(32, seed=1)
    with pytest.warns(UserWarning, match="eval_dataset is the private train_dataset"):
        DPSFTTrainer(model=SFT.tiny_gpt2(), args=SFTConfig(**_common(tmp_path)), train_dataset=data,
                     eval_dataset=data, processing_class=SFT.word_tokenizer(), peft_config=LORA,
                     privacy=PrivacyArguments(noise_multiplier=1.0))


def test_dpo_with_user_level_privacy_collates_whole_users_and_charges_users(tmp_path):
    """Three pairs per user: the pair collator keeps its rows in order, so a batch of users is one call."""
    trainer = _dpo(tmp_path, privacy=PrivacyArguments(noise_multiplier=1.0, privacy_unit="user",
                                                      user_ids=[i // 3 for i in range(48)]), n=48,
                   gradient_accumulation_steps=1)
    trainer.train()
    assert trainer.privacy_engine.steps == 3 and trainer.privacy_engine.sample_rate == pytest.approx(4 / 16)
