"""The writer-thread sink of the statistics store (the format: :mod:`trainmon.run.statstore`): each step's
step-level statistics appended as one record batch to the rank's columnar table."""

from __future__ import annotations

import os

import numpy as np

from trainmon.run.columnar import SegmentWriter
from trainmon.run.layout import stats_rank_dir
from trainmon.run.records import (
    NUMEL,
    Derived,
    Row,
    StepRecord,
    TensorGroups,
    chunk_name,
    dtype_name,
    kind_name,
    shape_text,
)
from trainmon.run.statstore import STATS_OPTIONS, STATS_SCHEMA, StatEncoder

__all__ = ["StatStoreSink"]


class StatStoreSink:
    """Writer-thread sink appending each step's statistics to the rank's store."""

    def __init__(self, run_dir: str | os.PathLike[str], rank: int, multi_chunk: bool = False) -> None:
        self.multi_chunk = bool(multi_chunk)
        self.path = stats_rank_dir(run_dir, rank)
        self._encoder = StatEncoder()
        self._store = SegmentWriter(self.path, STATS_SCHEMA, STATS_OPTIONS)
        self._layout: tuple[object, tuple[np.ndarray, ...] | None] = (None, None)

    def _indices(self, groups: TensorGroups, rows: tuple[Row, ...]) -> tuple[np.ndarray, ...]:
        """The dictionary indices of the step's tensors and of their dtypes and shapes, once per row layout
        (the writer thread hands over one grouping object per layout, so comparing it by identity costs
        nothing)."""
        if self._layout[0] is not groups:
            keys = [
                (kind_name(kind), chunk_name(vpp_stage, name, self.multi_chunk))
                for kind, vpp_stage, name in groups.keys
            ]
            first = [rows[i] for i in groups.first_rows()]
            meta = self._encoder.meta_indices([dtype_name(r.dtype) for r in first],
                                              [shape_text(r.shape) for r in first])  # fmt: skip
            self._layout = (groups, (*self._encoder.indices(keys), *meta))
        found = self._layout[1]
        assert found is not None
        return found

    def write(self, record: StepRecord, derived: Derived) -> None:
        if not record.rows or self._store.closed:
            return
        kinds, names, dtypes, shapes = self._indices(derived.groups, record.rows)
        numel = derived.merged[:, NUMEL]
        batch = self._encoder.encode(record.step, kinds, names, derived.tensors, numel, (dtypes, shapes))
        self._store.append(batch, record.step)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self._store.close()
