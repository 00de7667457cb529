"""Appending a rank's anomaly records, with the per-step burst cap (the format:
:mod:`trainmon.run.anomaly_table`), and keeping the records a failed write could not store (bounded) until the
table can be written again. Its step ends and the records it wrote go on to the rank's step log
(:mod:`trainmon.anomaly.steplog`: the steps table, the timing tables, the summary)."""

from __future__ import annotations

import logging
import math
import os
import threading
from collections import deque
from collections.abc import Iterable

from trainmon.anomaly.steplog import StepEnd, StepLog, StepTarget
from trainmon.run.anomalies import anomaly_to_json
from trainmon.run.anomaly_table import ANOMALY_OPTIONS, ANOMALY_SCHEMA, AnomalyEncoder
from trainmon.run.columnar import SegmentWriter
from trainmon.run.layout import anomalies_rank_dir
from trainmon.run.records import PHASE_ORDER, SUPPRESSED_RULE, Anomaly
from trainmon.run.summary import RankSummary
from trainmon.run.timing import StepTiming

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
    (``RUN/plugins/trainmon/anomalies/rank=<r>/``) and hands the records and its step ends to ``steps``, the
    rank's step log (steps table, timing tables, summary): a :class:`~trainmon.anomaly.steplog.StepLog` of
    its own when none is given.

    Each :meth:`write_step` appends one record batch (whole, or nothing) and has the summary count it; each
    :meth:`end_step` has the step log append the step's row and rewrite the summary. At most
    ``max_per_step`` anomalies are kept per step (the first ones in (phase, micro-step, seq) order); the
    rest are replaced by one summary anomaly with rule ``"suppressed"``, name ``"*"`` and the number dropped
    as its value. The earliest anomaly of a step is therefore never dropped.

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
        steps: StepTarget | None = None,
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
        self.steps: StepTarget = steps if steps is not None else StepLog(run_dir, self.rank)
        self._written_at: tuple[int, int] = (-1, 0)  # (step, records written for it)
        self._backlog: deque[tuple[int, list[Anomaly], int]] = deque()  # (step, records, bytes), oldest first
        self._backlog_bytes = 0
        self.lost = 0  # anomalies dropped because the backlog was full
        self.error: OSError | None = None

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
            size = sum(len(anomaly_to_json(a)) + 1 for a in recorded) if self._backlog or self.error else 0
            if self._backlog and self._backlog_bytes + size > self.max_backlog_bytes:
                self.lost += len(recorded)
            else:
                self._backlog.append((recorded[0].step, recorded, size))
                self._backlog_bytes += size
            written = self._drain()
            # after the table: a summary never counts records a killed job did not write (unless they wait
            # in memory, which the summary counts at once)
            self.steps.records(recorded)
            return written

    def flush(self) -> bool:
        """Write the records waiting in memory, if the table can be written now; True when none wait."""
        with self._lock:
            if self._records is None:
                return True
            written = self._drain()
        self.steps.flush()
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
        """The step has ended (after its :meth:`write_step` calls, if any): the step log appends its row to
        the steps table (and its times to the timing tables) and rewrites the summary with it. A failed write
        is said once and never raised."""
        step = int(step)
        with self._lock:
            if self._records is None:
                raise ValueError(f"end_step on a closed AnomalyLog ({self.path})")
            self._drain()
            records = self._written_at[1] if self._written_at[0] == step else 0
            end = StepEnd(
                step, float(wall_time), float(grad_norm), float(grad_nonfinite), int(tensors), records,
                bool(skipped),
            )  # fmt: skip
            self.steps.end_step(end, timing)

    @property
    def summary(self) -> RankSummary:
        """The summary as this process holds it (a step log of its own only: the writer process holds it
        otherwise)."""
        return self.steps.summary  # type: ignore[attr-defined]  # a StepLog's

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
            self.steps.close()

    @property
    def closed(self) -> bool:
        return self._records is None

    def __enter__(self) -> AnomalyLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
