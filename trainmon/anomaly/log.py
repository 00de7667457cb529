"""Appending a rank's anomaly records, with the per-step burst cap, its per-step rows and its summary (the
formats: :mod:`trainmon.run.anomaly_table`, :mod:`trainmon.run.steptable`, :mod:`trainmon.run.summary`), and
keeping the records a failed write could not store (bounded) until the table can be written again."""

from __future__ import annotations

import logging
import math
import os
import threading
from collections import deque
from collections.abc import Iterable

from trainmon.run.anomalies import anomaly_to_json, iter_anomalies
from trainmon.run.anomaly_table import ANOMALY_OPTIONS, ANOMALY_SCHEMA, AnomalyEncoder
from trainmon.run.columnar import SegmentWriter
from trainmon.run.layout import (
    anomalies_file,
    anomalies_rank_dir,
    rank_times_dir,
    steps_rank_dir,
    summary_file,
    timing_rank_dir,
)
from trainmon.run.records import PHASE_ORDER, SUPPRESSED_RULE, Anomaly
from trainmon.run.steptable import STEPS_OPTIONS, STEPS_SCHEMA, encode_step
from trainmon.run.summary import RankSummary, SummaryFile, read_summary
from trainmon.run.timetable import (
    RANK_TIMES_OPTIONS,
    RANK_TIMES_SCHEMA,
    TIMING_OPTIONS,
    TIMING_SCHEMA,
    encode_rank_times,
    encode_timing,
)
from trainmon.run.timing import FIELD, StepTiming

logger = logging.getLogger("trainmon")

__all__ = ["AnomalyLog"]

# Records kept in memory while the table cannot be written (a full or read-only disk): the earliest steps are
# kept (where a NaN started), later ones beyond this are counted and dropped. Sizes are those of the records
# as JSON, a fair measure of what they hold.
MAX_BACKLOG_BYTES = 4 << 20


def _phase_rank(phase: str) -> int:
    return PHASE_ORDER.get(phase, len(PHASE_ORDER))


def _step_order(a: Anomaly) -> tuple[int, int, int]:
    return (_phase_rank(a.phase), a.micro_step, a.seq)


class AnomalyLog:
    """Appends the anomalies of one rank to its partition of the anomaly table
    (``RUN/plugins/trainmon/anomalies/rank=<r>/``), its per-step rows to the steps table and keeps its
    summary (``summary/rank_<r>.json``) current.

    Each :meth:`write_step` appends one record batch (whole, or nothing) and rewrites the summary; each
    :meth:`end_step` appends the step's row and rewrites the summary. At most ``max_per_step`` anomalies are
    kept per step (the first ones in (phase, micro-step, seq) order); the rest are replaced by one summary
    anomaly with rule ``"suppressed"``, name ``"*"`` and the number dropped as its value. The earliest
    anomaly of a step is therefore never dropped. A job resumed into the run continues the summary it finds.

    A step whose records cannot be written (disk full, read-only) is kept in memory, up to
    ``max_backlog_bytes``, and written before the next step's records once the table can be written again;
    :attr:`error` says why the last write failed while records wait (None when none wait). The summary in
    memory holds them at once, so the summary file has them at its next successful rewrite.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        rank: int,
        max_per_step: int = 50,
        max_backlog_bytes: int = MAX_BACKLOG_BYTES,
    ) -> None:
        if max_per_step < 0:
            raise ValueError(f"max_per_step must be >= 0, got {max_per_step}")
        self.run_dir = run_dir
        self.rank = int(rank)
        self.max_per_step = int(max_per_step)
        self.max_backlog_bytes = int(max_backlog_bytes)
        self.path = anomalies_rank_dir(run_dir, self.rank)
        self._lock = threading.Lock()
        self._encoder = AnomalyEncoder()
        self._records: SegmentWriter | None = SegmentWriter(self.path, ANOMALY_SCHEMA, ANOMALY_OPTIONS)
        self._steps = SegmentWriter(steps_rank_dir(run_dir, self.rank), STEPS_SCHEMA, STEPS_OPTIONS)
        # the step times: this rank's (opened at its first timed step), and on rank 0 every rank's
        self._timing: SegmentWriter | None = None
        self._rank_times: SegmentWriter | None = None
        self._summary_file = SummaryFile(summary_file(run_dir, self.rank))
        try:
            found = read_summary(self._summary_file.path)
        except ValueError as e:  # a damaged summary: start over rather than stop recording
            logger.warning("trainmon: %s; starting a new summary", e)
            found = None
        if found is None or found.rank != self.rank:  # a new rank, or one of a run of the old layout
            found = RankSummary(self.rank)
            if anomalies_file(run_dir, self.rank).exists():
                found = found.with_records(iter_anomalies(anomalies_file(run_dir, self.rank)))
        self.summary = found
        self._written_at: tuple[int, int] = (-1, 0)  # (step, records written for it)
        self._backlog: deque[tuple[int, list[Anomaly], int]] = deque()  # (step, records, bytes), oldest first
        self._backlog_bytes = 0
        self.lost = 0  # anomalies dropped because the backlog was full
        self.error: OSError | None = None
        self._steps_error: OSError | None = None  # the steps table or summary could not be written

    def _cap(self, step: int, anomalies: list[Anomaly]) -> list[Anomaly]:
        if len(anomalies) <= self.max_per_step:
            return sorted(anomalies, key=_step_order)
        ordered = sorted(anomalies, key=_step_order)  # stable: ties keep the caller's order
        kept, dropped = ordered[: self.max_per_step], ordered[self.max_per_step :]
        first = dropped[0]  # the summary sits where the dropping started
        summary = Anomaly(
            step=step,
            rank=self.rank,
            kind="*",
            name="*",
            stat="*",
            value=float(len(dropped)),
            rule=SUPPRESSED_RULE,
            seq=first.seq,
            micro_step=first.micro_step,
            vpp_stage=first.vpp_stage,
            pp_stage=first.pp_stage,
            phase=first.phase,
            collectives=first.collectives,
            wall_time=first.wall_time,
            message=f"{len(dropped)} more anomalies at this step not recorded "
            f"(at most {self.max_per_step} a step)",
        )
        return [*kept, summary]

    def cap(self, step: int, anomalies: Iterable[Anomaly]) -> list[Anomaly]:
        """One step's anomalies as they are recorded: (phase, micro-step, seq) order, burst cap applied."""
        return self._cap(int(step), list(anomalies))

    def write_step(self, step: int, anomalies: Iterable[Anomaly]) -> list[Anomaly]:
        """Append the anomalies of one step (burst cap applied, in (phase, micro-step, seq) order) and
        return what is recorded. The anomalies are written as given: no field of them is assigned. Records
        that cannot be written now wait in memory (see :attr:`error`); a failed write never raises."""
        written = self.cap(step, anomalies)
        self.append(written)
        return written

    def append(self, recorded: Iterable[Anomaly]) -> bool:
        """Append one step's already capped anomalies (one record batch); False when they wait in memory
        instead."""
        recorded = list(recorded)
        with self._lock:
            if self._records is None:
                raise ValueError(f"write to a closed AnomalyLog ({self.path})")
            if not recorded:
                return self._drain()
            self.summary = self.summary.with_records(recorded)
            size = sum(len(anomaly_to_json(a)) + 1 for a in recorded) if self._backlog or self.error else 0
            if self._backlog and self._backlog_bytes + size > self.max_backlog_bytes:
                self.lost += len(recorded)
            else:
                self._backlog.append((recorded[0].step, recorded, size))
                self._backlog_bytes += size
            written = self._drain()
            if written:
                self._write_summary()
            return written

    def flush(self) -> bool:
        """Write the records waiting in memory, if the table can be written now; True when none wait."""
        with self._lock:
            if self._records is None:
                return True
            written = self._drain()
            if written and self._steps_error is not None:
                self._write_summary()
            return written

    def _drain(self) -> bool:
        backlog = self._backlog
        try:
            while backlog:
                step, records, size = backlog[0]
                try:
                    batch = self._encoder.encode(records)
                except Exception:  # records that cannot be encoded must not hold up the ones after them
                    logger.exception(
                        "trainmon: %d anomaly records of step %d cannot be stored", len(records), step
                    )
                    backlog.popleft()
                    self._backlog_bytes -= size
                    self.lost += len(records)
                    continue
                self._records.append(batch, step)
                backlog.popleft()
                self._backlog_bytes -= size
                before = self._written_at[1] if self._written_at[0] == step else 0
                self._written_at = (step, before + len(records))
        except OSError as e:
            if self.error is None:
                logger.error(
                    "trainmon: cannot write anomaly records to %s (%s); they are kept in memory (up to %d "
                    "bytes) and written when it works again",
                    self.path,
                    e,
                    self.max_backlog_bytes,
                )
                # what waits from now on is measured, so that the bound holds
                for i, (step, records, size) in enumerate(backlog):
                    if not size:
                        size = sum(len(anomaly_to_json(a)) + 1 for a in records)
                        backlog[i] = (step, records, size)
                        self._backlog_bytes += size
            self.error = e
            return False
        if self.error is not None:
            self.error = None
            logger.warning(
                "trainmon: anomaly records are written to %s again (those kept in memory included%s)",
                self.path,
                f"; {self.lost} that did not fit in memory are lost" if self.lost else "",
            )
        return True

    def _write_summary(self) -> None:
        try:
            self._summary_file.write(self.summary)
        except OSError as e:  # rewritten whole at the next step end: nothing is lost meanwhile
            self._note_steps_error(e)
        else:
            self._steps_error = None

    def _note_steps_error(self, e: OSError) -> None:
        if self._steps_error is None:
            logger.warning(
                "trainmon: cannot write the steps table or the summary of rank %d under %s (%s); they are "
                "written again when it works",
                self.rank,
                self.run_dir,
                e,
            )
        self._steps_error = e

    def end_step(
        self,
        step: int,
        wall_time: float,
        grad_norm: float = math.nan,
        grad_nonfinite: float = 0.0,
        tensors: int = 0,
        skipped: bool = False,
        timing: StepTiming | None = None,
    ) -> None:
        """The step has ended (after its :meth:`write_step` calls, if any): append its row to the steps
        table (and its times to the timing tables) and rewrite the summary with it. A failed write is said
        once and never raised."""
        step = int(step)
        with self._lock:
            if self._records is None:
                raise ValueError(f"end_step on a closed AnomalyLog ({self.path})")
            self._drain()
            records = self._written_at[1] if self._written_at[0] == step else 0
            try:
                row = encode_step(step, wall_time, grad_norm, grad_nonfinite, tensors, records, skipped)
                self._steps.append(row, step)
            except OSError as e:
                self._note_steps_error(e)
            # the summary's step goes on even when the row could not be written
            norm = None if math.isnan(grad_norm) else float(grad_norm)  # NaN: no gradient collected
            self.summary = self.summary.with_step(step, wall_time, norm)
            if timing is not None:
                self._write_timing(timing)
            self._write_summary()

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
            self._note_steps_error(e)

    def close(self) -> None:
        with self._lock:
            if self._records is None:
                return
            if not self._drain():
                kept = sum(len(records) for _, records, _ in self._backlog)
                logger.error(
                    "trainmon: %d anomaly records of rank %d could not be written to %s (%s) and are lost",
                    kept + self.lost,
                    self.rank,
                    self.path,
                    self.error,
                )
            records, self._records = self._records, None
            records.close()
            self._steps.close()
            for table in (self._timing, self._rank_times):
                if table is not None:
                    table.close()

    @property
    def closed(self) -> bool:
        return self._records is None

    def __enter__(self) -> AnomalyLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
