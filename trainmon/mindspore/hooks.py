"""Cell hooks: activations (forward hook) and activation gradients (backward hook) of the target Cells.

Row names follow the torch collector: ``<cell>.input``, ``<cell>.output``, ``<cell>.input_grad``,
``<cell>.output_grad``, with ``_<i>`` appended when a hook argument holds several tensors, so the anomaly
origin locator, the CLI and the plugin treat both frameworks alike.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mindspore as ms
from mindspore import nn

from trainmon.run.records import Kind, Phase

logger = logging.getLogger("trainmon")

# add(kind, name, micro_step, phase, tensor): records one row of the current step
AddRow = Callable[[str, str, int, str, ms.Tensor], None]


@dataclass(frozen=True)
class CellSite:
    name: str
    cell: nn.Cell


def _add_all(add: AddRow, kind: str, base: str, role: str, values: Any, micro: int, phase: str) -> None:
    """One row per tensor of a hook argument (a gradient MindSpore did not compute is None: no row)."""
    if isinstance(values, ms.Tensor):
        values = (values,)
    if not isinstance(values, (tuple, list)):
        return
    indexed = len(values) > 1
    for i, value in enumerate(values):
        if isinstance(value, ms.Tensor):
            add(kind, f"{base}.{role}_{i}" if indexed else f"{base}.{role}", micro, phase, value)


class CellHooks:
    """The hooks of the target Cells, installed for collected steps only (:meth:`install`, :meth:`remove`):
    a Cell with a backward hook makes MindSpore's autograd take a slower path even when the hook returns at
    once. They call ``settle()`` after the rows of each call. A failing hook logs and never stops training."""

    def __init__(
        self,
        sites: Sequence[CellSite],
        add: AddRow,
        is_collecting: Callable[[], bool],
        micro_step: Callable[[], int],
        settle: Callable[[], None],
        *,
        forward: bool,
        backward: bool,
    ) -> None:
        self._handles: list[Any] = []
        self._add, self._collecting, self._micro, self._settle = add, is_collecting, micro_step, settle
        self._sites, self._forward, self._backward = tuple(sites), forward, backward

    @property
    def installed(self) -> bool:
        return bool(self._handles)

    def install(self) -> None:
        """Register the hooks (again after :meth:`remove`); nothing when they are in place."""
        if self._handles:
            return
        for site in self._sites:
            if self._forward:
                self._handles.append(site.cell.register_forward_hook(self._forward_hook(site.name)))
            if self._backward:
                self._handles.append(site.cell.register_backward_hook(self._backward_hook(site.name)))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _forward_hook(self, base: str):
        def hook(cell: nn.Cell, inputs: Any, output: Any) -> None:
            if not self._collecting():
                return
            try:
                micro = self._micro()
                _add_all(self._add, Kind.ACTV.value, base, "input", inputs, micro, Phase.FORWARD.value)
                _add_all(self._add, Kind.ACTV.value, base, "output", output, micro, Phase.FORWARD.value)
                self._settle()
            except Exception:
                logger.exception("trainmon: forward hook of %r failed; training continues", base)

        return hook

    def _backward_hook(self, base: str):
        def hook(cell: nn.Cell, grad_input: Any, grad_output: Any) -> None:
            if not self._collecting():
                return
            try:
                micro, phase = self._micro(), Phase.BACKWARD.value
                # gradient at the output first: it exists before the one at the input
                _add_all(self._add, Kind.ACTV_GRAD.value, base, "output_grad", grad_output, micro, phase)
                _add_all(self._add, Kind.ACTV_GRAD.value, base, "input_grad", grad_input, micro, phase)
                self._settle()
            except Exception:
                logger.exception("trainmon: backward hook of %r failed; training continues", base)

        return hook
