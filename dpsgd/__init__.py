"""dpsgd: the randomized-clipping DP-SGD trainer in PyTorch.

:class:`PrivacyEngine` (``make_private``, Opacus-style) trains any model with DP-SGD whose per-example
gradient norms are estimated by random projections (:mod:`dpsgd.estimators`: Hutchinson, Hutch++) or computed
exactly (fast-gradient and ghost clipping).  The modules, by concern:

* making training private: :mod:`dpsgd.privacy_engine` (the wiring), :mod:`dpsgd.arguments` (``make_private``'s
  arguments, checked), :mod:`dpsgd.optimizer` (the optimizer, which owns the step), :mod:`dpsgd.loss` (the private
  loss), :mod:`dpsgd.hf` (Hugging Face's ``Trainer``);
* what a run is accounted as: :mod:`dpsgd.accounting` (one object, and the table of what is refused),
  :mod:`dpsgd.ledger` (the steps charged and their epsilon), :mod:`dpsgd.loaders` (one loader builder for
  :mod:`dpsgd.samplers`' batch samplings and :mod:`dpsgd.users`' user-level privacy), :mod:`dpsgd.noise`,
  :mod:`dpsgd.strategies` (l2 clipping, paper 002's twice sampling and hybrid clipping);
* the step: :mod:`dpsgd.plan` (which norm each parameter gets), :mod:`dpsgd.capture` (the recorded forward),
  :mod:`dpsgd.rowcheck`, :mod:`dpsgd.clipping` (norms and clipped sums), :mod:`dpsgd.step` (the batch in
  progress and its noisy gradients);
* per-layer handlers: :mod:`dpsgd.handler` (the contract and registry), :mod:`dpsgd.layers`,
  :mod:`dpsgd.materialized`;
* example isolation by structure: :mod:`dpsgd.isolation`, :mod:`dpsgd.rows` and the rules of :mod:`dpsgd.rules`
  (:mod:`dpsgd.layout_rules`, :mod:`dpsgd.mixing_rules`), :mod:`dpsgd.validator`;
* :mod:`dpsgd.data` (Poisson batches, micro-batching), :mod:`dpsgd.distributed`, :mod:`dpsgd.cost` (paper 000's
  memory and FLOP models), :mod:`dpsgd.spectrum` (paper 004's gradient-spectrum tools).

Importing this package does not need torch until one of these names is used.
"""

__all__ = ["per_sample_sq_norms", "PrivacyEngine", "ModuleValidator", "BatchMemoryManager",
           "IncompleteGradientError", "ExampleMixingError", "StateChangedError", "NormPlan", "L2Clipping",
           "TwiceSampling", "HybridClipping", "GaussianNoise", "LaplaceNoise", "UnsupportedSamplerError",
           "ExampleTracker", "audit_isolation"]

_WHERE = {"per_sample_sq_norms": "clipping", "IncompleteGradientError": "isolation",
          "ExampleMixingError": "isolation", "StateChangedError": "isolation", "ExampleTracker": "isolation",
          "audit_isolation": "isolation",
          "NormPlan": "plan", "PrivacyEngine": "privacy_engine", "ModuleValidator": "validator",
          "BatchMemoryManager": "data", "L2Clipping": "strategies", "TwiceSampling": "strategies",
          "HybridClipping": "strategies",
          "GaussianNoise": "noise", "LaplaceNoise": "noise", "UnsupportedSamplerError": "data"}


def __getattr__(name: str):
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    raise AttributeError(f"module 'dpsgd' has no attribute {name!r}")
