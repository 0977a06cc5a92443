"""dpsgd: the randomized-clipping DP-SGD trainer in PyTorch.

:class:`PrivacyEngine` (``make_private``, Opacus-style) trains any model with DP-SGD whose per-example
gradient norms are estimated by random projections (:mod:`dpsgd.estimators`: Hutchinson, Hutch++) or
computed exactly (fast-gradient and ghost clipping), with per-layer-type handlers (:mod:`dpsgd.layers`),
the two-backward step (:mod:`dpsgd.engine`), Poisson sampling (:mod:`dpsgd.data`) and the memory and
FLOP models of paper 000's App. E (:mod:`dpsgd.cost`).  Importing this package does not need torch until
one of these names is used.
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
