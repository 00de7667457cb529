"""What a rank does for the job as a whole under a config: whether it writes, whether the ranks merge each
step's tensors (the ``all_ranks`` run) and which rank writes that merge, which steps it collects."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainmon.config import MonitorConfig
from trainmon.device import world_size
from trainmon.step.allranks import AllRanksAggregate
from trainmon.step.buffer import StepBuffer
from trainmon.step.schedule import Schedule
from trainmon.writer.outputs import writes_all_ranks

__all__ = ["JobShape", "default_group"]


def default_group() -> object:
    """The default process group when one is up (the all_ranks aggregates are reduced over it), else None."""
    import torch.distributed as dist

    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


@dataclass(frozen=True)
class JobShape:
    """This rank in its job. ``sharded``: the optimizer merges statistics over ranks, so every rank must
    take part in each collected step, and ``module_ranks`` only chooses the ranks that record activations
    and write."""

    rank: int
    sharded: bool
    pp_stage: int = 0

    def writes(self, config: MonitorConfig) -> bool:
        return not (self.sharded and config.module_ranks and self.rank not in config.module_ranks)

    def speaks_for_job(self, config: MonitorConfig, world: int) -> bool:
        """Whether this rank says the messages every rank would say alike (``trainmon.joblog``): the first
        rank that hooks the modules (rank 0, or the first of ``module_ranks``: only the ranks listed meet
        what the modules hold), and every rank of a later pipeline stage, which holds modules the first does
        not (a fact only they meet is said by each of them rather than by none)."""
        listed = sorted(r for r in config.module_ranks if r < world)
        first = listed[0] if listed else 0
        return world < 2 or self.rank == first or self.pp_stage > 0

    def every_rank_checks(self, config: MonitorConfig) -> bool:
        """Whether every rank checks the same steps (then they can agree on a skip)."""
        return self.sharded or not config.module_ranks

    def schedule(self, config: MonitorConfig) -> Schedule:
        ranks = () if self.sharded else config.module_ranks
        return Schedule(config.start_step, config.step_interval, config.collect_times, ranks, self.rank)

    def aggregates(self, config: MonitorConfig) -> bool:
        """Whether the ranks can merge each step's tensors over the job (the all_ranks run): a process group
        of several ranks, each taking part in every collected step."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or world_size() < 2:
            return False
        return self.every_rank_checks(config)

    def all_ranks_writer(self, config: MonitorConfig) -> int:
        """The one rank that writes the all_ranks run: the first rank that writes at all."""
        return min(config.module_ranks) if self.sharded and config.module_ranks else 0

    def placement(self, config: MonitorConfig) -> dict[str, Any]:
        """What ``format_sinks`` needs to know of the job for ``config``."""
        return {
            "world": world_size(),
            "aggregates": self.aggregates(config),
            "all_ranks_writer": self.rank == self.all_ranks_writer(config),
        }

    def configure_all_ranks(self, buffer: StepBuffer, config: MonitorConfig) -> None:
        on = self.aggregates(config) and writes_all_ranks(config, world_size(), True)
        if not on:
            buffer.all_ranks = None
        elif buffer.all_ranks is None:  # kept across reloads: its table of tensors stays agreed
            buffer.all_ranks = AllRanksAggregate(default_group)
        buffer.keep_all_ranks = on and self.rank == self.all_ranks_writer(config)
