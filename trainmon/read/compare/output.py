"""The report folder of ``trainmon compare`` (statistics)::

    OUT/summary.json                        what --json prints: the first divergence, its cause and evidence
    OUT/tensors.csv                         every tensor pair: rank, kind, names in A and B, how they were
                                            paired, dtypes in A and B, shape, the precision its tolerance
                                            allows for and why, tolerance, divergent steps, first one
    OUT/diffs/rank=<r>/part-<k>.parquet     per step and tensor: step, kind, name (as run A names it; B's
                                            name is in tensors.csv), rel, score, divergent (step range k of
                                            rank r)

``diffs`` is a hive-partitioned Parquet dataset like the run's own tables: DuckDB
(``read_parquet('OUT/diffs/*/*.parquet', hive_partitioning=true)``), pandas and Polars read it whole.
``rel`` is the relative difference (:mod:`~trainmon.read.compare.diff`), NaN where a run holds no row of the
tensor at the step; ``score`` is ``rel`` over the tolerance and the state's slack (above 1: divergent).
Ranges are written on a thread of their own while the comparison goes on.
"""

from __future__ import annotations

import csv
import json
import queue
import shutil
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from trainmon.read.compare.engine import Chunk, Result

__all__ = ["DIFFS_DIR", "SUMMARY_FILE", "TENSORS_FILE", "ReportWriter", "diff_file"]

SUMMARY_FILE = "summary.json"
TENSORS_FILE = "tensors.csv"
DIFFS_DIR = "diffs"
_SCHEMA = pa.schema(
    [
        pa.field("step", pa.int64(), nullable=False),
        pa.field("kind", pa.dictionary(pa.int8(), pa.string()), nullable=False),
        pa.field("name", pa.dictionary(pa.int32(), pa.string()), nullable=False),
        pa.field("rel", pa.float32()),
        pa.field("score", pa.float32()),
        pa.field("divergent", pa.bool_(), nullable=False),
    ]
)
# lz4, and min/max statistics of the step column only (what step-range readers prune row groups by): half
# the CPU of zstd with every column's statistics, for 5% more bytes (a full comparison writes tens of millions
# of rows)
_OPTIONS = {"compression": "lz4", "use_dictionary": ["step", "kind", "name", "divergent"],
            "use_byte_stream_split": ["rel", "score"], "write_statistics": ["step"]}  # fmt: skip
_QUEUE = 4  # ranges waiting to be written; the comparison waits beyond


def diff_file(out: Path, rank: int, index: int) -> Path:
    return out / DIFFS_DIR / f"rank={int(rank)}" / f"part-{int(index):05d}.parquet"


def _dictionary(values: list[str], indices: np.ndarray, index_type: pa.DataType) -> pa.DictionaryArray:
    return pa.DictionaryArray.from_arrays(pa.array(indices, index_type), pa.array(values, pa.string()))


def _table(chunk: Chunk) -> pa.Table:
    pairs = chunk.plan.pairs
    n_steps, n_pairs = chunk.rel.shape
    column = np.tile(np.arange(n_pairs, dtype=np.int32), n_steps)
    kinds = list(dict.fromkeys(p.kind for p in pairs))
    kind_of = np.asarray([kinds.index(p.kind) for p in pairs], dtype=np.int8)
    return pa.table(
        [
            pa.array(np.repeat(chunk.steps.astype(np.int64), n_pairs)),
            _dictionary(kinds, kind_of[column], pa.int8()),
            _dictionary([p.name for p in pairs], column, pa.int32()),
            pa.array(chunk.rel.reshape(-1)),
            pa.array(chunk.score.reshape(-1)),
            pa.array(chunk.score.reshape(-1) > 1),
        ],
        schema=_SCHEMA,
    )


class ReportWriter:
    """Writes the report folder: :meth:`add` as a comparison's sink, :meth:`finish` at its end."""

    def __init__(self, out: str | Path) -> None:
        self.out = Path(out)
        if (self.out / DIFFS_DIR).exists():  # a report of an earlier comparison: replaced, never mixed
            shutil.rmtree(self.out / DIFFS_DIR)
        self.out.mkdir(parents=True, exist_ok=True)
        self._queue: queue.Queue = queue.Queue(maxsize=_QUEUE)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="trainmon-compare-report", daemon=True)
        self._thread.start()

    def add(self, chunk: Chunk) -> None:
        if self._error is not None:
            raise self._error
        self._queue.put(chunk)

    def _run(self) -> None:
        while True:
            chunk = self._queue.get()
            if chunk is None:
                return
            if self._error is not None:
                continue
            try:
                path = diff_file(self.out, chunk.rank, chunk.index)
                path.parent.mkdir(parents=True, exist_ok=True)
                pq.write_table(_table(chunk), path, **_OPTIONS)
            except BaseException as e:  # raised to the comparison at its next range, or at finish
                self._error = e

    def finish(self, summary: dict[str, Any], result: Result) -> None:
        """Wait for the ranges, then write the summary and the tensor list."""
        self._queue.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error
        (self.out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2, allow_nan=False) + "\n")
        with open(self.out / TENSORS_FILE, "w", newline="", encoding="utf-8") as f:
            out = csv.writer(f)
            out.writerow(["rank", "kind", "name", "name_b", "paired_by", "phase", "dtype", "dtype_b", "shape",
                          "precision", "rtol", "ztol", "tolerance_why", "divergent_steps",
                          "first_divergent_step"])  # fmt: skip
            for tally in result.ranks:
                if tally.plan is None:
                    continue
                for pair in tally.plan.pairs:
                    key = (pair.kind, pair.name)
                    first = tally.pair_first.get(key)
                    out.writerow([tally.rank, pair.kind, pair.name, pair.name_b, pair.how, pair.phase,
                                  pair.dtype or "", pair.dtype_b or "", pair.shape or "",
                                  pair.precision or "", f"{pair.rtol:.3g}", f"{pair.ztol:.3g}", pair.why,
                                  tally.pair_counts.get(key, 0), "" if first is None else first])  # fmt: skip
