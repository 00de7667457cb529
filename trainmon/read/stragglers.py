"""The stragglers of a run (``trainmon analyze RUN --rule straggler``): every straggler episode, the slowest
first, with what the rank's step went to around it.

The ranks with episodes come from their summaries (their counts per rule); only those ranks' records are read,
and for each episode the rank's own timing table over the steps that made the rule hold (the ``window``
steps up to the episode's first step: ``trainmon.run.timing``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainmon.read.summaries import read_summaries
from trainmon.run.records import STRAGGLER_RULE, Anomaly
from trainmon.run.timing import TIMES

__all__ = ["Episode", "stragglers"]

# steps of a rank's timing read before an episode's first step when the record does not say its window
_SPAN = 10


@dataclass(frozen=True)
class Episode:
    """One straggler episode: its record (``name`` the part of the step, ``value`` the rank's typical time
    a step, ``baseline`` the ranks' median, seconds) and the rank's mean times over the steps up to it
    (:data:`~trainmon.run.timing.TIMES`; empty when the run has no timing table for the rank)."""

    record: Anomaly
    times: dict[str, float]
    steps: tuple[int, int] | None  # the steps the times are the mean of

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

    out = {}
    for name, column in zip(TIMES, TIMING_COLUMNS, strict=True):
        values = np.asarray(table.column(column).to_numpy(zero_copy_only=False), dtype=np.float64)
        finite = values[np.isfinite(values)]
        out[name] = float(finite.mean()) if len(finite) else math.nan
    steps = table.column("step").to_pylist()
    return out, (min(steps), max(steps))


def stragglers(run: str | Path) -> list[Episode]:
    """Every straggler episode of the run, the one that held the job back the most (the largest excess over
    the ranks' median) first."""
    run = Path(run)
    episodes = []
    for rank, s in read_summaries(run).items():
        if not s.counts.get(STRAGGLER_RULE) or s.anomaly_steps is None:
            continue
        for a in _records(run, rank, *s.anomaly_steps):
            window, at = _window(a.message), _timed_step(a)
            times, steps = _times(run, rank, at - window + 1, at)
            episodes.append(Episode(a, times, steps))
    episodes.sort(key=lambda e: (-e.excess, e.record.step, e.record.rank))
    return episodes
