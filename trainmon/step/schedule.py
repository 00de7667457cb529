"""Which steps are collected: decided once per step, before any statistic is computed."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Schedule:
    """The steps ``start_step + k * step_interval`` until ``collect_times`` of them were collected, on the
    ranks of ``module_ranks`` (all when empty). :meth:`start` decides a step and counts it."""

    start_step: int = 0
    step_interval: int = 1
    collect_times: int = 100_000_000
    module_ranks: tuple[int, ...] = ()
    rank: int = 0
    _collected: int = field(default=0, init=False, repr=False)

    @property
    def collected(self) -> int:
        """Steps collected so far (counted by :meth:`start`)."""
        return self._collected

    def is_collect_step(self, step: int) -> bool:
        """Whether ``step`` would be collected now; counts nothing."""
        if self.module_ranks and self.rank not in self.module_ranks:
            return False
        if step < self.start_step or self._collected >= self.collect_times:
            return False
        return (step - self.start_step) % self.step_interval == 0

    def start(self, step: int) -> bool:
        """Whether ``step``, which starts now, is collected; a collected step counts toward ``collect_times``.
        Call it once per step (a monitor that is switched off does not call it, and counts nothing)."""
        collect = self.is_collect_step(step)
        self._collected += collect
        return collect
