"""The per-step table: one row per collected step of a rank (:mod:`trainmon.run.columnar`)::

    RUN/plugins/trainmon/steps/rank=<r>/part-<seq>-<lo>-<hi>.parquet, _open-<seq>-<lo>.arrows

Columns (:data:`STEPS_SCHEMA`): ``step``; ``wall_time`` (when the step ended); ``grad_norm``, the L2 norm of
the rank's gradients at the step (every ``grad_reduced`` tensor, else every ``grad_unreduced`` one; finite
elements; NaN when no gradient was collected) and ``grad_nonfinite``, their NaN and Inf elements; ``tensors``,
the tensors collected; ``anomalies``, the records written for the step; ``skipped``, whether the update was
skipped (the loss scaler, or ``alert.on_nan: skip``). What "global gradient norm per step" and "which steps
went bad on which rank" read, across ranks, with DuckDB or :func:`read_steps`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import pyarrow as pa

from trainmon.run.columnar import ParquetOptions, read_partition
from trainmon.run.layout import steps_rank_dir
from trainmon.run.records import grad_norm

__all__ = ["STEPS_OPTIONS", "STEPS_SCHEMA", "encode_step", "grad_norm", "read_steps"]

STEPS_SCHEMA = pa.schema(
    [
        pa.field("step", pa.int64(), nullable=False),
        pa.field("wall_time", pa.float64(), nullable=False),
        pa.field("grad_norm", pa.float64(), nullable=False),
        pa.field("grad_nonfinite", pa.float64(), nullable=False),
        pa.field("tensors", pa.int32(), nullable=False),
        pa.field("anomalies", pa.int32(), nullable=False),
        pa.field("skipped", pa.bool_(), nullable=False),
    ]
)
STEPS_OPTIONS = ParquetOptions(dictionary=("tensors", "anomalies", "grad_nonfinite"))


def encode_step(
    step: int,
    wall_time: float,
    grad_norm: float,
    grad_nonfinite: float,
    tensors: int,
    anomalies: int,
    skipped: bool,
) -> pa.RecordBatch:
    """The one-row batch of a step."""
    values = (step, wall_time, grad_norm, grad_nonfinite, tensors, anomalies, skipped)
    columns = [pa.array([v], f.type) for v, f in zip(values, STEPS_SCHEMA, strict=True)]
    return pa.RecordBatch.from_arrays(columns, schema=STEPS_SCHEMA)


def read_steps(
    run: str | os.PathLike[str],
    rank: int,
    columns: Sequence[str] | None = None,
    step_lo: int | None = None,
    step_hi: int | None = None,
) -> pa.Table:
    """One rank's step rows in a step range, in write order."""
    return read_partition(steps_rank_dir(run, rank), STEPS_SCHEMA, columns, step_lo, step_hi)
