"""The anomaly pipeline of one rank, run by the writer thread on every finished step:
rules -> overflow origin -> anomaly records (the columnar anomaly table) -> alerts."""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable
from fnmatch import fnmatchcase
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from trainmon.anomaly.alerts import Alert, CallbackSink, dispatcher_for
from trainmon.anomaly.log import AnomalyLog
from trainmon.anomaly.origin import Overflow, Received, locate_overflow, mark
from trainmon.anomaly.rules import RuleEngine, non_finite_part
from trainmon.anomaly.steplog import StepTarget
from trainmon.anomaly.straggler import StragglerEngine
from trainmon.config.rules import straggler_rules, tensor_rules
from trainmon.run.dumps import DumpRequest
from trainmon.run.records import (
    INFS,
    LOSS_SCALE_RULE,
    MAX_RATIO_RULE,
    N_PARTIALS,
    NANS,
    NON_FINITE_RULES,
    SKIPPED_RULE,
    SUMSQ,
    THRESHOLD_RULE,
    Anomaly,
    Derived,
    Kind,
    Phase,
    StepRecord,
)
from trainmon.run.steptable import grad_norm

if TYPE_CHECKING:
    from trainmon.config.alert import AlertConfig

logger = logging.getLogger("trainmon")

# what alert.capture: exact decides and dumps at the step boundary (trainmon.step.boundary)
_EXACT_RULES = (*NON_FINITE_RULES, THRESHOLD_RULE, MAX_RATIO_RULE)
_MAX_DUMP_REQUESTS = 8  # per anomalous step: the origin module and the first flagged tensors
# the alert's note for a step the writer's queue refused (WriterThread's check of dropped steps)
_UNWRITTEN = "the writer was behind: this step's statistics were not written, only its NaN/Inf checked"


class AnomalySink:
    """A writer-thread sink. ``run_dir`` None keeps records off disk (format ``api``); alerts still go out.
    ``steps``: where the step ends and the summary go (the writer process's step log), a step log of its own
    when None."""

    def __init__(
        self,
        alert: AlertConfig,
        rank: int,
        run_name: str,
        run_dir: Path | None,
        request_dump: Callable[[DumpRequest], None] | None = None,
        on_alert: Callable[[Alert], Any] | None = None,
        pp_stage: int = 0,
        steps: StepTarget | None = None,
    ) -> None:
        self._pp_stage = pp_stage
        self._alert = alert
        rules = alert.evaluated_rules  # on_nan keeps NaN/Inf detection on
        self._engine = RuleEngine(tensor_rules(rules))
        # for steps the writer had no room for
        self._nan_engine = RuleEngine(non_finite_part(tensor_rules(rules)))
        self._stragglers = StragglerEngine(straggler_rules(rules))  # judged on the ranks' step times
        self._saturation = alert.saturation
        self._log = (
            AnomalyLog(run_dir, rank, max_per_step=alert.max_per_step, steps=steps) if run_dir else None
        )
        self._extra = [CallbackSink(on_alert)] if on_alert is not None else []
        self._dispatcher = dispatcher_for(alert, extra_sinks=self._extra)
        self._retired: list[Any] = []  # dispatchers of earlier alert sections, delivering what they hold
        self._rank, self._run_name = rank, run_name
        # alert.dump: capture the origin module and the flagged tensors at their next occurrence
        self._dump_requester = request_dump
        self._request_dump = request_dump if alert.dump else None
        self._previous_flagged = False  # dumps are taken at the onset of an anomaly, not while it lasts
        self._lock = threading.Lock()
        self._first_non_finite: Anomaly | None = None
        self._exact_dumps: dict[int, str] = {}  # step -> its exact capture's folder, relative to the run
        self._grad_rows: tuple[object, np.ndarray | None] = (None, None)

    def reconfigure(self, alert: AlertConfig) -> None:
        """Writer thread, between two steps (``WriterThread.call``): follow an edited ``alert`` section.
        The sink stays, so the NaN the training thread is about to act on (``on_nan``) and the exact captures
        noted are kept; the new dispatcher is built before the old one is retired, and the old one still
        delivers what it holds without anyone waiting for it."""
        old = self._alert
        if alert == old:
            return
        dispatcher = self._dispatcher
        if alert.delivery != old.delivery:
            dispatcher = dispatcher_for(alert, extra_sinks=self._extra)
        rules = alert.evaluated_rules
        if tensor_rules(rules) != tensor_rules(old.evaluated_rules):
            self._engine = RuleEngine(tensor_rules(rules))
            self._nan_engine = RuleEngine(non_finite_part(tensor_rules(rules)))
        if straggler_rules(rules) != straggler_rules(old.evaluated_rules):
            self._stragglers = StragglerEngine(straggler_rules(rules))
        self._alert, self._saturation = alert, alert.saturation
        if self._log is not None:
            self._log.max_per_step = alert.max_per_step
        self._request_dump = self._dump_requester if alert.dump else None
        if dispatcher is not self._dispatcher:
            self._dispatcher.retire()
            self._retired = [d for d in self._retired if d.busy] + [self._dispatcher]
            self._dispatcher = dispatcher

    def note_exact_capture(self, step: int, folder: str) -> None:
        """Training thread, at the step boundary: ``step``'s tensors were dumped to ``folder`` already
        (``alert.capture: exact``), so its anomalies link there instead of requesting later dumps."""
        with self._lock:
            self._exact_dumps[step] = folder

    def write(self, record: StepRecord, derived: Derived) -> None:
        try:
            self._write(record, derived)
        finally:  # the step's row and the summary's last step, with or without anomalies
            if self._log:
                norm, nonfinite = self._gradients(derived)
                skipped = record.skipped or bool(record.skip_reason)
                tensors = len(derived.groups.keys)
                self._log.end_step(
                    record.step, record.wall_time, norm, nonfinite, tensors, skipped, timing=record.timing
                )

    def _gradients(self, derived: Derived) -> tuple[float, float]:
        """(norm, NaN + Inf elements) of the step's gradients; (NaN, 0) when none was collected."""
        groups = derived.groups
        if self._grad_rows[0] is not groups:  # the grouping is one object per row layout
            self._grad_rows = (groups, _gradient_rows(groups.keys))
        rows = self._grad_rows[1]
        if rows is None:
            return math.nan, 0.0
        p = derived.merged[rows]
        return grad_norm(p[:, SUMSQ]), float(p[:, NANS].sum() + p[:, INFS].sum())

    def _write(self, record: StepRecord, derived: Derived) -> None:
        anomalies = self._labelled(record, self._engine.evaluate(record, derived))
        # a rank slower than the others: no tensor to dump, no NaN; recorded and alerted like the rest
        stragglers = self._stragglers.evaluate(record) if self._stragglers else []
        if stragglers and self._pp_stage:
            stragglers = [dataclasses.replace(a, pp_stage=self._pp_stage) for a in stragglers]
        onset, self._previous_flagged = not self._previous_flagged, bool(anomalies)
        if not anomalies:
            if stragglers or (record.skip_reason and self._log):  # skip: the NaN was on another rank
                self._record(record.step, stragglers, record)
            return
        non_finite = [a for a in anomalies if a.rule in NON_FINITE_RULES]
        overflow = locate_overflow(record, derived, self._saturation) if non_finite else None
        if non_finite:
            anomalies = mark(anomalies, overflow, record.collectives)
        with self._lock:
            exact = self._exact_dumps.pop(record.step, None)
            for old in [s for s in self._exact_dumps if s < record.step]:  # steps the writer never saw
                del self._exact_dumps[old]
        if exact is not None:  # dumped at this very step (origin module included): later ones explain less
            anomalies = [_link_exact(a, exact) for a in anomalies]
        if self._request_dump is not None and onset:  # a NaN that stays must not dump every step
            anomalies = self._request_dumps(record.step, anomalies, overflow if exact is None else None)
        if non_finite:  # before any write: on_nan never depends on the disk
            self._note_non_finite(anomalies, [a for a in anomalies if a.rule in NON_FINITE_RULES])
        self._record(record.step, [*anomalies, *stragglers], record)

    def check_non_finite(self, record: StepRecord) -> None:
        """A step the writer had no room for (its statistics are not written): only its NaN/Inf counters are
        checked, recorded and alerted on, and noted for ``on_nan``. Runs on the writer's checking thread,
        beside :meth:`write`; it keeps no history, requests no dumps."""
        found = self._non_finite(record)
        if found is not None:
            anomalies, non_finite = found
            self._note_non_finite(anomalies, non_finite)
            self._record(record.step, anomalies, record, note=_UNWRITTEN)

    def peek_non_finite(self, record: StepRecord) -> Anomaly | None:
        """The first NaN/Inf anomaly of ``record`` (its origin where it has one), as :meth:`write` would note
        it, with nothing recorded, alerted or noted: what ``on_nan`` acts on when the writer cannot say in
        time. Safe beside the writer thread."""
        found = self._non_finite(record)
        if found is None:
            return None
        anomalies, non_finite = found
        return next((a for a in anomalies if a.origin), None) or non_finite[0]

    def _non_finite(self, record: StepRecord) -> tuple[list[Anomaly], list[Anomaly]] | None:
        """The NaN/Inf part of the rules on ``record``, origin marked: (every anomaly, the NaN/Inf ones), or
        None when it has none (a loss scaler's overflow is none)."""
        if not has_non_finite(record):  # the common case: nothing to do
            return None
        derived = Derived(record)
        anomalies = self._labelled(record, self._nan_engine.evaluate(record, derived))
        non_finite = [a for a in anomalies if a.rule in NON_FINITE_RULES]
        if not non_finite:
            return None
        overflow = locate_overflow(record, derived, self._saturation)
        return mark(anomalies, overflow, record.collectives), non_finite

    def _labelled(self, record: StepRecord, anomalies: list[Anomaly]) -> list[Anomaly]:
        """The rules' anomalies with what the record knows about their place: collectives, pipeline stage,
        and a loss scaler's skip (NaN/Inf it expects is no alarm)."""
        if anomalies and record.collectives is not None:  # the cross-rank "which came first" key
            anomalies = [
                dataclasses.replace(a, collectives=int(record.collectives[a.seq])) for a in anomalies
            ]
        if anomalies and self._pp_stage:
            anomalies = [dataclasses.replace(a, pp_stage=self._pp_stage) for a in anomalies]
        if record.skipped and not record.skip_reason:  # a loss scaler saw inf/NaN: expected
            anomalies = [
                dataclasses.replace(a, rule=LOSS_SCALE_RULE) if a.rule in NON_FINITE_RULES else a
                for a in anomalies
            ]
        return anomalies

    def _note_non_finite(self, anomalies: list[Anomaly], non_finite: list[Anomaly]) -> None:
        first = next((a for a in anomalies if a.origin), None) or non_finite[0]
        with self._lock:
            if self._first_non_finite is None or first.step < self._first_non_finite.step:
                self._first_non_finite = first

    def _record(self, step: int, anomalies: list[Anomaly], record: StepRecord, note: str = "") -> None:
        """Append the step's records (with its skip record), then alert. A record the disk cannot take now
        waits in memory (AnomalyLog), and the alert says so: a failed write never costs the alert."""
        written = anomalies
        notes = [note] if note else []
        if self._log is not None:
            written = self._log.cap(step, anomalies)
            skip = [_skipped(record, self._alert.on_nan)] if record.skip_reason else []
            skipped = self._log.cap(step, skip) if skip else []
            try:
                if not self._log.append([*written, *skipped]):
                    notes.append(
                        f"not recorded yet: {self._log.path} cannot be written ({self._log.error}); the "
                        "records are kept in memory and written when it can"
                    )
            except Exception:  # never keeps the alert from going out
                logger.exception("trainmon: recording the anomalies of step %d failed", step)
                notes.append("not recorded (see the log)")
        alarms = [a for a in written if a.rule != LOSS_SCALE_RULE]
        if alarms:
            self._dispatcher.notify(alarms, run=self._run_name, rank=self._rank, note="; ".join(notes))

    def _request_dumps(
        self, step: int, anomalies: list[Anomaly], overflow: Overflow | Received | None
    ) -> list[Anomaly]:
        """Request dumps of the origin module and the flagged tensors at their next occurrence; each anomaly
        they cover links to its request (``dump = "request:<id>"``, the ``reason`` of the dump index)."""
        if all(a.dump for a in anomalies):  # all of them captured at their own step (alert.capture: exact)
            return anomalies
        # a rank that received another rank's NaN/Inf has no origin module: its flagged tensors only
        names = ([f"{overflow.module}.*"] if isinstance(overflow, Overflow) else []) + [
            a.name for a in anomalies if a.name != "*" and not a.dump
        ]
        requests = [
            DumpRequest(name=name, step=None, rank=self._rank, kind=None, id=f"anomaly-step{step}-{i}",
                        created=time.time())
            for i, name in enumerate(list(dict.fromkeys(names))[:_MAX_DUMP_REQUESTS])
        ]  # fmt: skip
        for request in requests:
            self._request_dump(request)
        linked = []
        for a in anomalies:
            covering = None if a.dump else next((r for r in requests if fnmatchcase(a.name, r.name)), None)
            linked.append(dataclasses.replace(a, dump=f"request:{covering.id}") if covering else a)
        return linked

    def take_non_finite(self) -> Anomaly | None:
        """The first NaN/Inf anomaly seen since the last call (the training thread acts on it)."""
        with self._lock:
            found, self._first_non_finite = self._first_non_finite, None
        return found

    def flush(self) -> None:
        """Records are on disk after every step already (those a failed write kept in memory are tried
        again here); alerts are not waited for here, so a hanging endpoint never holds up a writer flush
        (on_nan flushes every step)."""
        if self._log is not None:
            self._log.flush()

    def flush_alerts(self, timeout: float) -> None:
        """Wait (bounded) for queued alerts to leave: before on_nan raises or exits."""
        self._dispatcher.flush(timeout=timeout)

    def close(self) -> None:
        if self._log:
            self._log.close()
        deadline = time.monotonic() + 3.0  # alerts still unsent at shutdown are best effort (all were logged)
        for retired in self._retired:
            retired.flush(timeout=max(0.0, deadline - time.monotonic()))
        self._dispatcher.close(timeout=max(0.0, deadline - time.monotonic()))


def has_non_finite(record: StepRecord) -> bool:
    """Whether any row of ``record`` counts a NaN or an Inf (one vectorised look at its partials)."""
    partials = np.asarray(record.partials).reshape(-1, N_PARTIALS)
    return bool(partials[:, NANS].any() or partials[:, INFS].any())


def _gradient_rows(keys: tuple) -> np.ndarray | None:
    """The tensors whose norm is the step's gradient norm: every grad_reduced one, else every
    grad_unreduced one; None when neither was collected."""
    for kind in (Kind.GRAD_REDUCED.value, Kind.GRAD_UNREDUCED.value):
        rows = [i for i, (k, _, _) in enumerate(keys) if k == kind]
        if rows:
            return np.asarray(rows, dtype=np.intp)
    return None


def _skipped(record: StepRecord, action: str) -> Anomaly:
    """The record of a step whose update ``alert.on_nan`` (skip, raise, exit) kept from landing, after its
    anomalies."""
    return Anomaly(
        step=record.step,
        rank=record.rank,
        kind="*",
        name="*",
        stat="*",
        value=0.0,
        rule=SKIPPED_RULE,
        seq=len(record.rows),
        phase=Phase.OPTIMIZER.value,
        wall_time=record.wall_time,
        message=f"update skipped (alert.on_nan: {action}): {record.skip_reason}",
    )


def _link_exact(a: Anomaly, folder: str) -> Anomaly:
    """An anomaly the exact capture covers (a NaN/Inf or a value rule's finding, or a tracked scalar, which
    that capture always takes) links to the folder of its step's dumps."""
    return dataclasses.replace(a, dump=folder) if a.rule in _EXACT_RULES or a.kind == "scalar" else a
