"""The stats kernel: tensor -> 8 mergeable partial statistics (see :mod:`trainmon.run.records`).

For a tensor ``x`` (flattened) the partials vector is::

    numel, nans, infs, zeros (|x| <= eps, NaN is not a zero), min, max, sum, sumsq

where min/max/sum/sumsq are over the *finite* elements only; with no finite element min=+inf, max=-inf and
sum=sumsq=0, so that :func:`trainmon.run.records.merge` combines pieces exactly. The output is always float64.

One kernel per kind of device, with the same semantics, chosen once per device (and, inside it, per dtype):

* **native** (:mod:`~trainmon.stats.native`): the C kernel, for CPU tensors.
* **triton** (:mod:`~trainmon.stats.triton_path`): fused Triton kernels on CUDA/ROCm. One read of each
  tensor; parameter-side tensors of one dtype share one launch (a tensor table); the step's rows are
  finished by one launch at the step end. Float32/float16/bfloat16; other dtypes take the torch backend.
  Needs Triton 3.2 or newer (installed with CUDA builds of torch, or ``pip install trainmon[gpu]``); never on
  the CPU except under Triton's interpreter (``TRITON_INTERPRET=1``, how CI tests the kernels). Where Triton
  is missing or too old, or a kernel fails at its launch (a compile error in the first collected step), the
  torch backend takes over with one warning naming the reason (:mod:`~trainmon.stats.triton_path`).
* **torch** (:mod:`~trainmon.stats.torch_ops`): torch ops on the tensor's device (NPUs, other dtypes).

None of them synchronises an accelerator: no value is read on the host, no Python number is copied into a
device tensor. ``TRAINMON_STATS_BACKEND`` (``auto``, ``native``, ``triton``, ``torch``; read at import) or
:func:`set_backend` forces one where it can run; ``auto`` is native on the CPU, Triton on CUDA, torch
elsewhere.

Dtype notes: complex tensors are summarised by their magnitudes ``|z|`` (so ``norm`` is the Frobenius norm);
other floating types (float8, ...) are upcast to float32; integer and bool tensors are exact (int64 sums,
sumsq in float64 for int64/int32). For fp32 inputs the per-element squares are fp32, so elements with
``|x| > ~1.8e19`` give ``sumsq = inf`` (with ``infs == 0``); such magnitudes are anomalies in any case.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Protocol

import torch

from trainmon.run.records import N_PARTIALS
from trainmon.stats import native, torch_ops, triton_path
from trainmon.stats.direct import AdamItem, DirectReducer
from trainmon.stats.native import THREAD_MIN_NUMEL

__all__ = [
    "THREAD_MIN_NUMEL",
    "AdamItem",
    "Reducer",
    "adam_update_ratio_into",
    "backend_of",
    "get_backend",
    "native_available",
    "native_isa",
    "partials",
    "partials_into",
    "partials_many_into",
    "reducer_for",
    "set_backend",
    "triton_available",
]

log = logging.getLogger(__name__)

_F64 = torch.float64
_FLOAT_TYPES = torch_ops.FLOAT_TYPES
BACKENDS = ("auto", "native", "triton", "torch")
_backend = "auto"


class Reducer(Protocol):
    """What the step buffer asks of a backend on one device. Rows written by a *deferred* reducer are final
    only after :meth:`complete` (which gets the buffer as it is then: it may have grown meanwhile)."""

    deferred: bool

    def row(
        self,
        t: torch.Tensor,
        out: torch.Tensor,
        index: int,
        eps: float,
        shareable: bool = False,
        site: object = None,
    ) -> None:
        """``shareable``: nothing rewrites ``t`` without bumping its version counter, so a reducer may
        read it later in the step (in a batch with others) and reuse the result for the same unchanged
        tensor. ``site``: what identifies the hook from step to step (the row's description)."""

    def rows(
        self,
        tensors: Sequence[torch.Tensor],
        out: torch.Tensor,
        first: int,
        eps: float,
        shareable: bool = False,
    ) -> None: ...

    def merged_row(
        self, tensors: Sequence[torch.Tensor], out: torch.Tensor, index: int, eps: float
    ) -> None: ...

    def adam_rows(self, items: Sequence[AdamItem], out: torch.Tensor, eps: float) -> None: ...

    def complete(self, out: torch.Tensor) -> None: ...

    def reset(self) -> None: ...


def set_backend(name: str) -> None:
    """Force a backend for reducers made from now on: ``auto``, ``native`` (C kernel on the CPU, torch
    elsewhere), ``triton`` (Triton wherever it runs, the CPU included under its interpreter; torch
    elsewhere) or ``torch`` (the portable backend everywhere; tests use it to prove all agree)."""
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"stats backend must be one of {BACKENDS}, not {name!r}")
    _backend = name


def get_backend() -> str:
    return _backend


def native_available() -> bool:
    return native.available()


def native_isa() -> str | None:
    """Instruction set the native kernel selected at import (``avx512``, ``avx2``, ``baseline``)."""
    return native.isa()


def triton_available() -> bool:
    return triton_path.kernels() is not None


_env_backend = os.environ.get("TRAINMON_STATS_BACKEND", "auto").strip().lower() or "auto"
if _env_backend not in BACKENDS:
    log.warning("ignoring TRAINMON_STATS_BACKEND=%r (expected one of %s)", _env_backend, BACKENDS)
    _env_backend = "auto"
set_backend(_env_backend)


def backend_of(device: torch.device, dtype: torch.dtype) -> str:
    """The backend that reduces a ``dtype`` tensor on ``device`` under the current setting."""
    reducer = reducer_for(device)
    if isinstance(reducer, triton_path.TritonReducer):
        return "triton" if dtype in triton_path.KERNEL_DTYPES else "torch"
    if reducer.use_native and device.type == "cpu" and dtype in native.CODES:
        return "native"
    return "torch"


def reducer_for(device: torch.device | str) -> Reducer:
    """A new reducer for one device (the step buffer keeps one per device)."""
    device = torch.device(device)
    wants_triton = _backend == "triton" or (_backend == "auto" and device.type == "cuda")
    if wants_triton and _backend != "torch" and triton_path.supports(device):
        return triton_path.TritonReducer(device)
    if _backend == "triton" and device.type != "cpu":
        log.warning("trainmon: TRAINMON_STATS_BACKEND=triton, but Triton cannot run on %s", device)
    return DirectReducer(use_native=_backend in ("auto", "native", "triton"))


# ---------------------------------------------------------------------------------------------------------
# standalone calls: each completes its rows before returning (in stream order)


def partials_into(t: torch.Tensor, out: torch.Tensor, row: int, eps: float = 1e-8) -> None:
    """Write the 8 partials of ``t`` into ``out[row]``.

    ``out``: float64, shape (capacity, 8), on ``t``'s device. Creates no autograd graph, keeps no reference
    to ``t`` and never synchronises the device.
    """
    _check_out(out, row)
    if out.device != t.device:
        raise ValueError(f"out is on {out.device} but the tensor on {t.device}")
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")
    reducer = _reducer(t.device)
    reducer.row(t, out, row, eps)
    reducer.complete(out)


def partials(t: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """The partials of ``t`` as a new (8,) float64 tensor on ``t``'s device."""
    out = torch.empty((1, N_PARTIALS), dtype=_F64, device=t.device)
    partials_into(t, out, 0, eps)
    return out[0]


def partials_many_into(
    tensors: Sequence[torch.Tensor], out: torch.Tensor, first_row: int, eps: float = 1e-8
) -> None:
    """Rows ``first_row .. first_row + len(tensors) - 1`` of ``out`` receive the partials of ``tensors``
    (parameters, gradients, optimizer moments): one native call on the CPU, one launch per dtype with
    Triton."""
    k = len(tensors)
    if k == 0:
        return
    _check_out(out, first_row)
    _check_out(out, first_row + k - 1)
    reducer = _reducer(out.device)
    reducer.rows(tensors, out, first_row, eps)
    reducer.complete(out)


def adam_update_ratio_into(
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    bias_correction1: float | torch.Tensor,
    bias_correction2: float | torch.Tensor,
    eps: float,
    out: torch.Tensor,
    row_update: int,
    row_ratio: int,
    stats_eps: float = 1e-8,
) -> None:
    """Partials of Adam's ``update = (m/c1) / (sqrt(v/c2) + eps)`` into ``out[row_update]`` and of
    ``ratio = (m/c1) / sqrt(v/c2)`` into ``out[row_ratio]``, without materialising either on the native and
    Triton backends (computed in fp32). ``m``/``v``: ``exp_avg``/``exp_avg_sq``; ``c1``/``c2``: bias
    corrections (Python floats, or 0-d tensors on the moments' device)."""
    _check_out(out, row_update)
    _check_out(out, row_ratio)
    reducer = _reducer(out.device)
    item = AdamItem(exp_avg, exp_avg_sq, bias_correction1, bias_correction2, eps, row_update, row_ratio)
    reducer.adam_rows([item], out, stats_eps)
    reducer.complete(out)


_direct: dict[tuple[str, str], DirectReducer] = {}


def _reducer(device: torch.device) -> Reducer:
    """A reducer for one standalone call: the stateless direct ones are shared."""
    key = (_backend, device.type)
    reducer = _direct.get(key)
    if reducer is None:
        reducer = reducer_for(device)
        if isinstance(reducer, DirectReducer):
            _direct[key] = reducer
    return reducer


def _check_out(out: torch.Tensor, row: int) -> None:
    if out.dtype != _F64 or out.dim() != 2 or out.shape[1] != N_PARTIALS:
        raise ValueError(
            f"out must be a float64 tensor of shape (capacity, {N_PARTIALS}), got {out.dtype} "
            f"{tuple(out.shape)}"
        )
    if not 0 <= row < out.shape[0]:
        raise IndexError(f"row {row} out of range for out with {out.shape[0]} rows")
