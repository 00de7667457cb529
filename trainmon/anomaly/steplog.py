"""A rank's per-step outputs: its row of the steps table, its times (the timing tables) and its summary,
rewritten at every step's end (the formats: :mod:`trainmon.run.steptable`, :mod:`trainmon.run.timetable`,
:mod:`trainmon.run.summary`).

They are written where the step's statistics are: in the writer process, which the anomaly sink feeds with
the step's end and the records it wrote (:class:`trainmon.writer.process.RemoteStepLog`), so that the
training process spends none of its time on them; or by :class:`StepLog` in the writer thread
(``TRAINMON_WRITER=thread``, a writer process that ended, a rank that writes no statistics).
"""

from __future__ import annotations

import logging
import math
import os
import threading
from dataclasses import dataclass
from typing import Protocol

from trainmon.run.anomalies import iter_anomalies
from trainmon.run.columnar import SegmentWriter
from trainmon.run.layout import anomalies_file, rank_times_dir, steps_rank_dir, summary_file, timing_rank_dir
from trainmon.run.records import Anomaly
from trainmon.run.steptable import STEPS_OPTIONS, STEPS_SCHEMA, encode_step, read_steps
from trainmon.run.summary import RankSummary, SummaryFile, read_summary
from trainmon.run.timetable import (
    RANK_TIMES_OPTIONS,
    RANK_TIMES_SCHEMA,
    TIMING_COLUMNS,
    TIMING_OPTIONS,
    TIMING_SCHEMA,
    encode_rank_times,
    encode_timing,
    read_timing,
)
from trainmon.run.timing import FIELD, StepTiming

logger = logging.getLogger("trainmon")

__all__ = ["StepEnd", "StepLog", "StepTarget"]


@dataclass(frozen=True, slots=True)
class StepEnd:
    """What the steps table and the summary record of a step that ended (its times travel with its record:
    :class:`~trainmon.run.timing.StepTiming`)."""

    step: int
    wall_time: float
    grad_norm: float = math.nan  # NaN: no gradient collected
    grad_nonfinite: float = 0.0
    tensors: int = 0
    anomalies: int = 0  # the records written for the step
    skipped: bool = False


class StepTarget(Protocol):
    """Where the anomaly log sends a rank's step ends and the records it wrote (for the summary's counts)."""

    def records(self, recorded: list[Anomaly]) -> None: ...

    def end_step(self, end: StepEnd, timing: StepTiming | None) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class StepLog:
    """Appends a rank's per-step rows to the steps table (``RUN/plugins/trainmon/steps/rank=<r>/``), its times
    to the timing tables and keeps its summary (``summary/rank_<r>.json``) current. A job resumed into the run
    continues the summary it finds. A failed write is said once and never raised: the summary is rewritten
    whole at the next step end, so nothing of it is lost meanwhile. Thread-safe (the writer's checking
    thread adds the records of steps whose statistics were dropped)."""

    def __init__(self, run_dir: str | os.PathLike[str], rank: int) -> None:
        self.run_dir = run_dir
        self.rank = int(rank)
        self._lock = threading.Lock()
        found = self._found_summary()
        self._steps: SegmentWriter | None = SegmentWriter(
            steps_rank_dir(run_dir, self.rank), STEPS_SCHEMA, STEPS_OPTIONS
        )
        # the step times: this rank's (opened at its first timed step), and on rank 0 every rank's
        self._timing: SegmentWriter | None = None
        self._rank_times: SegmentWriter | None = None
        self._summary_file = SummaryFile(summary_file(run_dir, self.rank))
        self.summary = found
        self._error: OSError | None = None  # the last write failed

    def _found_summary(self) -> RankSummary:
        """The summary a job before this one left (a resumed job, or the writer process this log replaces),
        caught up with the tables, or a new one."""
        try:
            found = read_summary(summary_file(self.run_dir, self.rank))
        except ValueError as e:  # a damaged summary: start over rather than stop recording
            logger.warning("trainmon: %s; starting a new summary", e)
            found = None
        if found is None or found.rank != self.rank:  # a new rank, or one of a run of the old layout
            found = RankSummary(self.rank)
            if anomalies_file(self.run_dir, self.rank).exists():
                found = found.with_records(iter_anomalies(anomalies_file(self.run_dir, self.rank)))
        try:
            return self._caught_up(found)
        except Exception:  # the tables cannot be read: the summary as it was found
            logger.debug("trainmon: reading the steps table of rank %d failed", self.rank, exc_info=True)
            return found

    def _caught_up(self, summary: RankSummary) -> RankSummary:
        """``summary`` with the rows the tables hold beyond it. A step's row and times are appended before
        the summary is rewritten with them; a writer killed in between (the writer process, a job) left them
        uncounted, and the summary must count what the tables hold."""
        after = None if summary.last_step is None else summary.last_step + 1
        if after is None and not steps_rank_dir(self.run_dir, self.rank).is_dir():
            return summary  # a new rank: nothing to read
        steps = read_steps(self.run_dir, self.rank, ("step", "wall_time", "grad_norm"), step_lo=after)
        rows = zip(*(steps.column(i).to_pylist() for i in range(3)), strict=True)
        for step, wall_time, norm in sorted(rows):
            summary = summary.with_step(step, wall_time, None if math.isnan(norm) else norm)
        if timing_rank_dir(self.run_dir, self.rank).is_dir():
            # on an accelerator a step's times are of an earlier step: what is uncounted is the last rows
            timing = read_timing(self.run_dir, self.rank, TIMING_COLUMNS)
            for row in range(summary.timed, timing.num_rows):
                summary = summary.with_times([timing.column(name)[row].as_py() for name in TIMING_COLUMNS])
        return summary

    def records(self, recorded: list[Anomaly]) -> None:
        """Records written (or kept in memory to be written) for a step: the summary counts them at once."""
        if not recorded:
            return
        with self._lock:
            self.summary = self.summary.with_records(recorded)
            self._write_summary()

    def end_step(self, end: StepEnd, timing: StepTiming | None = None) -> None:
        """Append the step's row (and its times) and rewrite the summary with it."""
        with self._lock:
            if self._steps is None:
                raise ValueError(f"end_step on a closed StepLog ({self.run_dir}, rank {self.rank})")
            try:
                row = encode_step(
                    end.step, end.wall_time, end.grad_norm, end.grad_nonfinite, end.tensors, end.anomalies,
                    end.skipped,
                )  # fmt: skip
                self._steps.append(row, end.step)
            except OSError as e:
                self._note_error(e)
            # the summary's step goes on even when the row could not be written
            norm = None if math.isnan(end.grad_norm) else float(end.grad_norm)  # NaN: no gradient collected
            self.summary = self.summary.with_step(end.step, end.wall_time, norm)
            if timing is not None:
                self._write_timing(timing)
            self._write_summary()

    def flush(self) -> None:
        """Rewrite the summary when its last rewrite failed."""
        with self._lock:
            if self._error is not None and self._steps is not None:
                self._write_summary()

    def close(self) -> None:
        with self._lock:
            steps, self._steps = self._steps, None
            if steps is None:
                return
            steps.close()
            for table in (self._timing, self._rank_times):
                if table is not None:
                    table.close()

    @property
    def closed(self) -> bool:
        return self._steps is None

    def _write_timing(self, timing: StepTiming) -> None:
        table = timing.table()
        mine = table[timing.index if timing.ranks is not None else 0]
        self.summary = self.summary.with_times(mine)
        try:
            if self._timing is None:
                folder = timing_rank_dir(self.run_dir, self.rank)
                self._timing = SegmentWriter(folder, TIMING_SCHEMA, TIMING_OPTIONS)
            own = timing.own
            row = encode_timing(timing.step, mine, int(own[FIELD["gc_count"]]), int(own[FIELD["comm_count"]]))
            self._timing.append(row, timing.step)
            if timing.ranks is not None and self.rank == 0:
                if self._rank_times is None:
                    folder = rank_times_dir(self.run_dir)
                    self._rank_times = SegmentWriter(folder, RANK_TIMES_SCHEMA, RANK_TIMES_OPTIONS)
                self._rank_times.append(encode_rank_times(timing.step, table), timing.step)
        except OSError as e:
            self._note_error(e)

    def _write_summary(self) -> None:
        try:
            self._summary_file.write(self.summary)
        except OSError as e:  # rewritten whole at the next step end: nothing is lost meanwhile
            self._note_error(e)
        else:
            self._error = None

    def _note_error(self, e: OSError) -> None:
        if self._error is None:
            logger.warning(
                "trainmon: cannot write the steps table or the summary of rank %d under %s (%s); they are "
                "written again when it works",
                self.rank,
                self.run_dir,
                e,
            )
        self._error = e
