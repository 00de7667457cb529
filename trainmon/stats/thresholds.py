"""The zero threshold of each dtype, computed on the host once: every backend counts ``|x| <= eps`` exactly
as a float64 comparison would, while comparing in the tensor's own precision."""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

_F64 = torch.float64


@functools.lru_cache(maxsize=256)
def zero_bounds(dtype: torch.dtype, eps: float) -> tuple[float | int, float | int]:
    """``(lo, hi)`` in ``dtype`` such that ``lo <= x <= hi``  <=>  ``|float64(x)| <= eps`` (floating: hi is
    the largest value of dtype not above eps; integers: +-floor(eps), clamped). ``lo > hi`` when nothing is
    a zero (a negative or NaN eps)."""
    if not eps >= 0:
        return 1, 0
    if dtype.is_floating_point:
        hi = largest_not_above(dtype, eps)
        return -hi, hi
    info = torch.iinfo(dtype)
    k = math.floor(eps) if eps < 2.0**63 else info.max
    return max(-k, info.min), min(k, info.max)


def zero_threshold_f32(dtype: torch.dtype, eps: float) -> float:
    """The float32 value ``hi`` with ``|x| <= hi``  <=>  ``|float64(x)| <= eps`` for ``x`` of ``dtype``
    (float32, float16, bfloat16) once upcast to float32; -1.0 when nothing is a zero. Exact as a float32
    kernel argument, since it is a value of ``dtype``."""
    lo, hi = zero_bounds(dtype, eps)
    return -1.0 if lo > hi else float(hi)


def largest_not_above(dtype: torch.dtype, eps: float) -> float:
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
