"""The CPU backend: the native C kernel (``trainmon.stats._statskernel``).

CPU tensors of dtype float32/float64/float16/bfloat16/int64/int32/int16/int8/uint8/bool. One fused pass
reads every element once (vectorised for SSE2/AVX2/AVX-512, chosen at import by the CPU); half types
accumulate in fp32 blocks folded into double; calls above ``THREAD_MIN_NUMEL`` elements are split across up
to ``torch.get_num_threads()`` threads of torch's own OpenMP pool (no extra threads compete with torch's),
with the GIL released. Non-contiguous tensors whose elements are dense in memory (transposes, permutes)
are read in place; other strided CPU tensors are copied once with ``.contiguous()``.

Each function returns False (or the indices it left) where the kernel does not apply, so that the caller
can hand those tensors to the torch backend.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from trainmon.run.records import N_PARTIALS

log = logging.getLogger(__name__)

try:  # the extension is optional: without it everything runs on the torch backend
    from trainmon.stats import _statskernel as _kernel
except Exception as exc:  # ImportError, OSError (bad .so), anything a broken build raises
    _kernel = None
    log.debug("trainmon.stats._statskernel not available (%s); CPU stats use the torch backend", exc)

# dtype -> code of the native kernel (mirrors the enum in _statskernel.c)
CODES: dict[torch.dtype, int] = {
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
_STRIDED = torch.strided
# the types whose data_ptr() is their memory (trainmon.step.gate admits only these; a subclass that slips
# past it is left to the torch backend, never read by address)
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def available() -> bool:
    return _kernel is not None


def isa() -> str | None:
    """Instruction set the kernel selected at import (``avx512``, ``avx2``, ``baseline``)."""
    return None if _kernel is None else str(_kernel.ISA)


def _threads(n: int) -> int:
    return torch.get_num_threads() if n >= THREAD_MIN_NUMEL else 1


def fits_out(out: torch.Tensor) -> bool:
    """Whether the kernel can write rows into ``out`` (a contiguous float64 CPU tensor)."""
    return out.is_cpu and out.dtype is _F64 and out.is_contiguous()


def dense(t: torch.Tensor) -> bool:
    """True when the elements of ``t`` occupy exactly ``numel`` consecutive slots starting at
    ``data_ptr()`` (a permutation of a contiguous layout: transposes, permutes). The statistics do not
    depend on the order, so a kernel can read such a tensor in place."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride(), strict=True) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def readable(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when a kernel can read it as a flat array, else a contiguous copy."""
    if t.is_contiguous() or dense(t):
        return t
    return t.detach().contiguous()


def row_at(t: torch.Tensor, address: int, eps: float) -> bool:
    """Partials of ``t`` into the 8 float64 at ``address`` (a row of a contiguous float64 CPU tensor the
    caller keeps alive); False when the kernel does not take ``t``. Called once per monitored tensor on the
    CPU, so it asks ``t`` only what it must."""
    code = CODES.get(t.dtype)
    if code is None or type(t) not in _PLAIN or not t.is_cpu or t.layout is not _STRIDED:
        return False
    if not t.is_contiguous():
        t = readable(t)
    n = t.numel()
    _kernel.partials(
        t.data_ptr(), n, code, eps, address, torch.get_num_threads() if n >= THREAD_MIN_NUMEL else 1
    )
    return True


def rows(tensors: Sequence[torch.Tensor], out: torch.Tensor, first: int, eps: float) -> list[int]:
    """Partials of every tensor the kernel takes, in one call, into ``out[first + i]``; returns the indices
    of the others."""
    if _kernel is None or not fits_out(out):
        return list(range(len(tensors)))
    items: list[tuple[int, int, int]] = []
    keep: list[torch.Tensor] = []  # contiguous copies alive until the call returns
    rest: list[int] = []
    total = 0
    codes = CODES
    for i, t in enumerate(tensors):
        code = codes.get(t.dtype)
        if code is None or type(t) not in _PLAIN or not t.is_cpu or t.layout is not _STRIDED:
            items.append((0, 0, 0))
            rest.append(i)
            continue
        if not t.is_contiguous():
            t = readable(t)
            keep.append(t)
        n = t.numel()
        total += n
        items.append((t.data_ptr(), n, code))
    _kernel.partials_many(items, eps, out.data_ptr() + first * _ROW_BYTES, _threads(total))
    return rest


def adam_rows(
    m: torch.Tensor,
    v: torch.Tensor,
    c1: float,
    c2: float,
    adam_eps: float,
    out: torch.Tensor,
    row_update: int,
    row_ratio: int,
    eps: float,
) -> bool:
    """Partials of Adam's update and update/ratio computed in fp32 without materialising either."""
    code = _ADAM_CODES.get(m.dtype)
    if (
        code is None
        or _kernel is None
        or type(m) not in _PLAIN
        or type(v) not in _PLAIN
        or v.dtype != m.dtype
        or not (m.is_cpu and v.is_cpu and fits_out(out))
        or m.numel() != v.numel()
        or any(isinstance(c, torch.Tensor) and not c.is_cpu for c in (c1, c2))
    ):
        return False
    m = m if m.is_contiguous() else m.detach().contiguous()
    v = v if v.is_contiguous() else v.detach().contiguous()
    n = m.numel()
    base = out.data_ptr()
    _kernel.adam_update_ratio(
        m.data_ptr(),
        v.data_ptr(),
        n,
        code,
        float(c1),
        float(c2),
        float(adam_eps),
        float(eps),
        base + row_update * _ROW_BYTES,
        base + row_ratio * _ROW_BYTES,
        _threads(2 * n),
    )
    return True
