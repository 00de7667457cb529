"""The per-rank step timer across config edits (``timing``): made, kept or dropped as the config says, with
its device events where the model lives on an accelerator, and handed to what marks a step's points."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol

from trainmon.config import MonitorConfig
from trainmon.device import timing_events, world_size
from trainmon.joblog import rank_note
from trainmon.step.buffer import StepBuffer
from trainmon.step.timing import LAG, MAX_COLLECTIVE_EVENTS, MAX_POINTS, StepTimer, TimesExchange

logger = logging.getLogger("trainmon")

__all__ = ["StepClock"]


class Marks(Protocol):
    """A hook that marks a step's points (the micro-step counter, the optimizer's hooks)."""

    timer: StepTimer | None


class StepClock:
    """The timer of timed steps, or None when ``timing`` is off. The ranks' times ride in the all_ranks
    merge, or go in an exchange of their own (``TimesExchange``) where every rank takes part in every
    collected step without one."""

    def __init__(self, rank: int, pp_stage: int, chunks: Sequence[Any], buffer: StepBuffer) -> None:
        self._rank, self._pp_stage, self._chunks, self._buffer = rank, pp_stage, chunks, buffer
        self.timer: StepTimer | None = None

    def configure(self, config: MonitorConfig, exchange: bool, marks: Sequence[Marks]) -> None:
        """At attach and after a config edit; ``exchange``: the ranks merge each step (``JobShape``)."""
        buffer = self._buffer
        if not config.timing.enable:
            if self.timer is not None:
                self.timer.close()
            self.timer = None
            buffer.exchange = None
        elif self.timer is None:
            self.timer = StepTimer(
                index=self._rank if exchange else 0,
                world=world_size() if exchange else 1,
                pp_stage=self._pp_stage,
                exchange=exchange,
                events=self._events(),
            )
        timer = self.timer
        alone = timer is not None and timer.exchange and buffer.all_ranks is None
        if alone and buffer.exchange is None:
            try:
                buffer.exchange = TimesExchange(timer.world, timer.index, config.sync_timeout_s)
            except Exception:  # no gloo in this build, ...: each rank's times alone
                logger.exception(
                    "trainmon: %sthe ranks cannot exchange their step times; each records its own",
                    rank_note(),
                )
        buffer.timer = timer
        for mark in marks:
            mark.timer = timer

    def _events(self) -> Any:
        """Device events for the timer where the model lives on an accelerator (None on the CPU)."""
        first = next((p for chunk in self._chunks for p in chunk.parameters()), None)
        if first is None:
            return None
        return timing_events(first.device, LAG + 1, MAX_POINTS, MAX_COLLECTIVE_EVENTS)

    def end(self, at: float, step: int) -> bool:
        """The step ended at ``at``: whether it was timed."""
        return self.timer.end(at, step) if self.timer is not None else False

    def start(self, collecting: bool) -> None:
        if self.timer is not None:
            self.timer.start(collecting)

    def resume(self, at: float) -> None:
        """The next step's clock starts (a timer a config edit just made starts here)."""
        if self.timer is not None:
            self.timer.resume(at)

    def close(self) -> None:
        if self.timer is not None:
            self.timer.close()
