"""The portable backend: torch ops on the tensor's own device (NPUs through torch_npu, dtypes no kernel
takes, and everything when forced with ``TRAINMON_STATS_BACKEND=torch``).

Sync-free: no value of a device tensor is read on the host and no host data is copied to the device. The
row is written by device ops; the element count, known on the host, reaches the device as the argument
of a fill. Half types are reduced with fp32 accumulation (float64 stays float64); integer and bool tensors
are exact (int64 sums, sumsq in float64 for int64/int32).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from trainmon.stats.thresholds import zero_bounds

_F64 = torch.float64
_F32 = torch.float32
_INF = float("inf")
FLOAT_TYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_SMALL_INTS = (torch.int16, torch.int8, torch.uint8)


def as_real(x: torch.Tensor) -> torch.Tensor:
    """Flattened, detached tensor of a dtype this backend reduces: floating or int64/.../uint8.

    Complex tensors are summarised by their magnitudes ``|z|`` (so ``norm`` is the Frobenius norm); other
    floating types (float8, ...) are upcast to float32."""
    if x.layout != torch.strided:
        raise TypeError(f"stats of {x.layout} tensors are not supported (pass t.to_dense() or t.values())")
    if x.is_quantized:
        x = x.dequantize()
    x = x.detach().reshape(-1)
    if x.is_complex():
        return x.abs()
    if x.is_floating_point():
        return x if x.dtype in FLOAT_TYPES else x.float()
    if x.dtype == torch.bool:
        return x.view(torch.uint8)
    if x.dtype in (torch.int64, torch.int32, *_SMALL_INTS):
        return x
    return x.to(torch.int64)  # uint16/32/64 ...


def row(t: torch.Tensor, out: torch.Tensor, index: int, eps: float) -> None:
    """Write the partials of ``t`` into ``out[index]`` with device ops."""
    if out.device != t.device:
        raise ValueError(f"out is on {out.device} but the tensor on {t.device}")
    x = as_real(t)
    r = out[index]
    n = x.numel()
    if n == 0:
        r.zero_()
        r[4].fill_(_INF)
        r[5].fill_(-_INF)
        return
    counts, values = (_float_parts if x.is_floating_point() else _int_parts)(x, eps)
    r[0].fill_(n)  # a kernel argument: no host-to-device copy
    r[1:4].copy_(counts)
    r[4:8].copy_(values)


def rows(tensors: Sequence[torch.Tensor], out: torch.Tensor, first: int, eps: float) -> None:
    for i, t in enumerate(tensors):
        row(t, out, first + i, eps)


def vector(t: torch.Tensor, eps: float) -> torch.Tensor:
    """The partials of ``t`` as a new (8,) float64 tensor on ``t``'s device."""
    out = torch.empty((1, 8), dtype=_F64, device=t.device)
    row(t, out, 0, eps)
    return out[0]


def _float_parts(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """([nans, infs, zeros] int64, [min, max, sum, sumsq]) of a non-empty floating tensor. nan_to_num and
    the is* tests are vectorised on every device (``where`` with a Python number is ~10x slower on the
    CPU); masks are counted with ``count_nonzero``, ~15x faster than ``bool.sum()`` on the CPU."""
    acc = _F64 if x.dtype == _F64 else _F32
    lo, hi = zero_bounds(x.dtype, eps)
    if lo <= hi:
        zeros = torch.count_nonzero(x.abs() <= hi)  # NaN compares false
    else:
        zeros = torch.zeros((), dtype=torch.int64, device=x.device)
    counts = torch.stack([torch.count_nonzero(torch.isnan(x)), torch.count_nonzero(torch.isinf(x)), zeros])
    # min over finite: NaN and -inf -> +inf (+inf stays); max symmetric. No finite element: +-inf.
    mn = torch.nan_to_num(x, nan=_INF, posinf=_INF, neginf=_INF).amin()
    mx = torch.nan_to_num(x, nan=-_INF, posinf=-_INF, neginf=-_INF).amax()
    xf = torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)  # a new tensor: safe to square in place
    if xf.dtype != acc:
        xf = xf.to(acc)  # half types: squares must not overflow fp16
    # sum, not vector_norm/dot, whose fp32 CPU kernels lose ~1e-4 relative accuracy on 4M elements
    s = xf.sum()
    q = xf.square_().sum()
    return counts, torch.stack([mn.to(acc), mx.to(acc), s, q])


def _int_parts(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Integer (and bool as uint8) tensors: exact counts, int64 sums."""
    mn, mx = torch.aminmax(x)
    lo, hi = zero_bounds(x.dtype, eps)
    if lo > hi:
        zeros = torch.zeros((), dtype=torch.int64, device=x.device)
    else:
        zeros = torch.count_nonzero((x >= lo) & (x <= hi))  # no abs(): abs(int8 -128) overflows
    nothing = torch.zeros((), dtype=torch.int64, device=x.device)
    s = x.sum(dtype=torch.int64)
    if x.dtype in (torch.int64, torch.int32):  # squares (or their sum) may not fit int64
        xd = x.to(_F64)
        q = torch.dot(xd, xd)
    else:
        xl = x.to(torch.int64)
        q = (xl * xl).sum().to(_F64)
    return torch.stack([nothing, nothing, zeros]), torch.stack([mn.to(_F64), mx.to(_F64), s.to(_F64), q])


def adam_tensors(
    m: torch.Tensor, v: torch.Tensor, c1: float | torch.Tensor, c2: float | torch.Tensor, adam_eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Adam's update ``(m/c1) / (sqrt(v/c2) + eps)`` and ratio ``(m/c1) / sqrt(v/c2)`` in fp32 (float64 for
    float64 moments), device ops only. ``m = v = 0`` (a gradient that was always exactly zero) gives ratio
    0, as the native kernel does."""
    dt = _F64 if m.dtype == _F64 else _F32
    mh = m.detach().reshape(-1).to(dt) / c1
    den = (v.detach().reshape(-1).to(dt) / c2).sqrt()
    return mh / (den + adam_eps), mh / (den + (mh == 0).to(dt))


def adam_rows(
    m: torch.Tensor,
    v: torch.Tensor,
    c1: float | torch.Tensor,
    c2: float | torch.Tensor,
    adam_eps: float,
    out: torch.Tensor,
    row_update: int,
    row_ratio: int,
    eps: float,
) -> None:
    update, ratio = adam_tensors(m, v, c1, c2, adam_eps)
    row(update, out, row_update, eps)
    row(ratio, out, row_ratio, eps)
