"""A comparison of one rank as a step x tensor heatmap: the relative difference of every tensor pair, binned
over the steps (the largest of each bin), with the bins holding a divergence flagged, and the first
divergence (what the TensorBoard plugin's comparison view draws). Beside it, each cell's decision with its
parts, the command line's: the bin's highest score, and at the step that scored it the relative difference
and the state allowance beside the pair's tolerance (score = relative difference / (tolerance + state
allowance), or the zero fraction's or a count's when those decide; above 1: divergent)."""

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
    scores: np.ndarray  # (P, B) float32: the bin's highest score (NaN: no step)
    rel_at: np.ndarray  # (P, B) float32: the relative difference at the step of that score
    slack_at: np.ndarray  # (P, B) float32: the state allowance at that step


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
            shape = (n_pairs, len(edges) - 1)
            cells["values"] = np.full(shape, np.nan, dtype=np.float32)
            cells["flags"] = np.zeros(shape, dtype=np.uint8)
            for name in ("scores", "rel_at", "slack_at"):
                cells[name] = np.full(shape, np.nan, dtype=np.float32)
        if cells["values"].shape[0] != n_pairs:  # the run changed its tensors: the first layout is shown
            return
        which = np.searchsorted(edges, chunk.steps, side="right") - 1
        starts = np.flatnonzero(np.r_[True, which[1:] != which[:-1]])
        columns = which[starts]
        present = ~np.isnan(chunk.rel)
        rel = np.where(present, chunk.rel, -np.inf)
        top = np.maximum.reduceat(rel, starts, axis=0).T  # (P, bins touched)
        top[np.isinf(top) & (top < 0)] = np.nan
        score = np.where(present, chunk.score, -np.inf)
        best = np.maximum.reduceat(score, starts, axis=0)  # (bins touched, P)
        at_best = score == np.repeat(best, np.diff(np.r_[starts, len(score)]), axis=0)
        zero = np.zeros(n_pairs, dtype=np.float32)
        slack = chunk.slack.tolerance(zero) if chunk.slack is not None else np.zeros_like(chunk.rel)
        rel_at = np.maximum.reduceat(np.where(at_best, rel, -np.inf), starts, axis=0).T
        slack_at = np.maximum.reduceat(np.where(at_best, slack, -np.inf), starts, axis=0).T
        best = best.T
        divergent = best > 1
        bin_present = np.logical_or.reduceat(present, starts, axis=0).T
        cells["values"][:, columns] = np.fmax(cells["values"][:, columns], top)
        cells["flags"][:, columns] |= (bin_present * HAS_DATA + divergent * DIVERGENT).astype(np.uint8)
        known = cells["scores"][:, columns]
        better = bin_present & ~(known >= best)  # a bin two ranges share: the higher score's parts
        for name, found in (("scores", best), ("rel_at", rel_at), ("slack_at", slack_at)):
            view = cells[name][:, columns]
            view[better] = found[better]
            cells[name][:, columns] = view

    result = compare(a, b, [rank], tolerance, name_map, Options(workers=2), sink=sink)
    if "values" not in cells:
        return None
    return CompareHeatmap(result, edges, cells["values"], cells["flags"], cells["scores"], cells["rel_at"],
                          cells["slack_at"])  # fmt: skip
