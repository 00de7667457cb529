"""Appending a rank's anomaly records, with the per-step burst cap, its per-step rows and its summary (the
formats: :mod:`trainmon.run.anomaly_table`, :mod:`trainmon.run.steptable`, :mod:`trainmon.run.summary`)."""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Iterable

from trainmon.run.anomalies import iter_anomalies
from trainmon.run.anomaly_table import ANOMALY_OPTIONS, ANOMALY_SCHEMA, AnomalyEncoder
from trainmon.run.columnar import SegmentWriter
from trainmon.run.layout import anomalies_file, anomalies_rank_dir, steps_rank_dir, summary_file
from trainmon.run.records import PHASE_ORDER, SUPPRESSED_RULE, Anomaly
from trainmon.run.steptable import STEPS_OPTIONS, STEPS_SCHEMA, encode_step
from trainmon.run.summary import RankSummary, SummaryFile, read_summary

logger = logging.getLogger("trainmon")

__all__ = ["AnomalyLog"]


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
    """

    def __init__(self, run_dir: str | os.PathLike[str], rank: int, max_per_step: int = 50) -> None:
        if max_per_step < 0:
            raise ValueError(f"max_per_step must be >= 0, got {max_per_step}")
        self.run_dir = run_dir
        self.rank = int(rank)
        self.max_per_step = int(max_per_step)
        self.path = anomalies_rank_dir(run_dir, self.rank)
        self._lock = threading.Lock()
        self._encoder = AnomalyEncoder()
        self._records: SegmentWriter | None = SegmentWriter(self.path, ANOMALY_SCHEMA, ANOMALY_OPTIONS)
        self._steps = SegmentWriter(steps_rank_dir(run_dir, self.rank), STEPS_SCHEMA, STEPS_OPTIONS)
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

    def write_step(self, step: int, anomalies: Iterable[Anomaly]) -> list[Anomaly]:
        """Append the anomalies of one step (burst cap applied, in (phase, micro-step, seq) order) and
        return what was written. The anomalies are written as given: no field of them is assigned."""
        step = int(step)
        written = self._cap(step, list(anomalies))
        if not written:
            return written
        with self._lock:
            if self._records is None:
                raise ValueError(f"write_step on a closed AnomalyLog ({self.path})")
            self._records.append(self._encoder.encode(written), step)
            before = self._written_at[1] if self._written_at[0] == step else 0
            self._written_at = (step, before + len(written))
            self.summary = self.summary.with_records(written)
            self._summary_file.write(self.summary)
        return written

    def end_step(
        self,
        step: int,
        wall_time: float,
        grad_norm: float = math.nan,
        grad_nonfinite: float = 0.0,
        tensors: int = 0,
        skipped: bool = False,
    ) -> None:
        """The step has ended (after its :meth:`write_step` calls, if any): append its row to the steps
        table and rewrite the summary with it."""
        step = int(step)
        with self._lock:
            if self._records is None:
                raise ValueError(f"end_step on a closed AnomalyLog ({self.path})")
            records = self._written_at[1] if self._written_at[0] == step else 0
            try:
                row = encode_step(step, wall_time, grad_norm, grad_nonfinite, tensors, records, skipped)
                self._steps.append(row, step)
            finally:  # the summary's step goes on even when the row could not be written
                norm = None if math.isnan(grad_norm) else float(grad_norm)  # NaN: no gradient collected
                self.summary = self.summary.with_step(step, wall_time, norm)
                self._summary_file.write(self.summary)

    def close(self) -> None:
        with self._lock:
            if self._records is not None:
                records, self._records = self._records, None
                records.close()
                self._steps.close()

    @property
    def closed(self) -> bool:
        return self._records is None

    def __enter__(self) -> AnomalyLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
