"""Which steps are collected: decided once per step, before any statistic is computed."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Schedule:
    start_step: int = 0
    step_interval: int = 1
    collect_times: int = 100_000_000
    module_ranks: tuple[int, ...] = ()
    rank: int = 0
    collected: int = 0  # collected steps so far

    def is_collect_step(self, step: int) -> bool:
        if self.module_ranks and self.rank not in self.module_ranks:
            return False
        if step < self.start_step or self.collected >= self.collect_times:
            return False
        return (step - self.start_step) % self.step_interval == 0
