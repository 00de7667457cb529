"""The stragglers of a run (``trainmon analyze RUN --rule straggler``): every straggler episode, the slowest
first, with what the rank's step went to around it.

The ranks with episodes come from their summaries (their counts per rule); only those ranks' records are read,
and for each episode the rank's own timing table (``trainmon.run.timing``): the rule names a rank once, at the
step it first holds (a ``window`` of slow steps after the episode began), so the episode's true span, from its
first slow step to its last, is read back from that table (:func:`episode_span`), and the rank's times are
its means over that span."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainmon.read.summaries import read_summaries
from trainmon.run.records import STRAGGLER_RULE, Anomaly
from trainmon.run.timing import TIMES

__all__ = ["Episode", "episode_span", "slow_span", "stragglers"]

# steps of a rank's timing read before an episode's first step when the record does not say its window
_SPAN = 10
# slow steps may be this many steps apart and still be one episode (a step that ran at the usual speed in the
# middle of an episode, or a step not timed, does not end it)
_GAP = 2


@dataclass(frozen=True)
class Episode:
    """One straggler episode: its record (``name`` the part of the step, ``value`` the rank's typical time
    a step, ``baseline`` the ranks' median, seconds) and the rank's mean times over the steps up to it
    (:data:`~trainmon.run.timing.TIMES`; empty when the run has no timing table for the rank)."""

    record: Anomaly
    times: dict[str, float]
    steps: tuple[int, int] | None  # the steps the times are the mean of
    span: tuple[int, int] | None = None  # the episode's first and last slow step (None: no timing table)

    @property
    def length(self) -> int | None:
        """Steps from the episode's first slow step to its last, both counted."""
        return self.span[1] - self.span[0] + 1 if self.span else None

    @property
    def excess(self) -> float:
        base = self.record.baseline or 0.0
        return self.record.value - base

    @property
    def factor(self) -> float:
        base = self.record.baseline or 0.0
        return self.record.value / base if base > 0 else math.inf

    def to_dict(self) -> dict[str, Any]:
        a = self.record
        return {
            "rank": a.rank,
            "step": a.step,
            "from_step": self.span[0] if self.span else None,
            "to_step": self.span[1] if self.span else None,
            "length": self.length,
            "phase": a.name,
            "time_s": a.value,
            "median_s": a.baseline,
            "excess_s": self.excess,
            "factor": self.factor if math.isfinite(self.factor) else None,
            "times_s": {k: (v if math.isfinite(v) else None) for k, v in self.times.items()},
            "times_steps": list(self.steps) if self.steps else None,
            "message": a.message,
        }


def _window(message: str) -> int:
    """The rule's window as the record's message says it (``over the last N steps``)."""
    marker = "over the last "
    at = message.find(marker)
    if at >= 0:
        digits = message[at + len(marker) :].split(" ", 1)[0]
        if digits.isdigit():
            return max(1, int(digits))
    return _SPAN


def _timed_step(a: Anomaly) -> int:
    """The step an episode's times are of (on an accelerator its message says ``timed at step N``)."""
    marker = "(timed at step "
    at = a.message.find(marker)
    if at >= 0:
        digits = a.message[at + len(marker) :].split(")", 1)[0]
        if digits.isdigit():
            return int(digits)
    return a.step


def _records(run: Path, rank: int, lo: int, hi: int) -> list[Anomaly]:
    from trainmon.run.anomaly_table import read_anomalies

    return [a for a in read_anomalies(run, rank, lo, hi) if a.rule == STRAGGLER_RULE]


def _times(run: Path, rank: int, lo: int, hi: int) -> tuple[dict[str, float], tuple[int, int] | None]:
    from trainmon.run.timetable import TIMING_COLUMNS, read_timing

    try:
        table = read_timing(run, rank, ["step", *TIMING_COLUMNS], lo, hi)
    except (OSError, ValueError):
        return {}, None
    if not table.num_rows:
        return {}, None
    import numpy as np

    from trainmon.run.columnar import column_numpy  # not to_numpy: its first call imports pandas (0.5 s)

    out = {}
    for name, column in zip(TIMES, TIMING_COLUMNS, strict=True):
        values = np.asarray(column_numpy(table.column(column)), dtype=np.float64)
        finite = values[np.isfinite(values)]
        out[name] = float(finite.mean()) if len(finite) else math.nan
    steps = table.column("step").to_pylist()
    return out, (min(steps), max(steps))


def episode_span(run: str | Path, record: Anomaly) -> tuple[int, int] | None:
    """The steps of a straggler episode (its record): see :func:`slow_span`."""
    return slow_span(run, record.rank, record.name, _timed_step(record), record.value, record.baseline,
                     _window(record.message))  # fmt: skip


def slow_span(
    run: str | Path,
    rank: int,
    part: str,
    step: int,
    value: float,
    baseline: float | None,
    window: int = _SPAN,
) -> tuple[int, int] | None:
    """The steps of the straggler episode of ``rank`` in ``part`` of the step that the rule named at ``step``:
    from the first to the last step in which the rank's time of that part stood above the midpoint between
    the ranks' median (``baseline``) and the rank's typical time the rule saw (``value``), slow steps at
    most :data:`_GAP` apart, around ``step``. None when the rank has no timing table there."""
    from trainmon.run.timetable import TIMING_COLUMNS, read_timing

    if part not in TIMES:
        return None
    column = TIMING_COLUMNS[TIMES.index(part)]
    try:
        table = read_timing(run, rank, ["step", column], step - 4 * window - _GAP, None)
    except (OSError, ValueError):
        return None
    if not table.num_rows:
        return None
    import numpy as np

    # not to_numpy: its first call imports pandas (0.5 s), in the plugin the first timeline's
    from trainmon.run.columnar import column_numpy

    steps = np.asarray(column_numpy(table.column("step")), dtype=np.int64)
    values = np.asarray(column_numpy(table.column(column)), dtype=np.float64)
    order = np.argsort(steps, kind="stable")
    steps, values = steps[order], values[order]
    base = baseline if baseline is not None and math.isfinite(baseline) else 0.0
    slow_steps = steps[values > (base + value) / 2]
    # the slow step the rule saw last: at its step, else the last one before it
    k = int(np.searchsorted(slow_steps, step, side="right")) - 1
    if k < 0 or step - slow_steps[k] > window + _GAP:
        return None
    lo = hi = k
    while lo > 0 and slow_steps[lo] - slow_steps[lo - 1] <= _GAP + 1:
        lo -= 1
    while hi + 1 < len(slow_steps) and slow_steps[hi + 1] - slow_steps[hi] <= _GAP + 1:
        hi += 1
    return int(slow_steps[lo]), int(slow_steps[hi])


def stragglers(run: str | Path) -> list[Episode]:
    """Every straggler episode of the run, the one that held the job back the most (the largest excess over
    the ranks' median) first."""
    run = Path(run)
    episodes = []
    for rank, s in read_summaries(run).items():
        if not s.counts.get(STRAGGLER_RULE) or s.anomaly_steps is None:
            continue
        for a in _records(run, rank, *s.anomaly_steps):
            span = episode_span(run, a)
            if span is None:  # the steps that made the rule hold
                at = _timed_step(a)
                times, steps = _times(run, rank, at - _window(a.message) + 1, at)
            else:
                times, steps = _times(run, rank, *span)
            episodes.append(Episode(a, times, steps, span))
    episodes.sort(key=lambda e: (-e.excess, e.record.step, e.record.rank))
    return episodes
