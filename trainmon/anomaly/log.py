"""Appending a rank's anomaly records, with the per-step burst cap (the format:
:mod:`trainmon.run.anomalies`), and keeping the records a failed write could not store (bounded) until the
file can be written again."""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Iterable

from trainmon.run.anomalies import anomaly_to_json
from trainmon.run.append import AppendFile
from trainmon.run.layout import anomalies_file
from trainmon.run.records import PHASE_ORDER, SUPPRESSED_RULE, Anomaly

__all__ = ["AnomalyLog"]

logger = logging.getLogger("trainmon")

# Records kept in memory while the file cannot be written (a full or read-only disk): the earliest steps are
# kept (where a NaN started), later ones beyond this are counted and dropped.
MAX_BACKLOG_BYTES = 4 << 20


def _phase_rank(phase: str) -> int:
    return PHASE_ORDER.get(phase, len(PHASE_ORDER))


def _step_order(a: Anomaly) -> tuple[int, int, int]:
    return (_phase_rank(a.phase), a.micro_step, a.seq)


class AnomalyLog:
    """Appends the anomalies of one rank to ``run_dir/plugins/trainmon/anomalies/rank_<rank>.jsonl``.

    Each :meth:`write_step` is one ``os.write`` of complete lines on an ``O_APPEND`` descriptor. At most
    ``max_per_step`` anomalies are kept per step (the first ones in (phase, micro-step, seq) order); the rest
    are replaced by one summary anomaly with rule ``"suppressed"``, name ``"*"`` and the number dropped as
    its value. The earliest anomaly of a step is therefore never dropped.

    A step whose lines cannot be written (disk full, read-only) is kept in memory, up to
    ``max_backlog_bytes``, and written before the next step's lines once the file can be written again;
    :attr:`error` says why the last write failed while records wait (None when none wait).
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
        self.rank = int(rank)
        self.max_per_step = int(max_per_step)
        self.max_backlog_bytes = int(max_backlog_bytes)
        self.path = anomalies_file(run_dir, self.rank)
        self._lock = threading.Lock()
        self._file: AppendFile | None = AppendFile(self.path)
        self._backlog: deque[bytes] = deque()  # steps' lines not written yet, oldest first
        self._backlog_bytes = 0
        self.lost = 0  # anomalies dropped because the backlog was full
        self.error: OSError | None = None

    def cap(self, step: int, anomalies: Iterable[Anomaly]) -> list[Anomaly]:
        """One step's anomalies as they are recorded: (phase, micro-step, seq) order, burst cap applied."""
        return self._cap(int(step), list(anomalies))

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
        return what is recorded. The anomalies are written as given: no field of them is assigned. Lines that
        cannot be written now wait in memory (see :attr:`error`); this never raises for a failed write."""
        written = self._cap(int(step), list(anomalies))
        self.append(written)
        return written

    def append(self, recorded: Iterable[Anomaly]) -> bool:
        """Append already capped anomalies (one write); False when they wait in memory instead."""
        lines = [anomaly_to_json(a) + "\n" for a in recorded]
        with self._lock:
            if self._file is None:
                raise ValueError(f"write to a closed AnomalyLog ({self.path})")
            if not lines:
                return self._drain()
            data = "".join(lines).encode("utf-8", "backslashreplace")
            if self._backlog_bytes + len(data) > self.max_backlog_bytes and self._backlog:
                self.lost += len(lines)
            else:
                self._backlog.append(data)
                self._backlog_bytes += len(data)
            return self._drain()

    def flush(self) -> bool:
        """Write the records waiting in memory, if the file can be written now; True when none wait."""
        with self._lock:
            return self._file is None or self._drain()

    def _drain(self) -> bool:
        backlog = self._backlog
        try:
            while backlog:
                self._file.append(backlog[0])
                self._backlog_bytes -= len(backlog.popleft())
        except OSError as e:
            if self.error is None:
                logger.error(
                    "trainmon: cannot write anomaly records to %s (%s); they are kept in memory (up to %d "
                    "bytes) and written when it works again",
                    self.path,
                    e,
                    self.max_backlog_bytes,
                )
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

    def close(self) -> None:
        with self._lock:
            if self._file is None:
                return
            if not self._drain():
                kept = sum(data.count(b"\n") for data in self._backlog)
                logger.error(
                    "trainmon: %d anomaly records of rank %d could not be written to %s (%s) and are lost",
                    kept + self.lost,
                    self.rank,
                    self.path,
                    self.error,
                )
            f, self._file = self._file, None
            f.close()

    @property
    def closed(self) -> bool:
        return self._file is None

    def __enter__(self) -> AnomalyLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
