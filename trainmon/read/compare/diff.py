"""How far apart two runs' statistics of one tensor are, relative to the tensor's own magnitude.

Per (step, tensor), from the statistics both runs stored (min, max, mean, norm, zeros, nans, infs, numel):

- ``norm``: ``|norm_a - norm_b| / max(norm_a, norm_b)``;
- ``mean``: ``|mean_a - mean_b| / rms``, ``rms = max(norm_a / sqrt(n_a), norm_b / sqrt(n_b))`` over the finite
  elements: the mean of a tensor that is zero-mean by construction (a LayerNorm's input gradient) is rounding
  noise, many times its own size between two runs, but tiny against the tensor's spread;
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


def _abs_diff(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        d = np.abs(a - b)
    both = np.isnan(a) & np.isnan(b)
    if both.any():
        d[both] = 0.0
    return d


def _ratio(d: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """``d / scale``; 0 where both are 0, inf where only the scale is (or NaN: one run has no value)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        r = d / scale
    zero = d == 0
    r[zero] = 0.0
    r[np.isnan(r)] = np.inf
    return r


def _parts(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The four relative differences (norm, mean, min, max), float32."""
    f32 = np.float32
    na, nb = a["norm"].astype(f32, copy=False), b["norm"].astype(f32, copy=False)
    amax = np.fmax(
        np.fmax(np.abs(a["min"]), np.abs(a["max"])), np.fmax(np.abs(b["min"]), np.abs(b["max"]))
    ).astype(f32, copy=False)
    count_a, count_b = a.get("numel"), b.get("numel")
    known = count_a is not None and count_b is not None
    if known and not (np.isnan(count_a).all() or np.isnan(count_b).all()):
        with np.errstate(invalid="ignore", divide="ignore"):
            fa = np.maximum(count_a - a["nans"] - a["infs"], 1.0).astype(f32)
            fb = np.maximum(count_b - b["nans"] - b["infs"], 1.0).astype(f32)
            rms = np.fmax(na / np.sqrt(fa), nb / np.sqrt(fb))
        rms = np.where(np.isnan(rms), amax, rms)
    else:
        rms = amax
    return {
        "norm": _ratio(_abs_diff(na, nb), np.fmax(na, nb)),
        "mean": _ratio(_abs_diff(a["mean"].astype(f32, copy=False), b["mean"].astype(f32, copy=False)), rms),
        "min": _ratio(_abs_diff(a["min"].astype(f32, copy=False), b["min"].astype(f32, copy=False)), amax),
        "max": _ratio(_abs_diff(a["max"].astype(f32, copy=False), b["max"].astype(f32, copy=False)), amax),
    }


def _counts_differ(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = {}
    for stat in ("nans", "infs", "numel"):
        x, y = a.get(stat), b.get(stat)
        if x is None or y is None:
            continue
        with np.errstate(invalid="ignore"):
            out[stat] = (x != y) & ~(np.isnan(x) | np.isnan(y))  # an unknown count differs from nothing
    return out


def differences(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> Diff:
    """The relative differences of aligned (steps x pairs) statistics, the zero fractions' difference and
    where a count differs."""
    parts = _parts(a, b)
    rel = parts["norm"]
    for stat in ("mean", "min", "max"):
        np.maximum(rel, parts[stat], out=rel)
    zeros = _abs_diff(a["zeros"].astype(np.float32, copy=False), b["zeros"].astype(np.float32, copy=False))
    exact = np.zeros(rel.shape, dtype=bool)
    for differ in _counts_differ(a, b).values():
        exact |= differ
    return Diff(rel, zeros, exact)


def scores(diff: Diff, rtol: np.ndarray, ztol: np.ndarray, slack: np.ndarray | float = 0.0) -> np.ndarray:
    """Each cell's score: its relative difference over ``rtol + slack``, its zero fractions' over ``ztol +
    slack``, whichever is larger; infinite where a count differs. ``slack`` (per cell, or broadcast) is what
    the state the step started from explains (:mod:`~trainmon.read.compare.state`)."""
    slack = np.asarray(slack, dtype=np.float32)
    with np.errstate(invalid="ignore", divide="ignore"):
        score = diff.rel / (rtol.astype(np.float32) + slack)
        np.maximum(score, diff.zeros / (ztol.astype(np.float32) + slack), out=score)
    score[diff.exact] = np.inf
    return score


def worst(a: dict[str, np.ndarray], b: dict[str, np.ndarray], rtol: float, ztol: float) -> tuple[str, float]:
    """The statistic that decides one cell's score (``a``/``b``: scalars per statistic; ``rtol``/``ztol``
    with the cell's slack in them), and its score."""
    one = {k: np.atleast_1d(np.asarray(v, dtype=np.float64)) for k, v in a.items()}
    two = {k: np.atleast_1d(np.asarray(v, dtype=np.float64)) for k, v in b.items()}
    for stat, differ in _counts_differ(one, two).items():
        if differ[0]:
            return stat, float("inf")
    scores = {stat: float(v[0]) / rtol for stat, v in _parts(one, two).items()}
    scores["zeros"] = float(_abs_diff(one["zeros"], two["zeros"])[0]) / ztol
    stat = max(scores, key=lambda s: scores[s])
    return stat, scores[stat]
