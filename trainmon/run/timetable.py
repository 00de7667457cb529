"""The timing tables (:mod:`trainmon.run.timing` says what the times mean; :mod:`trainmon.run.columnar` how a
table is written)::

    RUN/plugins/trainmon/timing/rank=<r>/    one row per timed step of rank r (:data:`TIMING_SCHEMA`)
    RUN/plugins/trainmon/rank_times/         one row per timed step: every rank's times

``timing`` columns: ``step``, then the seconds of :data:`~trainmon.run.timing.TIMES` (``step``'s as
``step_time``), ``gc_count`` and ``comm_count``. ``rank_times`` columns: ``step``, ``world`` and one list of
``world`` float32 per time, named as in ``timing`` (the ranks in order; NaN for a rank that sent no row).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from trainmon.run.columnar import ParquetOptions, read_partition
from trainmon.run.layout import rank_times_dir, timing_rank_dir
from trainmon.run.timing import TIMES

__all__ = [
    "RANK_TIMES_LIST",
    "RANK_TIMES_OPTIONS",
    "RANK_TIMES_SCHEMA",
    "TIMING_COLUMNS",
    "TIMING_OPTIONS",
    "TIMING_SCHEMA",
    "encode_rank_times",
    "encode_timing",
    "rank_times_batch",
    "read_rank_times",
    "read_timing",
]

# the column of each time in the per-rank table (the step's own wall time is ``step_time``: ``step`` is the
# step's number, as in every table)
TIMING_COLUMNS = tuple("step_time" if name == "step" else name for name in TIMES)

TIMING_SCHEMA = pa.schema(
    [
        pa.field("step", pa.int64(), nullable=False),
        *(pa.field(name, pa.float64(), nullable=False) for name in TIMING_COLUMNS),
        pa.field("gc_count", pa.int32(), nullable=False),
        pa.field("comm_count", pa.int32(), nullable=False),
    ]
)
TIMING_OPTIONS = ParquetOptions(dictionary=("gc_count", "comm_count"), byte_stream_split=TIMING_COLUMNS)


def encode_timing(step: int, times: Sequence[float], gc_count: int, comm_count: int) -> pa.RecordBatch:
    """The one-row batch of a timed step of one rank (``times`` in :data:`TIMES` order)."""
    values = (step, *(float(t) for t in times), int(gc_count), int(comm_count))
    columns = [pa.array([v], f.type) for v, f in zip(values, TIMING_SCHEMA, strict=True)]
    return pa.RecordBatch.from_arrays(columns, schema=TIMING_SCHEMA)


def read_timing(
    run: str | os.PathLike[str],
    rank: int,
    columns: Sequence[str] | None = None,
    step_lo: int | None = None,
    step_hi: int | None = None,
) -> pa.Table:
    """One rank's timed steps in a step range, in write order."""
    return read_partition(timing_rank_dir(run, rank), TIMING_SCHEMA, columns, step_lo, step_hi)


# every rank's value, NaN for a rank that sent none: the items are never null, and saying so spares a reader
# the definition levels of 20 million items (a 1,024-rank x 20,000-step time)
RANK_TIMES_LIST = pa.list_(pa.field("item", pa.float32(), nullable=False))
RANK_TIMES_SCHEMA = pa.schema(
    [
        pa.field("step", pa.int64(), nullable=False),
        pa.field("world", pa.int32(), nullable=False),
        *(pa.field(name, RANK_TIMES_LIST, nullable=False) for name in TIMING_COLUMNS),
    ]
)
# uncompressed: measured times have noisy mantissas, so zstd saved only a quarter of the bytes and took half
# of the time of the heat map's first read of a time (the tab reads a whole time of every rank at once)
RANK_TIMES_OPTIONS = ParquetOptions(dictionary=("world",), compression="none")


def encode_rank_times(step: int, table: np.ndarray) -> pa.RecordBatch:
    """The one-row batch of a step's ``(world, len(TIMES))`` times of every rank."""
    return rank_times_batch(np.asarray([step]), np.asarray(table).reshape(1, -1, len(TIMES)))


def rank_times_batch(steps: np.ndarray, times: np.ndarray) -> pa.RecordBatch:
    """The batch of ``n`` steps' ``(n, world, len(TIMES))`` times of every rank (a row a step)."""
    n, world, _ = times.shape
    offsets = pa.array(np.arange(n + 1, dtype=np.int32) * world)
    columns = [pa.array(np.asarray(steps, dtype=np.int64)), pa.array(np.full(n, world, dtype=np.int32))]
    for j in range(len(TIMES)):
        values = pa.array(np.ascontiguousarray(times[:, :, j], dtype=np.float32).ravel())
        columns.append(pa.ListArray.from_arrays(offsets, values, type=RANK_TIMES_LIST))
    return pa.RecordBatch.from_arrays(columns, schema=RANK_TIMES_SCHEMA)


def read_rank_times(
    run: str | os.PathLike[str],
    columns: Sequence[str] | None = None,
    step_lo: int | None = None,
    step_hi: int | None = None,
) -> pa.Table:
    """The rows of every rank's times in a step range, in write order."""
    return read_partition(rank_times_dir(run), RANK_TIMES_SCHEMA, columns, step_lo, step_hi)
