"""The step times in TensorBoard (trainmon.run.timing): ``time/<name>_ms`` on the ranks that write their own
events; on the ``all_ranks`` run, over every rank, ``time/<name>_ms/min``, ``/median``, ``/max`` and
``/max_rank`` (the rank of the max: which rank is slowest, and at what)."""

from __future__ import annotations

import numpy as np

from trainmon.run.timing import TIMES, StepTiming

__all__ = ["AGGREGATE_TAGS", "RANK_TAGS", "aggregate_values", "rank_values"]

RANK_TAGS = tuple(f"time/{name}_ms" for name in TIMES)
_AGGREGATES = ("min", "median", "max", "max_rank")
AGGREGATE_TAGS = tuple(f"time/{name}_ms/{what}" for name in TIMES for what in _AGGREGATES)


def rank_values(timing: StepTiming) -> np.ndarray:
    """This rank's times in milliseconds, in :data:`RANK_TAGS` order."""
    return timing.mine() * 1e3


def aggregate_values(timing: StepTiming) -> np.ndarray | None:
    """Every rank's times summarised, in :data:`AGGREGATE_TAGS` order (None without every rank's times)."""
    if timing.ranks is None:
        return None
    table = timing.table() * 1e3
    out = np.full((len(TIMES), len(_AGGREGATES)), np.nan)
    for j in range(len(TIMES)):
        column = table[:, j]
        finite = np.flatnonzero(np.isfinite(column))
        if not len(finite):
            continue
        values = column[finite]
        top = int(np.argmax(values))
        out[j] = (values.min(), np.median(values), values[top], float(finite[top]))
    return out.reshape(-1)
