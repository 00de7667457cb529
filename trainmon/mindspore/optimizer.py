"""The optimizer call: gradients it receives and parameters before it, parameters and Adam moments after.

A MindSpore optimizer is a Cell called with the gradient tuple (``optimizer(grads)``); a forward pre-hook
sees the gradients and the parameters before the update, a forward hook the updated parameters and
``moments1``/``moments2`` (Adam, AdamWeightDecay, Lamb...). The forward hook ends the step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mindspore as ms
from mindspore import nn

from trainmon.records import Kind

logger = logging.getLogger("trainmon")

AddParam = Callable[[str, str, ms.Tensor], None]  # add(kind, name, tensor), optimizer phase


@dataclass(frozen=True)
class OptimizerParts:
    grads: bool
    params: bool
    moments: bool


class OptimizerHooks:
    def __init__(
        self,
        optimizer: nn.Cell,
        names: Sequence[str | None],
        add: AddParam,
        is_collecting: Callable[[], bool],
        parts: Callable[[], OptimizerParts],
        end_step: Callable[[], None],
    ) -> None:
        """``names[i]`` is the monitored name of ``optimizer.parameters[i]`` (None: not a target)."""
        self._optimizer, self._names = optimizer, list(names)
        self._add, self._collecting, self._parts, self._end_step = add, is_collecting, parts, end_step
        self._handles = [
            optimizer.register_forward_pre_hook(self._before),
            optimizer.register_forward_hook(self._after),
        ]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _named(self, tensors: Sequence[Any]) -> list[tuple[str, ms.Tensor]]:
        # the optimizer's own tuples (grads, parameters, moments) are in the order of its parameters
        pairs = zip(self._names, tensors, strict=False)
        return [(n, t) for n, t in pairs if n is not None and isinstance(t, ms.Tensor)]

    def _before(self, cell: nn.Cell, inputs: tuple) -> None:
        if not self._collecting():
            return
        try:
            parts = self._parts()
            grads = inputs[0] if len(inputs) == 1 and isinstance(inputs[0], (tuple, list)) else inputs
            if parts.grads:
                for name, g in self._named(grads):
                    self._add(Kind.GRAD_REDUCED.value, name, g)
            if parts.params:
                for name, p in self._named(self._optimizer.parameters):
                    self._add(Kind.PARAM_ORIGIN.value, name, p)
        except Exception:
            logger.exception("trainmon: optimizer pre-hook failed; training continues")

    def _after(self, cell: nn.Cell, inputs: tuple, output: Any) -> None:
        try:
            if self._collecting():
                parts = self._parts()
                if parts.params:
                    for name, p in self._named(self._optimizer.parameters):
                        self._add(Kind.PARAM_UPDATED.value, name, p)
                if parts.moments:
                    for attr, kind in (("moments1", Kind.EXP_AVG), ("moments2", Kind.EXP_AVG_SQ)):
                        for name, m in self._named(getattr(self._optimizer, attr, None) or ()):
                            self._add(kind.value, name, m)
        except Exception:
            logger.exception("trainmon: optimizer hook failed; training continues")
        self._end_step()
