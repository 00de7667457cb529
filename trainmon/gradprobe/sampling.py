"""The sample positions of ``grad_probe``: which elements of a gradient the direction sketch keeps.

Framework-free (numpy and the standard library only), so that the PyTorch collector, the MindSpore collector
and the readers draw exactly the same positions for the same name and shape.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np

_MASK64 = (1 << 64) - 1


def _splitmix64(state: int) -> tuple[int, int]:
    state = (state + 0x9E3779B97F4A7C15) & _MASK64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return state, z ^ (z >> 31)


def sample_seed(name: str, shape: Sequence[int], by: str = "name") -> int:
    """The seed of a parameter's sample positions: CRC32 of its name and shape (``by="name"``), or of its
    shape alone (``by="shape"``: for runs that name parameters differently)."""
    dims = "x".join(str(int(d)) for d in shape)
    return zlib.crc32((f"{name}|{dims}" if by == "name" else dims).encode("utf-8"))


def sample_positions(numel: int, k: int, seed: int) -> np.ndarray:
    """``min(k, numel)`` distinct flat positions in ``[0, numel)``, sorted, from ``seed`` alone.

    Floyd's algorithm over splitmix64: the positions depend on nothing but the three integers, not on the
    numpy or torch version or the machine, so runs on different stacks sample the same elements."""
    if numel <= k:
        return np.arange(numel, dtype=np.int64)
    state = seed & _MASK64
    chosen: set[int] = set()
    for j in range(numel - k, numel):
        state, r = _splitmix64(state)
        t = r % (j + 1)
        chosen.add(j if t in chosen else t)
    return np.sort(np.fromiter(chosen, dtype=np.int64, count=k))
