"""Where the training loop is right now: step, micro-step, phase. Written by hooks, read by hooks."""

from __future__ import annotations

from dataclasses import dataclass

from trainmon.records import Phase


@dataclass
class StepState:
    step: int = 0
    collecting: bool = False  # decided at the step boundary by the schedule
    forward_micro: int = -1  # index of the current forward micro-batch in this step
    backward_micro: int = -1  # index of the current backward micro-batch in this step
    phase: str = Phase.FORWARD.value
    expected_micro_steps: int = 1  # grad_acc_steps; corrected from what a step actually saw

    def start_forward(self) -> None:
        self.forward_micro += 1
        self.phase = Phase.FORWARD.value

    def start_backward(self) -> None:
        self.backward_micro += 1
        self.phase = Phase.BACKWARD.value

    def advance(self) -> None:
        """Move to the next step; whether it is collected is the schedule's call (``Monitor._arm_for``)."""
        self.step += 1
        self.forward_micro = -1
        self.backward_micro = -1
        self.phase = Phase.FORWARD.value
