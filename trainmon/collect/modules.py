"""Activations (forward inputs, kwargs, outputs) and activation gradients (grad_input/grad_output)."""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from trainmon.collect.base import guarded
from trainmon.device import in_backward_pass
from trainmon.run.names import encode_name
from trainmon.run.records import Kind, Phase
from trainmon.step.buffer import StepBuffer
from trainmon.step.position import LoopPosition

_ACTV, _ACTV_GRAD = Kind.ACTV.value, Kind.ACTV_GRAD.value
_FORWARD, _BACKWARD = Phase.FORWARD.value, Phase.BACKWARD.value


@dataclass(frozen=True)
class ModuleSite:
    vpp_stage: int
    name: str
    module: nn.Module


class _Names:
    """Row names of one module, built once: ``<module>.input``, ``<module>.input_1``, ``<module>.output``;
    and the gradient hook of each name, also built once (hooks run for every module call)."""

    def __init__(self, base: str, state: LoopPosition, buffer: StepBuffer, vpp: int) -> None:
        self.base = base
        self._cache: dict[tuple[str, Any, bool], str] = {}
        self._hooks: dict[tuple[str, Any, bool], Any] = {}
        self._state, self._buffer, self._vpp = state, buffer, vpp

    def get(self, role: str, key: Any, indexed: bool) -> str:
        cache_key = (role, key, indexed)
        name = self._cache.get(cache_key)
        if name is None:
            # a dict output's key is any string: written encoded, as the module name is (run.names)
            name = f"{self.base}.{role}_{encode_name(str(key))}" if indexed else f"{self.base}.{role}"
            self._cache[cache_key] = name
        return name

    def grad_hook(self, role: str, key: Any, indexed: bool):
        cache_key = (role, key, indexed)
        hook = self._hooks.get(cache_key)
        if hook is None:
            hook = _grad_hook(self._state, self._buffer, self.get(role, key, indexed), self._vpp)
            self._hooks[cache_key] = hook
        return hook


def _add_all(
    buffer: StepBuffer, kind: str, names: _Names, role: str, values: Any, vpp: int, micro: int, phase: str
) -> None:
    """Rows for every tensor in a hook argument; tuple/list elements and dict values get their own row."""
    if isinstance(values, torch.Tensor):
        buffer.add(kind, names.get(role, 0, False), vpp, micro, phase, values)
    elif isinstance(values, (tuple, list)):
        indexed = len(values) > 1
        for i, value in enumerate(values):
            if isinstance(value, torch.Tensor):
                buffer.add(kind, names.get(role, i, indexed), vpp, micro, phase, value)
    elif isinstance(values, dict):
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                buffer.add(kind, names.get(role, key, True), vpp, micro, phase, value)


class ModuleCollector:
    """Forward and full backward hooks on the target modules, installed only on collected steps."""

    def __init__(
        self,
        sites: Sequence[ModuleSite],
        state: LoopPosition,
        buffer: StepBuffer,
        *,
        forward: bool,
        backward: bool,
    ) -> None:
        self._sites = list(sites)
        self._state = state
        self._buffer = buffer
        self._forward = forward
        self._backward = backward
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def arm(self) -> None:
        if self._handles:
            return
        for site in self._sites:
            names = _Names(site.name, self._state, self._buffer, site.vpp_stage)
            if self._backward:
                # before the forward hook, so the output hooks below see the aliased inputs
                self._handles.append(
                    site.module.register_forward_pre_hook(
                        self._alias_inputs_hook(site.vpp_stage, names), with_kwargs=True
                    )
                )
            if self._forward or self._backward:
                self._handles.append(
                    site.module.register_forward_hook(
                        self._forward_hook(site.vpp_stage, names), with_kwargs=True
                    )
                )

    def disarm(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _forward_hook(self, vpp: int, names: _Names):
        state, buffer, forward, backward = self._state, self._buffer, self._forward, self._backward

        @guarded(f"forward hook of {names.base!r}")
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if not module.training:
                return  # eval passes are not micro-batches
            # activation recomputation (checkpointing) runs the forward again inside backward: its
            # activations were recorded by the first pass (which ran under no_grad), but gradient hooks can
            # only be attached now, to the recomputed graph
            recompute = in_backward_pass()
            if backward and torch.is_grad_enabled():
                _hook_grads(names, "output_grad", output, _graph_micro(state, vpp, recompute))
            if not forward or recompute:
                return
            # the stats kernel builds no autograd graph, so no torch.no_grad() is needed here
            micro = state.forward_micro
            _add_all(buffer, _ACTV, names, "input", args, vpp, micro, _FORWARD)
            for key, value in kwargs.items():
                if isinstance(value, torch.Tensor):
                    buffer.add(_ACTV, names.get("input", key, True), vpp, micro, _FORWARD, value)
            _add_all(buffer, _ACTV, names, "output", output, vpp, micro, _FORWARD)

        return hook

    def _alias_inputs_hook(self, vpp: int, names: _Names):
        """Activation gradients w.r.t. the module's inputs, from this module only.

        Each input that requires grad is replaced by a view of itself (same storage, same values: training
        is unchanged) and a tensor hook on that view sees exactly the gradient flowing back through this
        module (the module's ``grad_input``). Unlike ``register_full_backward_hook``, whose custom autograd
        Function forbids in-place changes of the module's inputs and outputs, this is safe with models that
        modify activations in place (Megatron's masked softmax and vocab-parallel cross entropy do).
        """

        @guarded(f"backward hook of {names.base!r}")
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            if not module.training or not torch.is_grad_enabled():
                return None
            micro = _graph_micro(self._state, vpp, in_backward_pass())
            indexed = sum(isinstance(a, torch.Tensor) for a in args) > 1
            new_args = tuple(_aliased(names, i, indexed, a, micro) for i, a in enumerate(args))
            new_kwargs = {key: _aliased(names, key, True, value, micro) for key, value in kwargs.items()}
            return new_args, new_kwargs

        return hook


def _graph_micro(state: LoopPosition, vpp: int, recompute: bool) -> int:
    """The forward micro-batch a graph being built belongs to, or -1 where that does not say which backward
    micro-batch its hooks run in: recomputation happens inside a backward that has started already, and
    the micro-steps are counted on the first model chunk only (other chunks' forwards interleave with it)."""
    return -1 if recompute or vpp != 0 else state.forward_micro


def _aliased(names: _Names, key: Any, indexed: bool, value: Any, micro: int) -> Any:
    if not isinstance(value, torch.Tensor) or not value.requires_grad:
        return value
    alias = value.view_as(value)
    alias.register_hook(functools.partial(names.grad_hook("input_grad", key, indexed), micro))
    return alias


def _hook_grads(names: _Names, role: str, values: Any, micro: int) -> None:
    """Tensor hooks on every output the call produced that requires grad: each fires with the gradient
    w.r.t. that output."""
    if isinstance(values, torch.Tensor):
        if _produced(values):
            values.register_hook(functools.partial(names.grad_hook(role, 0, False), micro))
    elif isinstance(values, (tuple, list)):
        indexed = len(values) > 1
        for i, value in enumerate(values):
            if isinstance(value, torch.Tensor) and _produced(value):
                value.register_hook(functools.partial(names.grad_hook(role, i, indexed), micro))
    elif isinstance(values, dict):
        for key, value in values.items():
            if isinstance(value, torch.Tensor) and _produced(value):
                value.register_hook(functools.partial(names.grad_hook(role, key, True), micro))


def _produced(value: torch.Tensor) -> bool:
    """A non-leaf that requires grad. A leaf output is a parameter handed back as it is (Megatron's
    linear layers return ``(output, self.bias)`` to fuse the bias later): a hook on it would stay for the
    run, one more every call, and fire in later micro-batches and steps with a stale micro-step."""
    return value.requires_grad and not value.is_leaf


def _grad_hook(state: LoopPosition, buffer: StepBuffer, name: str, vpp: int):
    @guarded(f"gradient hook of {name!r}")
    def hook(forward_micro: int, grad: torch.Tensor) -> None:
        if state.collecting:  # a graph built on a collected step may be run backward after it ended
            # this hook may be the first of its micro-batch to fire (a module whose output is the model's
            # output was hooked before the micro-step counter saw that output): start the micro-batch here
            if forward_micro >= 0:
                state.start_backward(forward_micro)
            buffer.add(_ACTV_GRAD, name, vpp, max(state.backward_micro, 0), _BACKWARD, grad)

    return hook


class MicroStepCounter:
    """Counts forward and backward micro-batches of the model's first chunk. Always installed: two Python
    calls per micro-batch, needed to number micro-steps and to find the last one."""

    def __init__(self, root: nn.Module, state: LoopPosition) -> None:
        self._state = state
        self._handles = [
            root.register_forward_pre_hook(self._on_forward_start),
            root.register_forward_hook(self._on_forward_end),
        ]

    @guarded("micro-step counter")
    def _on_forward_start(self, module: nn.Module, args: tuple) -> None:
        if module.training and not in_backward_pass():
            self._state.start_forward()

    @guarded("micro-step counter")
    def _on_forward_end(self, module: nn.Module, args: tuple, output: Any) -> None:
        if not module.training or in_backward_pass() or not torch.is_grad_enabled():
            return
        # every output, not only the first: the backward of a later output (an auxiliary loss) may run first
        start = functools.partial(self._on_backward_start, self._state.forward_micro)
        for tensor in _grad_tensors(output):
            tensor.register_hook(start)

    def _on_backward_start(self, forward_micro: int, grad: torch.Tensor) -> None:
        self._state.start_backward(forward_micro)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _grad_tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        if _produced(value):
            yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _grad_tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _grad_tensors(item)
