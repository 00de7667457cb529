"""A comparison of one rank as a step x tensor heatmap: the relative difference of every tensor pair, binned
over the steps (the largest of each bin), with the bins holding a divergence flagged, and the first
divergence (what the TensorBoard plugin's comparison view draws)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trainmon.read.compare.engine import Chunk, Options, Result, common_range, compare
from trainmon.read.compare.mapfile import NameMap
from trainmon.read.compare.source import RankReader
from trainmon.read.compare.tolerance import Tolerance

__all__ = ["HAS_DATA", "DIVERGENT", "CompareHeatmap", "compare_heatmap"]

HAS_DATA, DIVERGENT = 1, 2  # flag bits of a cell


@dataclass(frozen=True)
class CompareHeatmap:
    """``values[p, b]``: the largest relative difference of pair ``p`` in step bin ``b`` (NaN: no step);
    ``flags[p, b]``: :data:`HAS_DATA`, :data:`DIVERGENT`. Bin ``b`` holds steps ``edges[b]`` to
    ``edges[b + 1] - 1``."""

    result: Result
    edges: np.ndarray  # (B + 1,) int64
    values: np.ndarray  # (P, B) float32
    flags: np.ndarray  # (P, B) uint8


def _edges(lo: int, hi: int, bins: int) -> np.ndarray:
    bins = max(1, min(int(bins), hi - lo + 1))
    return np.unique(np.linspace(lo, hi + 1, bins + 1).round().astype(np.int64))


def compare_heatmap(
    a: RankReader,
    b: RankReader,
    rank: int,
    tolerance: Tolerance,
    bins: int,
    name_map: NameMap | None = None,
) -> CompareHeatmap | None:
    """Compare one rank of two runs and bin it (None: no step in common)."""
    span = common_range(a, b, [rank])
    if span is None:
        return None
    edges = _edges(*span, bins)
    cells: dict[str, np.ndarray] = {}

    def sink(chunk: Chunk) -> None:
        n_pairs = len(chunk.plan.pairs)
        if "values" not in cells:
            cells["values"] = np.full((n_pairs, len(edges) - 1), np.nan, dtype=np.float32)
            cells["flags"] = np.zeros((n_pairs, len(edges) - 1), dtype=np.uint8)
        if cells["values"].shape[0] != n_pairs:  # the run changed its tensors: the first layout is shown
            return
        which = np.searchsorted(edges, chunk.steps, side="right") - 1
        starts = np.flatnonzero(np.r_[True, which[1:] != which[:-1]])
        columns = which[starts]
        rel = np.where(np.isnan(chunk.rel), -np.inf, chunk.rel)
        top = np.maximum.reduceat(rel, starts, axis=0).T  # (P, bins touched)
        top[np.isinf(top) & (top < 0)] = np.nan
        divergent = np.logical_or.reduceat(chunk.score > 1, starts, axis=0).T
        present = np.logical_or.reduceat(~np.isnan(chunk.rel), starts, axis=0).T
        cells["values"][:, columns] = np.fmax(cells["values"][:, columns], top)
        cells["flags"][:, columns] |= (present * HAS_DATA + divergent * DIVERGENT).astype(np.uint8)

    result = compare(a, b, [rank], tolerance, name_map, Options(workers=2), sink=sink)
    if "values" not in cells:
        return None
    return CompareHeatmap(result, edges, cells["values"], cells["flags"])
