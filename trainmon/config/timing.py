"""The ``timing`` section: per-rank time of every collected step (``trainmon.step.timing``,
docs/timing.md)."""

from __future__ import annotations

from dataclasses import dataclass

from trainmon.config.keys import Section, key

__all__ = ["TimingConfig"]


@dataclass(frozen=True)
class TimingConfig(Section):
    """``timing``: where each collected step's time goes on every rank, without a sync."""

    PATH = "timing"

    enable: bool = key(
        True,
        "time each collected step's parts on every rank (docs/timing.md)",
        doc="Time each collected step on every rank: its wall time and its parts (data loading, forward, "
        "backward, optimizer, collectives and the wait at them, garbage collection, the monitor's own, the "
        "rest), with device events on accelerators and the host's clock on the CPU, never a synchronising "
        "call ([timing.md](timing.md)). In a process group the ranks exchange their times with the step's "
        "other aggregates. `false` turns it off.",
    )
    collectives: bool = key(
        False,
        "time torch.distributed collectives without cc_distribution's statistics",
        doc="Time the job's torch.distributed collectives, and the wait at them, without recording their "
        "statistics: their functions are wrapped on collected steps as `cc_distribution` does (with "
        "`cc_distribution.enable` they are timed anyway). Off by default: the wrappers are put in place and "
        "taken away again at every change between collected and other steps.",
    )
