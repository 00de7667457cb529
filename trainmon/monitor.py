"""The Monitor: the conductor of one attach. It owns the step boundary and hands everything else to parts
that each do one job: the hooks a config asks for (``collect.wiring``), dumps (``collect.dumping``), which
steps this rank collects and merges (``step.job``), the step timer (``step.clock``), the check before the
update (``step.preupdate``) and the writer's life (``writer.lifecycle``)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from time import perf_counter
from typing import Any

import torch

from trainmon.adapters import Resolved
from trainmon.collect.dumping import StepDumps
from trainmon.collect.owners import claim, close_previous, release
from trainmon.collect.wiring import Wiring, watch_scaler
from trainmon.config import MonitorConfig
from trainmon.config.watch import EditedConfig
from trainmon.device import current_rank, world_size
from trainmon.joblog import Place, announce, leave, rank_note, settle
from trainmon.run.layout import rank_dir
from trainmon.run.names import encode_name
from trainmon.run.records import Kind
from trainmon.step.agree import RankAgreement
from trainmon.step.buffer import StepBuffer
from trainmon.step.clock import StepClock
from trainmon.step.job import JobShape
from trainmon.step.position import LoopPosition
from trainmon.step.preupdate import PreUpdateCheck
from trainmon.step.stepstats import StepStats
from trainmon.writer.lifecycle import Latest, WriterLife
from trainmon.writer.outputs import where_it_goes, writes_to_disk

logger = logging.getLogger("trainmon")


class Monitor:
    """A running monitor. Create it with :func:`trainmon.attach`; step boundaries come from the optimizer."""

    def __init__(
        self,
        resolved: Resolved,
        config: MonitorConfig,
        run_dir: Path,
        *,
        grad_acc_steps: int = 1,
        start_iteration: int = 0,
        config_path: str | os.PathLike[str] | None = None,
        overrides: Mapping[str, Any] | None = None,
        on_alert: Callable[[Any], Any] | None = None,
    ) -> None:
        if grad_acc_steps < 1:
            raise ValueError(f"trainmon.attach: grad_acc_steps must be >= 1, got {grad_acc_steps}")
        close_previous(resolved)  # never two monitors' hooks on one model or optimizer
        self.run_dir, self.rank = Path(run_dir), current_rank()
        self.rank_dir = rank_dir(self.run_dir, self.rank)
        adapter, chunks = resolved.optimizer, resolved.chunks
        self._job = JobShape(self.rank, adapter is not None and adapter.sharded, resolved.pp_stage)
        self._closed, self._steps_ended, self._scaler = False, 0, None
        self._latest: Latest | None = None
        # what the ranks of a process group must decide alike: config edits, on_nan: skip (step/agree.py)
        agreement = RankAgreement(config.sync_timeout_s)
        # a config given as a file is watched: edits apply from the next step (msprobe's dynamic mode too),
        # in a process group on every rank at the same step, as rank 0 reads the file
        self._edits = EditedConfig(config, config_path, agreement, overrides)
        config = self._edits.first
        self._speak_for_job(config)
        # the run's first line, once a job and seen without a logging setup: where the run is, how to open it
        if self.rank == 0 and (note := where_it_goes(config, self.run_dir)) is not None:
            announce(logger, note)
        self.state = LoopPosition(step=start_iteration, expected_micro_steps=grad_acc_steps)
        self.buffer = StepBuffer(config.eps)
        ends = (self._end_step, self._check_boundary)
        wiring = self._wiring = Wiring(resolved, self.state, self.buffer, ends, self.run_dir, self.rank)
        self._counter, self._optimizer_collector = wiring.counter, wiring.optimizer
        self.config = config
        # dump requests are polled from the run directory (trainmon dump request) and raised by anomalies
        self._dumps = StepDumps(self.run_dir, self.rank, wiring.optimizer) if writes_to_disk(config) else None
        self._capture = self._dumps.capture if self._dumps is not None else None
        wiring.check_targets(config)  # before the writer: the manifest says why a run may be empty
        sinks = [*wiring.sinks(), *([self._dumps.sink] if self._dumps is not None else [])]
        life = self._life = WriterLife(
            self.run_dir,
            self.rank,
            config,
            multi_chunk=len(chunks) > 1,
            manifest=wiring.manifest if self.rank == 0 else None,
            placement=self._job.placement,
            request_dump=self._capture.trigger if self._capture else None,
            on_alert=on_alert,
            pp_stage=resolved.pp_stage,
            sinks=sinks,
        )
        self.writer, self._outputs, self._anomalies = life.thread, life.outputs, life.anomalies
        if self._dumps is not None:
            self._dumps.note_exact = self._anomalies.note_exact_capture
        self._clock = StepClock(self.rank, resolved.pp_stage, chunks, self.buffer)
        stopping = life.flush_before_stopping  # max_skips: what is pending is written first
        self._guard = PreUpdateCheck(self.run_dir, adapter, agreement, self._dumps, stopping)
        self._configure(config)
        self._arm_for(self.state.step)
        self._clock.resume(perf_counter())  # the first step's clock starts when attach returns
        claim(self, resolved)

    def _configure(self, config: MonitorConfig) -> None:
        """Everything that follows from the config: the schedule and the collectors. Runs at attach and,
        after a config change, between two steps (the step_interval grid stays anchored at start_step)."""
        self._wiring.disarm()
        config = self.config = self._wiring.effective(config)
        self._speak_for_job(config)
        self.buffer.eps = config.eps
        self.schedule = self._job.schedule(config)
        self._writes = self._job.writes(config)
        self._job.configure_all_ranks(self.buffer, config)
        self._clock.configure(config, self._job.aggregates(config), self._wiring.marks())
        self._guard.configure(config, self._job.every_rank_checks(config))
        self._wiring.configure(config, self._writes, self._clock.timer)

    def _speak_for_job(self, config: MonitorConfig) -> None:
        """Whether this rank says the job-wide messages under ``config`` (``trainmon.joblog``)."""
        world = world_size()
        self._place = Place(self.rank, world, self._job.speaks_for_job(config, world))
        settle(self._place)

    def _reload(self) -> None:
        """Apply an edited config file from the next step (called at the step boundary; in a process group
        every rank gets the same change at the same step)."""
        change = self._edits.at_step_end(self.state.step)
        if change is None:
            return
        if change.config != self.config:
            self._life.follow(self.config, change.config)
            self._configure(change.config)
        self._edits.say_applied(self.state.step)

    # ------------------------------------------------------------------ public API
    @property
    def step(self) -> int:
        """The step being trained now (the next one to finish)."""
        return self.state.step

    @property
    def closed(self) -> bool:
        return self._closed

    def track(self, name: str, tensor: torch.Tensor) -> None:
        """Record an extra scalar (e.g. the loss) for the current step, without a host sync.

        Call it before ``optimizer.step()``: the step ends inside the optimizer step.
        """
        if not self.state.collecting or self._closed:
            return
        try:
            value = tensor.detach() if isinstance(tensor, torch.Tensor) else torch.tensor(float(tensor))
            micro = max(self.state.forward_micro, 0)
            self.buffer.add(Kind.SCALAR.value, encode_name(name), 0, micro, self.state.phase, value)
        except Exception:
            logger.exception("trainmon: %strack(%r) failed; training continues", rank_note(), name)

    def latest(self) -> StepStats | None:
        """Statistics of the last finished collected step, in memory (None before the first one)."""
        if self._latest is None:
            return None
        record, ready = self._latest
        if ready is not None:
            ready()
        return StepStats(record, multi_chunk=self._outputs.multi_chunk)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every finished step is written to disk."""
        return self.writer.flush(timeout)

    def watch_grad_scaler(self, scaler: Any) -> None:
        """End a step that ``scaler.step(optimizer)`` skips (inf/NaN gradients under loss scaling) like any
        other, and record its non-finite gradients as ``loss_scale_overflow``, not as an alarm."""
        ends = (lambda: self._steps_ended, lambda: self._closed)
        watch_scaler(scaler, *ends, lambda: self._end_step(skipped=True))
        self._scaler = scaler  # close() deletes its step: the class's method again

    def close(self) -> None:
        """Remove every hook, write what is pending, close files. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        release(self)
        if self._scaler is not None:
            del self._scaler.step  # back to the class's method
        self._wiring.close()
        self._clock.close()
        self.buffer.discard()
        self._life.close()
        leave(self._place)

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Monitor(run_dir={str(self.run_dir)!r}, rank={self.rank}, step={self.step})"

    # ------------------------------------------------------------------ the step boundary
    def _check_boundary(self) -> str:
        """The optimizer's pre-step of a collected step: why the update must not land, or ""."""
        return self._guard.run(self.buffer, self.state.step, self._closed)

    def _end_step(self, skipped: bool = False, skip_reason: str = "") -> None:
        """Called after every optimizer step (or a step a GradScaler skipped): ship the step's statistics,
        then prepare the next step. ``skip_reason``: why the monitor kept the update from landing, or ""."""
        ended_at = perf_counter()  # the step's end; what follows here is the monitor's own time
        state = self.state
        timed = self._clock.end(ended_at, state.step)
        self._steps_ended += 1
        self._guard.settle(state.step, skip_reason, self.config.alert.on_nan)
        if state.collecting:
            if self._dumps is not None:
                self._dumps.step_end(state.step)
            self._wiring.before_finish()
            forward_ran = state.forward_micro >= 0
            record, ready = self.buffer.finish(state.step, self.rank, skipped, skip_reason, timed)
            self._wiring.step_done(record.rows, forward_ran)
            if self._writes:
                self._latest = (record, ready)
                self.writer.submit(record, ready)
        state.check_micro_steps()
        alert = self.config.alert  # the step's own on_nan decides, whatever an edit landing now says
        try:
            self._reload()
        except Exception:  # a reload problem must not stop the step from ending
            logger.exception(
                "trainmon: %sapplying the edited config failed; keeping the previous one", rank_note()
            )
        state.advance()
        self._arm_for(state.step)
        self._life.act_on_nan(alert, skip_reason, self._latest, state.step - 1, self.rank)
        self._clock.resume(perf_counter())  # a timer a config edit just made starts its clock here

    def _arm_for(self, step: int) -> None:
        collecting = self._edits.enabled and not self._closed and self.schedule.start(step)
        self.state.collecting = collecting
        capturing = self._capture is not None and self._capture.start_step(step, collecting)
        self.buffer.capture = self._capture if capturing else None
        self._guard.start_step(self.buffer, collecting)
        self._clock.start(collecting)
        self._wiring.arm(collecting)
