"""Rows computed at once: the native C kernel for CPU tensors, the torch backend for the rest.

The reducer the step buffer uses on the CPU and on devices without Triton (NPUs). Rows are final when a
call returns (in stream order), so :meth:`DirectReducer.complete` has nothing to do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from trainmon.run.records import MAX, MIN, N_PARTIALS
from trainmon.stats import native, torch_ops

_F64 = torch.float64
_ROW_BYTES = 8 * N_PARTIALS


@dataclass(frozen=True)
class AdamItem:
    """One parameter's Adam state and the rows its update and ratio go to."""

    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    c1: float | torch.Tensor  # bias corrections 1 - beta**t (Python floats, or 0-d tensors)
    c2: float | torch.Tensor
    adam_eps: float
    row_update: int
    row_ratio: int

    def op_args(self, out: torch.Tensor, eps: float) -> tuple:
        """The arguments of ``native.adam_rows`` / ``torch_ops.adam_rows`` for this parameter."""
        m, v = self.exp_avg, self.exp_avg_sq
        return (m, v, self.c1, self.c2, self.adam_eps, out, self.row_update, self.row_ratio, eps)


class DirectReducer:
    deferred = False

    def __init__(self, use_native: bool) -> None:
        self.use_native = use_native and native.available()
        # the last ``out`` found fit for the native kernel, and its address (rows are written by address)
        self._checked_out: torch.Tensor | None = None
        self._out_ptr = 0

    def row(
        self,
        t: torch.Tensor,
        out: torch.Tensor,
        index: int,
        eps: float,
        shareable: bool = False,
        site: object = None,
    ) -> None:
        if self.use_native:
            if out is not self._checked_out and native.fits_out(out):
                self._checked_out, self._out_ptr = out, out.data_ptr()
            if out is self._checked_out and native.row_at(t, self._out_ptr + index * _ROW_BYTES, eps):
                return
        torch_ops.row(t, out, index, eps)

    def rows(
        self,
        tensors: Sequence[torch.Tensor],
        out: torch.Tensor,
        first: int,
        eps: float,
        shareable: bool = False,
    ) -> None:
        rest = native.rows(tensors, out, first, eps) if self.use_native else range(len(tensors))
        for i in rest:
            torch_ops.row(tensors[i], out, first + i, eps)

    def merged_row(self, tensors: Sequence[torch.Tensor], out: torch.Tensor, index: int, eps: float) -> None:
        merge_rows_into(self.rows, tensors, out, index, eps)

    def adam_rows(self, items: Sequence[AdamItem], out: torch.Tensor, eps: float) -> None:
        for item in items:
            args = item.op_args(out, eps)
            if not (self.use_native and native.adam_rows(*args)):
                torch_ops.adam_rows(*args)

    def complete(self, out: torch.Tensor) -> None:
        pass

    def reset(self) -> None:
        pass


RowsFn = Callable[[Sequence[torch.Tensor], torch.Tensor, int, float], None]


def merge_rows_into(
    rows: RowsFn, tensors: Sequence[torch.Tensor], out: torch.Tensor, index: int, eps: float
) -> None:
    """``out[index]`` = the partials of the concatenation of ``tensors``: their rows (by ``rows``, which must
    write them at once) merged on the device, SUM of counts and sums, min of mins, max of maxes."""
    parts = torch.empty((len(tensors), N_PARTIALS), dtype=_F64, device=out.device)
    rows([t if t.device == out.device else t.to(out.device) for t in tensors], parts, 0, eps)
    merged = parts.sum(dim=0)
    merged[MIN] = parts[:, MIN].min()
    merged[MAX] = parts[:, MAX].max()
    out[index].copy_(merged)
