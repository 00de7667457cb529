"""The stats kernel: tensor -> 8 mergeable partial statistics (see :mod:`trainmon.records`).

For a tensor ``x`` (flattened) the partials vector is::

    numel, nans, infs, zeros (|x| <= eps, NaN is not a zero), min, max, sum, sumsq

where min/max/sum/sumsq are over the *finite* elements only; with no finite element min=+inf, max=-inf and
sum=sumsq=0, so that :func:`trainmon.records.merge` combines pieces exactly. The output is always float64.

Two implementations with the same semantics:

* **native** (``trainmon._statskernel``, C): CPU tensors of dtype float32/float64/float16/bfloat16/int64/
  int32/int16/int8/uint8/bool. One fused pass reads every element once (vectorised for SSE2/AVX2/AVX-512,
  chosen at import by the CPU), half types accumulate in fp32 blocks folded into double; calls above
  ``THREAD_MIN_NUMEL`` elements are split across up to ``torch.get_num_threads()`` threads of torch's own
  OpenMP pool (no extra threads compete with torch's), with the GIL released.
  Non-contiguous tensors whose elements are dense in memory (transposes, permutes) are read in place;
  other strided CPU tensors are copied once with ``.contiguous()``.
* **torch**: everything else (CUDA/NPU tensors, other dtypes, or when forced). Device ops only: it never
  reads a value on the host (no ``.item()``), so it does not synchronise an accelerator; the result row is
  written with a device op. Half types are reduced with fp32 accumulation.

``TRAINMON_STATS_BACKEND=torch`` (read at import) or :func:`set_backend` forces the torch path everywhere.

Dtype notes: complex tensors are summarised by their magnitudes ``|z|`` (so ``norm`` is the Frobenius norm);
other floating types (float8, ...) are upcast to float32; integer and bool tensors are exact (int64 sums,
sumsq in float64 for int64/int32). For fp32 inputs the per-element squares are fp32, so elements with
``|x| > ~1.8e19`` give ``sumsq = inf`` (with ``infs == 0``); such magnitudes are anomalies in any case.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from collections.abc import Sequence

import numpy as np
import torch

from trainmon.records import N_PARTIALS

__all__ = [
    "THREAD_MIN_NUMEL",
    "adam_update_ratio_into",
    "get_backend",
    "native_available",
    "native_isa",
    "partials",
    "partials_into",
    "partials_many_into",
    "set_backend",
]

log = logging.getLogger(__name__)

try:  # the extension is optional: without it everything runs on the torch path
    from trainmon import _statskernel as _native
except Exception as exc:  # ImportError, OSError (bad .so), anything a broken build raises
    _native = None
    log.debug("trainmon._statskernel not available (%s); stats use the torch path", exc)

# dtype -> code of the native kernel (mirrors the enum in _statskernel.c)
_NATIVE_CODES: dict[torch.dtype, int] = {
    torch.float32: 0,
    torch.float64: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.int64: 4,
    torch.int32: 5,
    torch.int16: 6,
    torch.int8: 7,
    torch.uint8: 8,
    torch.bool: 9,
}
_ADAM_CODES = {torch.float32: 0, torch.float16: 2, torch.bfloat16: 3}

# Native calls with at least this many elements may be split across up to torch.get_num_threads() threads
# of torch's own OpenMP pool (the kernel gives each thread at least 32K elements).
THREAD_MIN_NUMEL = 1 << 16
_ROW_BYTES = 8 * N_PARTIALS
_F64 = torch.float64
_FLOAT_TYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_INF = math.inf

_BACKENDS = ("auto", "torch")
_backend = "auto"
_codes: dict[torch.dtype, int] = {}  # empty when the native path is off: one dict lookup decides


def set_backend(name: str) -> None:
    """``"auto"``: native kernel for CPU tensors where possible, torch elsewhere; ``"torch"``: the
    portable torch path everywhere (tests use it to prove both agree)."""
    global _backend, _codes
    if name not in _BACKENDS:
        raise ValueError(f"stats backend must be one of {_BACKENDS}, not {name!r}")
    _backend = name
    _codes = _NATIVE_CODES if (name == "auto" and _native is not None) else {}


def get_backend() -> str:
    return _backend


def native_available() -> bool:
    return _native is not None


def native_isa() -> str | None:
    """Instruction set the native kernel selected at import (``avx512``, ``avx2``, ``baseline``)."""
    return None if _native is None else str(_native.ISA)


_env_backend = os.environ.get("TRAINMON_STATS_BACKEND", "auto").strip().lower() or "auto"
if _env_backend not in _BACKENDS:
    log.warning("ignoring TRAINMON_STATS_BACKEND=%r (expected one of %s)", _env_backend, _BACKENDS)
    _env_backend = "auto"
set_backend(_env_backend)


# ---------------------------------------------------------------------------------------------------------
# public API


def partials_into(t: torch.Tensor, out: torch.Tensor, row: int, eps: float = 1e-8) -> None:
    """Write the 8 partials of ``t`` into ``out[row]``.

    ``out``: float64, shape (capacity, 8), on ``t``'s device (on CPU for CPU tensors). Creates no autograd
    graph, keeps no reference to ``t`` and never reads a value of a device tensor on the host.
    """
    code = _codes.get(t.dtype)
    if code is not None:
        if not (t.is_cpu and out.is_cpu):
            code = None
        elif not t.is_contiguous():
            if t.layout != torch.strided:  # sparse: the torch path explains
                code = None
            elif not _dense(t):
                t = t.detach().contiguous()
    if code is not None:
        n = t.numel()
        shape = out.shape
        if out.dtype is not _F64 or len(shape) != 2 or shape[1] != N_PARTIALS or not out.is_contiguous():
            _check_out(out, row)
            raise ValueError("out must be contiguous")
        if not 0 <= row < shape[0]:
            _check_out(out, row)
        addr = out.data_ptr() + row * _ROW_BYTES
        _native.partials(
            t.data_ptr(), n, code, eps, addr, torch.get_num_threads() if n >= THREAD_MIN_NUMEL else 1
        )
        return
    _check_out(out, row)
    if out.device != t.device:
        raise ValueError(f"out is on {out.device} but the tensor on {t.device}")
    _write_row(out, row, _torch_parts(t, float(eps)))


def partials(t: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """The partials of ``t`` as a new (8,) float64 tensor on ``t``'s device."""
    out = torch.empty((1, N_PARTIALS), dtype=_F64, device=t.device)
    partials_into(t, out, 0, eps)
    return out[0]


def partials_many_into(
    tensors: Sequence[torch.Tensor], out: torch.Tensor, first_row: int, eps: float = 1e-8
) -> None:
    """Rows ``first_row .. first_row + len(tensors) - 1`` of ``out`` receive the partials of ``tensors``
    (parameters, gradients, optimizer moments). CPU tensors go through one native call."""
    k = len(tensors)
    if k == 0:
        return
    _check_out(out, first_row)
    _check_out(out, first_row + k - 1)
    if _codes and out.is_cpu and out.is_contiguous():
        items: list[tuple[int, int, int]] = []
        keep: list[torch.Tensor] = []  # contiguous copies alive until the native call returns
        rest: list[int] = []
        total = 0
        for i, t in enumerate(tensors):
            code = _codes.get(t.dtype)
            if code is None or not t.is_cpu or t.layout != torch.strided:
                items.append((0, 0, 0))
                rest.append(i)
                continue
            if not t.is_contiguous() and not _dense(t):
                t = t.detach().contiguous()
                keep.append(t)
            n = t.numel()
            total += n
            items.append((t.data_ptr(), n, code))
        nthreads = torch.get_num_threads() if total >= THREAD_MIN_NUMEL else 1
        _native.partials_many(items, eps, out.data_ptr() + first_row * _ROW_BYTES, nthreads)
        del keep
        for i in rest:
            partials_into(tensors[i], out, first_row + i, eps)
        return
    _torch_many_into(tensors, out, first_row, float(eps))


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
    ``ratio = (m/c1) / sqrt(v/c2)`` into ``out[row_ratio]``, without materialising either on the native
    path (computed in fp32). ``m``/``v``: ``exp_avg``/``exp_avg_sq``; ``c1``/``c2``: bias corrections
    (Python floats, or 0-d tensors on the moments' device)."""
    _check_out(out, row_update)
    _check_out(out, row_ratio)
    code = _ADAM_CODES.get(exp_avg.dtype) if _codes else None
    if (
        code is not None
        and exp_avg_sq.dtype == exp_avg.dtype
        and exp_avg.is_cpu
        and exp_avg_sq.is_cpu
        and out.is_cpu
        and exp_avg.numel() == exp_avg_sq.numel()
        and out.is_contiguous()
    ):
        m = exp_avg if exp_avg.is_contiguous() else exp_avg.detach().contiguous()
        v = exp_avg_sq if exp_avg_sq.is_contiguous() else exp_avg_sq.detach().contiguous()
        n = m.numel()
        base = out.data_ptr()
        _native.adam_update_ratio(
            m.data_ptr(),
            v.data_ptr(),
            n,
            code,
            float(bias_correction1),
            float(bias_correction2),
            float(eps),
            float(stats_eps),
            base + row_update * _ROW_BYTES,
            base + row_ratio * _ROW_BYTES,
            torch.get_num_threads() if 2 * n >= THREAD_MIN_NUMEL else 1,
        )
        return
    update, ratio = _torch_adam(exp_avg, exp_avg_sq, bias_correction1, bias_correction2, eps)
    _write_row(out, row_update, _torch_parts(update, float(stats_eps)))
    _write_row(out, row_ratio, _torch_parts(ratio, float(stats_eps)))


# ---------------------------------------------------------------------------------------------------------
# helpers


def _dense(t: torch.Tensor) -> bool:
    """True when the elements of ``t`` occupy exactly ``numel`` consecutive slots starting at
    ``data_ptr()`` (a permutation of a contiguous layout: transposes, permutes). The statistics do not
    depend on the order, so the native kernel can read such a tensor in place."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride(), strict=True) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _check_out(out: torch.Tensor, row: int) -> None:
    if out.dtype != _F64 or out.dim() != 2 or out.shape[1] != N_PARTIALS:
        raise ValueError(
            f"out must be a float64 tensor of shape (capacity, {N_PARTIALS}), got {out.dtype} "
            f"{tuple(out.shape)}"
        )
    if not 0 <= row < out.shape[0]:
        raise IndexError(f"row {row} out of range for out with {out.shape[0]} rows")


def _write_row(out: torch.Tensor, row: int, parts: _Parts) -> None:
    """Write torch-path partials into ``out[row]`` with device ops (no host round trip)."""
    n, counts, values = parts
    r = out[row]
    r[0] = float(n)
    r[1:4].copy_(counts)
    r[4:8].copy_(values)


# ---------------------------------------------------------------------------------------------------------
# torch path

# (numel, [nans, infs, zeros] as int64, [min, max, sum, sumsq] as fp32/fp64) on the tensor's device
_Parts = tuple[int, torch.Tensor, torch.Tensor]


def _as_real(x: torch.Tensor) -> torch.Tensor:
    """Flattened, detached tensor of a dtype the torch path reduces: floating or int64/.../uint8."""
    if x.layout != torch.strided:
        raise TypeError(f"stats of {x.layout} tensors are not supported (pass t.to_dense() or t.values())")
    if x.is_quantized:
        x = x.dequantize()
    x = x.detach().reshape(-1)
    if x.is_complex():
        return x.abs()
    if x.is_floating_point():
        if x.dtype in _FLOAT_TYPES:
            return x
        return x.float()  # float8 and friends
    if x.dtype == torch.bool:
        return x.view(torch.uint8)
    if x.dtype in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        return x
    return x.to(torch.int64)  # uint16/32/64 ...


def _torch_parts(t: torch.Tensor, eps: float) -> _Parts:
    """Partials of ``t`` computed with device ops only (no value is read on the host)."""
    x = _as_real(t)
    n = x.numel()
    dev = x.device
    if n == 0:
        values = torch.zeros(4, dtype=_F64, device=dev)
        values[0], values[1] = _INF, -_INF  # fills on the device, no host->device copy
        return 0, torch.zeros(3, dtype=torch.int64, device=dev), values
    if not x.is_floating_point():
        return _torch_parts_int(x, eps)
    acc = _F64 if x.dtype == _F64 else torch.float32
    counts = torch.stack(
        [torch.count_nonzero(torch.isnan(x)), torch.count_nonzero(torch.isinf(x)), _zeros(x, eps)]
    )
    # min over finite: NaN and -inf -> +inf (+inf stays); max symmetric. No finite element: +-inf.
    mn = torch.nan_to_num(x, nan=_INF, posinf=_INF, neginf=_INF).amin().to(acc)
    mx = torch.nan_to_num(x, nan=-_INF, posinf=-_INF, neginf=-_INF).amax().to(acc)
    s, q = _sum_sumsq(x, acc)
    return n, counts, torch.stack([mn, mx, s, q])


def _zeros(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Count of ``|x| <= eps`` (exactly as in float64), with the comparison in ``x``'s own dtype.
    Masks are counted with ``count_nonzero``: ``bool.sum()`` is ~15x slower on CPU."""
    lo, hi = _zero_bounds(x.dtype, eps)
    if lo > hi:
        return torch.zeros((), dtype=torch.int64, device=x.device)
    if x.is_floating_point():
        return torch.count_nonzero(x.abs() <= hi)  # NaN compares false
    return torch.count_nonzero((x >= lo) & (x <= hi))  # no abs(): abs(int8 -128) overflows


@functools.lru_cache(maxsize=256)
def _zero_bounds(dtype: torch.dtype, eps: float) -> tuple[float | int, float | int]:
    """``(lo, hi)`` in ``dtype`` such that ``lo <= x <= hi``  <=>  ``|float64(x)| <= eps`` (floating: hi is
    the largest value of dtype not above eps, as the native kernel does; integers: +-floor(eps), clamped)."""
    if not eps >= 0:  # negative or NaN: nothing is a zero
        return 1, 0
    if dtype.is_floating_point:
        hi = _largest_not_above(dtype, eps)
        return -hi, hi
    info = torch.iinfo(dtype)
    k = math.floor(eps) if eps < 2.0**63 else info.max
    return max(-k, info.min), min(k, info.max)


def _largest_not_above(dtype: torch.dtype, eps: float) -> float:
    """Largest value representable in ``dtype`` that is <= ``eps`` (>= 0); host arithmetic only."""
    if dtype == _F64:
        return eps
    npt = np.float16 if dtype == torch.float16 else np.float32
    with np.errstate(over="ignore"):
        e = npt(eps)  # rounds to nearest (inf above the range)
    if float(e) > eps:
        e = np.nextafter(e, npt(-np.inf))
    if dtype == torch.bfloat16:  # truncating a non-negative float32 gives the largest bf16 below it
        bits = np.array([e], dtype=np.float32).view(np.uint32) & np.uint32(0xFFFF0000)
        return float(bits.view(np.float32)[0])
    return float(e)


def _sum_sumsq(x: torch.Tensor, acc: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum and sum of squares of the finite elements, accumulated in ``acc``. Uses ``sum`` rather than
    ``vector_norm``/``dot``, whose fp32 CPU kernels lose ~1e-4 relative accuracy on 4M elements."""
    xz = torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)  # a new tensor: safe to square in place
    if xz.dtype != acc:
        xz = xz.to(acc)  # half types: squares must not overflow fp16
    return xz.sum(), xz.square_().sum()


def _torch_parts_int(x: torch.Tensor, eps: float) -> _Parts:
    """Integer (and bool as uint8) tensors: exact counts, int64 sums."""
    mn, mx = torch.aminmax(x)
    zeros = _zeros(x, eps)
    counts = torch.stack([torch.zeros_like(zeros), torch.zeros_like(zeros), zeros])
    s = x.sum(dtype=torch.int64)
    if x.dtype in (torch.int64, torch.int32):  # squares (or their sum) may not fit int64
        xd = x.to(_F64)
        q = torch.dot(xd, xd)
    else:
        xl = x.to(torch.int64)
        q = (xl * xl).sum().to(_F64)
    return x.numel(), counts, torch.stack([mn.to(_F64), mx.to(_F64), s.to(_F64), q])


def _torch_many_into(tensors: Sequence[torch.Tensor], out: torch.Tensor, first_row: int, eps: float) -> None:
    """Torch path for a list. Floating tensors of one (device, dtype) group share multi-tensor
    (``torch._foreach_max``) launches for max and min; all rows are written with three copies."""
    k = len(tensors)
    parts: list[_Parts | None] = [None] * k
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    xs = [_as_real(t) for t in tensors]
    for i, x in enumerate(xs):
        if x.is_floating_point() and x.numel() > 0 and x.device == out.device:
            groups.setdefault((x.device, x.dtype), []).append(i)
        else:
            parts[i] = _torch_parts(x, eps)
    for (_, dtype), idx in groups.items():
        acc = _F64 if dtype == _F64 else torch.float32
        group = [xs[i] for i in idx]
        hi = [torch.nan_to_num(x, nan=-_INF, posinf=-_INF, neginf=-_INF) for x in group]
        lo = [torch.nan_to_num(x.neg(), nan=-_INF, posinf=-_INF, neginf=-_INF) for x in group]  # -x
        if _HAS_FOREACH_MAX:  # one multi-tensor launch each instead of len(group)
            mxs, negmns = torch._foreach_max(hi), torch._foreach_max(lo)
        else:
            mxs, negmns = [x.amax() for x in hi], [x.amax() for x in lo]
        del hi, lo
        for j, i in enumerate(idx):
            x = group[j]
            counts = torch.stack(
                [torch.count_nonzero(torch.isnan(x)), torch.count_nonzero(torch.isinf(x)), _zeros(x, eps)]
            )
            s, q = _sum_sumsq(x, acc)
            parts[i] = (x.numel(), counts, torch.stack([negmns[j].neg().to(acc), mxs[j].to(acc), s, q]))
    done: list[_Parts] = [p for p in parts if p is not None]
    block = out[first_row : first_row + k]
    block[:, 0].copy_(torch.tensor([float(p[0]) for p in done], dtype=_F64).to(out.device, non_blocking=True))
    block[:, 1:4].copy_(torch.stack([p[1].to(out.device) for p in done]))
    block[:, 4:8].copy_(torch.stack([p[2].to(out.device, _F64) for p in done]))


_HAS_FOREACH_MAX = hasattr(torch, "_foreach_max")


def _torch_adam(
    m: torch.Tensor, v: torch.Tensor, c1: float | torch.Tensor, c2: float | torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """update and ratio in fp32 (float64 for float64 moments), device ops only."""
    dt = _F64 if m.dtype == _F64 else torch.float32
    mh = m.detach().reshape(-1).to(dt) / c1
    den = (v.detach().reshape(-1).to(dt) / c2).sqrt()
    # m = v = 0 (a gradient that was always exactly zero) gives ratio 0, as the native kernel does
    return mh / (den + eps), mh / (den + (mh == 0).to(dt))
