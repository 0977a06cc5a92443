"""``python -m dpsgd plan``: a model's norm plan and the envelope dimension D its accountant uses, which is the
terms summed over every parameter (not the widest layer's) and equals the engine's own."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from dpsgd import PrivacyEngine
from dpsgd.__main__ import main

ROOT = Path(__file__).resolve().parents[2]
TINY_GPT2 = ["n_layer=1", "n_embd=32", "n_head=2", "vocab_size=100", "n_positions=16"]


def _run(*args, cwd=None, pythonpath=()):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *map(str, pythonpath)])}
    return subprocess.run([sys.executable, "-m", "dpsgd", *args], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=300)


def test_a_tiny_gpt2_config_prints_its_plan_and_the_dimension_the_engine_uses():
    pytest.importorskip("transformers")
    run = _run("plan", "--hf-model-type", "gpt2", "--set", *TINY_GPT2, "--estimator", "hutch")
    assert run.returncode == 0, run.stderr
    out = run.stdout
    # tied wte/lm_head min(100, 32) + wpe min(16, 32) + four Conv1D weights of rank 32 and their biases
    assert "envelope dimension D = 180: the terms column summed over all 16 trainable parameters" in out
    assert "transformer.wte.weight              Embedding, Linear  100x32  EmbeddingHandler, LinearHandler  hutch" \
        in out
    assert "transformer.h.0.ln_1.weight         LayerNorm          32      NormalizationHandler             exact" \
        in out
    assert ("epsilon: python -m dpmath epsilon --estimator hutchpp --projection-dim 32 --dim 180 --noise-multiplier "
            "SIGMA --delta DELTA --sample-rate Q --steps STEPS") in out
    # the engine on the same model charges that envelope
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(**{k: int(v) for k, v in (kv.split("=") for kv in TINY_GPT2)}))
    engine = PrivacyEngine()
    ids = torch.zeros(8, 4, dtype=torch.long)
    engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), max_grad_norm=1.0,
                        data_loader=DataLoader(TensorDataset(ids, ids), batch_size=4), noise_multiplier=1.0,
                        estimator="hutch")
    assert repr(engine.envelope) in out and engine.envelope.dim == 180


def test_a_module_factory_prints_its_plan(tmp_path):
    (tmp_path / "my_models.py").write_text("from torch import nn\n\n\ndef mlp():\n"
                                           "    return nn.Sequential(nn.Linear(20, 6), nn.ReLU(), nn.Linear(6, 3))\n")
    run = _run("plan", "--module", "my_models:mlp", "--projection-dim", "4", "--estimator", "hutch", cwd=tmp_path,
               pythonpath=[tmp_path])
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("model: Sequential (from my_models:mlp()); 147 trainable parameter entries; "
                                 "estimator hutch, k = 4\n")
    assert "envelope dimension D = 11: the terms column summed over all 4 trainable parameters" in run.stdout
    assert "--estimator hutch --projection-dim 4 --dim 11 " in run.stdout


def test_config_json_lora_exact_estimators_and_refusals(tmp_path, capsys, monkeypatch):
    pytest.importorskip("peft")
    from transformers import GPT2Config

    path = tmp_path / "config.json"
    GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=16).to_json_file(path)
    # LoRA rank 4 on GPT-2's c_attn (peft's default): lora_A 4 x 32 and lora_B 96 x 4 add 4 terms each, per layer
    assert main(["plan", "--config-json", str(path), "--set", "n_layer=3", "--lora", "4", "--estimator", "hutch"]) == 0
    out = capsys.readouterr().out
    assert "LoRA rank 4" in out and "envelope dimension D = 24: the terms column summed over all 6 trainable" in out
    assert "--estimator hutch --projection-dim 32 --dim 24 " in out
    assert main(["plan", "--config-json", str(path), "--estimator", "ghost"]) == 0
    out = capsys.readouterr().out
    assert "every per-example norm is exact" in out and "\nepsilon: python -m dpmath epsilon --noise-multiplier" in out
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "batchnorm_model.py").write_text(
        "from torch import nn\n\n\ndef build():\n    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))\n")
    assert main(["plan", "--module", "batchnorm_model:build"]) == 1
    assert "refused: " in capsys.readouterr().out
    for argv, message in ((["--module", "batchnorm_model"], "package.module:factory"),
                          (["--module", "batchnorm_model:build", "--set", "a=1"], "--set overrides"),
                          (["--hf-model-type", "gpt2", "--set", "n_layer"], "KEY=VALUE")):
        with pytest.raises(SystemExit):
            main(["plan", *argv])
        assert message in capsys.readouterr().err
    assert json.loads(path.read_text())["n_layer"] == 2   # --set changes the plan's config, never the file


def test_lora_targets_and_the_model_class_are_the_ones_planned(capsys):
    pytest.importorskip("peft")
    # the LoRA example adapts c_attn and c_fc: planning peft's default (c_attn alone) would count half the terms
    assert main(["plan", "--hf-model-type", "gpt2", "--set", *TINY_GPT2, "--lora", "8",
                 "--lora-target-modules", "c_attn", "c_fc", "--estimator", "hutch"]) == 0
    out = capsys.readouterr().out
    assert "LoRA rank 8 on c_attn, c_fc" in out and "envelope dimension D = 32:" in out
    # a classifier's head is counted, not the causal-LM head a model type defaults to
    bert = ["num_hidden_layers=1", "hidden_size=32", "num_attention_heads=2", "intermediate_size=64"]
    assert main(["plan", "--hf-model-type", "bert", "--set", *bert, "--model-class",
                 "BertForSequenceClassification"]) == 0
    assert "model: BertForSequenceClassification" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["plan", "--hf-model-type", "bert", "--model-class", "NoSuchModel"])
    with pytest.raises(SystemExit):
        main(["plan", "--hf-model-type", "gpt2", "--lora-target-modules", "c_attn"])   # needs --lora


def test_the_default_plan_estimates_only_weights_whose_exact_norm_costs_eight_times_more(tmp_path, capsys,
                                                                                           monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "wide_model.py").write_text(
        "from torch import nn\n\n\ndef build():\n"
        "    return nn.Sequential(nn.Linear(20, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),\n"
        "                         nn.Linear(1024, 2))\n")
    assert main(["plan", "--module", "wide_model:build", "--target-epsilon", "2", "--sample-rate", "0.05",
                 "--steps", "60"]) == 0
    out = capsys.readouterr().out
    # only the 1024 x 1024 weight: 1024 * 1024 >= 8 * 32 * 2048; the 1024 x 20 and 2 x 1024 ones and the biases exact
    assert "estimator auto: 1 of 6 parameters estimated with hutch (D = 1024), 5 exact" \
        in out
    assert "2.weight   Linear  1024x1024  LinearHandler  hutch   1024" in out
    assert "0.weight   Linear  1024x20    LinearHandler  exact      0" in out
    assert "with the estimate against" in out and "% noise) for epsilon 2 at delta 1e-05" in out
    (tmp_path / "narrow_model.py").write_text(
        "from torch import nn\n\n\ndef build():\n"
        "    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 2))\n")
    assert main(["plan", "--module", "narrow_model:build", "--target-epsilon", "2", "--sample-rate", "0.05",
                 "--steps", "60"]) == 0
    out = capsys.readouterr().out
    assert "estimator auto: every norm exact (4 parameters), accounted as DP-SGD" in out
    assert "noise_multiplier 1.189 for epsilon 2 at delta 1e-05" in out


def test_a_target_needs_its_sample_rate_and_steps(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--hf-model-type", "gpt2", "--target-epsilon", "2"])
    assert "--target-epsilon needs --sample-rate and --steps" in capsys.readouterr().err
