"""Partial statistics of MindSpore tensors, computed with MindSpore ops on the tensor's device.

The layout and semantics are those of :mod:`trainmon.records` (``PARTIALS``) and the torch stats kernel:
``numel, nans, infs, zeros (|x| <= eps, NaN is not a zero), min, max, sum, sumsq`` with min/max/sum/sumsq
over the finite elements only (min=+inf, max=-inf, sum=sumsq=0 when there is none). Each tensor gives one
device row; :class:`DeviceRows` stacks a step's rows into one device tensor that is read on the host once.
Values are reduced in float32 (every other dtype is cast to float32 first); the partials row is float64.
"""

from __future__ import annotations

import functools

import mindspore as ms
import numpy as np
from mindspore import ops

from trainmon.records import N_PARTIALS

_F32, _F64 = ms.float32, ms.float64


@functools.lru_cache(maxsize=16)
def _zero_bound(eps: float) -> float:
    """Largest float32 not above ``eps``: ``|x| <= bound`` in float32 is exactly ``|float64(x)| <= eps``,
    as the torch kernel decides it (a float32 rounding of eps may lie above eps)."""
    if not eps >= 0:  # negative or NaN: nothing is a zero
        return -1.0
    bound = np.float32(eps)
    if float(bound) > eps:
        bound = np.nextafter(bound, np.float32(-np.inf))
    return float(bound)


def partials_row(x: ms.Tensor, eps: float = 1e-8) -> ms.Tensor:
    """(8,) float64 device tensor of the partials of ``x``; nothing is read on the host."""
    numel = int(x.size)
    x = ops.stop_gradient(x).reshape(-1)
    if x.dtype != _F32:
        x = x.astype(_F32)
    if numel == 0:
        return ms.Tensor(np.array([0, 0, 0, 0, np.inf, -np.inf, 0, 0], dtype=np.float64))
    nan = ops.isnan(x)
    inf = ops.isinf(x)
    finite = ops.isfinite(x)
    zero = ops.abs(x) <= _zero_bound(float(eps))  # NaN compares False: never a zero
    x0 = ops.where(finite, x, ops.zeros_like(x))
    pos_inf = ops.full_like(x, float("inf"))
    counts = ops.stack([nan.astype(ms.int32).sum(), inf.astype(ms.int32).sum(), zero.astype(ms.int32).sum()])
    values = ops.stack(
        [
            ops.where(finite, x, pos_inf).min(),
            ops.where(finite, x, -pos_inf).max(),
            x0.sum(),
            (x0 * x0).sum(),
        ]
    )
    return ops.concat([ms.Tensor([numel], _F64), counts.astype(_F64), values.astype(_F64)])


class DeviceRows:
    """A step's partials rows on the device; :meth:`to_host` stacks them and reads them in one copy."""

    def __init__(self) -> None:
        self._rows: list[ms.Tensor] = []

    def __len__(self) -> int:
        return len(self._rows)

    def add(self, x: ms.Tensor, eps: float) -> None:
        self._rows.append(partials_row(x, eps))

    def to_host(self) -> np.ndarray:
        """(n, 8) float64 on the host; the only device-to-host read of the step. Clears the rows."""
        rows, self._rows = self._rows, []
        if not rows:
            return np.zeros((0, N_PARTIALS), dtype=np.float64)
        return ops.stack(rows).asnumpy().astype(np.float64, copy=False)
