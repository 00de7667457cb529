"""How far apart two runs' statistics of one tensor are, relative to the tensor's own magnitude.

Per (step, tensor), from the statistics both runs stored (min, max, mean, norm, zeros, nans, infs, numel):

- ``norm``: ``|norm_a - norm_b| / max(norm_a, norm_b)``;
- ``mean``: ``|mean_a - mean_b| / rms``, ``rms = max(norm_a, norm_b) / sqrt(n)``: the mean of a tensor that
  is zero-mean by construction (a LayerNorm's input gradient) is rounding noise, many times its own size
  between two runs, but tiny against the tensor's spread;
- ``min``, ``max``: the difference over the largest magnitude of either run (a tensor of tiny squares, Adam's
  ``exp_avg_sq``, has a minimum of a few ulps that moves by percents);

``rel`` is the largest of the four: **the relative difference** the report and the heatmap show. Beside it,
``zeros`` (the fraction of zero elements) is compared as an absolute difference of fractions, and the NaN and
Inf counts and the element count exactly. A tensor's ``score`` is ``rel / (rtol + slack)`` or ``|zeros_a -
zeros_b| / (ztol + slack)``, whichever is larger, and infinite when a count differs: above 1 the tensor
**diverges** (``slack``: what the state the step started from explains, :mod:`~trainmon.read.compare.state`).

Without element counts (a store written before they were kept) the largest magnitude stands for ``rms`` (a
looser check of the mean). Statistics that are NaN in both runs (a tensor without one finite element) agree.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["DIFF_STATS", "Diff", "differences", "scores", "worst"]

# what the comparison reads of each run
DIFF_STATS = ("min", "max", "mean", "norm", "zeros", "nans", "infs", "numel")
_VALUE = ("norm", "mean", "min", "max")


@dataclass(frozen=True)
class Diff:
    """Per step row ``s`` and tensor pair ``p``: ``rel[s, p]`` (float32), ``zeros[s, p]`` (the zero fractions'
    absolute difference) and ``exact[s, p]`` (a NaN/Inf/element count differs)."""

    rel: np.ndarray
    zeros: np.ndarray
    exact: np.ndarray


_TINY = np.float32(np.finfo(np.float32).tiny)


def _f32(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float32, copy=False)


def _abs_diff(a: np.ndarray, b: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``|a - b|``, 0 where both are NaN (a tensor without a finite element in both runs)."""
    with np.errstate(invalid="ignore"):
        d = np.subtract(a, b, out=out)
    np.abs(d, out=d)
    nan = np.isnan(d)
    if nan.any():  # rare: fixed where it happens
        d[nan & np.isnan(a) & np.isnan(b)] = 0.0
    return d


def _ratio(d: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """``d / scale`` into ``d``: 0 where both are 0, huge where only the scale is, inf where one run has no
    value (NaN)."""
    np.fmax(scale, _TINY, out=scale)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        np.divide(d, scale, out=d)
    nan = np.isnan(d)
    if nan.any():
        d[nan] = np.inf
    return d


def _rms(scale: np.ndarray, count: np.ndarray | None, amax: np.ndarray) -> np.ndarray:
    """The root mean square of the larger-norm run: ``max(norm_a, norm_b) / sqrt(numel)`` (NaN and Inf
    elements are few where they are not the difference already); the largest magnitude without counts."""
    if count is None or np.isnan(count).all():
        return amax.copy()
    with np.errstate(invalid="ignore", divide="ignore"):
        out = np.sqrt(count, dtype=np.float32)
        np.divide(scale, out, out=out)
    unknown = np.isnan(out)
    if unknown.any():
        out[unknown] = amax[unknown]
    return out


def _relative(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> np.ndarray:
    """The largest of the four relative differences (norm, mean, min, max), float32; computed in place
    (a comparison scores hundreds of thousands of cells a step range)."""
    a_min, a_max, b_min, b_max = _f32(a["min"]), _f32(a["max"]), _f32(b["min"]), _f32(b["max"])
    amax = np.abs(a_min)
    tmp = np.abs(a_max)
    np.fmax(amax, tmp, out=amax)
    np.abs(b_min, out=tmp)
    np.fmax(amax, tmp, out=amax)
    np.abs(b_max, out=tmp)
    np.fmax(amax, tmp, out=amax)
    na, nb = _f32(a["norm"]), _f32(b["norm"])
    scale = np.fmax(na, nb)
    rms = _rms(scale, a.get("numel"), amax)
    # the extremes: over the largest magnitude (NaN propagates: one run without a finite element)
    rel = _abs_diff(a_min, b_min)
    np.maximum(rel, _abs_diff(a_max, b_max, out=tmp), out=rel)
    rel = _ratio(rel, amax)  # amax is used up here
    np.maximum(rel, _ratio(_abs_diff(na, nb, out=tmp), scale), out=rel)
    np.maximum(rel, _ratio(_abs_diff(_f32(a["mean"]), _f32(b["mean"]), out=tmp), rms), out=rel)
    return rel


def _counts_differ(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Where each count differs. NaN counts are rows a run does not have (the caller leaves those cells
    out), or element counts a store did not keep (never a difference)."""
    out = {stat: a[stat] != b[stat] for stat in ("nans", "infs") if stat in a and stat in b}
    x, y = a.get("numel"), b.get("numel")
    if x is not None and y is not None:
        with np.errstate(invalid="ignore"):
            differ = x != y
        if differ.any():
            differ &= ~(np.isnan(x) | np.isnan(y))
        out["numel"] = differ
    return out


def differences(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> Diff:
    """The relative differences of aligned (steps x pairs) statistics, the zero fractions' difference and
    where a count differs."""
    rel = _relative(a, b)
    zeros = _abs_diff(_f32(a["zeros"]), _f32(b["zeros"]))
    found = list(_counts_differ(a, b).values())
    exact = found[0] if found else np.zeros(rel.shape, dtype=bool)
    for differ in found[1:]:
        exact |= differ
    return Diff(rel, zeros, exact)


def scores(diff: Diff, rtol: np.ndarray, ztol: np.ndarray, slack=None) -> np.ndarray:
    """Each cell's score: its relative difference over ``rtol + slack``, its zero fractions' over ``ztol +
    slack``, whichever is larger; infinite where a count differs. ``slack``: what the state the step started
    from explains (a :class:`~trainmon.read.compare.state.Slack`, or a number; None: none)."""
    if slack is None or not hasattr(slack, "tolerance"):
        extra = np.float32(slack or 0.0)
        tol = rtol.astype(np.float32)[None, :] + extra
        ztol_cells = ztol.astype(np.float32)[None, :] + extra
    else:
        tol, ztol_cells = slack.tolerance(rtol), None
    with np.errstate(invalid="ignore", divide="ignore"):
        score = np.divide(diff.rel, tol, out=tol if tol.shape == diff.rel.shape else None)
        if np.count_nonzero(diff.zeros):  # the zero fractions mostly agree exactly: nothing to add
            if ztol_cells is None:
                ztol_cells = slack.tolerance(ztol)
            np.maximum(score, diff.zeros / ztol_cells, out=score)
    if diff.exact.any():
        score[diff.exact] = np.inf
    return score


def worst(a: dict[str, np.ndarray], b: dict[str, np.ndarray], rtol: float, ztol: float) -> tuple[str, float]:
    """The statistic that decides one cell's score (``a``/``b``: scalars per statistic; ``rtol``/``ztol``
    with the cell's slack in them), and its score."""
    one = {k: np.atleast_1d(np.asarray(v, dtype=np.float64)) for k, v in a.items()}
    two = {k: np.atleast_1d(np.asarray(v, dtype=np.float64)) for k, v in b.items()}
    for stat, differ in _counts_differ(one, two).items():
        if differ[0] and not (np.isnan(one[stat][0]) or np.isnan(two[stat][0])):
            return stat, float("inf")
    scores = {}
    for stat in ("norm", "mean", "min", "max"):  # each alone: the others agree
        only = {**one, stat: two[stat]}
        scores[stat] = float(_relative(one, only)[0]) / rtol
    scores["zeros"] = float(_abs_diff(one["zeros"], two["zeros"])[0]) / ztol
    stat = max(scores, key=lambda s: scores[s])
    return stat, scores[stat]
