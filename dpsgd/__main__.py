r"""``python -m dpsgd plan``: a model's norm plan and the envelope dimension its accountant uses (no training).

For each trainable parameter: the module and handler that cover it, its shape, how its per-example norm is
found (``hutch``/``hutchpp`` estimated, or ``exact``) and the chi-square terms it adds; then the envelope's
dimension ``D``, the **sum** of those terms over every parameter (not the widest layer's), the envelope the
accountant charges, and the ``python -m dpmath epsilon`` options that reproduce its epsilon::

    python -m dpsgd plan --hf-model-type gpt2                       # GPT-2 small's defaults
    python -m dpsgd plan --hf-model-type llama --set num_hidden_layers=2 hidden_size=512 --estimator hutchpp
    python -m dpsgd plan --config-json path/to/config.json --lora 8
    python -m dpsgd plan --module mypackage.models:build_model --projection-dim 16
    python -m dpsgd plan --hf-model-type gpt2 --target-epsilon 8 --sample-rate 0.01 --steps 3000   # the price

A Hugging Face model is built from its config with random weights on the ``meta`` device (no download, no
memory: a 7B config takes a second); ``--module`` calls your factory as it is.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import warnings

from .cli import plan_report, show_progress

PROG = "python -m dpsgd"


def _value(text: str) -> object:
    """A ``--set`` value: JSON (``2``, ``0.1``, ``true``, ``null``, ``[1, 2]``), Python's ``True``/``False``/``None``,
    else the text itself (a lax config would read the text ``"False"`` as true)."""
    python = {"True": True, "False": False, "None": None}
    if text in python:
        return python[text]
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _overrides(items: list[str], parser: argparse.ArgumentParser) -> dict:
    out = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            parser.error(f"--set takes KEY=VALUE pairs (e.g. n_layer=2), got {item!r}")
        out[key] = _value(text)
    return out


def _hf_model(args: argparse.Namespace, overrides: dict):
    """The Hugging Face model of ``--hf-model-type`` or ``--config-json``, on the meta device; its description."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()   # e.g. token ids outside a --set vocabulary: no weights are ever used

    if args.hf_model_type is not None:
        config = AutoConfig.for_model(args.hf_model_type, **overrides)
    else:
        config = AutoConfig.from_pretrained(args.config_json)
        config.update(overrides)
    with torch.device("meta"):   # shapes and module types are all a plan reads
        if args.model_class is not None:   # the head must be the one trained: its parameters are counted
            cls = getattr(transformers, args.model_class, None)
            if not isinstance(cls, type):
                raise SystemExit(f"{PROG} plan: error: --model-class {args.model_class!r} is not a transformers class")
            model = cls.from_config(config) if hasattr(cls, "from_config") else cls(config)
        else:
            try:
                model = AutoModelForCausalLM.from_config(config)
            except ValueError:   # not a causal LM (an encoder, a vision model): its base model
                model = AutoModel.from_config(config)
    return model, f"{type(model).__name__} (model type {config.model_type}, random weights on the meta device)"


def _factory_model(spec: str, parser: argparse.ArgumentParser):
    """The module ``package.module:factory()`` returns; its description."""
    from torch import nn

    where, sep, name = spec.partition(":")
    if not sep or not where or not name:
        parser.error(f"--module takes package.module:factory, got {spec!r}")
    model = getattr(importlib.import_module(where), name)()
    if not isinstance(model, nn.Module):
        parser.error(f"{spec}() returned a {type(model).__name__}, not a torch.nn.Module")
    return model, f"{type(model).__name__} (from {spec}())"


def _with_lora(model, rank: int, targets: list[str] | None):
    """``model`` with LoRA adapters of rank ``rank`` on ``targets`` (default: peft's target modules for its
    type; the base weights frozen, the adapters trainable, no dropout), and the targets used."""
    from peft import LoraConfig, get_peft_model

    with warnings.catch_warnings():   # peft's notice that it sets fan_in_fan_out for GPT-2's Conv1D itself
        warnings.filterwarnings("ignore", message=".*fan_in_fan_out")
        model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                                 target_modules=targets))
    return model, sorted(model.peft_config["default"].target_modules)


def main(argv: list[str] | None = None) -> int:
    """Run ``python -m dpsgd``; the exit status (0, or 1 when the model is refused)."""
    parser = argparse.ArgumentParser(prog=PROG, description="Command-line tools of the dpsgd trainer.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="plan")
    plan = commands.add_parser(
        "plan", help="print a model's norm plan and the envelope dimension D its accountant uses",
        description="Print a model's norm plan (per trainable parameter: module, shape, handler, how its "
                    "per-example norm is found, the chi-square terms it adds) and the envelope dimension D, their "
                    "sum over all parameters, with the python -m dpmath epsilon options that reproduce the "
                    "trainer's accounting.",
        epilog="example: python -m dpsgd plan --hf-model-type gpt2 --set n_layer=2 n_embd=256 n_head=4")
    source = plan.add_mutually_exclusive_group(required=True)
    source.add_argument("--hf-model-type", metavar="TYPE",
                        help="a transformers model type (gpt2, llama, bert, ...): its default config, random weights")
    source.add_argument("--config-json", metavar="PATH", help="a saved transformers config (config.json)")
    source.add_argument("--module", metavar="PACKAGE.MODULE:FACTORY",
                        help="a callable returning the torch.nn.Module to plan")
    plan.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                      help="override config fields of --hf-model-type or --config-json (values read as JSON: "
                           "n_layer=2 n_embd=256)")
    plan.add_argument("--estimator", choices=["auto", "hutch", "hutchpp", "ghost", "exact"], default="auto",
                      help="per-example norm estimator (default auto: hutch where an exact norm costs at least 8x "
                           "as much, exact elsewhere, as make_private chooses)")
    plan.add_argument("--projection-dim", type=int, default=32, metavar="K",
                      help="k, the random projections of hutch or hutchpp (default 32)")
    plan.add_argument("--target-epsilon", type=float, metavar="EPS",
                      help="also calibrate the noise multiplier for this epsilon with the plan's estimate and with "
                           "exact norms (needs --sample-rate and --steps)")
    plan.add_argument("--target-delta", type=float, default=1e-5, metavar="DELTA", help="delta (default 1e-5)")
    plan.add_argument("--sample-rate", type=float, metavar="Q", help="batch size / data-set size")
    plan.add_argument("--steps", type=int, metavar="N", help="the number of steps")
    plan.add_argument("--lora", type=int, metavar="RANK",
                      help="add LoRA adapters of this rank (needs peft); on --lora-target-modules, else on peft's "
                           "default targets for the model type (c_attn only for gpt2)")
    plan.add_argument("--lora-target-modules", nargs="+", metavar="NAME",
                      help="the module names LoRA adapts, as in peft's LoraConfig(target_modules=...): "
                           "give the ones your training uses")
    plan.add_argument("--model-class", metavar="CLASS",
                      help="the transformers class to build (e.g. BertForSequenceClassification); default: the "
                           "causal LM of the model type, else its base model. The head counts: plan the one you train")
    args = parser.parse_args(argv)
    if args.set and args.module is not None:
        parser.error("--set overrides a Hugging Face config: use it with --hf-model-type or --config-json")
    if args.projection_dim < 1:
        parser.error(f"--projection-dim must be a positive integer, got {args.projection_dim}")
    target = None
    if args.target_epsilon is not None:
        if args.sample_rate is None or args.steps is None:
            parser.error("--target-epsilon needs --sample-rate and --steps")
        target = (args.target_epsilon, args.target_delta, args.sample_rate, args.steps)
    elif args.sample_rate is not None or args.steps is not None:
        parser.error("--sample-rate and --steps go with --target-epsilon")
    if args.module is not None:
        model, what = _factory_model(args.module, parser)
    else:
        model, what = _hf_model(args, _overrides(args.set, parser))
    if args.lora_target_modules and args.lora is None:
        parser.error("--lora-target-modules needs --lora RANK")
    if args.model_class is not None and args.module is not None:
        parser.error("--model-class builds a Hugging Face model: use it with --hf-model-type or --config-json")
    if args.lora is not None:
        model, targets = _with_lora(model, args.lora, args.lora_target_modules)
        what = f"{what}, LoRA rank {args.lora} on {', '.join(targets)}"
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"model: {what}; {trainable:,} trainable parameter entries; estimator {args.estimator}, "
          f"k = {args.projection_dim}")
    from .validator import UnsupportedModuleError

    try:
        print(plan_report(model, args.estimator, args.projection_dim, target))
    except UnsupportedModuleError as err:
        print(f"refused: {err}")
        return 1
    return 0


if __name__ == "__main__":
    show_progress()
    sys.exit(main())
