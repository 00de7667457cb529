"""Runs with known per-rank times for the plugin's time views (tests/test_plugin_time.py,
tests/test_plugin_time_ui.py), written through the monitor's own log of a rank
(:class:`trainmon.anomaly.log.AnomalyLog`: the timing tables, ``rank_times/`` by rank 0, the steps table, the
summaries) from exchanged rows (:data:`trainmon.run.timing.EXCHANGED`) made here; the straggler's records come
from the rule itself (:class:`trainmon.anomaly.straggler.StragglerEngine`, its defaults).

Every rank-step is :data:`BASE_MS` plus a little of its own; the straggler's forward takes
:data:`STRAGGLER_MS` more from ``straggler_from`` on, and every rank waits for the slowest at the one
collective of a step (its slot), so the others' wait rises by as much. Times are whole microseconds."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from trainmon.anomaly.log import AnomalyLog
from trainmon.anomaly.straggler import StragglerEngine
from trainmon.config.rules import StragglerRule
from trainmon.run.manifest import write_manifest
from trainmon.run.records import N_PARTIALS, StepRecord
from trainmon.run.timing import FIELD, SLOT0, WIDTH, StepTiming, rank_times

BASE_MS = {"data": 2.0, "forward": 30.0, "backward": 50.0, "optimizer": 10.0, "monitor": 0.5, "other": 1.0}
COMM_MS = 8.0
STRAGGLER_MS = 40.0


def exchanged_rows(
    world: int, step: int, straggler: int | None, straggler_from: int, straggler_to: int | None = None
) -> np.ndarray:
    """``(world, WIDTH)``: every rank's exchanged row of ``step`` (seconds); the straggler slow from
    ``straggler_from`` up to ``straggler_to`` (not included; None: to the end)."""
    rng = np.random.default_rng((7, step))
    rows = np.zeros((world, WIDTH))
    ms = {name: base + rng.integers(0, 1000, world) / 1000.0 for name, base in BASE_MS.items()}
    slow_to = step + 1 if straggler_to is None else straggler_to
    if straggler is not None and straggler_from <= step < slow_to:
        ms["forward"][straggler] += STRAGGLER_MS
    ms["gc"] = np.zeros(world)
    if world > 1 and step % 7 == 3:  # a collection on one rank now and then
        ms["gc"][1] = 12.0
    arrived = ms["data"] + ms["forward"] + ms["backward"] + ms["gc"]
    ms["comm"] = COMM_MS + rng.integers(0, 100, world) / 1000.0 + (arrived.max() - arrived)
    for name, values in ms.items():
        rows[:, FIELD[name]] = np.round(values, 3) / 1e3
    rows[:, FIELD["step"]] = sum(rows[:, FIELD[n]] for n in ms)
    rows[:, FIELD["gc_count"]] = ms["gc"] > 0
    rows[:, FIELD["comm_count"]] = 1
    rows[:, FIELD["present"]] = 1
    rows[:, SLOT0] = rows[:, FIELD["comm"]]
    return rows


def grad_norm(rank: int, step: int) -> float:
    """The gradient norm the steps table holds for a rank-step."""
    return 1.0 + 0.01 * step + 0.001 * rank


def write_timed_run(
    run: Path,
    world: int,
    steps: int,
    straggler: int | None = None,
    straggler_from: int = 0,
    timed: list[int] | None = None,
    straggler_to: int | None = None,
) -> np.ndarray:
    """Write the run (the steps ``timed``, default every one of ``steps``); returns every rank's times
    ``(steps, world, len(TIMES))`` in seconds, as :func:`rank_times` derives them from the rows (what the
    tables hold; NaN at the steps not timed)."""
    run.mkdir(parents=True, exist_ok=True)
    write_manifest(run, {"world_size": world, "config": {}, "chunks": 1})
    rows = [exchanged_rows(world, s, straggler, straggler_from, straggler_to) for s in range(steps)]
    timed = list(range(steps)) if timed is None else timed
    for rank in range(world):
        log = AnomalyLog(run, rank)
        engine = StragglerEngine([StragglerRule()]) if rank == straggler else None
        for step in timed:
            timing = StepTiming(step, rank, rows[step][rank], rows[step] if world > 1 else None)
            if engine is not None:
                record = StepRecord(step, rank, (), np.empty((0, N_PARTIALS)), 1.7e9 + step, timing=timing)
                found = engine.evaluate(record)
                if found:
                    log.write_step(step, found)
            log.end_step(step, 1.7e9 + step, grad_norm(rank, step), 0.0, 4, timing=timing)
        log.close()
    out = np.stack([rank_times(r) for r in rows])
    out[np.setdiff1d(np.arange(steps), timed)] = np.nan
    return out
