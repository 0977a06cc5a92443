r"""The private optimizer: :class:`DPOptimizer`, a ``torch.optim.Optimizer`` that owns the noisy step.

Its ``step()`` is the step of DP-SGD-RC, in this order: the batch's backwards are closed
(:meth:`~dpsgd.step.PrivateStep.begin_step`; a micro-batch that does not end its logical batch only accumulates),
the clipped sums become the noisy gradients (:meth:`~dpsgd.step.PrivateStep.noisy_gradients`: admitted by the
engine's calibration and charged in its ledger as they are made), the wrapped optimizer steps, and the batch is
cleared.
"""

from __future__ import annotations

import torch

from .accounting import fixed_setting
from .step import PrivateStep

__all__ = ["DPOptimizer"]

# Opacus' DPOptimizer carries these, and Opacus' noise schedulers set optimizer.noise_multiplier; here they are
# fixed by make_private (the accountant charges every step at them), so a schedule is refused, not ignored
_FIXED = ("noise_multiplier", "max_grad_norm", "expected_batch_size")



class DPOptimizer(torch.optim.Optimizer):
    r"""A ``torch.optim.Optimizer`` around the user's: ``step()`` adds noise to the clipped sum, normalizes by
    the expected batch size, steps, and records the step in the ledger.

    ``param_groups``, ``state`` and ``defaults`` are the wrapped optimizer's, so learning-rate schedulers,
    ``state_dict`` and ``add_param_group`` work on it.  Between ``backward()`` and ``step()`` the clipped
    sums are held by the step (:class:`~dpsgd.step.PrivateStep`) and ``p.grad`` stays ``None``: the sum before
    noise is not private, so it is not exposed for logging, and ``clip_grad_norm_`` has nothing to act on (every
    example is already clipped to ``max_grad_norm``).  ``step()`` refuses if a ``.grad`` was written by anything
    else.  Under :class:`~dpsgd.data.BatchMemoryManager`, ``step()`` after a micro-batch that does not end its
    logical batch only accumulates (``zero_grad()`` then keeps the accumulated sums, as in Opacus).

    Parameters
    ----------
    optimizer : torch.optim.Optimizer
        The user's optimizer (:attr:`original_optimizer`), which steps with the noisy gradients.
    private_step : PrivateStep
        The batch in progress and its noisy gradients.
    noise_multiplier, max_grad_norm, expected_batch_size : float
        The run's (read-only here: setting one raises ``AttributeError``, as the engine does).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, private_step: PrivateStep, *, noise_multiplier: float,
                 max_grad_norm: float, expected_batch_size: float) -> None:
        # no Optimizer.__init__: the wrapped optimizer owns the parameter groups and the state
        self.original_optimizer = optimizer
        self.private_step = private_step
        self._settings = {"noise_multiplier": noise_multiplier, "max_grad_norm": max_grad_norm,
                          "expected_batch_size": expected_batch_size}
        self._optimizer_step_pre_hooks = {}
        self._optimizer_step_post_hooks = {}
        self._optimizer_state_dict_pre_hooks = {}
        self._optimizer_state_dict_post_hooks = {}
        self._optimizer_load_state_dict_pre_hooks = {}
        self._optimizer_load_state_dict_post_hooks = {}
        self._sealed = True   # from here on a public attribute it does not have is refused (__setattr__)

    def __setattr__(self, name: str, value) -> None:
        if name in _FIXED and self.__dict__.get("_sealed"):
            raise fixed_setting(name)
        # an Opacus optimizer's setting (loss_reduction, secure_mode, ...) would be accepted and do nothing here;
        # torch's and schedulers' own attributes (step, _opt_called, ...) pass
        if self.__dict__.get("_sealed") and not name.startswith("_") and name not in self.__dict__ \
                and not hasattr(type(self), name):
            raise AttributeError(f"DPOptimizer has no setting {name!r}, so setting it would change nothing. Its "
                                 f"settings are the engine's (noise_multiplier, max_grad_norm, expected_batch_size: "
                                 f"fixed by make_private; check_every_step and check_rate on the PrivacyEngine) and "
                                 f"the wrapped optimizer's param_groups (lr, weight_decay, ...)")
        super().__setattr__(name, value)

    @property
    def param_groups(self) -> list[dict]:
        return self.original_optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict]) -> None:
        self.original_optimizer.param_groups = groups

    @property
    def state(self):
        return self.original_optimizer.state

    @state.setter
    def state(self, state) -> None:
        self.original_optimizer.state = state

    @property
    def defaults(self) -> dict:
        return self.original_optimizer.defaults

    @defaults.setter
    def defaults(self, defaults: dict) -> None:
        self.original_optimizer.defaults = defaults

    @property
    def noise_multiplier(self) -> float:
        """The run's ``noise_multiplier`` (read-only: setting it raises ``AttributeError``)."""
        return self._settings["noise_multiplier"]

    @property
    def max_grad_norm(self) -> float:
        """The run's ``max_grad_norm`` (read-only: setting it raises ``AttributeError``)."""
        return self._settings["max_grad_norm"]

    @property
    def expected_batch_size(self) -> float:
        """The run's ``expected_batch_size`` (read-only: setting it raises ``AttributeError``)."""
        return self._settings["expected_batch_size"]

    def __repr__(self) -> str:
        return f"DPOptimizer({self.original_optimizer!r})"

    def __getstate__(self):
        return self.__dict__

    def __setstate__(self, state):
        self.__dict__.update(state)

    def add_param_group(self, param_group: dict) -> None:
        """Add a group to the wrapped optimizer; its trainable parameters must be ones the engine covers."""
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        self.private_step.check_covered(params, "add_param_group")
        self.original_optimizer.add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear ``.grad`` and the accumulated clipped sums (kept while a logical batch is being accumulated)."""
        self.private_step.zero_grad()

    def step(self, closure=None):
        """The noisy step (or, inside a logical batch split by the memory manager, accumulation only)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # every parameter the wrapped optimizer steps must be one the plan clips (a group added to the wrapped
        # optimizer directly, or param_groups edited by hand, would step with a gradient nobody clipped or noised)
        self.private_step.check_covered([p for g in self.param_groups for p in g["params"]], "the optimizer's "
                                        "param_groups")
        if self.private_step.begin_step():
            self.private_step.noisy_gradients()   # admitted and charged
            self.original_optimizer.step()
            self.private_step.end_step()
        return loss

    def state_dict(self) -> dict:
        return self.original_optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.original_optimizer.load_state_dict(state_dict)
