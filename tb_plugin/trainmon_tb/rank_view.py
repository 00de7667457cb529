"""One rank's steps side by side: its time (its ``timing/rank=<r>`` table: the step and its parts,
:mod:`trainmon.run.timing`) and its numerics (its ``steps/rank=<r>`` table: the gradient norm and the
anomalies of each step, :mod:`trainmon.run.steptable`), read when a rank row is opened, over the same bins of
steps.

Up to ``points`` steps every step is a point; beyond, a point is a bin of steps (:func:`bin_edges`): the mean
of each time over the bin's steps (the parts of a step add up to it, and their means add up to the mean
step), the largest gradient norm (a spike stays visible) and the anomalies of the bin's steps."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainmon.run.columnar import column_numpy
from trainmon.run.steptable import read_steps
from trainmon.run.timetable import read_timing
from trainmon_tb.anomaly_index import bin_edges
from trainmon_tb.time_index import COLUMN

__all__ = ["RankSteps", "rank_steps"]


@dataclass
class RankSteps:
    """``steps``: each point's first step, ``span``: the steps of each point (``edges`` when binned: point
    ``i`` holds steps ``edges[i] .. edges[i+1] - 1``); ``times``: ms per time name (NaN: no value);
    ``grad_norm``, ``anomalies``: from the steps table (None: the rank has none)."""

    rank: int
    steps: np.ndarray
    edges: list[int] | None
    times: dict[str, np.ndarray]
    timed_steps: int  # timed steps the points hold
    grad_norm_steps: np.ndarray | None
    grad_norm: np.ndarray | None
    anomalies: np.ndarray | None
    numeric_edges: list[int] | None


def _numpy(table, column: str, dtype) -> np.ndarray:
    return np.asarray(column_numpy(table.column(column)), dtype=dtype)


def _last_each(steps: np.ndarray) -> np.ndarray:
    """Rows of the last write of each step (a resumed job writes a step again), by step."""
    _, rev = np.unique(steps[::-1], return_index=True)
    return len(steps) - 1 - rev


def _binned(
    steps: np.ndarray, columns: dict[str, np.ndarray], lo: int, hi: int, points: int, how: dict[str, str]
) -> tuple[np.ndarray, list[int] | None, dict[str, np.ndarray]]:
    """(first step of each point, edges or None, each column per point: ``mean``, ``max`` or ``sum``)."""
    if len(steps) <= points:
        return steps, None, columns
    bins, edges = bin_edges(lo, hi, points)
    which = np.searchsorted(np.asarray(edges), steps, side="right") - 1
    used, starts = np.unique(which, return_index=True)
    out = {}
    for name, values in columns.items():
        finite = np.isfinite(values)
        if how.get(name) == "max":
            red = np.fmax.reduceat(np.where(finite, values, -np.inf), starts)
            red[np.isinf(red)] = np.nan
        else:
            total = np.add.reduceat(np.where(finite, values, 0.0), starts)
            if how.get(name) == "sum":
                red = total
            else:
                count = np.add.reduceat(finite.astype(np.int64), starts)
                with np.errstate(invalid="ignore", divide="ignore"):
                    red = np.where(count > 0, total / np.maximum(count, 1), np.nan)
        out[name] = red
    point_edges = [edges[b] for b in used.tolist()] + [edges[int(used[-1]) + 1]]
    return np.asarray(point_edges[:-1], dtype=np.int64), point_edges, out


def rank_steps(run_dir: Path, rank: int, step_lo: int | None, step_hi: int | None, points: int) -> RankSteps:
    """The rank's times and numerics in ``[step_lo, step_hi]`` (None: its first or last step)."""
    names = list(COLUMN)
    table = read_timing(run_dir, rank, ["step", *COLUMN.values()], step_lo, step_hi)
    steps = _numpy(table, "step", np.int64)
    keep = _last_each(steps)
    steps = steps[keep]
    times = {name: _numpy(table, COLUMN[name], np.float64)[keep] * 1e3 for name in names}
    lo = step_lo if step_lo is not None else int(steps[0]) if len(steps) else 0
    hi = step_hi if step_hi is not None else int(steps[-1]) if len(steps) else lo
    points_steps, edges, binned = _binned(steps, times, lo, hi, points, {})
    try:
        numeric = read_steps(run_dir, rank, ["step", "grad_norm", "anomalies"], lo, hi)
    except (OSError, ValueError):  # no steps table (an old run), or one that cannot be read
        numeric = None
    norm_steps = norm = anomalies = numeric_edges = None
    if numeric is not None and numeric.num_rows:
        s = _numpy(numeric, "step", np.int64)
        keep = _last_each(s)
        columns = {
            "grad_norm": _numpy(numeric, "grad_norm", np.float64)[keep],
            "anomalies": _numpy(numeric, "anomalies", np.float64)[keep],
        }
        norm_steps, numeric_edges, reduced = _binned(
            s[keep], columns, lo, hi, points, {"grad_norm": "max", "anomalies": "sum"}
        )
        norm, anomalies = reduced["grad_norm"], reduced["anomalies"]
    return RankSteps(
        rank=rank,
        steps=points_steps,
        edges=edges,
        times=binned,
        timed_steps=len(steps),
        grad_norm_steps=norm_steps,
        grad_norm=norm,
        anomalies=anomalies,
        numeric_edges=numeric_edges,
    )
