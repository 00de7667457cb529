"""Activations (forward inputs, kwargs, outputs) and activation gradients (grad_input/grad_output)."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from trainmon.buffer import StepBuffer
from trainmon.collect.base import guarded
from trainmon.device import in_backward_pass
from trainmon.records import Kind, Phase
from trainmon.state import StepState

# Our full backward hooks make torch warn about modules whose inputs need no grad (the embedding);
# that warning is caused by the monitor, not by the user's model.
warnings.filterwarnings(
    "ignore", message="Full backward hook is firing when gradients are computed with respect"
)

_ACTV, _ACTV_GRAD = Kind.ACTV.value, Kind.ACTV_GRAD.value
_FORWARD, _BACKWARD = Phase.FORWARD.value, Phase.BACKWARD.value


@dataclass(frozen=True)
class ModuleSite:
    vpp_stage: int
    name: str
    module: nn.Module


class _Names:
    """Row names of one module, built once: ``<module>.input``, ``<module>.input_1``, ``<module>.output``"""

    def __init__(self, base: str) -> None:
        self.base = base
        self._cache: dict[tuple[str, Any, bool], str] = {}

    def get(self, role: str, key: Any, indexed: bool) -> str:
        cache_key = (role, key, indexed)
        name = self._cache.get(cache_key)
        if name is None:
            name = f"{self.base}.{role}_{key}" if indexed else f"{self.base}.{role}"
            self._cache[cache_key] = name
        return name


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
        state: StepState,
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
            names = _Names(site.name)
            if self._forward:
                self._handles.append(
                    site.module.register_forward_hook(
                        self._forward_hook(site.vpp_stage, names), with_kwargs=True
                    )
                )
            if self._backward:
                self._handles.append(
                    site.module.register_full_backward_hook(self._backward_hook(site.vpp_stage, names))
                )

    def disarm(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _forward_hook(self, vpp: int, names: _Names):
        state, buffer = self._state, self._buffer

        @guarded(f"forward hook of {names.base!r}")
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            # eval passes and activation recomputation (forward run again in backward) are not micro-batches
            if not module.training or in_backward_pass():
                return
            # the stats kernel builds no autograd graph, so no torch.no_grad() is needed here
            micro = state.forward_micro
            _add_all(buffer, _ACTV, names, "input", args, vpp, micro, _FORWARD)
            for key, value in kwargs.items():
                if isinstance(value, torch.Tensor):
                    buffer.add(_ACTV, names.get("input", key, True), vpp, micro, _FORWARD, value)
            _add_all(buffer, _ACTV, names, "output", output, vpp, micro, _FORWARD)

        return hook

    def _backward_hook(self, vpp: int, names: _Names):
        state, buffer = self._state, self._buffer

        @guarded(f"backward hook of {names.base!r}")
        def hook(module: nn.Module, grad_input: tuple, grad_output: tuple) -> None:
            micro = state.backward_micro
            _add_all(buffer, _ACTV_GRAD, names, "output_grad", grad_output, vpp, micro, _BACKWARD)
            _add_all(buffer, _ACTV_GRAD, names, "input_grad", grad_input, vpp, micro, _BACKWARD)

        return hook


class MicroStepCounter:
    """Counts forward and backward micro-batches of the model's first chunk. Always installed: two Python
    calls per micro-batch, needed to number micro-steps and to find the last one."""

    def __init__(self, root: nn.Module, state: StepState) -> None:
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
        first = _first_grad_tensor(output)
        if first is not None:
            first.register_hook(self._on_backward_start)

    def _on_backward_start(self, grad: torch.Tensor) -> None:
        self._state.start_backward()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _first_grad_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value if value.requires_grad else None
    if isinstance(value, (tuple, list)):
        for item in value:
            found = _first_grad_tensor(item)
            if found is not None:
                return found
    if isinstance(value, dict):
        for item in value.values():
            found = _first_grad_tensor(item)
            if found is not None:
                return found
    return None
