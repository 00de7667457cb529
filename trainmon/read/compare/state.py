"""What the state a step starts from explains: the slack added to a tensor's tolerance.

Two runs that differ only in rounding drift apart as they train: a few ulps in one step's gradients become
differences in the parameters (more so under Adam, whose per-element normalisation turns rounding noise in
near-zero gradient elements into updates of up to the learning rate), and every later step computes from
parameters that differ. Judging those steps against rounding alone would name drift as a divergence. So a
tensor of step ``s`` may differ by ``coupling x D(s)`` beyond its tolerance, where ``D(s)``, the **state
difference**, is the largest relative difference of what the step started from:

- the parameters it ran with (``param_origin`` at ``s``),
- the state the previous step left (``param_updated``, ``exp_avg``, ``exp_avg_sq`` at ``s - 1``).

``param_origin`` itself is judged against the previous step's state only (so parameters that differ at the
first step compared, different initial weights, are a divergence of their own), and the step's data (its
first input: nothing the step computes comes before it, and no parameter goes into it) against rounding
alone, whatever the state. Runs that record neither
parameters nor moments get no slack. ``D`` is capped at 1 (a tensor that is NaN or zero in one run only must
not excuse everything after it: its counts or its own score say that already).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from trainmon.run.records import Kind

__all__ = ["STATE_AFTER", "STATE_NOW", "Slack", "slack"]

STATE_NOW = frozenset({Kind.PARAM_ORIGIN.value})
STATE_AFTER = frozenset({Kind.PARAM_UPDATED.value, Kind.EXP_AVG.value, Kind.EXP_AVG_SQ.value})
_CAP = 1.0


@dataclass(frozen=True)
class Slack:
    """The slack of a (steps x pairs) block: ``rows[s]`` for every pair of step row ``s`` but the
    ``param_origin`` ones (``origin``), whose slack is ``before[s]``, and the data (``data``), which has
    none; both already times the coupling."""

    rows: np.ndarray  # (S,) float32
    before: np.ndarray  # (S,) float32
    origin: np.ndarray  # (P,) bool
    data: np.ndarray | None = None  # (P,) bool

    def tolerance(self, tol: np.ndarray) -> np.ndarray:
        """``tol`` per pair plus each cell's slack: (S, P) float32."""
        out = tol.astype(np.float32)[None, :] + self.rows[:, None]
        if self.origin.any():
            out[:, self.origin] = tol[self.origin][None, :] + self.before[:, None]
        if self.data is not None and self.data.any():
            out[:, self.data] = tol[self.data][None, :]
        return out

    def of(self, row: int) -> np.ndarray:
        """One step row's slack per pair."""
        found = np.where(self.origin, self.before[row], self.rows[row]).astype(np.float32)
        if self.data is not None:
            found[self.data] = 0.0
        return found


def _row_max(rel: np.ndarray, columns: np.ndarray) -> np.ndarray:
    if not len(columns):
        return np.zeros(rel.shape[0], dtype=np.float32)
    with np.errstate(invalid="ignore"):
        found = np.fmax.reduce(rel[:, columns], axis=1)  # NaN (no row at the step) left out
    found = np.where(np.isnan(found), 0.0, found)
    return np.minimum(found, _CAP).astype(np.float32)


def slack(
    rel: np.ndarray, kinds: Sequence[str], carried: float, coupling: float, data: np.ndarray | None = None
) -> tuple[Slack, float]:
    """The slack of every cell of a (steps x pairs) block of relative differences, and the state
    difference the block's last step leaves to the next block (``carried``: the one the previous block
    left; 0 for the first step compared). ``data``: the pairs that are the step's data (no slack)."""
    kinds = np.asarray(kinds)
    origin = np.isin(kinds, list(STATE_NOW))
    after = np.flatnonzero(np.isin(kinds, list(STATE_AFTER)))
    now = _row_max(rel, np.flatnonzero(origin))
    left = _row_max(rel, after)
    before = np.concatenate(([np.float32(min(carried, _CAP))], left[:-1])).astype(np.float32)
    state_in = np.maximum(now, before)
    c = np.float32(coupling)
    return Slack(state_in * c, before * c, origin, data), float(left[-1]) if len(left) else carried
