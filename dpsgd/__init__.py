"""dpsgd: the randomized-clipping DP-SGD trainer in PyTorch.

So far: :mod:`dpsgd.estimators`, the per-sample squared-norm estimators (exact, ghost, Hutchinson,
Hutch++) as pure functions on a layer's activations and output gradients.  The trainer itself (hooks,
``make_private``, accounting) is tracked by the issue "dpsgd: the randomized-clipping DP-SGD trainer in
PyTorch".  Importing this package does not need torch; importing :mod:`dpsgd.estimators` does.
"""

__all__: list[str] = []
