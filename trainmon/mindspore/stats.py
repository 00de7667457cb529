"""Partial statistics of MindSpore tensors, computed with MindSpore ops on the tensor's device.

The layout and semantics are those of :mod:`trainmon.run.records` (``PARTIALS``) and the torch stats kernel:
``numel, nans, infs, zeros (|x| <= eps, NaN is not a zero), min, max, sum, sumsq`` with min/max/sum/sumsq
over the finite elements only (min=+inf, max=-inf, sum=sumsq=0 when there is none). Values are reduced in
float32 (every other dtype is cast to float32 first); counts in int32; the row is float64.

The reduction of one tensor is a small graph compiled by ``mindspore.jit`` once per (shape, dtype, eps): in
PyNative mode each eager op is dispatched on its own (about 1 ms apiece on a CPU), where the compiled graph
is one launch (about 0.1 ms). ``numel`` is known on the host and never goes to the device.
:class:`DeviceRows` keeps a step's device rows and reads them on the host once.
"""

from __future__ import annotations

import contextlib
import functools
import logging

import mindspore as ms
import numpy as np
from mindspore import ops

from trainmon.run.records import N_PARTIALS

logger = logging.getLogger("trainmon")

_F32, _F64 = ms.float32, ms.float64
_EMPTY = np.array([0, 0, 0, np.inf, -np.inf, 0, 0], dtype=np.float64)  # the 7 device partials of no element


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


def _device_partials(x: ms.Tensor, bound: float) -> ms.Tensor:
    """(7,) float64: nans, infs, zeros, min, max, sum, sumsq of a non-empty tensor."""
    x = ops.stop_gradient(x).reshape(-1).astype(_F32)
    total = x.sum()
    zeros = ops.sum(ops.abs(x) <= bound, dtype=ms.int32)  # NaN compares False: never a zero
    if ops.isfinite(total):
        # a NaN or an Inf makes the sum NaN or Inf: here every element is finite, and four passes do
        nans = ops.zeros((), ms.int32)
        infs = ops.zeros((), ms.int32)
        low, high, sumsq = x.min(), x.max(), (x * x).sum()
    else:
        finite = ops.isfinite(x)
        x0 = ops.where(finite, x, ops.zeros_like(x))
        pos_inf = ops.full_like(x, float("inf"))
        nans = ops.sum(ops.isnan(x), dtype=ms.int32)
        infs = ops.sum(ops.isinf(x), dtype=ms.int32)
        low = ops.where(finite, x, pos_inf).min()
        high = ops.where(finite, x, -pos_inf).max()
        total, sumsq = x0.sum(), (x0 * x0).sum()
    counts = ops.stack([nans, infs, zeros]).astype(_F64)
    return ops.concat([counts, ops.stack([low, high, total, sumsq]).astype(_F64)])


def _device_partials_many(bound: float, *xs: ms.Tensor) -> ms.Tensor:
    """(len(xs), 7) float64: :func:`_device_partials` of each tensor, in one graph. (Tensors passed as
    separate arguments: inside a tuple argument MindSpore would compile their values in as constants.)"""
    return ops.stack([_device_partials(x, bound) for x in xs])


_compiled_many = ms.jit(_device_partials_many)
# Outside gradient recording: a compiled call inside a value_and_grad forward (an activation hook) would be
# taped for autodiff, which costs more than the reduction. Private in MindSpore 2.x, hence the fallback.
_no_grad = getattr(ms, "_no_grad", contextlib.nullcontext)
# Tensors reduced by one compiled call at most: a graph per hook call, small enough to compile in a second.
_BATCH = 32


class _Kernel:
    """The compiled reduction, or the same ops run eagerly once compiling failed (logged once)."""

    def __init__(self) -> None:
        self.compiled = True

    def __call__(self, xs: tuple[ms.Tensor, ...], bound: float) -> ms.Tensor:
        with _no_grad():
            if self.compiled:
                try:
                    return _compiled_many(bound, *xs)
                except Exception:
                    self.compiled = False
                    logger.warning(
                        "trainmon: the compiled MindSpore stats kernel failed (shapes %s); statistics use "
                        "eager ops from now on (slower)",
                        [tuple(x.shape) for x in xs],
                        exc_info=True,
                    )
            return _device_partials_many(bound, *xs)


_kernel = _Kernel()


def _plain(x: ms.Tensor) -> ms.Tensor:
    # a compiled graph takes a Parameter by identity: one compile per parameter instead of per shape
    return ms.Tensor(x) if isinstance(x, ms.Parameter) else x


def device_partials_blocks(xs: list[ms.Tensor], eps: float = 1e-8) -> list[ms.Tensor]:
    """The partials of ``xs`` after ``numel``, as (k, 7) float64 device blocks whose rows follow ``xs``;
    compiled calls of at most 32 tensors; nothing is read on the host."""
    bound = _zero_bound(float(eps))
    blocks: list[ms.Tensor] = []
    run: list[ms.Tensor] = []
    for x in xs:
        if int(x.size) == 0:
            if run:
                blocks.append(_kernel(tuple(run), bound))
                run = []
            blocks.append(ms.Tensor(_EMPTY[None, :]))
            continue
        run.append(_plain(x))
        if len(run) == _BATCH:
            blocks.append(_kernel(tuple(run), bound))
            run = []
    if run:
        blocks.append(_kernel(tuple(run), bound))
    return blocks


def partials_row(x: ms.Tensor, eps: float = 1e-8) -> ms.Tensor:
    """(8,) float64 device tensor of the partials of ``x`` (``numel`` first); nothing is read on the host."""
    (block,) = device_partials_blocks([x], eps)
    return ops.concat([ms.Tensor([float(x.size)], _F64), block[0]])


class DeviceRows:
    """A step's partials rows on the device; :meth:`to_host` reads them on the host in one copy.

    Added tensors wait (held by reference) until :meth:`reduce`, which reduces the waiting ones with one
    compiled call per 32 tensors. :meth:`settle` reduces them once more than ``hold_bytes`` wait: 0 reduces
    every hook call's tensors together at once; on a CPU, where each compiled call waits for the ops queued
    before it, holding a step's tensors and reducing them together makes the stats nearly free. Reduce
    before anything held can change in place (parameters before the optimizer updates them).

    A tensor added again while it waits (nested Cells pass the same output object up: ``layers.0.output``
    is ``layers.0.1.output``) is reduced once and its row repeated."""

    def __init__(self, eps: float, hold_bytes: int = 0) -> None:
        self._eps = eps
        self._hold_bytes = hold_bytes
        self._waiting: list[ms.Tensor] = []
        self._waiting_at: dict[int, int] = {}  # id of a waiting tensor -> its index among the reduced ones
        self._waiting_bytes = 0
        self._blocks: list[ms.Tensor] = []
        self._reduced = 0  # rows in _blocks
        self._sources: list[int] = []  # per added tensor: its row in the concatenated blocks
        self._numels: list[int] = []

    def __len__(self) -> int:
        return len(self._numels)

    def add(self, x: ms.Tensor) -> None:
        self._numels.append(int(x.size))
        at = self._waiting_at.get(id(x))
        if at is None:
            at = self._waiting_at[id(x)] = self._reduced + len(self._waiting)
            self._waiting.append(x)
            self._waiting_bytes += int(x.size) * int(x.itemsize)
        self._sources.append(at)

    def settle(self) -> None:
        if self._waiting and self._waiting_bytes >= self._hold_bytes:
            self.reduce()

    def reduce(self) -> None:
        if self._waiting:
            self._blocks.extend(device_partials_blocks(self._waiting, self._eps))
            self._reduced += len(self._waiting)
            self._waiting, self._waiting_at, self._waiting_bytes = [], {}, 0

    def clear(self) -> None:
        self._waiting, self._waiting_at, self._waiting_bytes = [], {}, 0
        self._blocks, self._reduced, self._sources, self._numels = [], 0, [], []

    def to_host(self) -> np.ndarray:
        """(n, 8) float64 on the host; the only device-to-host read of the step. Clears the rows."""
        try:
            self.reduce()
            blocks, sources, numels = self._blocks, self._sources, self._numels
        finally:
            self.clear()
        out = np.zeros((len(numels), N_PARTIALS), dtype=np.float64)
        if blocks:
            unique = (blocks[0] if len(blocks) == 1 else ops.concat(blocks)).asnumpy()
            out[:, 0] = numels
            out[:, 1:] = unique[np.asarray(sources, dtype=np.int64)]
        return out
