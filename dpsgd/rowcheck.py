r"""The row check: on checked steps, a backward of a randomly weighted half of the losses whose gradients must be
exactly zero in the other examples' rows (:class:`~dpsgd.isolation.ExampleMixingError` otherwise), and on a new
layout of calls the check that row ``i`` of every recorded call is example ``i`` (:func:`check_rows`).

Example isolation is proved on every step by structure (:mod:`dpsgd.isolation`); this sampled check adds the
handlers' per-example gradients checked against autograd's.
"""

from __future__ import annotations

import torch

from .capture import (
    Capture,
    clear_derived,
    first_backward,
    gathered_leaves,
    graph_nodes,
    handler_call,
    keep_saved_buffers,
    leak_message,
    qualified_name,
    reset_shares,
)
from .distributed import MIN_ROWS, any_rank, is_sharded, max_over_ranks, rank_world
from .handler import Call, secret_seed
from .isolation import ExampleMixingError, IncompleteGradientError
from .shared import carrying_back


def row_check(capture: Capture, calls: list[Call], losses: torch.Tensor) -> None:
    """The row check (:func:`check_rows`: example ``i``'s loss depends on example ``i``'s rows alone) on a step
    that needs it: a new layout of calls (with the row attribution too), a probed forward, or every step with
    ``check_every_step``; it sees the probed forwards' inputs.  It runs before the step's own backward, which
    then keeps no graph for it.

    Under FSDP2 on several ranks its backward passes gather sharded parameters, so the ranks decide together, in
    one collective: every rank checks, with the attribution passes, if some rank needs to, and every rank raises if
    some rank's check fails (:func:`check_rows` with ``collective``).  Every rank's batch must then hold at least
    :data:`~dpsgd.distributed.MIN_ROWS` rows (the private loader completes smaller parts with filler rows); a
    smaller one raises ``ValueError`` on every rank, before any backward."""
    b = losses.shape[0]
    probes, capture.probes = capture.probes, []
    layout = _layout(calls, losses, probes)
    new_layout = layout not in capture.checked_layouts
    need = capture.check_every_step or new_layout or any(c.cache.get("probed") for c in calls)
    # 0: no check, 1: the isolation pass, 2: with the attribution passes
    level = (2 if new_layout else 1) if need and b > 1 else 0
    # the plan's parameters, the ones the optimizer holds: under FSDP2 the sharded tensors, whatever a module holds
    collective = rank_world()[1] > 1 and any(is_sharded(p) for p in capture.plan.params)
    if collective:   # the check's backward gathers parameters: every rank or none, with as many passes
        level, neg = max_over_ranks([level, -b])
        fewest = -neg
        if fewest < MIN_ROWS:
            raise ValueError(f"a backward of {fewest} row(s) on some rank (this rank: {b}) under FSDP2: every rank "
                             f"runs the row check's backward, which gathers the sharded parameters, on batches of "
                             f"at least {MIN_ROWS} rows. Draw the batches from the loader make_private returned (it "
                             f"completes a rank's smaller part with filler rows that the step weights 0), or give "
                             f"every rank's losses at least {MIN_ROWS} rows")
    if level:
        capture.active = False
        try:
            with keep_saved_buffers():   # a torch.compile'd backward is compiled at its first call
                check_rows(losses, calls, probes, attribution=level == 2, collective=collective)
        finally:
            capture.active = True
        capture.checked_layouts.add(layout)


def output_gradients(capture: Capture, calls: list[Call], losses: torch.Tensor, model_params: list,
                      two_pass: bool) -> list[Call]:
    """The one backward, ``autograd.grad(sum_i L_i, outputs + real parameters)``: each call the losses reached gets
    its output gradients (``call.grads``) and is consumed from ``capture``, resolved for its handler
    (:func:`handler_call`); returned in order.

    Guarantees: no trainable parameter received gradient outside a recorded call (else
    :class:`IncompleteGradientError` naming it; under FSDP2 also through a gathered copy), and every reached
    call's tensors start with the losses' batch dimension (else ``ValueError``).  The lists of every output and
    output gradient are this function's own, so each call's are freed once its sums are formed."""
    plan, b = capture.plan, losses.shape[0]
    outputs = [o for c in calls for o in c.outputs]
    reset_shares(calls)
    with keep_saved_buffers():
        grads = (first_backward(capture, losses, outputs, model_params, retain_graph=two_pass) if b
                 else [None] * (len(outputs) + len(model_params)))
    leaked = [plan.names.get(id(p), qualified_name(plan.model, p)) for p, g in zip(model_params, grads[len(outputs):],
                                                                              strict=True) if g is not None]
    if b and any(is_sharded(p) for p in plan.params):
        # FSDP2 runs modules with gathered copies of the sharded parameters: gradient that reaches one outside
        # a recorded call would not reach the parameter itself, so look for it in the graph
        leaked += gathered_leaves(losses, calls)
    if leaked:
        raise IncompleteGradientError(leak_message(leaked, plan))
    pos, reached = 0, []
    for c in calls:
        c.grads = grads[pos:pos + len(c.outputs)]
        pos += len(c.outputs)
        if any(g is not None for g in c.grads):
            reached.append(c)
    done = {id(c) for c in reached}
    capture.calls = [c for c in calls if id(c) not in done]
    reached = [handler_call(c, b) for c in reached]
    for c in reached:
        name = c.cache["unit"].path or type(c.module).__name__
        if c.batch_size != b:
            raise ValueError(f"{name} ran in a forward of {c.batch_size} examples but the loss has {b}: every "
                             f"handled module's input and output must start with the batch dimension of the loss "
                             f"(one row per example)")
        lead = [tuple(g.shape) for g in c.grads[:1] if g is not None and not _rows_ok(c, g, b)]
        if lead:
            raise ValueError(f"{name}'s output has shape {lead[0]}, which does not start with the batch dimension "
                             f"({b} examples): per-example gradients need one row per example. Outputs shared by the "
                             f"batch are read where they meet it when they are computed from no example's data "
                             f"(positions from torch.arange, a bias table) or have one row for the whole batch; rows "
                             f"that flatten the batch ((B*T, d), example-major) are read by every handler but "
                             f"convolutions and GroupNorm")
    return reached


def _layout(calls: list[Call], losses: torch.Tensor, probes: list) -> tuple:
    """The calls' modules and tensor shapes, with the batch size written ``-1``, and the operations of the
    autograd graph from the calls to the losses (without the probes' own nodes): equal for steps whose forwards
    and losses ran the same way on batches of any size (a loss that starts reading another example's output
    changes it)."""
    b = losses.shape[0]

    def shapes(ts):
        return tuple(tuple(-1 if d == b else d for d in t.shape) for t in ts if isinstance(t, torch.Tensor))
    skip = {id(node) for _, _, node in probes if node is not None}
    ops = tuple(type(node).__name__ for node in graph_nodes(losses, skip)) if losses.requires_grad else ()
    return tuple((c.cache["unit"].path, type(c.cache["unit"].handler).__name__, shapes(c.args),
                  shapes(c.kwargs.values()), shapes(c.outputs),
                  shapes(c.cache["share"].meetings) if c.cache.get("share") else ()) for c in calls) + (ops,)


def check_rows(losses: torch.Tensor, calls: list[Call], probes: list, attribution: bool,
                collective: bool = False) -> None:
    r"""Raise unless example ``i``'s loss depends on example ``i``'s rows alone (and, with ``attribution``, row ``i``
    of every recorded call is example ``i`` as its handler reads it).  Runs before the step's own backward and
    keeps the autograd graph for it.

    Each pass draws a random half ``S`` of the batch (from ``os.urandom``) and weights ``v_i`` uniform in
    ``[1, 2]`` for ``i`` in ``S``, ``0`` elsewhere, and runs one backward of ``sum_i v_i L_i``:

    * **isolation** (:class:`ExampleMixingError`): its gradient with respect to every recorded call's output
      and every probed input must be *exactly zero* in the rows outside ``S``.  Operations that treat rows
      separately never create a non-zero there (a zero row times anything finite is zero), so no tolerance
      is needed, and a mixing term of any size (a batch mean, batch statistics, softmax or attention over the
      batch, a loss that reads other rows) is caught once ``S`` separates two examples it mixes: with
      probability at least 1/4 per pass for any one pair, 1/2 over the two complementary passes made with
      ``attribution``, and almost surely for a batch-wide statistic.  The gradients are inspected as they pass
      (tensor hooks) and, without ``attribution``, never stored: the backward is asked only for the probed
      inputs and the outputs of calls whose inputs need no gradient, so no weight gradient is formed.
    * **attribution** (:class:`IncompleteGradientError`, two complementary passes, so every row has a non-zero
      weight once): with the output gradients ``G^v`` of the pass (``v_j G_j`` row by row, once isolation
      holds), each handler's sum of per-example gradients must equal autograd's gradient of ``sum_i v_i L_i``
      with respect to the call's parameters; a wrong per-example gradient agrees only for ``v`` in a set of
      measure zero.  Relative tolerance ``1e-6`` in float64, ``1e-4`` in float32, ``5e-2`` when the forward
      ran under autocast or an output is half precision, of the layer's gradient or (if larger) of the
      largest layer's divided by the batch size.

    With ``collective`` (FSDP2: every rank runs the same passes) each pass's verdict is shared after the pass: if
    any rank's fails, every rank raises (the others :class:`IncompleteGradientError` saying so), so no rank goes on to
    a backward that the failed one skips.
    """
    b = losses.shape[0]
    rows = _secret_halves(b)
    for j in range(2 if attribution else 1):
        inside = rows if j == 0 else ~rows
        v = torch.where(inside, 1 + torch.rand(b, generator=torch.Generator().manual_seed(secret_seed()),
                                               dtype=torch.float64), 0.0)
        v = v.to(losses.device, losses.dtype)
        outside = (~inside).to(losses.device)
        mixed: list[tuple[int, str]] = []   # (forward order, what): the last one is where the mixing follows
        sums = _HandlerSums(calls, b) if attribution else None
        handles = []
        reset_shares(calls)
        for i, c in enumerate(calls):
            share = c.cache.get("share")
            for t in share.meetings if share is not None else ():
                # where an output shared by the batch meets it: rows are examples
                what = f"{c.cache['unit'].path or type(c.module).__name__}'s output where it meets the batch"
                handles.append(t.register_hook(_rows_hook(outside, mixed, (i, what), None, None)))
            for k, t in enumerate(c.outputs):
                # the first output starts with the batch (the engine refuses a call whose first output does not);
                # another (an LSTM's (layers, B, H) state) may have it elsewhere: kept, not inspected
                first = k == 0 and (share is None or share.aligned) and _rows_ok(c, t, b)
                if t.requires_grad and (first or attribution):
                    what = f"{c.cache['unit'].path or type(c.module).__name__}'s output"
                    handles.append(t.register_hook(_rows_hook(outside if first else None, mixed, (i, what),
                                                              sums, (i, k))))
        probed = [(name, x) for name, x, _ in probes if x.requires_grad]
        if attribution:
            pairs = [(c, local) for c in calls for local in c.aliases]
            targets = [c.aliases[local] for c, local in pairs]
        else:
            pairs = []
            targets = [t for c in calls if c.cache.get("root") for t in c.outputs if t.requires_grad]
            if not targets and not probed:
                targets = [a for c in calls for a in c.aliases.values()]
        if not targets and not probed:   # nothing recorded (an eval-mode forward): the backward below says so
            for h in handles:
                h.remove()
            return
        try:
            if attribution:
                # autograd's gradient of each alias is compared with its handler's sum as soon as both exist, then
                # dropped: the pass never holds every parameter's gradient and sum at once
                index = {id(c): i for i, c in enumerate(calls)}
                for c, local in pairs:
                    handles.append(c.aliases[local].register_post_accumulate_grad_hook(
                        _alias_hook(sums, (index[id(c)], local))))
                torch.autograd.backward((losses * v).sum(), inputs=targets + [x for _, x in probed],
                                        retain_graph=True)
                grads = [x.grad for _, x in probed]
                for _, x in probed:
                    x.grad = None
            else:
                grads = torch.autograd.grad((losses * v).sum(), targets + [x for _, x in probed],
                                            allow_unused=True, retain_graph=True)[len(targets):]
        finally:
            for h in handles:
                h.remove()
        for (name, _), g in zip(probed, grads, strict=True):
            if g is not None and _nonzero_rows(g, outside.to(g.device)):
                mixed.append((-1, f"the input {name}"))
        try:
            if mixed:
                raise ExampleMixingError(_mixing_message(mixed, calls))
            if attribution:
                sums.finish()
                if sums.error is not None:
                    raise sums.error
                _compare_attribution(sums, b)
        except Exception:
            # one rank's verdict (its random half may be the one that separates mixed examples) is every rank's:
            # a rank that went on to the next pass or the step's backward would wait for the others for ever
            if collective:
                any_rank(True)
            raise
        if collective and any_rank(False):
            raise IncompleteGradientError("the row check failed on another rank (its error names the cause); the "
                                          "step was not taken on any rank")


def _mixing_message(mixed: list[tuple[int, str]], calls: list[Call]) -> str:
    """Where the mixing is: after the last recorded output (or input) whose other rows the losses depend on, and
    before the next recorded output that is clean."""
    last, what = max(mixed)
    flagged = {i for i, _ in mixed}
    after = next((c for i, c in enumerate(calls) if i > last and i not in flagged), None)
    where = f"after {what}" + ("" if after is None else
                               f" and before the output of {after.cache['unit'].path or type(after.module).__name__}")
    return (f"the losses of some examples depend on rows of {what} that are not their own (the gradient of a "
            f"weighted sum of some examples' losses is not zero in the other examples' rows), so one example could "
            f"move the others' clipped contributions and no bound by max_grad_norm holds; the step was not taken. "
            f"Look {where}: either the rows are not the examples (a loop over examples inside the forward, permuted "
            f"or gathered rows), or something mixes examples (a batch statistic such as F.batch_norm or "
            f"x - x.mean(0), softmax or attention over the batch dimension, a loss that reads other rows such as "
            f"in-batch negatives). Compute everything per example, row i for example i.")


def _alias_hook(sums: _HandlerSums, key: tuple[int, str]):
    """A post-accumulate-grad hook that hands an alias's gradient from a check pass to ``sums`` and frees it."""
    def hook(alias):
        sums.true_gradient(key, alias.grad.detach().reshape(-1))
        alias.grad = None
    return hook


def _rows_hook(outside: torch.Tensor | None, found: list, what: tuple, sums: _HandlerSums | None, key: tuple):
    """A tensor hook that records ``what`` if the gradient passing is non-zero in a row ``outside`` (and hands it
    to ``sums`` when given)."""
    def hook(grad):
        if carrying_back():
            return   # an output shared by the batch carrying per-example gradients back through this tensor
        if outside is not None and _nonzero_rows(grad, outside.to(grad.device)):
            found.append(what)
        if sums is not None:
            sums.add(key, grad)
    return hook


class _HandlerSums:
    """Each call's handler sums of per-example gradients for the output gradients of one check pass, formed as
    soon as all of the call's output gradients have arrived (inside the backward), and compared with autograd's
    gradient of the same weighted sum as soon as that arrives too: only the sums and gradients of the layers in
    flight are held, not every layer's output gradient nor every parameter's gradient."""

    def __init__(self, calls: list[Call], b: int) -> None:
        self.calls, self.b = calls, b
        self.pending: dict[int, dict[int, torch.Tensor]] = {}
        self.expect = {i: sum(t.requires_grad for t in c.outputs) for i, c in enumerate(calls)}
        self.sums: dict[tuple[int, str], torch.Tensor] = {}    # sums whose autograd gradient has not arrived
        self.trues: dict[tuple[int, str], torch.Tensor] = {}   # autograd gradients whose sum is not formed yet
        self.compared: list[tuple[Call, str, float, float]] = []   # (call, name, ||sum - gradient||, ||gradient||)
        self.error: Exception | None = None   # a handler's refusal, raised after the isolation verdict

    def true_gradient(self, key: tuple[int, str], t: torch.Tensor) -> None:
        """Autograd's gradient of the pass's weighted loss with respect to a call's parameter alias."""
        s = self.sums.pop(key, None)
        if s is None:
            self.trues[key] = t
        else:
            self._compare(key, s, t)

    def _compare(self, key: tuple[int, str], s: torch.Tensor, t: torch.Tensor) -> None:
        self.compared.append((self.calls[key[0]], key[1], float((s - t.to(s.dtype)).norm()), float(t.norm())))

    def add(self, key: tuple[int, int], grad: torch.Tensor) -> None:
        i, k = key
        got = self.pending.setdefault(i, {})
        got[k] = grad if k not in got else got[k] + grad
        if len(got) == self.expect[i]:
            self._form(i)

    def finish(self) -> None:
        """Form the sums of calls some of whose outputs received no gradient, and compare the sums of parameters
        that received none from autograd with zero."""
        for i in list(self.pending):
            self._form(i)
        for key, s in self.sums.items():
            self._compare(key, s, torch.zeros_like(s))
        self.sums.clear()
        self.trues.clear()

    def _form(self, i: int) -> None:
        got = self.pending.pop(i)
        c, b = self.calls[i], self.b
        c.grads = [got.get(k) for k in range(len(c.outputs))]
        try:
            view = handler_call(c, b)
            lead = view.grads[0] if view is not c else c.outputs[0] if c.outputs else None
            if c.batch_size != b or lead is None or not _rows_ok(view, lead, b):
                return   # not batch-first: the step's own backward refuses it by name
            ones = torch.ones(b, dtype=torch.float64, device=lead.device)
            for local in c.aliases:
                s = c.cache["unit"].handler.clipped_sum(view, local, ones)
                # in the precision it was formed in (float32, or float64 for a float64 model): a float64 copy of
                # every parameter would double the first step's peak
                s = s.detach().reshape(-1)
                t = self.trues.pop((i, local), None)
                if t is None:
                    self.sums[(i, local)] = s
                else:
                    self._compare((i, local), s, t)
        except Exception as err:   # noqa: BLE001 -- kept for after the isolation verdict, which names the cause
            self.error = self.error or err
        finally:
            c.grads = []
            clear_derived(c)


def _nonzero_rows(grad: torch.Tensor, outside: torch.Tensor) -> bool:
    """Whether ``grad`` is non-zero in a row of an example marked ``outside`` (``(B * k, ...)`` rows that flatten
    the batch example-major: ``k`` rows an example)."""
    if grad.shape[0] != outside.shape[0]:
        outside = outside.repeat_interleave(grad.shape[0] // outside.shape[0])
    return bool(grad[outside].ne(0).any())


def _rows_ok(call: Call, t: torch.Tensor, b: int) -> bool:
    """Whether ``t`` (a call's first output or its gradient) has the call's examples as rows: ``b`` of them, or
    ``b * k`` rows that flatten the batch example-major (OPT's ``(B * T, d)``) for a handler that reads them so
    (the row check verifies the order on the first step of the layout)."""
    if t.dim() == 0 or t.shape[0] == 0:
        return False
    if t.shape[0] == b:
        return True
    unit = call.cache.get("unit")
    return (t.shape[0] % b == 0 and unit is not None and unit.handler.flattened_rows(call.module))


def _secret_halves(b: int) -> torch.Tensor:
    """A random split of ``b >= 2`` rows into two non-empty parts (a boolean mask), from ``os.urandom``."""
    g = torch.Generator().manual_seed(secret_seed())
    while True:
        rows = torch.rand(b, generator=g) < 0.5
        if 0 < int(rows.sum()) < b:
            return rows


def _compare_attribution(sums: _HandlerSums, b: int) -> None:
    """Each handler's sum of per-example gradients from a check pass's output gradients against autograd's gradient
    of the same weighted sum, per (call, parameter) the pass reached (``sums.compared``: the distances and norms)."""
    kept = sums.compared
    if not kept:
        return
    # a layer whose every per-example gradient is rounding noise (a bias before a normalization) is compared
    # with the model's largest gradient per example, not with its own
    floor = max(norm for *_, norm in kept) / b
    # the precision the backward ran in: any half-precision output or autocast in the forward rounds the
    # gradients of every layer below it
    half = (torch.float16, torch.bfloat16)
    dtypes = {o.dtype for c, *_ in kept for o in c.outputs if o.is_floating_point()}
    dtypes |= {c.aliases[local].dtype for c, local, *_ in kept}
    low = any(d in half for d in dtypes) or any(c.cache.get("autocast") for c, *_ in kept)
    tol = 5e-2 if low else (1e-6 if dtypes == {torch.float64} else 1e-4)
    for c, _, err, norm in kept:
        if not err <= tol * max(norm, floor):
            unit = c.cache["unit"]
            raise IncompleteGradientError(
                f"the rows of {unit.path or type(c.module).__name__}'s input and output are not its examples: the "
                f"per-example gradients read from them do not add up to the gradient of a weighted sum of the "
                f"losses (relative error {err / max(norm, floor, 1e-300):.3g}). The module is called on "
                f"something other than the batch (a loop over examples inside the forward, a slice, permuted or "
                f"gathered rows), or its output mixes examples afterwards. Run it on the whole batch, one row per "
                f"example.")
