"""The anomaly pipeline of one rank, run by the writer thread on every finished step:
rules -> overflow origin -> anomaly records (JSONL) -> alerts."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from trainmon.anomaly.alerts import dispatcher_from_config
from trainmon.anomaly.jsonl import AnomalyLog
from trainmon.anomaly.origin import locate_overflow, mark
from trainmon.anomaly.rules import RuleEngine, parse_rules
from trainmon.records import Anomaly, StepRecord

_NON_FINITE_RULES = ("nan", "inf")
_DELIVERY_KEYS = ("webhooks", "rate_limit_s", "max_queue", "max_lines")


class AnomalySink:
    """A writer-thread sink. ``run_dir`` None keeps records off disk (format ``api``); alerts still go out."""

    def __init__(self, alert: Mapping[str, Any], rank: int, run_name: str, run_dir: Path | None) -> None:
        self._engine = RuleEngine(parse_rules({"rules": alert.get("rules", ())}))
        self._saturation = bool(alert.get("saturation", False))
        max_per_step = int(alert.get("max_per_step", 50))
        self._log = AnomalyLog(run_dir, rank, max_per_step=max_per_step) if run_dir else None
        delivery = {k: alert[k] for k in _DELIVERY_KEYS if k in alert}
        self._dispatcher = dispatcher_from_config(delivery, path="alert")
        self._rank, self._run_name = rank, run_name
        self._lock = threading.Lock()
        self._first_non_finite: Anomaly | None = None

    def write(self, record: StepRecord, derived: dict[str, np.ndarray]) -> None:
        anomalies = self._engine.evaluate(record, derived)
        if not anomalies:
            return
        non_finite = [a for a in anomalies if a.rule in _NON_FINITE_RULES]
        if non_finite:
            anomalies = mark(anomalies, locate_overflow(record, derived, self._saturation))
        written = self._log.write_step(record.step, anomalies) if self._log else anomalies
        self._dispatcher.notify(written, run=self._run_name, rank=self._rank)
        if non_finite:
            first = next((a for a in anomalies if a.origin), None) or non_finite[0]
            with self._lock:
                if self._first_non_finite is None:
                    self._first_non_finite = first

    def take_non_finite(self) -> Anomaly | None:
        """The first NaN/Inf anomaly seen since the last call (the training thread acts on it)."""
        with self._lock:
            found, self._first_non_finite = self._first_non_finite, None
        return found

    def flush(self) -> None:
        self._dispatcher.flush(timeout=10.0)

    def close(self) -> None:
        if self._log:
            self._log.close()
        self._dispatcher.close(timeout=10.0)
