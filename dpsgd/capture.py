r"""The recorded forward: :class:`Capture` hooks every handled module of a :class:`~dpsgd.plan.NormPlan`, runs each
call with its parameters replaced by fresh leaf aliases, and records the call's inputs and outputs
(:class:`~dpsgd.handler.Call`), so that a parameter used outside a recorded call is detected rather than missed;
with the first backward and the graph walks the step and the row check share.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch import nn
from torch.nn.utils.parametrizations import _SpectralNorm

from .distributed import is_sharded
from .handler import Call, flat_tensors, secret_seed
from .isolation import IncompleteGradientError, StateChangedError, call_examples
from .materialized import RootParameterHandler, per_leaf
from .plan import NormPlan, Unit
from .shared import Share, SharedOutput, share_output
from .validator import UnsupportedModuleError, frozen_batch_norm

#: probability that a step's forward is probed and its rows checked (the default schedule; docs/trainer.md)
DEFAULT_CHECK_RATE = 0.125


# the layouts of calls whose rows a check verified, per model (a new layout is checked at its first step)
_VERIFIED_LAYOUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class Capture:
    """Forward hooks that record handled calls and swap their parameters for per-call aliases.

    Recording happens only while gradients are enabled, the root model is in training mode and the
    capture is active (the engine deactivates it while it computes norms and during its backward, where
    gradient checkpointing re-runs forwards).  ``calls`` keeps every recorded call until a backward
    consumes it or :meth:`clear` drops it.

    Around every recorded forward of the root model, the versions and identities of the model's parameters
    and buffers are compared: a change raises :class:`StateChangedError`.  A forward is *probed* on every
    step (``check_every_step``), on the first forward, or else with probability ``check_rate`` drawn from
    ``os.urandom``: its floating-point inputs that carry the batch are replaced by leaves that require
    gradient, so the row check (:func:`clipped_backward`) can see whether one example's loss depends on
    another example's input.
    """

    def __init__(self, plan: NormPlan) -> None:
        self.plan = plan
        self.calls: list[Call] = []
        self.active = True
        self._batch: int | None = None
        self._root_ints: set = set()
        self._depth = 0
        self._root_grad = False
        self.no_grad_units: list[str] = []
        # layouts of calls whose row-to-example attribution was verified, shared by every capture of the model
        self.checked_layouts: set = _VERIFIED_LAYOUTS.setdefault(plan.model, set())
        self.check_every_step = False
        self.check_rate = DEFAULT_CHECK_RATE
        self._forwards = 0            # recorded root forwards so far (the first is always probed)
        self._forward_probed = False  # whether the forward in progress is probed
        # probed forwards' inputs (name, leaf, the clone's node), until a backward takes them
        self.probes: list[tuple[str, torch.Tensor, object]] = []
        self._state: list | None = None
        self._swapped: dict[int, dict] = {}
        # the engine's ExampleTracker and the ids of the examples drawn for this step: each recorded call keeps the
        # examples of its rows, which the backward compares with the losses' (dpsgd.isolation)
        self.tracker = None
        self.batch_ids: torch.Tensor | None = None
        root = plan.model
        # the hooks run eagerly in a torch.compile'd model (each is a graph break): the compiled code between them
        # is the model's own, and the aliases are its inputs
        eager = torch.compiler.disable
        self._handles = [root.register_forward_pre_hook(eager(self._root_pre), with_kwargs=True),
                         root.register_forward_hook(eager(self._root_post), always_call=True)]
        self._handles += self._unit_hooks()

    def _unit_hooks(self) -> list:
        """The hooks of every unit of the plan, and the frozen batch norms' guards (the root's are registered once)."""
        eager = torch.compiler.disable
        handles = []
        for unit in self.plan.units:
            handles.append(unit.module.register_forward_pre_hook(eager(self._pre_hook(unit)), with_kwargs=True))
            handles.append(unit.module.register_forward_hook(eager(self._post_hook(unit)), with_kwargs=True,
                                                             always_call=True))
        return handles + _batch_norm_guards(self)

    def recording(self) -> bool:
        """Whether a forward now is recorded: hooks active, gradients enabled, the model in training mode."""
        return self.active and torch.is_grad_enabled() and self.plan.model.training

    def _root_pre(self, module, args, kwargs):
        self._depth += 1
        if self._depth != 1:
            return None
        # the batch size of this forward: the main input's leading dimension
        self._root_grad = torch.is_grad_enabled()
        main = [kwargs[n] for n in _MAIN_INPUTS if n in kwargs]
        first = next((x for x in (*main, *args, *kwargs.values()) if isinstance(x, torch.Tensor) and x.dim() > 0),
                     None)
        self._batch = None if first is None else int(first.shape[0])
        # integer inputs carry the examples (token ids): a module reading a view of them is batched
        self._root_ints = {t.untyped_storage().data_ptr() for t in flat_tensors([list(args), kwargs])
                           if not (t.is_floating_point() or t.is_complex())}
        self._forward_probed = False
        if not self.recording():
            self._state = None
            return None
        self._state = _state_of(self.plan.model)
        if self.tracker is not None and self.batch_ids is not None and not self.tracker.active:
            self.tracker.push()   # another micro-batch of the batch drawn for this step
        self._forward_probed = (self.check_every_step or self._forwards == 0
                                or _secret_uniform() < self.check_rate)
        self._forwards += 1
        if not self._forward_probed or self._batch is None:
            return None
        return (tuple(self._probe(f"argument {i}", x) for i, x in enumerate(args)),
                {n: self._probe(n, x) for n, x in kwargs.items()})

    def _probe(self, name: str, x: object) -> object:
        """A batched floating-point input as a leaf that requires gradient (its clone enters the forward, so an
        in-place operation on the input inside the model stays legal)."""
        if not (isinstance(x, torch.Tensor) and x.is_floating_point() and x.dim() > 0 and x.shape[0] == self._batch):
            return x
        if x.requires_grad:   # computed from something that trains: checked where it is
            self.probes.append((name, x, None))
            return x
        leaf = x.detach().requires_grad_(True)
        clone = leaf.clone()
        self.probes.append((name, leaf, clone.grad_fn))
        return clone

    def _root_post(self, module, args, output):
        self._depth -= 1
        if self._depth == 0:
            self._batch = None
            state, self._state = self._state, None
            if state is not None and output is not None:
                changed = _changed_state(self.plan.model, state)
                if changed:
                    raise StateChangedError(
                        f"{changed} changed during a training forward, so the model would carry un-noised information "
                        f"about the batch (running statistics of private data, Embedding(max_norm=...)'s in-place "
                        f"renormalization of the looked-up rows). Private training here offers no privatized running "
                        f"statistics: remove the update (or construct the module without it, e.g. max_norm=None, "
                        f"track_running_stats=False), or freeze the statistics before training")

    def _pre_hook(self, unit: Unit):
        def hook(module, args, kwargs):
            if not self.recording():
                if self.active and self._depth and self._root_grad and self.plan.model.training:
                    # no_grad inside a training forward (e.g. reentrant checkpointing's first pass): its
                    # parameters would silently not train
                    self.no_grad_units.append(unit.path or type(module).__name__)
                return None
            aliases, previous, installed = {}, {}, {}   # installed: what this hook put on the module, by name
            for local, p in unit.params.items():
                owner, attr = _locate(module, local)
                current = owner._parameters[attr]
                if current is p:
                    data = p.detach()
                elif is_sharded(p) and current is not None and current.shape == p.shape:
                    # FSDP2 gathered the parameter for this forward; it frees the gathered copy after use
                    data = current.detach().clone() if unit.handler.needs_weights(module) else current.detach()
                else:
                    raise RuntimeError(f"{self.plan.names[id(p)]} was replaced after make_private; its gradient "
                                       f"would not be that of the parameter the optimizer updates")
                alias = nn.Parameter(data, requires_grad=True)
                owner._parameters[attr] = alias
                aliases[local], previous[local], installed[local] = alias, current, alias
            share = None
            if isinstance(unit.handler, RootParameterHandler):
                # the model's own parameters are outputs shared by the batch: marked, every use of them is
                # followed to where it meets the batch
                if self._batch is None:
                    raise UnsupportedModuleError(
                        "", "the model has trainable parameters of its own, whose per-example gradients are found "
                            "where they meet the batch, but its forward got no tensor whose leading dimension is "
                            "the batch")
                share = Share("the model's own parameters", list(aliases.values()), self._batch)
                for local, alias in aliases.items():
                    owner, attr = _locate(module, local)
                    owner._parameters[attr] = installed[local] = share_output(alias, share)
            self._swapped.setdefault(id(module), []).append((aliases, previous, share, installed))
            return None
        return hook

    def _post_hook(self, unit: Unit):
        def hook(module, args, kwargs, output):
            stack = self._swapped.get(id(module))
            if not stack:
                return None
            aliases, previous, share, installed = stack.pop()
            for local in aliases:  # always restore, even when the forward raised
                owner, attr = _locate(module, local)
                # unless FSDP2 resharded the module in a post-forward hook that ran before this one: it has put the
                # sharded parameter back, and restoring the gathered copy would leave the module holding a full,
                # unsharded parameter (the ranks then disagree on whether the model is sharded)
                if owner._parameters[attr] is installed[local]:
                    owner._parameters[attr] = previous[local]
            if output is None:  # the forward raised (always_call)
                return None
            b = self._batch
            own = share is not None
            if own:   # the model's own parameters: the call is their use, the aliases its outputs (and the root's
                # own post-hook, registered first, has already forgotten the batch size)
                b, args, kwargs, outs = share.b, (), {}, list(aliases.values())
            else:
                outs = flat_tensors(output)
                if not outs:
                    raise ValueError(f"{unit.path or type(module).__name__} has trainable parameters but returned no "
                                     "tensor")
                if b is None:
                    b = outs[0].shape[0] if outs[0].dim() else 1
                if len(outs) > 1:
                    # one output may be computed from another inside the module (a router's scores from its
                    # logits): the model reads views, so each output's gradient is that of its uses outside
                    output = _fresh_views(output)
                    outs = flat_tensors(output)
                one_row = isinstance(output, torch.Tensor) and b > 1 and output.dim() and output.shape[0] == 1
                if self._batch is not None and len(outs) == 1 and isinstance(output, torch.Tensor) and (
                        one_row or _unbatched(args, kwargs, self._root_ints, b)):
                    # computed from no example's data (positions from torch.arange, a bias table, a prompt), or one
                    # row for a batch of several: an output shared by the batch, whose per-example gradients come
                    # from where it meets the batch
                    share = Share(unit.path or type(module).__name__, outs, b)
                    output = share_output(output, share)
            # a call whose inputs need no gradient (a first layer): the row check asks the backward for its outputs
            root = not any(t.requires_grad for t in flat_tensors(list(args)) + flat_tensors(kwargs))
            call = Call(module, tuple(_detach(x) for x in args), {n: _detach(x) for n, x in kwargs.items()},
                        outs, aliases, b)
            call.cache["root"] = root
            call.cache["versions"] = _versions(call)
            call.cache["nodes"] = [o.grad_fn for o in outs]
            call.cache["unit"] = unit
            call.cache["probed"] = self._forward_probed
            call.cache["share"] = share
            if share is not None:   # the exact fallback re-runs the module on these, once per example
                call.cache["shared_inputs"] = (call.args, call.kwargs)
            # the autocast the call ran under: the exact fallback re-runs it so, and the row check's tolerance
            # follows the precision the backward ran in
            call.cache["autocast"] = next(((d, torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")
                                           if torch.is_autocast_enabled(d)), None)
            unit.handler.check_forward(call)
            if self.tracker is not None and self.batch_ids is not None:
                # the examples of the call's rows, compared with the losses' at the backward
                call.cache["examples"] = call_examples(
                    self.tracker, f"a call of {unit.path or type(module).__name__}",
                    [*flat_tensors(list(args)), *flat_tensors(kwargs), *outs])
            self.calls.append(call)
            return output if (share is not None and not own) or len(outs) > 1 else None
        return hook

    def clear(self) -> None:
        """Drop every recorded call (their activations are freed)."""
        self.calls.clear()
        self.probes.clear()
        self.no_grad_units.clear()

    @property
    def hooked(self) -> bool:
        """Whether the hooks are on the model (until :meth:`remove`)."""
        return bool(self._handles)

    def remove(self) -> None:
        """Remove the hooks; the model is as before capture."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self.calls.clear()
        self.probes.clear()

    def replan(self, plan: NormPlan) -> None:
        """Follow ``plan``, a new plan of the same model (its trainable parameters changed between steps): the
        hooks of the units are registered again, the root's stay.  ``RuntimeError`` while a recorded call waits for
        a backward (it was recorded under the old plan)."""
        if plan.model is not self.plan.model:
            raise ValueError("a capture follows new plans of its own model only")
        if self.calls:
            raise RuntimeError("the trainable parameters changed while recorded calls wait for a backward")
        for h in self._handles[2:]:
            h.remove()
        self._handles = self._handles[:2]
        self.plan = plan
        self._handles += self._unit_hooks()


def _batch_norm_guards(capture: Capture) -> list:
    """Hooks that refuse a frozen batch norm (the validator's :func:`~dpsgd.validator.frozen_batch_norm`) found in
    training mode at a recorded forward, before it runs: it would normalize with the batch's statistics (mixing
    the examples) and update its running statistics from private data."""
    def guard(path: str):
        def hook(module, args):
            if module.training and capture.recording():
                raise UnsupportedModuleError(
                    path, f"{type(module).__name__} is frozen but in training mode in a training forward, where it "
                          f"would normalize with the batch's statistics (mixing the examples) and update its running "
                          f"statistics from private data. Keep it in evaluation mode: call "
                          f"model.get_submodule({path!r}).eval() after every model.train() (or override the model's "
                          f"train()), or replace it with GroupNorm (ModuleValidator.fix)")
        return hook
    return [m.register_forward_pre_hook(torch.compiler.disable(guard(path)))
            for path, m in capture.plan.model.named_modules() if frozen_batch_norm(m)]


def keep_saved_buffers():
    """A context in which ``torch.compile`` (AOTAutograd) compiles backward functions that keep their saved buffers
    (no donation), so that a graph can be backpropagated twice (the row check's pass, then the step's own)."""
    try:
        from torch._functorch import config
    except ImportError:   # no compiler: nothing to configure
        return contextlib.nullcontext()
    return config.patch(donated_buffer=False) if hasattr(config, "donated_buffer") else contextlib.nullcontext()


def _fresh_views(out: object) -> object:
    """``out`` with every floating-point tensor replaced by a view of itself (a new node in the autograd graph), in
    the same nesting of tuples, lists and dicts."""
    if isinstance(out, torch.Tensor):
        return out.view_as(out) if out.requires_grad else out
    if isinstance(out, tuple):
        items = [_fresh_views(v) for v in out]
        return type(out)(*items) if hasattr(out, "_fields") else type(out)(items)
    if isinstance(out, list):
        return [_fresh_views(v) for v in out]
    if isinstance(out, dict):
        fresh = out.copy()
        for k, v in out.items():
            fresh[k] = _fresh_views(v)
        return fresh
    return out


def _unbatched(args: tuple, kwargs: dict, root_ints: set, b: int) -> bool:
    """Whether a call's inputs carry no example's data: integer tensors that are neither views of the model's integer
    inputs nor shaped like a batch of sequences (``torch.arange`` positions, T5's relative-position buckets, prompt
    ids), outputs shared by the batch, or none at all.  Either misreading is safe: a batched output read as shared
    meets the batch row by row and is read as batched again; a shared one read as batched fails the row check."""
    for t in flat_tensors([list(args), kwargs]):
        if isinstance(t, SharedOutput) and t.shared:
            continue
        if t.is_floating_point() or t.is_complex() or t.untyped_storage().data_ptr() in root_ints:
            return False
        if t.dim() >= 2 and t.shape[0] == b and t.stride(0) != 0 and not _toeplitz(t):
            return False   # token ids computed from the inputs (labels shifted right into decoder inputs)
    return True


def _toeplitz(t: torch.Tensor) -> bool:
    """A 2-D table constant along its diagonals, as relative-position buckets ``f(j - i)`` are."""
    return t.dim() == 2 and t.shape[0] > 1 and t.shape[1] > 1 and torch.equal(t[1:, 1:], t[:-1, :-1])


def reset_shares(calls: list[Call]) -> None:
    for c in calls:
        if c.cache.get("share") is not None:
            c.cache["share"].reset()


def handler_call(c: Call, b: int) -> Call:
    """``c`` as its handler reads it, after a backward set ``c.grads`` (the gradient of the summed losses): for an
    output shared by the batch, a call of ``b`` examples each reading the whole inputs, with the per-example
    output gradients its meetings with the batch sent back, checked to add up to ``c.grads``."""
    share = c.cache.get("share")
    if share is None:
        return c
    name = c.cache["unit"].path or type(c.module).__name__
    per = share.take()
    met = any(g is not None for g in per)
    if share.aligned:
        if met:
            raise IncompleteGradientError(
                f"{name}'s output is combined with the batch both row by row and broadcast over it, so which rows "
                f"are which example's is ambiguous; give the shared use a leading dimension of 1")
        return c
    for g, p in zip(c.grads, per, strict=True):
        if p is None and g is not None and bool(g.ne(0).any()):
            raise IncompleteGradientError(
                f"a part of {name}'s output that is shared by the batch reached the losses without meeting the batch "
                f"in an operation the trainer follows (one combining it with each example's rows, as x + pos or "
                f"scores + bias; not a custom autograd.Function, torch.vmap, or operations with torch function "
                f"handling off), so its per-example gradient cannot be found; the step was not taken")
    if not met:   # no gradient reached it at all
        return c
    for g, p in zip(c.grads, per, strict=True):
        if g is None or p is None:
            continue
        low = g.dtype in (torch.float16, torch.bfloat16) or c.cache.get("autocast")
        tol = 5e-2 if low else (1e-8 if g.dtype == torch.float64 else 1e-4)
        err = float((p.sum(0).to(g.dtype) - g).norm())
        if not err <= tol * max(float(g.norm()), 1e-30):
            raise IncompleteGradientError(
                f"{name}'s output is shared by the batch, and part of its gradient reached the losses around the "
                f"operations that meet the batch (relative error {err / max(float(g.norm()), 1e-30):.3g}), so "
                f"its per-example gradients are incomplete; the step was not taken. Avoid .data, in-place writes "
                f"into it and operations outside torch on it")

    def expand(x):
        return x.unsqueeze(0).expand(b, *x.shape) if isinstance(x, torch.Tensor) else x
    return Call(c.module, tuple(per_leaf(x, expand) for x in c.args),
                {n: per_leaf(x, expand) for n, x in c.kwargs.items()}, c.outputs, c.aliases, b, per, c.cache)


def _secret_uniform() -> float:
    """A uniform draw from ``os.urandom``: no seed or generator of the user's can predict or replay it."""
    return secret_seed() / 2.0 ** 56


def _state_of(model: nn.Module) -> tuple:
    """What a training forward must leave as it was: every parameter's and buffer's identity and version."""
    params = [(n, p, p._version) for n, p in model.named_parameters(remove_duplicate=False)]
    skip = _weight_only(model)
    buffers = [(n, b, b._version) for n, b in model.named_buffers(remove_duplicate=False) if n not in skip]
    return params, buffers, skip


def _weight_only(model: nn.Module) -> set[str]:
    """Buffers a training forward updates from the weights alone, never from data: ``spectral_norm``'s power
    iteration vectors."""
    return {f"{path}.{n}" if path else n for path, m in model.named_modules() if isinstance(m, _SpectralNorm)
            for n, _ in m.named_buffers(recurse=False)}


def _changed_state(model: nn.Module, state: tuple) -> str | None:
    params, buffers, skip = state
    for name, p, version in params:
        if p._version != version:
            return f"parameter {name}"
    now = {n: b for n, b in model.named_buffers(remove_duplicate=False) if n not in skip}
    for name, b, version in buffers:
        if now.get(name) is not b or b._version != version:
            return f"buffer {name}"
    if len(now) != len(buffers):
        return f"buffer {next(n for n in now if n not in {m for m, _, _ in buffers})}"
    return None


# keyword inputs that carry the batch (Hugging Face names), looked at before any other argument
_MAIN_INPUTS = ("input_ids", "inputs_embeds", "pixel_values", "input_values", "input_features")


def _locate(module: nn.Module, local: str) -> tuple[nn.Module, str]:
    *path, attr = local.split(".")
    owner = module
    for part in path:
        owner = getattr(owner, part)
    return owner, attr


def _detach(x: object) -> object:
    """``x`` detached, in nested tuples and lists too (an LSTM's ``(h_0, c_0)``)."""
    return per_leaf(x, lambda t: t.detach() if isinstance(t, torch.Tensor) else t)


def _versions(call: Call) -> list[int]:
    ts = flat_tensors(list(call.args)) + flat_tensors(call.kwargs) + call.outputs
    return [t._version for t in ts]


# in-place operations whose gradient with respect to the tensor modified is the gradient of their result
_PASS_THROUGH = ("AddBackward0", "SubBackward0")


def _added_to(t: torch.Tensor, node: object) -> bool:
    """Whether ``t`` was only added to in place since its autograd node was ``node`` (``x += y`` on a layer's
    output, as Falcon's parallel attention does), each time with something computed without it: the gradient with
    respect to it is then unchanged.  (``x += f(x)`` is not: ``f(x)``'s gradient would reach the recorded output
    behind the row check's hooks, which sit on the sum.)"""
    current = t.grad_fn
    while current is not None and current is not node:
        if type(current).__name__ not in _PASS_THROUGH or _reaches(current.next_functions[1][0], node):
            return False
        current = current.next_functions[0][0]
    return current is node


def _reaches(start: object, node: object) -> bool:
    """Whether the autograd graph below ``start`` contains ``node`` (nodes created before ``node`` cannot, and are not
    searched: sequence numbers grow as nodes are made)."""
    if node is None or start is None:
        return False
    first = node._sequence_nr()
    seen, stack = set(), [start]
    while stack:
        cur = stack.pop()
        if cur is None or id(cur) in seen:
            continue
        if cur is node:
            return True
        seen.add(id(cur))
        if cur._sequence_nr() >= first:
            stack.extend(fn for fn, _ in cur.next_functions)
    return False


def check_unchanged(call: Call) -> None:
    now, then = _versions(call), call.cache["versions"]
    n_in = len(now) - len(call.outputs)
    unit = call.cache["unit"]
    ok = now[:n_in] == then[:n_in] and all(
        v == w or (not unit.handler.reads_output and _added_to(o, node))
        for o, node, v, w in zip(call.outputs, call.cache["nodes"], now[n_in:], then[n_in:], strict=True))
    if not ok:
        raise IncompleteGradientError(
            f"an input or output of {unit.path or type(call.module).__name__} was modified in place after its "
            f"forward (e.g. ReLU(inplace=True) or x += ...); its per-example gradient cannot be computed from the "
            f"recorded values. Use the out-of-place operation.")


# what a call's cache holds beyond the recording itself: derived from its output gradients by the handlers
_RECORDED = ("versions", "nodes", "unit", "probed", "autocast", "root", "share", "shared_inputs")


def release_call(call: Call) -> None:
    """Drop what a consumed call holds: its recorded inputs, output gradients and derived values; its outputs become
    stand-ins of one element broadcast to their shapes (the finished step still reads their shapes, dtypes and
    devices, never their values)."""
    call.grads = []
    call.args, call.kwargs = (), {}
    call.outputs = [o.detach().new_zeros(()).expand(o.shape) for o in call.outputs]
    call.cache.clear()


def clear_derived(call: Call) -> None:
    for key in [k for k in call.cache if k not in _RECORDED]:
        del call.cache[key]


def first_backward(capture: Capture, losses, outputs, model_params, retain_graph: bool = False) -> list:
    capture.active = False  # gradient checkpointing re-runs forwards inside this backward: record nothing
    before = [(p.grad, None if p.grad is None else p.grad._version) for p in model_params]
    # outputs that carry no gradient (a router's integer choices) get None
    wanted = [i for i, t in enumerate(outputs + model_params) if t.requires_grad]
    try:
        found = torch.autograd.grad(losses.sum(), [(outputs + model_params)[i] for i in wanted], allow_unused=True,
                                    materialize_grads=False, retain_graph=retain_graph)
        grads = [None] * (len(outputs) + len(model_params))
        for i, g in zip(wanted, found, strict=True):
            grads[i] = g
        touched = [qualified_name(capture.plan.model, p) for p, (g, v) in zip(model_params, before, strict=True)
                   if p.grad is not g or (g is not None and g._version != v)]
        if touched:  # a backward inside our backward wrote .grad behind the per-example norms
            raise IncompleteGradientError(
                f"{touched[0]}.grad was written inside the private backward by a nested backward (reentrant "
                f"gradient checkpointing?), outside the per-example norms; use "
                f"non-reentrant checkpointing (torch.utils.checkpoint(..., use_reentrant=False); the default of "
                f"Hugging Face's activation_checkpointing_enable())")
        return grads
    except RuntimeError as err:
        if "Checkpointing is not compatible" in str(err):
            raise IncompleteGradientError(
                "reentrant gradient checkpointing runs its own backward and cannot give per-example gradients; "
                "use non-reentrant checkpointing (torch.utils.checkpoint(..., use_reentrant=False); the default of "
                "Hugging Face's activation_checkpointing_enable())") from err
        raise
    finally:
        capture.active = True


def graph_nodes(losses: torch.Tensor, skip: set = frozenset()) -> list:
    """Every node of the autograd graph below ``losses`` (not below the nodes in ``skip``, by id), once each, in a
    deterministic depth-first order."""
    seen, stack, nodes = set(), [losses.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen or id(node) in skip:
            continue
        seen.add(id(node))
        nodes.append(node)
        stack.extend(fn for fn, _ in node.next_functions)
    return nodes


def gathered_leaves(losses: torch.Tensor, calls: list[Call]) -> list[str]:
    """Parameters (other than the recorded calls' aliases) that ``losses`` depend on, from its autograd graph."""
    aliases = {id(a) for c in calls for a in c.aliases.values()}
    return [f"a gathered FSDP parameter of shape {tuple(var.shape)}" for node in graph_nodes(losses)
            if isinstance(var := getattr(node, "variable", None), nn.Parameter) and id(var) not in aliases]


def qualified_name(model: nn.Module, p: nn.Parameter) -> str:
    return next((n for n, q in model.named_parameters() if q is p), "<unnamed parameter>")


def leak_message(names: list[str], plan: NormPlan) -> str:
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return (f"gradient reached {shown} outside every recorded module call, so its per-example contribution would "
            f"not be clipped; the step was not taken. Causes: the forward ran in eval mode or without the "
            f"private engine's hooks (call model.train()); the parameter is used by another module's forward "
            f"(e.g. F.linear(x, self.other.weight)) -- let that module's handler cover its submodules' parameters: "
            f"class Whole(dpsgd.materialized.FunctionalHandler): recursive = True, then "
            f"dpsgd.handler.register_handler(TheModuleClass, Whole()) before make_private; or it became trainable "
            f"after make_private. {len(plan.units)} modules are hooked.")
