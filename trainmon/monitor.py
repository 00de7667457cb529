"""The Monitor: wires collectors, the step buffer and the writer thread together, and owns step boundaries."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import weakref
from collections.abc import Callable, Mapping
from fnmatch import fnmatchcase
from pathlib import Path
from time import perf_counter
from typing import Any

import torch

from trainmon.adapters import Resolved
from trainmon.anomaly.alerts import TrainingNaNError, apply_nan_action, nan_message
from trainmon.anomaly.sink import AnomalySink, has_non_finite
from trainmon.collect.comm import CommCollector
from trainmon.collect.gradprobe import GradProbeCollector
from trainmon.collect.modules import MicroStepCounter, ModuleCollector, ModuleSite, clean_name, named_modules
from trainmon.collect.params import OptimizerCollector, ParamSite, UnreducedGradCollector
from trainmon.config import MonitorConfig
from trainmon.config.schema import AlertConfig
from trainmon.config.targets import TargetMatcher, squash_name, unmatched_targets
from trainmon.config.watch import ConfigReloads
from trainmon.device import (
    collective_counter,
    copy_to_host,
    current_rank,
    is_dtensor,
    no_collectives,
    timing_events,
    world_size,
)
from trainmon.run.layout import rank_dir, step_dumps_dir
from trainmon.run.names import encode_name
from trainmon.run.records import Kind, Phase, Row, StepRecord
from trainmon.step.agree import RankAgreement
from trainmon.step.allranks import AllRanksAggregate
from trainmon.step.boundary import BoundaryCheck
from trainmon.step.buffer import StepBuffer
from trainmon.step.capture import Capture, Captured, DumpSink
from trainmon.step.position import LoopPosition
from trainmon.step.schedule import Schedule
from trainmon.step.stepstats import StepStats
from trainmon.step.timing import LAG as TIMING_LAG
from trainmon.step.timing import MAX_COLLECTIVE_EVENTS, MAX_POINTS, StepTimer, TimesExchange
from trainmon.writer.outputs import (
    Outputs,
    unwritable_run_dir,
    where_it_goes,
    writes_all_ranks,
    writes_to_disk,
)
from trainmon.writer.thread import WriterThread

logger = logging.getLogger("trainmon")

# close() waits this long for pending steps to be written; past it the writer goes on alone (a daemon
# thread) and the run ends: storage that hangs must not hang the end of training
CLOSE_TIMEOUT_S = 30.0
# on_nan raise/exit: how long a step with a NaN/Inf waits for the writer's rules (its origin, its records)
# before the training thread names the NaN itself
NAN_WAIT_S = 10.0


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
        _close_previous(resolved)  # never two monitors' hooks on one model or optimizer
        self.run_dir = Path(run_dir)
        self.rank = current_rank()
        self._pp_stage = resolved.pp_stage
        # a sharded optimizer merges statistics over ranks: every rank must then take part in each collected
        # step, and module_ranks only chooses the ranks that record activations and write
        self._adapter = resolved.optimizer
        self._sharded = self._adapter is not None and self._adapter.sharded
        self._comm: CommCollector | None = None
        self.rank_dir = rank_dir(self.run_dir, self.rank)
        self._chunks = resolved.chunks
        self._closed = False
        self._latest: tuple[StepRecord, Callable[[], None] | None] | None = None
        self._warned_micro = False
        self._steps_ended = 0
        self._on_alert = on_alert
        self._held_reason = ""  # the last ended step's update was kept from landing, and why
        self._checked_targets: tuple[str, ...] | None = None
        self._notes: tuple[str, ...] = ()
        self._scaler: Any = None
        # what the ranks of a process group must decide alike: config edits, on_nan: skip (step/agree.py)
        self._agreement = RankAgreement(config.sync_timeout_s)
        # a config given as a file is watched: edits apply from the next step (msprobe's dynamic mode too),
        # in a process group on every rank at the same step, as rank 0 reads the file
        self._reloads = (
            ConfigReloads(config_path, config, self._agreement, overrides=overrides)
            if config_path is not None
            else None
        )
        agreed = self._reloads.at_attach() if self._reloads is not None else None
        config = agreed.config if agreed is not None else config
        note = where_it_goes(config, self.run_dir) if self.rank == 0 else None
        if note is not None:  # the run's first line: where the full detail is, how to export it
            logger.info("%s", note)
        self._enabled = self._reloads is None or self._reloads.enabled

        self.state = LoopPosition(step=start_iteration, expected_micro_steps=grad_acc_steps)
        self.buffer = StepBuffer(config.eps)
        self._counter = MicroStepCounter(self._chunks[0], self.state)
        self._timer: StepTimer | None = None  # per-rank time of timed steps (config.timing)
        self._collectors: list[Any] = []
        self._optimizer_collector: OptimizerCollector | None = None
        if resolved.optimizer is not None:
            self._optimizer_collector = OptimizerCollector(
                resolved.optimizer, self.state, self.buffer, self._end_step, self._check_boundary
            )
        else:
            logger.warning(
                "trainmon: no optimizer given; steps never end, so nothing is written. "
                "Pass the optimizer to trainmon.attach()."
            )
        self.config = config
        self._gradprobe = (
            GradProbeCollector(resolved.optimizer, self.state, self.run_dir, self.rank)
            if resolved.optimizer is not None
            else None
        )
        # dump requests are polled from the run directory (trainmon dump request) and raised by anomalies
        on_disk = writes_to_disk(config)
        self._capture = Capture(self.run_dir, self.rank) if on_disk else None
        self._check_targets(config)  # before the writer: the manifest says why a run may be empty
        try:
            self.writer = self._start_writer()
        except OSError as e:  # a full or read-only disk: say which folder, and what to do
            raise unwritable_run_dir(self.run_dir, e) from e
        self._boundary: BoundaryCheck | None = None
        self._configure(config)
        self._arm_for(self.state.step)
        if self._timer is not None:  # the first step's clock starts when attach returns
            self._timer.resume(perf_counter())
        _claim(self, resolved)

    def _configure(self, config: MonitorConfig) -> None:
        """Everything that follows from the config: the schedule and the collectors. Runs at attach and,
        after a config change, between two steps (the step_interval grid stays anchored at start_step)."""
        for collector in self._collectors:
            collector.disarm()
        config = self._without_module_ranks(config)
        self.config = config
        self.buffer.eps = config.eps
        self.schedule = Schedule(
            config.start_step,
            config.step_interval,
            config.collect_times,
            () if self._sharded else config.module_ranks,
            self.rank,
        )
        self._writes = not (self._sharded and config.module_ranks and self.rank not in config.module_ranks)
        self._configure_all_ranks(config)
        self._configure_timing(config)
        self._boundary = self._boundary_for(config)
        matcher = TargetMatcher(config.targets)
        self._check_targets(config)
        # every output writes the names as trainmon.run.names encodes them (lossless, valid UTF-8), and as an
        # eager run names them: without torch.compile's and other wrappers' segments (clean_name)
        if config.squash_name:
            rename = lambda name: encode_name(squash_name(clean_name(name)))  # noqa: E731
        else:
            rename = lambda name: encode_name(clean_name(name))  # noqa: E731
        self._collectors = []
        if config.xy_enabled and self._writes:
            sites = [
                ModuleSite(vpp, rename(name), module)
                for vpp, chunk in enumerate(self._chunks)
                for name, module in named_modules(chunk)
                if name and (config.monitor_all_modules or matcher.match_module(name, vpp))
            ]
            self._collectors.append(
                ModuleCollector(
                    sites,
                    self.state,
                    self.buffer,
                    forward=config.xy_forward,
                    backward=config.xy_backward,
                    chunks=self._chunks,
                )
            )
        param_sites = [
            ParamSite(vpp, rename(name), param)
            for vpp, chunk in enumerate(self._chunks)
            for name, param in chunk.named_parameters()
            if matcher.match_param(clean_name(name), vpp)
        ]
        if config.wg_distribution and self._writes:
            self._collectors.append(
                UnreducedGradCollector(
                    param_sites,
                    self.state,
                    self.buffer,
                    every_micro_step=config.monitor_mbs_grad,
                    chunks=self._chunks,
                )
            )
        self._configure_comm(config)
        if self._gradprobe is not None and config.grad_probe.enable and self._writes:
            self._gradprobe.configure(config.grad_probe, self._chunks, rename, config.eps)
            self._collectors.append(self._gradprobe)
        if self._optimizer_collector is not None:
            self._optimizer_collector.configure(
                param_sites,
                grads=config.wg_distribution,
                params=config.param_distribution,
                moments=config.mv_distribution,
                update_ratio=config.ur_distribution,
                stats_eps=config.eps,
            )

    def _without_module_ranks(self, config: MonitorConfig) -> MonitorConfig:
        """A model of DTensors (FSDP2, tensor parallelism) merges its activations too over the ranks that
        hold their pieces: every rank then collects and writes, whatever ``module_ranks`` says."""
        if not config.module_ranks or not any(
            is_dtensor(p) for chunk in self._chunks for p in chunk.parameters()
        ):
            return config
        logger.warning(
            "trainmon: module_ranks %s is ignored: the model's DTensors are merged over ranks, so every "
            "rank collects and writes (docs/fsdp.md)",
            list(config.module_ranks),
        )
        return dataclasses.replace(config, module_ranks=())

    def _aggregates(self, config: MonitorConfig) -> bool:
        """Whether the ranks can merge each step's tensors over the job (the all_ranks run): a process group
        of several ranks, each taking part in every collected step."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or world_size() < 2:
            return False
        return self._sharded or not config.module_ranks

    def _all_ranks_writer(self, config: MonitorConfig) -> int:
        """The one rank that writes the all_ranks run: the first rank that writes at all."""
        return min(config.module_ranks) if self._sharded and config.module_ranks else 0

    def _sink_placement(self, config: MonitorConfig) -> dict[str, Any]:
        """What ``format_sinks`` needs to know of the job for ``config``."""
        return {
            "world": world_size(),
            "aggregates": self._aggregates(config),
            "all_ranks_writer": self.rank == self._all_ranks_writer(config),
        }

    def _configure_all_ranks(self, config: MonitorConfig) -> None:
        on = self._aggregates(config) and writes_all_ranks(config, world_size(), True)
        if not on:
            self.buffer.all_ranks = None
        elif self.buffer.all_ranks is None:  # kept across reloads: its table of tensors stays agreed
            self.buffer.all_ranks = AllRanksAggregate(_default_group)
        self.buffer.keep_all_ranks = on and self.rank == self._all_ranks_writer(config)

    def _configure_timing(self, config: MonitorConfig) -> None:
        """``timing``: a step timer wired into the hooks that mark a step's points; the ranks' times ride in
        the all_ranks merge, or go in an exchange of their own (``TimesExchange``) where every rank takes part
        in every collected step without one (``_aggregates``)."""
        if not config.timing.enable:
            if self._timer is not None:
                self._timer.close()
            self._timer = None
            self.buffer.exchange = None
        elif self._timer is None:
            exchange = self._aggregates(config)
            world = world_size() if exchange else 1
            self._timer = StepTimer(
                index=self.rank if exchange else 0,
                world=world,
                pp_stage=self._pp_stage,
                exchange=exchange,
                events=self._timing_events(),
            )
        timer = self._timer
        alone = timer is not None and timer.exchange and self.buffer.all_ranks is None
        if alone and self.buffer.exchange is None:
            try:
                self.buffer.exchange = TimesExchange(timer.world, timer.index, config.sync_timeout_s)
            except Exception:  # no gloo in this build, ...: each rank's times alone
                logger.exception("trainmon: the ranks cannot exchange their step times; each records its own")
        self.buffer.timer = timer
        self._counter.timer = timer
        if self._optimizer_collector is not None:
            self._optimizer_collector.timer = timer

    def _timing_events(self) -> Any:
        """Device events for the timer where the model lives on an accelerator (None on the CPU)."""
        first = next((p for chunk in self._chunks for p in chunk.parameters()), None)
        if first is None:
            return None
        return timing_events(first.device, TIMING_LAG + 1, MAX_POINTS, MAX_COLLECTIVE_EVENTS)

    def _boundary_for(self, config: MonitorConfig) -> BoundaryCheck | None:
        """``alert.capture: exact`` / ``alert.on_nan: skip, raise, exit``: the pre-update check (boundary.py).
        ``raise`` and ``exit`` keep the NaN step's update from landing as ``skip`` does, then stop training
        when the step has ended (``_act_on_nan``)."""
        alert = config.alert
        exact = alert.capture == "exact"
        action = alert.on_nan
        hold = action in ("skip", "raise", "exit")
        if hold and self._adapter is not None and not self._adapter.skips_steps:
            why = self._adapter.skip_unsupported or f"not supported for {self._adapter.name}"
            if action == "skip":
                logger.warning("trainmon: alert.on_nan: skip is off: %s", why)
            else:
                logger.warning(
                    "trainmon: alert.on_nan: %s acts after the update of a NaN step, not before it: %s",
                    action,
                    why,
                )
            hold = False
        if not (exact or hold):
            return None
        # all ranks must agree on a skip; they can when every rank checks the same steps
        every_rank = self._sharded or not config.module_ranks
        check = BoundaryCheck(
            exact=exact and self._capture is not None,
            skip=hold,
            max_skips=alert.max_skips if action == "skip" else None,
            agree=self._agreement.max if every_rank else None,
            value_rules=alert.evaluated_rules if exact else (),
            admit=self._capture.admit if self._capture is not None else None,
        )
        if self._boundary is not None:
            check.skips = self._boundary.skips  # a config reload does not reset the count
        return check

    def _check_boundary(self) -> str:
        """In the optimizer's pre-step of a collected step: the NaN/Inf check of ``self._boundary``. Returns
        the reason the update must not land (``alert.on_nan`` skip, raise or exit), or "". Only
        TrainingNaNError (max_skips) leaves here."""
        check = self._boundary
        if check is None or self._closed:
            self.buffer.hold = None
            return ""
        try:
            verdict = check.check(
                self.buffer.rows, self.buffer.partials_so_far, self._params_at_hand, self.buffer.unmerged_rows
            )
        except TrainingNaNError as e:
            self._flush_before_stopping()
            raise TrainingNaNError(f"{e}; anomalies in {self.run_dir}") from None
        except Exception:  # the monitor's own fault: report it, let the step go on
            logger.exception("trainmon: the step-boundary NaN check failed; training continues")
            return ""
        finally:
            self.buffer.hold = None  # activations are not kept past the check
        if verdict.captured and self._dumps is not None:
            self._dumps.add(self.state.step, verdict.captured)
            folder = step_dumps_dir(self.run_dir, self.state.step, self.rank).relative_to(self.run_dir)
            self._anomalies.note_exact_capture(self.state.step, folder.as_posix())
        if not verdict.skip:
            return ""
        # the warning waits for the step's end: under fp16 loss scaling the framework may find the overflow
        # and skip the step itself, and then it is no NaN skip (BoundaryCheck.settle)
        return verdict.reason or "NaN/Inf on another rank"

    def _params_at_hand(self, module: str, bad: Any) -> list[tuple[Row, torch.Tensor]]:
        """Parameter-side tensors for an exact dump: those of the origin ``module``'s own parameters and of
        parameters with a flagged row, as they are before the update (value as ``param_origin``)."""
        collector = self._optimizer_collector
        if collector is None:
            return []
        flagged = {row.name for row, is_bad in zip(self.buffer.rows, bad, strict=True) if is_bad}
        prefix = f"{module}." if module else None
        taken = []
        for site in collector.sites:
            if not (site.name in flagged or (prefix and site.name.startswith(prefix))):
                continue
            for kind, tensor in collector.state_of(site):
                if kind == Kind.PARAM_UPDATED.value:
                    kind = Kind.PARAM_ORIGIN.value  # the update has not been applied yet
                row = Row(
                    kind, site.name, site.vpp_stage, 0, Phase.OPTIMIZER.value, tensor.shape, tensor.dtype
                )
                taken.append((row, tensor))
        return taken

    def _check_targets(self, config: MonitorConfig) -> None:
        """Warn once per target that matches no module or parameter, with the model's closest names; when no
        target matches, the run records no statistics of the model: say so in the log and the manifest."""
        if config.targets == self._checked_targets:
            return
        self._checked_targets = config.targets
        try:
            patterns = TargetMatcher(config.targets).patterns
            names = [
                {n for n, _ in named_modules(chunk)} | {clean_name(n) for n, _ in chunk.named_parameters()}
                for chunk in self._chunks
            ]
            missing = unmatched_targets(patterns, names)
        except Exception:  # a diagnosis must never stop training
            logger.exception("trainmon: checking the targets against the model failed")
            return
        notes = [
            f"target {m.target!r} matches no module or parameter of the model; closest names: "
            + (", ".join(map(repr, m.closest)) or "none (print([n for n, _ in model.named_modules()]))")
            for m in missing
        ]
        if patterns and len(missing) == len(patterns) and not config.monitor_all_modules:
            notes.append(
                "no target matches a module or parameter of the model, so this run records no statistics "
                "of the model (only scalars given to monitor.track())"
            )
        for note in notes:
            if note not in self._notes:
                logger.warning("trainmon: %s", note)
        self._notes = tuple(notes)

    def _configure_comm(self, config: MonitorConfig) -> None:
        """``cc_distribution``: statistics of collective inputs/outputs, and a count of collectives on every
        group for the anomaly ordering (instead of the default group's sequence number)."""
        cc = config.cc_distribution
        statistics = cc.enable and self._writes
        timed = self._timer is not None and (cc.enable or config.timing.collectives)
        if not (statistics or timed):
            if self._comm is not None:
                self._comm.disarm()
                self._comm.timer = None
            return
        if self._comm is None:
            self._comm = CommCollector(self.state, self.buffer, cc)
            self.buffer.count_collectives = self._comm.count
            self.buffer.discard()  # the step's collective count restarts from the new counter
        else:
            self._comm.configure(cc)
        self._comm.statistics = statistics
        self._comm.timer = self._timer if timed else None
        self._collectors.append(self._comm)

    def _reload(self) -> None:
        """Apply an edited config file from the next step (called at the step boundary; in a process group
        every rank gets the same change at the same step). The writer thread follows in order with the
        steps: it builds the new outputs before it lets the old ones go, and keeps them when it cannot."""
        change = self._reloads.at_step_end(self.state.step) if self._reloads is not None else None
        if change is None:
            return
        old, self._enabled = self.config, change.enabled
        if change.config != old:
            self.writer.call(functools.partial(self._outputs.follow, self.writer, old, change.config))
            if change.config.alert != old.alert:
                self.writer.call(functools.partial(self._anomalies.reconfigure, change.config.alert))
            self._configure(change.config)
        logger.warning(
            "trainmon: config %s reloaded; monitoring is %s from step %d",
            self._reloads.path,
            "on" if self._enabled else "off",
            self.state.step + 1,
        )

    # ------------------------------------------------------------------ public API
    @property
    def step(self) -> int:
        """The step being trained now (the next one to finish)."""
        return self.state.step

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
            logger.exception("trainmon: track(%r) failed; training continues", name)

    def latest(self) -> StepStats | None:
        """Statistics of the last finished collected step, in memory (None before the first one)."""
        if self._latest is None:
            return None
        record, ready = self._latest
        if ready is not None:
            ready()
        return StepStats(record, multi_chunk=len(self._chunks) > 1)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every finished step is written to disk."""
        return self.writer.flush(timeout)

    def watch_grad_scaler(self, scaler: Any) -> None:
        """End a step that ``scaler.step(optimizer)`` skips (inf/NaN gradients under loss scaling) like any
        other, and record its non-finite gradients as ``loss_scale_overflow``, not as an alarm."""
        original = scaler.step

        def step(optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            ended = self._steps_ended
            result = original(optimizer, *args, **kwargs)
            if self._steps_ended == ended and not self._closed:  # optimizer.step() was not called
                self._end_step(skipped=True)
            return result

        scaler.step = step  # on the instance: other scalers are untouched; close() removes it
        self._scaler = scaler

    def close(self) -> None:
        """Remove every hook, write what is pending, close files. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        _release(self)
        if self._scaler is not None:
            del self._scaler.step  # back to the class's method
        for collector in self._collectors:
            collector.disarm()
        self._counter.remove()
        if self._timer is not None:
            self._timer.close()
        if self._optimizer_collector is not None:
            self._optimizer_collector.remove()
        self.buffer.discard()
        if not self.writer.close(timeout=CLOSE_TIMEOUT_S):
            pid = self._outputs.give_up()
            logger.warning(
                "trainmon: close: the writer did not finish within %gs (storage stalled?); %d step(s) may be "
                "missing from %s%s",
                CLOSE_TIMEOUT_S,
                self.writer.pending + self._outputs.unconfirmed,
                self.run_dir,
                f"; the writer process (pid {pid}) goes on alone, writing what it was handed" if pid else "",
            )

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Monitor(run_dir={str(self.run_dir)!r}, rank={self.rank}, step={self.step})"

    # ------------------------------------------------------------------ internals
    def _start_writer(self) -> WriterThread:
        config = self.config
        self._outputs = Outputs(
            self.run_dir,
            self.rank,
            len(self._chunks) > 1,
            self._manifest_payload if self.rank == 0 else None,
            self._sink_placement,
        )
        sinks: list[Any] = self._outputs.open(config)
        on_disk = writes_to_disk(config)
        self._dumps = DumpSink(self.run_dir, self.rank) if self._capture is not None else None
        self._anomalies = AnomalySink(
            config.alert,
            self.rank,
            self.run_dir.name,
            self.run_dir if on_disk else None,
            request_dump=self._capture.trigger if self._capture else None,
            on_alert=self._on_alert,
            pp_stage=self._pp_stage,
            steps=self._outputs.step_log(),
        )
        sinks.append(self._anomalies)
        if self._gradprobe is not None:
            sinks.append(self._gradprobe.sink)
        if self._dumps is not None:
            sinks.append(self._dumps)
        if self._outputs.manifest is not None:
            sinks.append(self._outputs.manifest)
        return self._outputs.bind(WriterThread(sinks, check_dropped=self._anomalies.check_non_finite))

    def _manifest_payload(self, config: MonitorConfig) -> dict[str, Any]:
        return {
            "world_size": world_size(),
            "config": config.to_dict(),
            "chunks": len(self._chunks),
            **({"warnings": list(self._notes)} if self._notes else {}),
        }

    def _end_step(self, skipped: bool = False, skip_reason: str = "") -> None:
        """Called after every optimizer step (or a step a GradScaler skipped): ship the step's statistics,
        then prepare the next step."""
        ended_at = perf_counter()  # the step's end; what follows here is the monitor's own time
        timer = self._timer
        timed = timer.end(ended_at, self.state.step) if timer is not None else False
        self._steps_ended += 1
        self._held_reason = skip_reason  # why the monitor kept this step's update from landing, or ""
        if self._boundary is not None:
            self._boundary.settle(bool(skip_reason))
            if skip_reason and self.config.alert.on_nan == "skip":
                logger.warning(
                    "trainmon: step %d: %s; the update is skipped (alert.on_nan: skip, %d of max_skips %d)",
                    self.state.step,
                    skip_reason,
                    self._boundary.skips,
                    self._boundary.max_skips,
                )
        state = self.state
        if state.collecting and self._dumps is not None:
            try:
                self._dump_tensors_at_hand()
            except Exception:  # a dump must never keep the step from ending
                logger.exception("trainmon: dumping the tensors at hand failed; training continues")
        if state.collecting:
            if self._capture is not None and self._dumps is not None:
                self._dumps.add(state.step, self._capture.finish_step())
            if self._comm is not None:
                self._comm.step_end()  # outputs of finished async collectives; none of the merge's own
            forward_ran = state.forward_micro >= 0
            record, ready = self.buffer.finish(state.step, self.rank, skipped, skip_reason, timed)
            for collector in self._collectors:  # a model whose hooks never ran: said once (compiled code)
                step_done = getattr(collector, "step_done", None)
                if step_done is not None:
                    step_done(record.rows, forward_ran)
            if self._writes:
                self._latest = (record, ready)
                self.writer.submit(record, ready)
        self._check_micro_steps()
        alert = self.config.alert  # the step's own on_nan decides, whatever an edit landing now says
        try:
            self._reload()
        except Exception:  # a reload problem must not stop the step from ending
            logger.exception("trainmon: applying the edited config failed; keeping the previous one")
        state.advance()
        self._arm_for(state.step)
        self._act_on_nan(alert)
        if self._timer is not None:  # a timer a config edit just made starts its clock here
            self._timer.resume(perf_counter())

    def _act_on_nan(self, alert: AlertConfig) -> None:
        """``alert.on_nan``: raise or exit on the training thread once the step's anomalies are known.

        The step that just ended found a NaN/Inf before its update (``_check_boundary``), and the update was
        kept from landing; or the NaN/Inf showed only after the update (in ``param_updated``, the Adam
        state), or the optimizer cannot keep an update from landing: then the update is there."""
        action = alert.on_nan
        if action in ("continue", "skip"):  # skip: decided before the update (_check_boundary)
            return
        found = self._non_finite_found()
        held, self._held_reason = self._held_reason, ""
        step = self.state.step - 1  # the step that just ended
        if found is not None:
            message = nan_message(found, self.run_dir, update_applied=not held)
        elif held:  # the NaN was on another rank: every rank stops at the same step
            message = nan_message(
                None, self.run_dir, update_applied=False, reason=held, step=step, rank=self.rank
            )
        else:
            return
        apply_nan_action(action, alert.exit_code, message, before=self._flush_before_stopping)

    def _non_finite_found(self) -> Any:
        """The first NaN/Inf anomaly of the step that just ended (or of a dropped step the writer's check
        noted), without waiting on the disk: the step's statistics are looked at here (its host copy, one
        vectorised look), and only a step with a NaN or an Inf waits for the writer's rules, which give its
        origin, at most NAN_WAIT_S; a writer stuck on storage that hangs leaves the finding to this thread."""
        found = self._anomalies.take_non_finite()
        if found is not None or self._latest is None:
            return found
        record, ready = self._latest
        if record.step != self.state.step - 1:
            return None  # this step was not collected
        if ready is not None:
            ready()
        if not has_non_finite(record):
            return None
        if self.writer.flush(NAN_WAIT_S):
            found = self._anomalies.take_non_finite()
        return found if found is not None else self._anomalies.peek_non_finite(record)

    def _flush_before_stopping(self) -> None:
        if not self.writer.flush(CLOSE_TIMEOUT_S):
            logger.warning("trainmon: the writer did not finish within %gs before stopping", CLOSE_TIMEOUT_S)
        self._anomalies.flush_alerts(timeout=5.0)

    def _dump_tensors_at_hand(self) -> None:
        """For anomalies flagged since the last boundary: the matching parameters, gradients and Adam state
        as they are now, saved with this step (their activations follow at their next occurrence)."""
        requests = self._capture.pop_fresh_triggers() if self._capture is not None else []
        collector = self._optimizer_collector
        if not requests or collector is None:
            return
        taken = []
        for site in collector.sites:
            request = next((r for r in requests if fnmatchcase(site.name, r.name)), None)
            if request is None:
                continue
            for kind, tensor in collector.state_of(site):
                row = Row(
                    kind, site.name, site.vpp_stage, 0, Phase.OPTIMIZER.value, tensor.shape, tensor.dtype
                )
                if not self._capture.admit(row, tensor):  # the dump caps, before any copy
                    continue
                host, ready = copy_to_host(tensor)
                taken.append(Captured(row, host, ready, f"request {request.id} (at hand)"))
        self._dumps.add(self.state.step, taken)

    def _arm_for(self, step: int) -> None:
        if self.buffer.count_collectives is no_collectives:  # the process group may come up after attach
            self.buffer.count_collectives = collective_counter()
        self.state.collecting = self._enabled and not self._closed and self.schedule.start(step)
        capturing = self._capture is not None and self._capture.start_step(step, self.state.collecting)
        self.buffer.capture = self._capture if capturing else None
        if self._boundary is not None:
            self.buffer.hold = self._boundary.start_step(self.state.collecting)
        if self._timer is not None:
            self._timer.start(self.state.collecting)
        for collector in self._collectors:
            if self.state.collecting:
                collector.arm()
            else:  # a collector of compiled code keeps its hooks (ModuleCollector.pause)
                getattr(collector, "pause", collector.disarm)()

    def _check_micro_steps(self) -> None:
        seen = self.state.backward_micro + 1
        if seen > 0 and seen != self.state.expected_micro_steps:
            if not self._warned_micro:
                self._warned_micro = True
                logger.warning(
                    "trainmon: grad_acc_steps=%d but step %d ran %d micro-batches; using %d from now on",
                    self.state.expected_micro_steps,
                    self.state.step,
                    seen,
                    seen,
                )
            self.state.expected_micro_steps = seen


def _default_group() -> object:
    """The default process group when one is up (the all_ranks aggregates are reduced over it), else None."""
    import torch.distributed as dist

    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


# ---------------------------------------------------------------------------------------------------------
# One monitor per model and optimizer: a second attach would hook everything twice (each statistic recorded
# twice, each step ended twice). Each hooked object maps to its open monitor, weakly on both sides, so the
# registry keeps neither a model nor a monitor alive.
_OWNERS: weakref.WeakKeyDictionary[Any, weakref.ref[Monitor]] = weakref.WeakKeyDictionary()


def _hooked_objects(resolved: Resolved) -> list[Any]:
    """Every module of the model chunks, and the optimizer (or DeepSpeed engine) whose step is hooked."""
    objects: list[Any] = [module for chunk in resolved.chunks for module in chunk.modules()]
    if resolved.optimizer is not None:
        objects.extend(resolved.optimizer.hooked_objects())
    return objects


def _close_previous(resolved: Resolved) -> None:
    """Close, with a warning, the open monitors of any object the new monitor is about to hook."""
    previous: dict[int, Monitor] = {}
    for obj in _hooked_objects(resolved):
        try:
            ref = _OWNERS.get(obj)
        except TypeError:  # not weakly referenceable: never registered
            continue
        monitor = ref() if ref is not None else None
        if monitor is not None and not monitor._closed:
            previous[id(monitor)] = monitor
    for monitor in previous.values():
        logger.warning(
            "trainmon: this model or optimizer already has a monitor (run %s); closing it and attaching the "
            "new one. Call monitor.close() before attaching another.",
            monitor.run_dir,
        )
        monitor.close()


def _claim(monitor: Monitor, resolved: Resolved) -> None:
    ref = weakref.ref(monitor)
    for obj in _hooked_objects(resolved):
        with contextlib.suppress(TypeError):  # not weakly referenceable: no check for it
            _OWNERS[obj] = ref


def _release(monitor: Monitor) -> None:
    for obj, ref in list(_OWNERS.items()):
        if ref() is monitor:
            _OWNERS.pop(obj, None)
