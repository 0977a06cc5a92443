r"""How each ATen operation carries the examples' rows: the rules the isolation tracker
(:class:`dpsgd.isolation.ExampleTracker`) applies to every operation that reads a tensor of the batch.

A tensor's :class:`~dpsgd.rows.Rows` say which examples its elements were computed from: pairs of a dimension and
the example id of each index along it, or the first operation after which some element depends on several
examples (*mixed*).  :data:`RULES` maps each operation to its rule, ``rule(func, args, kwargs, out, rows) ->
[Rows]``, one per tensor output, following the operation's semantics:

* an element-wise operation keeps the example axis where broadcasting puts it;
* a view, reshape, permutation, slice, concatenation or index maps the axis (and its example ids) to the output's
  dimension that carries it (flattening ``(B, T)`` to ``B T`` rows keeps one id per row);
* a reduction, scan, sort or softmax over the example axis, a matrix product that contracts it, and attention
  whose keys carry other examples mark the output mixed.

The rules are :mod:`dpsgd.layout_rules`' (operations that move or copy elements) and :mod:`dpsgd.mixing_rules`'
(operations that combine them), with :mod:`dpsgd.rows`' for element-wise operations without torch's pointwise tag.
An operation without a rule is the tracker's to refuse.
"""

from __future__ import annotations

from collections.abc import Callable

from .layout_rules import LAYOUT_RULES
from .mixing_rules import MIXING_RULES
from .rows import local_scalar_rule, pointwise_rule

__all__ = ["RULES"]

RULES: dict[str, Callable] = {**LAYOUT_RULES, **MIXING_RULES, "_local_scalar_dense": local_scalar_rule}
# element-wise operations without the pointwise tag
for _n in ("native_dropout", "dropout", "bernoulli", "bernoulli_", "where", "masked_fill", "masked_fill_",
           "clamp", "clamp_", "clamp_min", "clamp_max", "_to_dtype", "fill_", "zero_", "uniform_", "normal_",
           "exponential_", "random_", "gelu", "silu", "relu", "threshold", "hardtanh", "elu", "leaky_relu",
           "softplus", "glu", "isnan", "isinf", "isfinite", "logical_not", "sign", "triu", "tril",
           "masked_scatter_", "_masked_scale", "native_dropout_backward", "mish", "hardswish", "hardsigmoid",
           "nan_to_num", "round", "bitwise_not", "floor_divide", "remainder", "fmod",
           "logit", "rrelu_with_noise", "celu", "selu", "prelu", "log_sigmoid_forward", "log_sigmoid"):
    RULES.setdefault(_n, pointwise_rule)
