"""dpsgd: the randomized-clipping DP-SGD trainer in PyTorch.

:class:`PrivacyEngine` (``make_private``, Opacus-style) trains any model with DP-SGD whose per-example
gradient norms are estimated by random projections (:mod:`dpsgd.estimators`: Hutchinson, Hutch++) or
computed exactly (fast-gradient and ghost clipping), with per-layer-type handlers (:mod:`dpsgd.layers`),
a norm plan (:mod:`dpsgd.plan`) and the one-backward book-keeping step (:mod:`dpsgd.capture`, :mod:`dpsgd.rowcheck`,
:mod:`dpsgd.clipping`), example isolation by structure
(:mod:`dpsgd.isolation`), a module validator
(:mod:`dpsgd.validator`), Poisson sampling and micro-batching (:mod:`dpsgd.data`), an optional Hugging Face
``Trainer`` (:mod:`dpsgd.hf`), the memory and FLOP models of paper 000's App. E (:mod:`dpsgd.cost`),
paper 004's gradient-spectrum tools (:mod:`dpsgd.spectrum`), the step's noise (:mod:`dpsgd.noise`: Gaussian,
or paper 003's Laplace) and paper 002's twice sampling and hybrid clipping (:mod:`dpsgd.strategies`).
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
