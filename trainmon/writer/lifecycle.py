"""The writer's life for one monitor: its outputs and the anomaly sink opened at attach, each finished step
handed over, a config edit followed in order with the steps, ``alert.on_nan`` acted on once a step's
anomalies are known, and the end (bounded: storage that hangs must not hang the end of training)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from trainmon.anomaly.alerts import apply_nan_action, nan_message
from trainmon.anomaly.sink import AnomalySink, has_non_finite
from trainmon.config import MonitorConfig
from trainmon.config.schema import AlertConfig
from trainmon.joblog import rank_note
from trainmon.run.records import Anomaly, StepRecord
from trainmon.writer.outputs import Outputs, unwritable_run_dir, writes_to_disk
from trainmon.writer.thread import RecordSink, WriterThread

logger = logging.getLogger("trainmon")

__all__ = ["CLOSE_TIMEOUT_S", "NAN_WAIT_S", "Latest", "WriterLife"]

# close() waits this long for pending steps to be written; past it the writer goes on alone (a daemon
# thread) and the run ends: storage that hangs must not hang the end of training
CLOSE_TIMEOUT_S = 30.0
# on_nan raise/exit: how long a step with a NaN/Inf waits for the writer's rules (its origin, its records)
# before the training thread names the NaN itself
NAN_WAIT_S = 10.0

# the last finished collected step's host record, and what makes its host copy complete (None: it is)
Latest = tuple[StepRecord, Callable[[], None] | None]


class WriterLife:
    """The writer thread (:attr:`thread`), the outputs it feeds (:attr:`outputs`) and the anomaly sink
    (:attr:`anomalies`) of one monitor. ``sinks`` go to the writer thread after the anomaly sink (gradient
    fingerprints, dumps). An ``OSError`` opening the outputs is raised naming the run folder."""

    def __init__(
        self,
        run_dir: Path,
        rank: int,
        config: MonitorConfig,
        *,
        multi_chunk: bool,
        manifest: Callable[[MonitorConfig], Mapping[str, Any]] | None,
        placement: Callable[[MonitorConfig], Mapping[str, Any]],
        request_dump: Callable[[Any], None] | None,
        on_alert: Callable[[Any], Any] | None,
        pp_stage: int,
        sinks: Sequence[RecordSink],
    ) -> None:
        self.run_dir = run_dir
        self.outputs = Outputs(run_dir, rank, multi_chunk, manifest, placement)
        try:
            opened: list[Any] = self.outputs.open(config)
            self.anomalies = AnomalySink(
                config.alert,
                rank,
                run_dir.name,
                run_dir if writes_to_disk(config) else None,
                request_dump=request_dump,
                on_alert=on_alert,
                pp_stage=pp_stage,
                steps=self.outputs.step_log(),
            )
        except OSError as e:  # a full or read-only disk: say which folder, and what to do
            raise unwritable_run_dir(run_dir, e) from e
        opened.append(self.anomalies)
        opened.extend(sinks)
        if self.outputs.manifest is not None:
            opened.append(self.outputs.manifest)
        thread = WriterThread(opened, check_dropped=self.anomalies.check_non_finite)
        self.thread = self.outputs.bind(thread)

    def follow(self, old: MonitorConfig, new: MonitorConfig) -> None:
        """A config edit: the writer thread builds the new outputs before it lets the old ones go (and keeps
        them when it cannot), in order with the steps."""
        self.thread.call(functools.partial(self.outputs.follow, self.thread, old, new))
        if new.alert != old.alert:
            self.thread.call(functools.partial(self.anomalies.reconfigure, new.alert))

    def act_on_nan(self, alert: AlertConfig, held: str, latest: Latest | None, step: int, rank: int) -> None:
        """``alert.on_nan``: raise or exit on the training thread once step ``step``'s anomalies are known.

        The step found a NaN/Inf before its update (``held``: why the update was kept from landing); or the
        NaN/Inf showed only after the update (in ``param_updated``, the Adam state), or the optimizer cannot
        keep an update from landing: then the update is there."""
        action = alert.on_nan
        if action in ("continue", "skip"):  # skip: decided before the update (the pre-update check)
            return
        found = self._non_finite_found(latest, step)
        if found is not None:
            message = nan_message(found, self.run_dir, update_applied=not held)
        elif held:  # the NaN was on another rank: every rank stops at the same step
            message = nan_message(None, self.run_dir, update_applied=False, reason=held, step=step, rank=rank)
        else:
            return
        apply_nan_action(action, alert.exit_code, message, before=self.flush_before_stopping)

    def _non_finite_found(self, latest: Latest | None, step: int) -> Anomaly | None:
        """The first NaN/Inf anomaly of ``step`` (or of a dropped step the writer's check noted), without
        waiting on the disk: the step's statistics are looked at here (its host copy, one vectorised look),
        and only a step with a NaN or an Inf waits for the writer's rules, which give its origin, at most
        NAN_WAIT_S; a writer stuck on storage that hangs leaves the finding to this thread."""
        found = self.anomalies.take_non_finite()
        if found is not None or latest is None:
            return found
        record, ready = latest
        if record.step != step:
            return None  # this step was not collected
        if ready is not None:
            ready()
        if not has_non_finite(record):
            return None
        if self.thread.flush(NAN_WAIT_S):
            found = self.anomalies.take_non_finite()
        return found if found is not None else self.anomalies.peek_non_finite(record)

    def flush_before_stopping(self) -> None:
        if not self.thread.flush(CLOSE_TIMEOUT_S):
            logger.warning(
                "trainmon: %sthe writer did not finish within %gs before stopping",
                rank_note(),
                CLOSE_TIMEOUT_S,
            )
        self.anomalies.flush_alerts(timeout=5.0)

    def close(self) -> None:
        """Write what is pending and close the outputs, within CLOSE_TIMEOUT_S."""
        if self.thread.close(timeout=CLOSE_TIMEOUT_S):
            return
        pid = self.outputs.give_up()
        logger.warning(
            "trainmon: %sclose: the writer did not finish within %gs (storage stalled?); %d step(s) may be "
            "missing from %s%s",
            rank_note(),
            CLOSE_TIMEOUT_S,
            self.thread.pending + self.outputs.unconfirmed,
            self.run_dir,
            f"; the writer process (pid {pid}) goes on alone, writing what it was handed" if pid else "",
        )
