"""Any ``torch.optim.Optimizer``: grads in ``param.grad``, Adam moments in ``optimizer.state``.

An optimizer that holds others (torchtitan's ``OptimizersContainer``: one optimizer per model part in
``.optimizers``, itself an ``Optimizer`` whose step runs theirs) is hooked as one, and each parameter's
state and hyper-parameters are read from the inner optimizer that updates it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from trainmon.device import is_dtensor


class TorchOptimizerAdapter:
    skips_steps = True  # see register_step_hooks
    skip_unsupported = ""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        inner = getattr(optimizer, "optimizers", None)
        inner = list(inner) if isinstance(inner, (list, tuple)) else []
        # where each parameter's state and group are: the inner optimizers first, the container last
        self._holders = [o for o in inner if isinstance(o, torch.optim.Optimizer)] + [optimizer]
        # DTensor parameters (FSDP2, tensor parallelism): their statistics are merged over the ranks that
        # hold their pieces (trainmon.step.gate), so every rank takes part in each collected step
        self.sharded = any(is_dtensor(p) for p in self.params())

    @property
    def name(self) -> str:
        return type(self.optimizer).__name__

    def hooked_objects(self) -> list[Any]:
        return [self.optimizer]

    def step_skipped(self) -> bool:
        return False  # a GradScaler's skip never calls optimizer.step() (Monitor.watch_grad_scaler)

    def params(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def grad(self, param: torch.Tensor) -> torch.Tensor | None:
        return param.grad

    def value(self, param: torch.Tensor) -> torch.Tensor:
        return param

    def _state_of(self, param: torch.Tensor) -> dict | None:
        for holder in self._holders:
            state = holder.state.get(param)
            if state:
                return state
        return None

    def moments(self, param: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        state = self._state_of(param)
        if not state or "exp_avg" not in state or "exp_avg_sq" not in state:
            return None
        return state["exp_avg"], state["exp_avg_sq"]

    def adam_bias_corrections(self, param: torch.Tensor) -> tuple[float, float, float] | None:
        state = self._state_of(param)
        group = self._group_of(param)
        if not state or group is None or "betas" not in group or "step" not in state:
            return None
        step = state["step"]
        if isinstance(step, torch.Tensor):
            if (
                step.device.type != "cpu"
            ):  # capturable/fused Adam keeps it on the device: reading it would sync
                return None
            step = float(step)  # torch's default Adam keeps this counter on the CPU: no device sync
        if step <= 0:
            return None
        beta1, beta2 = group["betas"]
        return 1.0 - beta1**step, 1.0 - beta2**step, float(group.get("eps", 1e-8))

    def register_step_hooks(self, pre: Callable[[], bool], post: Callable[[], None]) -> list[Any]:
        """``pre`` returning True skips the update: every torch optimizer leaves a parameter without a
        gradient untouched (value, moments, step count), so the gradients are hidden from it for this one
        call and handed back afterwards.

        ``optimizer.step(closure)`` (Lightning's automatic optimization, LBFGS, SAM-style loops) runs the
        closure's forward and backward inside the step, after torch's pre-hooks: there ``pre`` runs inside the
        closure, after its backward and before the update, once a step (an optimizer that calls the closure
        again, as LBFGS does, gets its gradients hidden again when the step is skipped)."""
        hidden: list[tuple[torch.Tensor, torch.Tensor]] = []
        skip = [False]

        def hide() -> None:
            for p in self.params():
                if p.grad is not None:
                    hidden.append((p, p.grad))
                    p.grad = None

        def decide() -> None:
            skip[0] = pre()
            if skip[0]:
                hide()

        def before(optimizer: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            closure, where = _closure_of(args, kwargs)
            if closure is None:
                decide()
                return None
            calls = [0]

            def closure_then_read(*a: Any, **k: Any) -> Any:
                loss = closure(*a, **k)
                calls[0] += 1
                if calls[0] == 1:
                    decide()
                elif skip[0]:
                    hidden.clear()  # the gradients of a later call replace the ones first hidden
                    hide()
                return loss

            return _with_closure(args, kwargs, where, closure_then_read)

        def after(optimizer: Any, args: Any, kwargs: Any) -> None:
            for p, grad in hidden:
                p.grad = grad
            hidden.clear()
            skip[0] = False
            post()

        return [
            self.optimizer.register_step_pre_hook(before),
            self.optimizer.register_step_post_hook(after),
        ]

    def _group_of(self, param: torch.Tensor) -> dict | None:
        groups = getattr(self, "_groups", None)
        if groups is None:
            groups = self._groups = {
                id(p): g
                for holder in reversed(self._holders)
                for g in holder.param_groups
                for p in g["params"]
            }
        return groups.get(id(param))


def _closure_of(args: tuple, kwargs: dict) -> tuple[Callable[..., Any] | None, int | str]:
    """The closure handed to ``step`` and where it is: ``"closure"`` (a keyword) or its position in the
    hooks' ``args``, which start with the optimizer itself."""
    if callable(kwargs.get("closure")):
        return kwargs["closure"], "closure"
    for at, arg in enumerate(args[:2]):
        if callable(arg) and not isinstance(arg, torch.optim.Optimizer):
            return arg, at
    return None, 0


def _with_closure(
    args: tuple, kwargs: dict, where: int | str, closure: Callable[..., Any]
) -> tuple[tuple, dict]:
    if isinstance(where, str):
        return args, {**kwargs, where: closure}
    return (*args[:where], closure, *args[where + 1 :]), kwargs


def inner_optimizer(optimizer: Any) -> Any:
    """The torch optimizer that takes step hooks: ``optimizer`` itself, or the one a wrapper holds
    (Accelerate's ``AcceleratedOptimizer``, which Hugging Face's Trainer hands its callbacks, keeps it in
    ``.optimizer`` and is an ``Optimizer`` without an ``Optimizer``'s state; Lightning's
    ``LightningOptimizer`` in ``._optimizer``). Wrappers that are whole optimizers themselves are kept."""
    for _ in range(8):  # wrappers of wrappers, never a cycle
        if isinstance(optimizer, torch.optim.Optimizer) and hasattr(optimizer, "_optimizer_step_pre_hooks"):
            return optimizer
        inner = getattr(optimizer, "optimizer", None)
        inner = inner if inner is not None else getattr(optimizer, "_optimizer", None)
        if inner is None or inner is optimizer:
            return optimizer
        optimizer = inner
    return optimizer
