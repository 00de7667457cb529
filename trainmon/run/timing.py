"""Per-rank time: what a step's time went to on each rank, in the records and on disk (docs/timing.md).

**On the training side** (:mod:`trainmon.step.timing`) every timed step of a rank ends with one row of
:data:`EXCHANGED` floats: the step's wall time and its parts, the monitored collectives' time in
:data:`SLOTS` slots, and a few counts. The ranks of a job exchange their rows (every rank sends its own row
into a ``(world, WIDTH)`` table, summed over the ranks), so that each rank holds the rows of all; from that
table :func:`rank_times` derives every rank's :data:`TIMES`, ``wait`` included:

- ``wait``, the time a rank waited at the monitored collectives for the others (arrival skew): per slot, how
  long the rank spent in it minus the shortest time any rank spent in it. A collective returns on every
  rank at about the same moment, so the rank that arrived last spent the least time in it and waited for
  nobody; each other rank waited by as much as it arrived earlier. Slot ``k`` holds the collectives
  ``k, k + SLOTS, ...`` of the step, in the order the rank issued them: exact for steps of up to
  :data:`SLOTS` monitored collectives, a lower bound beyond.
- ``other``: what the step held besides its named parts (the loss, gradient clipping, the user's own
  work after backward).

The parts add up: ``step = data + forward + backward + optimizer + comm + gc + monitor + other``; ``comm``
and ``gc`` are carved out of the phase they happened in.

**On disk** two tables (:mod:`trainmon.run.timetable`):

- ``timing/rank=<r>/``: one row per timed step of rank ``r``;
- ``rank_times/``: one row per timed step holding every rank's times as lists of ``world`` float32, written
  by one rank of the job (rank 0) when the ranks exchange their rows: what the rank x step heat map reads,
  one file a thousand steps whatever the world.

Imports neither numpy nor pyarrow at import time (the config's rule names come from here).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

__all__ = [
    "EXCHANGED",
    "PHASES",
    "SLOTS",
    "STRAGGLER_PHASES",
    "TIMES",
    "WIDTH",
    "StepTiming",
    "pp_stages",
    "rank_times",
]

# Per rank and timed step, in seconds: what the timing table, TensorBoard (``time/<name>_ms``) and the plugin
# show.
TIMES = ("step", "data", "forward", "backward", "optimizer", "comm", "wait", "gc", "monitor", "other")
# The parts a step is cut into (``comm`` includes ``wait``; ``monitor`` is the monitor's own work between two
# steps: the step end's host copies, merges and exchanges).
PHASES = ("data", "forward", "backward", "optimizer", "comm", "gc", "monitor", "other")
# What the straggler rule may judge: a rank's own time (``comm`` without ``wait``: the time a rank spends in
# collectives waiting for nobody). ``wait`` is what the others lose to a straggler, ``monitor`` the
# monitor's own (one rank writes the job's aggregates).
STRAGGLER_PHASES = ("step", "data", "forward", "backward", "optimizer", "comm", "gc", "other")

# Slots of collective time per step (collective k of a step adds to slot k % SLOTS).
SLOTS = 16
# One exchanged row: the host's (or device's) times of the step, its counts, then the collective slots.
EXCHANGED = (
    "step", "data", "forward", "backward", "optimizer", "comm", "gc", "monitor", "other",
    "gc_count", "comm_count", "pp_stage", "present",
)  # fmt: skip
FIELD = {name: i for i, name in enumerate(EXCHANGED)}
SLOT0 = len(EXCHANGED)
WIDTH = SLOT0 + SLOTS
_TIME = {name: i for i, name in enumerate(TIMES)}


@dataclass(frozen=True)
class StepTiming:
    """One timed step of one rank, as the record carries it.

    ``own`` is this rank's exchanged row (:data:`EXCHANGED` then the slots); ``ranks`` the rows of every rank
    of the job (``(world, WIDTH)``, row ``index`` this rank's), or None when the ranks did not exchange
    them (one process; ``module_ranks`` leaves ranks out). ``ranks`` may be a host copy still in flight:
    read it after the record's ``ready``. ``step`` is the step the times are of: the record's own step on
    the CPU; on an accelerator, whose events are read once they have completed, a step
    :data:`trainmon.step.timing.LAG` collected steps earlier."""

    step: int
    index: int
    own: np.ndarray
    ranks: np.ndarray | None = None

    def table(self) -> np.ndarray:
        """``(ranks, len(TIMES))``: every rank's times (this rank's alone when they were not exchanged)."""
        import numpy as np

        rows = self.ranks if self.ranks is not None else np.asarray(self.own, dtype=np.float64)[None, :]
        return rank_times(rows)

    def mine(self) -> np.ndarray:
        """This rank's ``len(TIMES)`` times (``wait`` NaN when the ranks did not exchange their rows)."""
        table = self.table()
        return table[self.index if self.ranks is not None else 0]


def rank_times(rows: np.ndarray) -> np.ndarray:
    """``(n, len(TIMES))`` times of ``n`` exchanged rows (ranks that sent none: NaN). ``wait`` is each rank's
    arrival skew over the collective slots every rank of the table filled (NaN for a lone row, and where one
    rank alone sent its row: an exchange that failed says nothing of whom it waited for)."""
    import numpy as np

    rows = np.asarray(rows, dtype=np.float64).reshape(-1, WIDTH)
    out = np.full((len(rows), len(TIMES)), np.nan)
    present = rows[:, FIELD["present"]] > 0
    for name in TIMES:
        if name in FIELD:
            out[:, _TIME[name]] = rows[:, FIELD[name]]
    if present.sum() > 1:
        slots = rows[:, SLOT0:]
        used = (np.arange(SLOTS)[None, :] < rows[:, FIELD["comm_count"]][:, None]) & present[:, None]
        with np.errstate(invalid="ignore"):
            shortest = np.where(used, slots, np.inf).min(axis=0)
            skew = np.where(used & np.isfinite(shortest)[None, :], slots - shortest[None, :], 0.0)
        out[:, _TIME["wait"]] = np.maximum(skew, 0.0).sum(axis=1)
    out[~present] = np.nan
    return out


def pp_stages(rows: np.ndarray) -> np.ndarray:
    """Each exchanged row's pipeline stage (-1: no row)."""
    import numpy as np

    rows = np.asarray(rows, dtype=np.float64).reshape(-1, WIDTH)
    return np.where(rows[:, FIELD["present"]] > 0, rows[:, FIELD["pp_stage"]], -1).astype(np.int64)
