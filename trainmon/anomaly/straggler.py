"""The straggler rule's evaluation (``trainmon.config.rules.StragglerRule``): on every rank, in the writer
thread, from the step times the ranks exchanged (:class:`~trainmon.run.timing.StepTiming`).

Every rank holds every rank's times of the step, so each rank judges itself with no further exchange: per
part of the step, its typical time over the last ``window`` timed steps (the mean without the slowest step:
one hiccup is no straggler) against the median of the ranks' typical times (the ranks of its own pipeline
stage: stages differ by design). The median is what the job runs at when a few
ranks are slow, so the ranks that wait for a straggler (at the next collective, or inside backward where
the gradient reduction waits) are not named: their wait is not their own time, and the parts they wait in
are the median's. A rank is named once per episode: at the step the rule first holds for it; the episode
ends after ``window`` steps in which it no longer holds.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from trainmon.config.rules import StragglerRule
from trainmon.run.records import STRAGGLER_RULE, Anomaly, StepRecord
from trainmon.run.timing import PHASES, TIMES, pp_stages

__all__ = ["StragglerEngine", "breakdown"]

_T = {name: i for i, name in enumerate(TIMES)}


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if np.isfinite(seconds) else "-"


def breakdown(times: np.ndarray) -> str:
    """What a step's time went to: ``"step 41.0 ms: data 0.2 ms, forward 31.1 ms, ..."`` (``times`` in
    :data:`TIMES` order; parts of no time left out)."""
    parts = [
        f"{name} {_ms(times[_T[name]])}"
        for name in (*PHASES[:5], "wait", *PHASES[5:])
        if np.isfinite(times[_T[name]]) and times[_T[name]] >= 5e-5
    ]
    return f"step {_ms(times[_T['step']])}: " + ", ".join(parts)


class _Judge:
    """One rule's history of every rank's times and the episodes open on this rank."""

    def __init__(self, rule: StragglerRule) -> None:
        self.rule = rule
        self.seen = 0  # timed steps with every rank's times
        self.filled = 0  # of them in the history
        self.history: np.ndarray | None = None  # (window, world, len(TIMES))
        self.stages: np.ndarray | None = None
        self.open: dict[str, int] = {}  # phase -> steps since the rule last held (an episode is open)

    def step(
        self, table: np.ndarray, stages: np.ndarray, index: int
    ) -> list[tuple[str, float, float, np.ndarray]]:
        """(phase, this rank's mean, the median, this rank's mean times) for each episode starting now."""
        rule = self.rule
        self.seen += 1
        if self.seen <= rule.warmup:
            return []
        world = len(table)
        if self.history is None or self.history.shape[1] != world:
            self.history = np.full((rule.window, world, len(TIMES)), np.nan)
            self.filled = 0
        self.history[self.filled % rule.window] = table
        self.filled += 1
        if self.filled < rule.window:
            return []
        with np.errstate(invalid="ignore"), _quiet():
            means = _typical(self.history)  # (world, len(TIMES))
            peers = (stages == stages[index]) & np.isfinite(means[:, _T["step"]])
            if peers.sum() < 2:
                return []
            judged = _judged(self.history, rule.phase)  # (world, phases)
            median = np.nanmedian(judged[peers], axis=0)
            step_median = float(np.nanmedian(means[peers, _T["step"]]))
            mine = judged[index]
            slow = (mine > rule.factor * median) & (mine - median >= rule.min_share * step_median)
        starting = []
        for j, phase in enumerate(rule.phase):
            if slow[j]:
                if phase not in self.open:
                    starting.append((phase, float(mine[j]), float(median[j]), means[index].copy()))
                self.open[phase] = 0
            elif phase in self.open:
                self.open[phase] += 1
                if self.open[phase] >= rule.window:
                    del self.open[phase]
        return starting


def _typical(history: np.ndarray) -> np.ndarray:
    """Each rank's typical time over the window: the mean of its steps without the slowest one (a single
    hiccup, a thread descheduled once, is no straggler; a pause every few steps is), the plain mean over
    fewer than three steps; steps without the time (NaN) left out."""
    finite = np.isfinite(history)
    n = finite.sum(axis=0)
    total = np.where(finite, history, 0.0).sum(axis=0)
    top = np.where(finite, history, -np.inf).max(axis=0)
    trimmed = n >= 3
    without_top = (total - np.where(trimmed, top, 0.0)) / np.maximum(n - trimmed, 1)
    out = np.where(trimmed, without_top, total / np.maximum(n, 1))
    out[n == 0] = np.nan
    return out


def _judged(history: np.ndarray, phases: Sequence[str]) -> np.ndarray:
    """Each rank's typical time of the parts a rule judges (``(world, phases)``), from the window's times
    ``(window, world, len(TIMES))``. ``comm`` is the time in collectives not spent waiting for other ranks,
    taken step by step before the typical time: the same on every rank at a step, whoever waited (the
    typical ``comm`` minus the typical ``wait`` would leave out a different step of each)."""
    columns = []
    for phase in phases:
        if phase == "comm":
            wait = np.nan_to_num(history[..., _T["wait"]])
            columns.append(history[..., _T["comm"]] - wait)
        else:
            columns.append(history[..., _T[phase]])
    return _typical(np.stack(columns, axis=-1))


class _quiet:
    """numpy's all-NaN-slice warnings off (a part a rank never had is NaN, and stays out)."""

    def __enter__(self) -> None:
        import warnings

        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("ignore", RuntimeWarning)

    def __exit__(self, *exc: object) -> None:
        self._catch.__exit__(*exc)


class StragglerEngine:
    """The straggler rules of one rank. :meth:`evaluate` once per record, in record order."""

    def __init__(self, rules: Sequence[StragglerRule]) -> None:
        self.rules = tuple(rules)
        self._judges = [_Judge(r) for r in self.rules]

    def __bool__(self) -> bool:
        return bool(self._judges)

    def evaluate(self, record: StepRecord) -> list[Anomaly]:
        """This rank's straggler episodes that start with ``record``'s times (none without every rank's)."""
        timing = record.timing
        if not self._judges or timing is None or timing.ranks is None:
            return []
        table = timing.table()
        stages = pp_stages(timing.ranks)
        found = []
        for judge in self._judges:
            for phase, mine, median, times in judge.step(table, stages, timing.index):
                found.append(_anomaly(record, judge.rule, phase, mine, median, times, timing.step))
        return found


def _anomaly(
    record: StepRecord,
    rule: StragglerRule,
    phase: str,
    mine: float,
    median: float,
    times: np.ndarray,
    timed_step: int,
) -> Anomaly:
    factor = mine / median if median > 0 else float("inf")
    what = " (in collectives, not waiting)" if phase == "comm" else ""
    at = "" if timed_step == record.step else f" (timed at step {timed_step})"
    ratio = f"{factor:.1f}x" if np.isfinite(factor) else "above"
    # "kind/name " first, as every rule's message (alerts print the rest after the tensor's place)
    message = (
        f"time/{phase} {_ms(mine)} a step{what} over the last {rule.window} steps{at}, {ratio} the ranks' "
        f"median {_ms(median)} (+{_ms(mine - median)}); rank {record.rank}'s {breakdown(times)}"
    )
    return Anomaly(
        step=record.step,
        rank=record.rank,
        kind="time",
        name=phase,
        stat="time",
        value=mine,
        rule=STRAGGLER_RULE,
        seq=0,
        phase=phase,
        baseline=median,
        wall_time=record.wall_time,
        message=message,
    )
