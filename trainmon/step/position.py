"""Where the training loop is right now: step, micro-step, phase. Written by hooks, read by hooks."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from trainmon.run.records import Phase

logger = logging.getLogger("trainmon")


@dataclass
class LoopPosition:
    step: int = 0
    collecting: bool = False  # decided at the step boundary by the schedule
    forward_micro: int = -1  # index of the current forward micro-batch in this step
    backward_micro: int = -1  # index of the current backward micro-batch in this step
    phase: str = Phase.FORWARD.value
    expected_micro_steps: int = 1  # grad_acc_steps; corrected from what a step actually saw
    # the forward micro-batch whose graph the running backward belongs to: a backward hook knows the forward
    # it was registered in, so the first hook of a new graph to fire starts its micro-batch, whichever it is
    backward_of: int = -1
    warned_micro: bool = False  # a step ran another number of micro-batches than expected: said once

    def start_forward(self) -> None:
        self.forward_micro += 1
        self.phase = Phase.FORWARD.value

    def start_backward(self, forward_micro: int) -> None:
        """A backward hook of the graph built in forward micro-batch ``forward_micro`` is firing.

        Called before every hook of the counted chunk records anything: the hook order within a tensor or
        across outputs (a module's output that is the model's output carries the module's hook first) then
        cannot label the first rows of a micro-batch with the previous one. Counting backward starts (not
        copying ``forward_micro``) keeps a forward that never runs backward (no_grad in train mode) out."""
        if forward_micro > self.backward_of:
            self.backward_of = forward_micro
            self.backward_micro += 1
            self.phase = Phase.BACKWARD.value

    def check_micro_steps(self) -> None:
        """At a step's end: a step that ran another number of backward micro-batches than expected sets the
        expectation from then on (said once)."""
        seen = self.backward_micro + 1
        if seen > 0 and seen != self.expected_micro_steps:
            if not self.warned_micro:
                self.warned_micro = True
                logger.warning(
                    "trainmon: grad_acc_steps=%d but step %d ran %d micro-batches; using %d from now on",
                    self.expected_micro_steps,
                    self.step,
                    seen,
                    seen,
                )
            self.expected_micro_steps = seen

    def advance(self) -> None:
        """Move to the next step; whether it is collected is the schedule's call (``Monitor._arm_for``)."""
        self.step += 1
        self.forward_micro = -1
        self.backward_micro = -1
        self.backward_of = -1
        self.phase = Phase.FORWARD.value
