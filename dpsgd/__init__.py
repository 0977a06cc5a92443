"""dpsgd: the randomized-clipping DP-SGD trainer in PyTorch.

So far: :mod:`dpsgd.estimators` (exact, ghost, Hutchinson and Hutch++ per-sample squared norms as pure
functions on a layer's activations and output gradients), :mod:`dpsgd.layers` (per-layer-type
handlers) and :mod:`dpsgd.engine` (:func:`per_sample_sq_norms` and one private step).  The Opacus-style
``make_private`` with accounting, checkpoints and DDP is tracked by the issue "dpsgd: the
randomized-clipping DP-SGD trainer in PyTorch".  Importing this package does not need torch until one
of these names is used.
"""

__all__ = ["per_sample_sq_norms", "private_step", "PrivacyEngine"]


def __getattr__(name: str):
    if name in ("per_sample_sq_norms", "private_step"):
        from . import engine

        return getattr(engine, name)
    if name == "PrivacyEngine":
        from .privacy_engine import PrivacyEngine

        return PrivacyEngine
    raise AttributeError(f"module 'dpsgd' has no attribute {name!r}")
