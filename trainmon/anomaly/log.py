"""Appending a rank's anomaly records, with the per-step burst cap (the format:
:mod:`trainmon.run.anomalies`)."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable

from trainmon.run.anomalies import anomaly_to_json
from trainmon.run.append import append_records, open_append
from trainmon.run.layout import anomalies_file
from trainmon.run.records import PHASE_ORDER, SUPPRESSED_RULE, Anomaly

__all__ = ["AnomalyLog"]


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
    """

    def __init__(self, run_dir: str | os.PathLike[str], rank: int, max_per_step: int = 50) -> None:
        if max_per_step < 0:
            raise ValueError(f"max_per_step must be >= 0, got {max_per_step}")
        self.rank = int(rank)
        self.max_per_step = int(max_per_step)
        self.path = anomalies_file(run_dir, self.rank)
        self._lock = threading.Lock()
        self._fd: int | None = open_append(self.path)

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
        written = self._cap(int(step), list(anomalies))
        if not written:
            return written
        data = "".join(anomaly_to_json(a) + "\n" for a in written).encode("utf-8")
        with self._lock:
            if self._fd is None:
                raise ValueError(f"write_step on a closed AnomalyLog ({self.path})")
            append_records(self._fd, data)
        return written

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                fd, self._fd = self._fd, None
                os.close(fd)

    @property
    def closed(self) -> bool:
        return self._fd is None

    def __enter__(self) -> AnomalyLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
