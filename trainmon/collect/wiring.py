"""The hooks a config asks for, over the model: module forward/backward, gradients as backward accumulates
them, collectives, gradient fingerprints and the optimizer's side; made at attach and again after a config
edit, armed for collected steps and paused or removed for the others.

What compiled code and DTensors change here: a model of DTensors merges its activations over the ranks that
hold their pieces, so every rank collects whatever ``module_ranks`` says; a collector of compiled code keeps
its hooks on off steps (``pause``) and says once when they never ran (``step_done``)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from trainmon.adapters import Resolved
from trainmon.collect.comm import CommCollector
from trainmon.collect.gradprobe import GradProbeCollector
from trainmon.collect.modules import MicroStepCounter, ModuleCollector, ModuleSite, clean_name, named_modules
from trainmon.collect.params import OptimizerCollector, ParamSite, UnreducedGradCollector
from trainmon.config import MonitorConfig
from trainmon.config.targets import TargetMatcher, squash_name, unmatched_targets
from trainmon.device import collective_counter, is_dtensor, no_collectives, world_size
from trainmon.joblog import job_wide
from trainmon.run.names import encode_name
from trainmon.step.buffer import StepBuffer
from trainmon.step.position import LoopPosition
from trainmon.step.timing import StepTimer

logger = logging.getLogger("trainmon")

__all__ = ["Wiring", "watch_scaler"]


class Wiring:
    """The collectors of one monitor, as the config in force asks for them. The micro-step counter, the
    optimizer's hooks (which end each step: ``end_step``, after ``check``, the pre-update check) and the
    gradient fingerprints' collector live as long as the monitor; the others are made for each config."""

    def __init__(
        self,
        resolved: Resolved,
        state: LoopPosition,
        buffer: StepBuffer,
        step_ends: tuple[Callable[..., None], Callable[[], str]],
        run_dir: Path,
        rank: int,
    ) -> None:
        chunks, adapter = resolved.chunks, resolved.optimizer
        self._chunks, self._state, self._buffer = chunks, state, buffer
        self.counter = MicroStepCounter(chunks[0], state)
        self.optimizer: OptimizerCollector | None = None
        self.gradprobe: GradProbeCollector | None = None
        if adapter is not None:
            self.optimizer = OptimizerCollector(adapter, state, buffer, *step_ends)
            self.gradprobe = GradProbeCollector(adapter, state, run_dir, rank)
        else:
            job_wide(logger).warning(
                "trainmon: no optimizer given; steps never end, so nothing is written. "
                "Pass the optimizer to trainmon.attach()."
            )
        self.comm: CommCollector | None = None
        self.collectors: list[Any] = []
        self.notes: tuple[str, ...] = ()  # what the targets check found (the manifest keeps it)
        self._checked_targets: tuple[str, ...] | None = None

    def effective(self, config: MonitorConfig) -> MonitorConfig:
        """``config`` as it applies to this model: a model of DTensors (FSDP2, tensor parallelism) merges its
        activations too over the ranks that hold their pieces, so ``module_ranks`` is ignored."""
        if not config.module_ranks or not any(
            is_dtensor(p) for chunk in self._chunks for p in chunk.parameters()
        ):
            return config
        job_wide(logger).warning(
            "trainmon: module_ranks %s is ignored: the model's DTensors are merged over ranks, so every "
            "rank collects and writes (docs/fsdp.md)",
            list(config.module_ranks),
        )
        return dataclasses.replace(config, module_ranks=())

    def configure(self, config: MonitorConfig, writes: bool, timer: StepTimer | None) -> None:
        """Make the collectors ``config`` asks for (the previous ones disarmed first). ``writes``: this rank
        records activations and writes (``JobShape.writes``)."""
        self.disarm()
        matcher = TargetMatcher(config.targets)
        self.check_targets(config)
        rename = _renamer(config.squash_name)
        chunks, state, buffer = self._chunks, self._state, self._buffer
        self.collectors = []
        if config.xy_enabled and writes:
            sites = [
                ModuleSite(vpp, rename(name), module)
                for vpp, chunk in enumerate(chunks)
                for name, module in named_modules(chunk)
                if name and (config.monitor_all_modules or matcher.match_module(name, vpp))
            ]
            forward, backward = config.xy_forward, config.xy_backward
            self.collectors.append(
                ModuleCollector(sites, state, buffer, forward=forward, backward=backward, chunks=chunks)
            )
        param_sites = [
            ParamSite(vpp, rename(name), param)
            for vpp, chunk in enumerate(chunks)
            for name, param in chunk.named_parameters()
            if matcher.match_param(clean_name(name), vpp)
        ]
        if config.wg_distribution and writes:
            every = config.monitor_mbs_grad
            self.collectors.append(
                UnreducedGradCollector(param_sites, state, buffer, every_micro_step=every, chunks=chunks)
            )
        self._configure_comm(config, writes, timer)
        if self.gradprobe is not None and config.grad_probe.enable and writes:
            self.gradprobe.configure(config.grad_probe, chunks, rename, config.eps)
            self.collectors.append(self.gradprobe)
        if self.optimizer is not None:
            self.optimizer.configure(
                param_sites,
                grads=config.wg_distribution,
                params=config.param_distribution,
                moments=config.mv_distribution,
                update_ratio=config.ur_distribution,
                stats_eps=config.eps,
            )

    def _configure_comm(self, config: MonitorConfig, writes: bool, timer: StepTimer | None) -> None:
        """``cc_distribution``: statistics of collective inputs/outputs, and a count of collectives on every
        group for the anomaly ordering (instead of the default group's sequence number)."""
        cc = config.cc_distribution
        statistics = cc.enable and writes
        timed = timer is not None and (cc.enable or config.timing.collectives)
        if not (statistics or timed):
            if self.comm is not None:
                self.comm.disarm()
                self.comm.timer = None
            return
        if self.comm is None:
            self.comm = CommCollector(self._state, self._buffer, cc)
            self._buffer.count_collectives = self.comm.count
            self._buffer.discard()  # the step's collective count restarts from the new counter
        else:
            self.comm.configure(cc)
        self.comm.statistics = statistics
        self.comm.timer = timer if timed else None
        self.collectors.append(self.comm)

    def check_targets(self, config: MonitorConfig) -> None:
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
            if note not in self.notes:
                job_wide(logger).warning("trainmon: %s", note)
        self.notes = tuple(notes)

    def manifest(self, config: MonitorConfig) -> dict[str, Any]:
        """The manifest's payload for ``config``: the job, the config, why a run may be empty."""
        return {
            "world_size": world_size(),
            "config": config.to_dict(),
            "chunks": len(self._chunks),
            **({"warnings": list(self.notes)} if self.notes else {}),
        }

    def arm(self, collecting: bool) -> None:
        """Hooks on for a collected step; off (or paused, for compiled code) for the others."""
        if self._buffer.count_collectives is no_collectives:  # the process group may come up after attach
            self._buffer.count_collectives = collective_counter()
        for collector in self.collectors:
            if collecting:
                collector.arm()
            else:  # a collector of compiled code keeps its hooks (ModuleCollector.pause)
                getattr(collector, "pause", collector.disarm)()

    def before_finish(self) -> None:
        """A collected step is about to end: the outputs of finished async collectives (none of the merge's
        own, which follows)."""
        if self.comm is not None:
            self.comm.step_end()

    def step_done(self, rows: Sequence[Any], forward_ran: bool) -> None:
        """A collected step ended: a model whose hooks never ran is said once (compiled code)."""
        for collector in self.collectors:
            step_done = getattr(collector, "step_done", None)
            if step_done is not None:
                step_done(rows, forward_ran)

    def disarm(self) -> None:
        for collector in self.collectors:
            collector.disarm()

    def marks(self) -> list[Any]:
        """The hooks that mark a step's points for the step timer."""
        return [m for m in (self.counter, self.optimizer) if m is not None]

    def sinks(self) -> list[Any]:
        """The writer thread's sinks of these collectors (the gradient fingerprints)."""
        return [self.gradprobe.sink] if self.gradprobe is not None else []

    def close(self) -> None:
        """Every hook removed."""
        self.disarm()
        self.counter.remove()
        if self.optimizer is not None:
            self.optimizer.remove()


def _renamer(squash: bool) -> Callable[[str], str]:
    """Every output writes the names as trainmon.run.names encodes them (lossless, valid UTF-8), and as an
    eager run names them: without torch.compile's and other wrappers' segments (clean_name)."""
    if squash:
        return lambda name: encode_name(squash_name(clean_name(name)))
    return lambda name: encode_name(clean_name(name))


def watch_scaler(
    scaler: Any, steps_ended: Callable[[], int], closed: Callable[[], bool], end_skipped: Callable[[], None]
) -> None:
    """Make ``scaler.step(optimizer)`` end the step when it skips the optimizer's step (inf/NaN gradients
    under loss scaling), as a skipped step (``end_skipped``). Set on the instance: other scalers are
    untouched, and deleting ``scaler.step`` puts the class's method back."""
    original = scaler.step

    def step(optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        ended = steps_ended()
        result = original(optimizer, *args, **kwargs)
        if steps_ended() == ended and not closed():  # optimizer.step() was not called
            end_skipped()
        return result

    scaler.step = step
