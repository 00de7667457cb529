"""The writer-thread sink of the statistics store (the format: :mod:`trainmon.run.statstore`): each step's
step-level statistics appended as one record batch to the rank's columnar table."""

from __future__ import annotations

import os

import numpy as np

from trainmon.run.columnar import SegmentWriter
from trainmon.run.layout import stats_rank_dir
from trainmon.run.records import Derived, StepRecord, TensorGroups, chunk_name, kind_name
from trainmon.run.statstore import STATS_OPTIONS, STATS_SCHEMA, StatEncoder
from trainmon.writer.layouts import LayoutCache

__all__ = ["StatStoreSink"]


class StatStoreSink:
    """Writer-thread sink appending each step's statistics to the rank's store."""

    def __init__(self, run_dir: str | os.PathLike[str], rank: int, multi_chunk: bool = False) -> None:
        self.multi_chunk = bool(multi_chunk)
        self.path = stats_rank_dir(run_dir, rank)
        self._encoder = StatEncoder()
        self._store = SegmentWriter(self.path, STATS_SCHEMA, STATS_OPTIONS)
        self._layouts = LayoutCache(self._indices)

    def _indices(self, rows: tuple) -> tuple[np.ndarray, np.ndarray]:
        keys = [
            (kind_name(kind), chunk_name(vpp_stage, name, self.multi_chunk))
            for kind, vpp_stage, name in TensorGroups(rows).keys
        ]
        return self._encoder.indices(keys)

    def write(self, record: StepRecord, derived: Derived) -> None:
        if not record.rows or self._store.closed:
            return
        kinds, names = self._layouts.get(tuple(record.rows))
        batch = self._encoder.encode(record.step, kinds, names, derived.tensors)
        self._store.append(batch, record.step)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self._store.close()
