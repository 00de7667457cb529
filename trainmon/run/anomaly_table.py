"""Anomaly records as a columnar table (:mod:`trainmon.run.columnar`)::

    RUN/plugins/trainmon/anomalies/rank=<r>/part-<seq>-<lo>-<hi>.parquet    sealed segments
    RUN/plugins/trainmon/anomalies/rank=<r>/_open-<seq>-<lo>.arrows         the steps being written

One row per record, the fields of :class:`~trainmon.run.records.Anomaly` as columns (:data:`ANOMALY_SCHEMA`;
the rank is the partition's): the strings of few values (kind, name, stat, rule, phase) dictionary-encoded,
``baseline`` and ``dump`` null when absent. Each step's records (the per-step cap applied) are one record
batch; steps without records write nothing.

Readers: :func:`anomaly_ranks`, :func:`read_anomaly_rows` (a pyarrow table, columns and a step range) and
:func:`read_anomalies` (``Anomaly`` objects). Both also read the old layout, one JSON object a line in
``anomalies/rank_<r>.jsonl`` (:mod:`trainmon.run.anomalies`), which ``trainmon migrate RUN`` converts.
"""

from __future__ import annotations

import dataclasses
import operator
import os
from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from trainmon.run.anomalies import iter_anomalies
from trainmon.run.columnar import GrowingDictionary, ParquetOptions, read_partition, utf8
from trainmon.run.layout import (
    RANK_JSONL,
    anomalies_dir,
    anomalies_file,
    anomalies_rank_dir,
    rank_files,
    rank_partitions,
)
from trainmon.run.records import Anomaly

__all__ = [
    "ANOMALY_OPTIONS",
    "ANOMALY_SCHEMA",
    "AnomalyEncoder",
    "anomaly_ranks",
    "read_anomalies",
    "read_anomaly_rows",
]

_DICT = pa.dictionary(pa.int32(), pa.string())
ANOMALY_SCHEMA = pa.schema(
    [
        pa.field("step", pa.int64(), nullable=False),
        pa.field("kind", _DICT, nullable=False),
        pa.field("name", _DICT, nullable=False),
        pa.field("stat", _DICT, nullable=False),
        pa.field("value", pa.float64(), nullable=False),
        pa.field("rule", _DICT, nullable=False),
        pa.field("seq", pa.int64(), nullable=False),
        pa.field("micro_step", pa.int32(), nullable=False),
        pa.field("vpp_stage", pa.int32(), nullable=False),
        pa.field("pp_stage", pa.int32(), nullable=False),
        pa.field("phase", _DICT, nullable=False),
        pa.field("baseline", pa.float64()),
        pa.field("origin", pa.bool_(), nullable=False),
        pa.field("propagated", pa.bool_(), nullable=False),
        pa.field("collectives", pa.int64(), nullable=False),
        pa.field("wall_time", pa.float64(), nullable=False),
        pa.field("dump", pa.string()),
        pa.field("message", pa.string(), nullable=False),  # plain: messages hold counts, nearly all differ
        pa.field("v", pa.int16(), nullable=False),
    ]
)
ANOMALY_OPTIONS = ParquetOptions()
_STRINGS = ("kind", "name", "stat", "rule", "phase")  # few distinct values: dictionaries that only grow
_PLAIN = {
    "step": (pa.int64(), np.int64),
    "value": (pa.float64(), np.float64),
    "seq": (pa.int64(), np.int64),
    "micro_step": (pa.int32(), np.int32),
    "vpp_stage": (pa.int32(), np.int32),
    "pp_stage": (pa.int32(), np.int32),
    "collectives": (pa.int64(), np.int64),
    "wall_time": (pa.float64(), np.float64),
    "v": (pa.int16(), np.int16),
}


_FIELDS = tuple(f.name for f in ANOMALY_SCHEMA)
_GET = operator.attrgetter(*_FIELDS)  # one record's fields, in the schema's order


class AnomalyEncoder:
    """Anomalies as a record batch of :data:`ANOMALY_SCHEMA` (the string columns' dictionaries only grow)."""

    def __init__(self) -> None:
        self._dicts = {name: GrowingDictionary() for name in _STRINGS}

    def encode(self, anomalies: Sequence[Anomaly]) -> pa.RecordBatch:
        values = dict(zip(_FIELDS, zip(*map(_GET, anomalies), strict=True), strict=True))
        columns: dict[str, pa.Array] = {}
        for name, (arrow_type, np_type) in _PLAIN.items():
            columns[name] = pa.array(np.asarray(values[name], dtype=np_type), arrow_type)
        for name, d in self._dicts.items():
            columns[name] = d.array(d.indices(values[name]))
        columns["baseline"] = pa.array(values["baseline"], pa.float64())
        columns["origin"] = pa.array(values["origin"], pa.bool_())
        columns["propagated"] = pa.array(values["propagated"], pa.bool_())
        columns["dump"] = pa.array([None if d is None else utf8(d) for d in values["dump"]], pa.string())
        columns["message"] = pa.array([utf8(m) for m in values["message"]], pa.string())
        return pa.RecordBatch.from_arrays([columns[f.name] for f in ANOMALY_SCHEMA], schema=ANOMALY_SCHEMA)


def anomaly_ranks(run: str | os.PathLike[str]) -> list[int]:
    """Ranks with anomaly records (columnar, or the old layout's files)."""
    directory = anomalies_dir(run)
    ranks = {r for r, _ in rank_partitions(directory)} | {r for r, _ in rank_files(directory, RANK_JSONL)}
    return sorted(ranks)


def _old(run: str | os.PathLike[str], rank: int, step_lo: int | None, step_hi: int | None) -> list[Anomaly]:
    path = anomalies_file(run, rank)
    if not path.is_file():
        return []
    return [
        a
        for a in iter_anomalies(path)
        if (step_lo is None or a.step >= step_lo) and (step_hi is None or a.step <= step_hi)
    ]


def read_anomaly_rows(
    run: str | os.PathLike[str],
    rank: int,
    columns: Sequence[str] | None = None,
    step_lo: int | None = None,
    step_hi: int | None = None,
) -> pa.Table:
    """One rank's records as a table (columns of :data:`ANOMALY_SCHEMA`) in a step range, in write order;
    an old layout's records first."""
    table = read_partition(anomalies_rank_dir(run, rank), ANOMALY_SCHEMA, columns, step_lo, step_hi)
    old = _old(run, rank, step_lo, step_hi)
    if old:
        legacy = AnomalyEncoder().encode(old)
        legacy_table = pa.Table.from_batches([legacy])
        if columns is not None:
            legacy_table = legacy_table.select(list(columns))
        table = pa.concat_tables([legacy_table, table], promote_options="permissive")
    return table


def read_anomalies(
    run: str | os.PathLike[str], rank: int, step_lo: int | None = None, step_hi: int | None = None
) -> list[Anomaly]:
    """One rank's records in a step range (both ends included; None: open), in write order."""
    old = _old(run, rank, step_lo, step_hi)
    table = read_partition(anomalies_rank_dir(run, rank), ANOMALY_SCHEMA, None, step_lo, step_hi)
    if not table.num_rows:
        return old
    fields = {f.name for f in dataclasses.fields(Anomaly)}
    rows = table.to_pylist()
    return old + [Anomaly(rank=rank, **{k: v for k, v in row.items() if k in fields}) for row in rows]
