"""The optimizer call: gradients it receives and parameters before it, parameters and Adam moments after.

A MindSpore optimizer is a Cell called with the gradient tuple (``optimizer(grads)``); a forward pre-hook
sees the gradients and the parameters before the update, a forward hook the updated parameters, the Adam
moments and Adam's update and ratio (:mod:`trainmon.mindspore.adam`). The forward hook ends the step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mindspore as ms
from mindspore import nn

from trainmon.mindspore.adam import BiasCorrection, moments
from trainmon.run.records import Kind

logger = logging.getLogger("trainmon")

AddParam = Callable[[str, str, ms.Tensor], None]  # add(kind, name, tensor), optimizer phase


@dataclass(frozen=True)
class OptimizerParts:
    grads: bool
    params: bool
    moments: bool
    update_ratio: bool = False


class OptimizerHooks:
    def __init__(
        self,
        optimizer: nn.Cell,
        names: Sequence[str | None],
        add: AddParam,
        is_collecting: Callable[[], bool],
        parts: Callable[[], OptimizerParts],
        end_step: Callable[[], None],
        on_grads: Callable[[Sequence[Any]], None] | None = None,
        before_update: Callable[[], None] | None = None,
        settle: Callable[[], None] | None = None,
    ) -> None:
        """``names[i]`` is the monitored name of ``optimizer.parameters[i]`` (None: not a target).
        ``on_grads``, if given, receives the whole gradient tuple (in the order of ``optimizer.parameters``)
        at every collected step, whatever the parts (grad_probe)."""
        self._optimizer, self._names = optimizer, list(names)
        self._add, self._collecting, self._parts, self._end_step = add, is_collecting, parts, end_step
        self._on_grads = on_grads
        self._before_update = before_update  # the rows so far must be reduced before parameters change
        self._settle = settle  # after each computed (update, ratio) pair: they need not all live at once
        self._moments = moments(optimizer)
        self._correction = BiasCorrection.of(optimizer)
        self._warned: set[str] = set()
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
        grads = inputs[0] if len(inputs) == 1 and isinstance(inputs[0], (tuple, list)) else inputs
        try:
            parts = self._parts()
            if parts.grads:
                for name, g in self._named(grads):
                    self._add(Kind.GRAD_REDUCED.value, name, g)
            if parts.params:
                for name, p in self._named(self._optimizer.parameters):
                    self._add(Kind.PARAM_ORIGIN.value, name, p)
            if self._before_update is not None:
                self._before_update()
        except Exception:
            logger.exception("trainmon: optimizer pre-hook failed; training continues")
        if self._on_grads is not None:
            try:
                self._on_grads(grads)
            except Exception:
                logger.exception("trainmon: optimizer gradient callback failed; training continues")

    def _after(self, cell: nn.Cell, inputs: tuple, output: Any) -> None:
        try:
            if self._collecting():
                parts = self._parts()
                if parts.params:
                    for name, p in self._named(self._optimizer.parameters):
                        self._add(Kind.PARAM_UPDATED.value, name, p)
                if parts.moments or parts.update_ratio:
                    self._add_moments(parts)
        except Exception:
            logger.exception("trainmon: optimizer hook failed; training continues")
        self._end_step()

    def _add_moments(self, parts: OptimizerParts) -> None:
        if self._moments is None:
            self._warn_once("moments", "keeps no Adam moments; mv/ur statistics are skipped")
            return
        first, second = self._moments
        if parts.moments:
            for name, m in self._named(first):
                self._add(Kind.EXP_AVG.value, name, m)
            for name, v in self._named(second):
                self._add(Kind.EXP_AVG_SQ.value, name, v)
        if not parts.update_ratio:
            return
        if self._correction is None:
            self._warn_once("ur", "has no known Adam bias correction; update/ratio statistics are skipped")
            return
        for (name, m), (_, v) in zip(self._named(first), self._named(second), strict=True):
            update, ratio = self._correction.update_and_ratio(m, v)
            self._add(Kind.UPDATE.value, name, update)
            self._add(Kind.RATIO.value, name, ratio)
            if self._settle is not None:
                self._settle()

    def _warn_once(self, key: str, what: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning("trainmon: %s %s", type(self._optimizer).__name__, what)
