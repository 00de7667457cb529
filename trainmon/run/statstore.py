"""The statistics store: every step-level statistic of every tensor of a rank, as a columnar table
(:mod:`trainmon.run.columnar`), for the TensorBoard plugin's heatmaps, cross-rank questions and any tool that
reads Parquet (DuckDB, pandas, Polars, Spark)::

    RUN/plugins/trainmon/stats/rank=<r>/part-<seq>-<lo>-<hi>.parquet    sealed segments
    RUN/plugins/trainmon/stats/rank=<r>/_open-<seq>-<lo>.arrows         the steps being written

One row per (step, tensor), columns :data:`STATS_SCHEMA`:

    step                         int64
    kind, name                   dictionary-encoded strings (each name once per segment, not once per value);
                                 ``name`` as TensorBoard shows it (``<chunk>:<name>`` with several chunks)
    min, max, mean, norm, zeros  float32: the values TensorBoard shows (micro-steps merged; beyond float32's
                                 range: +-inf), for all seven statistics whatever ``ops`` says
    nans, infs                   float64: element counts (exact to 2**53)
    numel                        int64: the elements the statistics cover (micro-steps merged)
    dtype, shape                 dictionary-encoded strings: the tensor's dtype (``float32``, ``bfloat16``:
                                 :func:`~trainmon.run.records.dtype_name`) and shape (``[8, 32]``, of its
                                 first micro-step)

``numel``, ``dtype`` and ``shape`` came with ``trainmon compare`` (its tolerance and its name alignment need
them); stores written before hold nulls there (:func:`read_meta` answers None).

**Reader API** (what the plugin and scripts build on; every function also reads the old store, below):

- :func:`stat_ranks` ``(run) -> [rank, ...]``: the ranks that have a store.
- :func:`read_stats` ``(run, rank, stats, step_lo, step_hi, kinds) -> StatFrame``: one rank's steps x tensors
  matrix per statistic for a step range (NaN where a tensor has no row at a step).
- :func:`read_stat_blocks` ``(run, rank, stat, step_lo, step_hi, block, kinds) -> StatBlocks``: per block of
  ``block`` steps and tensor, the lowest and highest value and whether any step held a NaN/Inf element: the
  zoomed-out heatmap.
- :func:`read_series` ``(run, rank, kind, name, stats, step_lo, step_hi) -> (steps, {stat: values})``: one
  tensor's line.
- :func:`read_rows` ``(run, rank, columns, step_lo, step_hi) -> pyarrow.Table``: the rows themselves.
- :func:`read_meta` ``(run, rank, step_lo, step_hi) -> TensorMeta | None``: each tensor's dtype and shape.
- :func:`read_frame` ``(run, rank, stats, step_lo, step_hi, kinds) -> (StatFrame, TensorMeta)``: both, from
  one read of the rows.
- :func:`step_span` ``(run, rank) -> (first, last) | None``: the steps a rank's store holds, from the
  segments' names and the step column of a stream still open (no other file is read).
- :func:`iter_store` ``(run, rank, columns, step_lo, step_hi) -> Iterator[pyarrow.Table]``: the rows of
  :func:`read_rows`, one segment at a time (a reader of a whole long store, ``trainmon export``, holds one
  segment in memory, never the store).

The old store (runs written before the columnar tables; ``trainmon migrate RUN`` converts it)::

    RUN/plugins/trainmon/stats/rank_<r>.names.jsonl   {"id": 0, "kind": "actv", "name": "layers.0.output"}
    RUN/plugins/trainmon/stats/rank_<r>.bin           records of STAT_RECORD: step, id, 7 float32 stats

is read by :func:`read_names` and :func:`read_records` (a reader ignores a trailing partial record).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from trainmon.run.columnar import (
    GrowingDictionary,
    ParquetOptions,
    array_numpy,
    read_partition,
    read_segment,
    segments,
    signature,
)
from trainmon.run.layout import (
    RANK_BIN,
    rank_files,
    rank_partitions,
    stats_dir,
    stats_names_file,
    stats_rank_dir,
    stats_records_file,
)
from trainmon.run.records import STATS

__all__ = [
    "STATS_OPTIONS",
    "STATS_SCHEMA",
    "STAT_RECORD",
    "StatBlocks",
    "StatEncoder",
    "StatFrame",
    "TensorMeta",
    "dictionary_ids",
    "iter_store",
    "last_step",
    "read_frame",
    "read_meta",
    "read_names",
    "read_records",
    "read_rows",
    "read_series",
    "read_stat_blocks",
    "read_stats",
    "stat_ranks",
    "step_span",
    "store_signature",
    "stored_tensors",
    "tensor_columns",
]

COUNT_STATS = ("nans", "infs")
VALUE_STATS = tuple(s for s in STATS if s not in COUNT_STATS)

STATS_SCHEMA = pa.schema(
    [
        pa.field("step", pa.int64(), nullable=False),
        pa.field("kind", pa.dictionary(pa.int8(), pa.string()), nullable=False),
        pa.field("name", pa.dictionary(pa.int32(), pa.string()), nullable=False),
        *(pa.field(s, pa.float32()) for s in VALUE_STATS),
        *(pa.field(s, pa.float64()) for s in COUNT_STATS),
        pa.field("numel", pa.int64()),
        pa.field("dtype", pa.dictionary(pa.int8(), pa.string())),
        pa.field("shape", pa.dictionary(pa.int32(), pa.string())),
    ]
)
META_COLUMNS = ("numel", "dtype", "shape")
STATS_OPTIONS = ParquetOptions(
    dictionary=("step", "kind", "name", *COUNT_STATS, *META_COLUMNS),  # counts: nearly always 0
    byte_stream_split=VALUE_STATS,
)

# ---------------------------------------------------------------------------------------------- writing


class StatEncoder:
    """One step's statistics as a record batch of :data:`STATS_SCHEMA`. The dictionaries only grow (a new
    tensor appends its name), so every batch of a stream indexes the same dictionary; a layout's indices are
    computed once (:meth:`indices`)."""

    def __init__(self) -> None:
        self.kinds = GrowingDictionary(index_type=pa.int8())
        self.names = GrowingDictionary(index_type=pa.int32())
        self.dtypes = GrowingDictionary(index_type=pa.int8())
        self.shapes = GrowingDictionary(index_type=pa.int32())

    def indices(self, keys: Sequence[tuple[str, str]]) -> tuple[np.ndarray, np.ndarray]:
        """The dictionary indices of (kind, name) pairs, adding new ones to the dictionaries."""
        return self.kinds.indices([k for k, _ in keys]), self.names.indices([n for _, n in keys])

    def meta_indices(self, dtypes: Sequence[str], shapes: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """The dictionary indices of the tensors' dtypes and shapes (texts), once per layout."""
        return self.dtypes.indices(list(dtypes)), self.shapes.indices(list(shapes))

    def encode(
        self,
        step: int,
        kinds: np.ndarray,
        names: np.ndarray,
        values: dict[str, np.ndarray],
        numel: np.ndarray | None = None,
        meta: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> pa.RecordBatch:
        """The batch of one step: ``kinds``/``names`` from :meth:`indices`, ``values[stat]`` per tensor,
        ``numel`` per tensor and ``meta`` from :meth:`meta_indices` (nulls when not given)."""
        n = len(kinds)
        columns = [pa.array(np.full(n, step, dtype=np.int64)), self.kinds.array(kinds),
                   self.names.array(names)]  # fmt: skip
        with np.errstate(over="ignore"):  # beyond float32 is +-inf, as in TensorBoard
            columns += [pa.array(np.asarray(values[s], dtype=np.float32)) for s in VALUE_STATS]
        columns += [pa.array(np.asarray(values[s], dtype=np.float64)) for s in COUNT_STATS]
        columns.append(pa.nulls(n, pa.int64()) if numel is None else pa.array(np.asarray(numel, np.int64)))
        if meta is None:
            columns += [pa.nulls(n, STATS_SCHEMA.field(c).type) for c in ("dtype", "shape")]
        else:
            columns += [self.dtypes.array(meta[0]), self.shapes.array(meta[1])]
        return pa.RecordBatch.from_arrays(columns, schema=STATS_SCHEMA)


# ---------------------------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class StatFrame:
    """One rank's statistics over a step range as matrices: ``values[stat][i, j]`` is tensor ``tensors[j]``
    at step ``steps[i]`` (NaN where the tensor has no row at that step; the last row wins where a resumed
    job wrote a step twice). Tensors in order of first appearance (the order the hooks fired)."""

    steps: np.ndarray  # (S,) int64, ascending
    tensors: tuple[tuple[str, str], ...]  # (kind, name) of each column
    values: dict[str, np.ndarray]  # stat -> (S, T): float32 for values, float64 for nans/infs

    def column(self, kind: str, name: str) -> int | None:
        try:
            return self.tensors.index((kind, name))
        except ValueError:
            return None


@dataclass(frozen=True)
class StatBlocks:
    """Per block of steps and tensor: the lowest and highest value of one statistic (NaN when no finite
    value), and flags: any row at all, any NaN element, any Inf element (whatever the statistic shown).
    Block ``b`` holds the steps ``starts[b] .. starts[b] + block - 1`` (aligned to ``block``)."""

    block: int
    starts: np.ndarray  # (B,) int64: the first step of each block that has a row
    tensors: tuple[tuple[str, str], ...]
    low: np.ndarray  # (B, T) float32
    high: np.ndarray  # (B, T) float32
    has_data: np.ndarray  # (B, T) bool
    has_nan: np.ndarray  # (B, T) bool
    has_inf: np.ndarray  # (B, T) bool


def stat_ranks(run: str | os.PathLike[str]) -> list[int]:
    """Ranks with a statistics store (columnar or old)."""
    directory = stats_dir(run)
    ranks = {r for r, _ in rank_partitions(directory)} | {r for r, _ in rank_files(directory, RANK_BIN)}
    return sorted(ranks)


def read_rows(
    run: str | os.PathLike[str],
    rank: int,
    columns: Sequence[str] | None = None,
    step_lo: int | None = None,
    step_hi: int | None = None,
) -> pa.Table:
    """One rank's rows (columns of :data:`STATS_SCHEMA`) in a step range, in write order; an old store's
    records are converted to the same columns."""
    table = read_partition(stats_rank_dir(run, rank), STATS_SCHEMA, columns, step_lo, step_hi)
    if stats_records_file(run, rank).exists():
        old = _old_rows(run, rank, step_lo, step_hi)
        if old.num_rows:
            old = old if columns is None else old.select(list(columns))
            table = pa.concat_tables([old, table], promote_options="permissive") if table.num_rows else old
    return table


def iter_store(
    run: str | os.PathLike[str],
    rank: int,
    columns: Sequence[str] | None = None,
    step_lo: int | None = None,
    step_hi: int | None = None,
) -> Iterator[pa.Table]:
    """The rows :func:`read_rows` returns, one table per segment in write order (an old store's rows first);
    each table holds whole steps. A live stream sealed while it is read is read from its sealed segment."""
    if stats_records_file(run, rank).exists():
        old = _old_rows(run, rank, step_lo, step_hi)
        if old.num_rows:
            yield old if columns is None else old.select(list(columns))
    partition = stats_rank_dir(run, rank)
    for segment in segments(partition):
        if not segment.overlaps(step_lo, step_hi):
            continue
        try:
            table = read_segment(segment, STATS_SCHEMA, columns, step_lo, step_hi)
        except FileNotFoundError:  # sealed (or replaced) since the listing: its Parquet has the same seq
            again = [s for s in segments(partition) if s.seq == segment.seq]
            if not again:
                continue
            table = read_segment(again[0], STATS_SCHEMA, columns, step_lo, step_hi)
        if table.num_rows:
            yield table


def _old_rows(run: str | os.PathLike[str], rank: int, step_lo: int | None, step_hi: int | None) -> pa.Table:
    recs = read_records(stats_records_file(run, rank))
    names = {i: (kind, name) for i, kind, name in read_names(stats_names_file(run, rank))[0]}
    steps = np.asarray(recs["step"])
    keep = np.ones(len(steps), dtype=bool)
    if step_lo is not None:
        keep &= steps >= step_lo
    if step_hi is not None:
        keep &= steps <= step_hi
    ids = np.asarray(recs["id"])[keep]
    known = np.isin(ids, np.fromiter(names, dtype=np.int64, count=len(names)))  # a damaged name line
    ids = ids[known]
    sel = np.flatnonzero(keep)[known]
    encoder = StatEncoder()
    order = sorted(names)
    kind_of, name_of = encoder.indices([names[i] for i in order])
    lookup = np.zeros(max(order, default=0) + 1, dtype=np.int64)
    lookup[np.asarray(order, dtype=np.int64)] = np.arange(len(order))
    pos = lookup[ids]
    stats = np.asarray(recs["stats"])[sel]
    columns = {
        "step": pa.array(steps[sel]),
        "kind": encoder.kinds.array(kind_of[pos]),
        "name": encoder.names.array(name_of[pos]),
    }
    for j, stat in enumerate(STATS):
        col = stats[:, j]
        columns[stat] = pa.array(col.astype(np.float64) if stat in COUNT_STATS else col)
    for column in META_COLUMNS:  # the old store kept no dtype, shape or element count
        columns[column] = pa.nulls(len(sel), STATS_SCHEMA.field(column).type)
    return pa.table(columns, schema=STATS_SCHEMA)


def dictionary_ids(column: pa.ChunkedArray, ids: dict[str, int]) -> np.ndarray:
    """Per row, the id (in ``ids``, grown as new values come) of a dictionary column's value: each chunk's
    dictionary is looked up once, its indices mapped through it (chunks may carry different dictionaries)."""
    out = np.empty(len(column), dtype=np.int32)
    start = 0
    for chunk in column.chunks:
        if not isinstance(chunk, pa.DictionaryArray):
            chunk = chunk.dictionary_encode()
        lookup = np.fromiter((ids.setdefault(v, len(ids)) for v in chunk.dictionary.to_pylist()), np.int32)
        indices = array_numpy(chunk.indices)
        if not len(lookup):
            out[start : start + len(chunk)] = 0
        elif (lookup == np.arange(len(lookup))).all():  # the usual case: the dictionary in first-seen order
            out[start : start + len(chunk)] = indices
        else:
            out[start : start + len(chunk)] = lookup[indices]
        start += len(chunk)
    return out


def _float_column(column: pa.ChunkedArray, dtype: type) -> np.ndarray:
    if column.null_count:
        if pa.types.is_integer(column.type):  # element counts a store did not keep: NaN
            column = column.cast(pa.float64())
        column = pc.fill_null(column, np.nan)
    if column.num_chunks == 1:
        return np.asarray(array_numpy(column.chunk(0)), dtype=dtype)
    out = np.empty(len(column), dtype=dtype)
    start = 0
    for chunk in column.chunks:  # one copy, straight into the result
        out[start : start + len(chunk)] = array_numpy(chunk)
        start += len(chunk)
    return out


WIDE_COLUMNS = (*COUNT_STATS, "numel")  # read as float64


def _column(table: pa.Table, name: str) -> pa.ChunkedArray:
    """A column of the table; all nulls when its segments predate it."""
    if name in table.column_names:
        return table.column(name)
    return pa.chunked_array([pa.nulls(table.num_rows, STATS_SCHEMA.field(name).type)])


def _int_column(column: pa.ChunkedArray) -> np.ndarray:
    return _float_column(column, np.int64)


def stored_tensors(run: str | os.PathLike[str], rank: int) -> list[tuple[str, str]]:
    """The (kind, name) pairs of a rank's latest segment (every step of a segment holds the same tensors but
    for reloads; reading one segment keeps this cheap on long runs), or of its old-layout store."""
    found = segments(stats_rank_dir(run, rank))
    if found:
        table = read_segment(found[-1], STATS_SCHEMA, ["kind", "name"])
        return list(tensor_columns(table)[1])
    if stats_records_file(run, rank).exists():
        return [(kind, name) for _, kind, name in read_names(stats_names_file(run, rank))[0]]
    return []


def last_step(run: str | os.PathLike[str], rank: int) -> int | None:
    """The last step of the rank's store: its last sealed segment's, or its open stream's last whole batch."""
    found = segments(stats_rank_dir(run, rank))
    if not found:
        return None
    last = found[-1]
    if last.sealed:
        return last.hi
    steps = read_partition(stats_rank_dir(run, rank), STATS_SCHEMA, ["step"], step_lo=last.lo).column("step")
    return pc.max(steps).as_py() if len(steps) else max((s.hi for s in found if s.sealed), default=None)


def step_span(run: str | os.PathLike[str], rank: int) -> tuple[int, int] | None:
    """The first and last step of the rank's store (None: no row), reading as little as that takes: the
    sealed segments say their steps in their names; only a stream still open (a live or killed job) has its
    step column read, and an old store its records' steps (one memory map)."""
    lo: int | None = None
    hi: int | None = None

    def take(first: int, last: int) -> None:
        nonlocal lo, hi
        lo = first if lo is None else min(lo, first)
        hi = last if hi is None else max(hi, last)

    partition = stats_rank_dir(run, rank)
    for segment in segments(partition):
        if segment.sealed:
            take(segment.lo, segment.hi)  # type: ignore[arg-type]
            continue
        try:
            steps = read_segment(segment, STATS_SCHEMA, ["step"]).column("step")
        except FileNotFoundError:  # sealed since the listing: its Parquet file's name says its steps
            again = [s for s in segments(partition) if s.seq == segment.seq and s.sealed]
            if again:
                take(again[0].lo, again[0].hi)  # type: ignore[arg-type]
            continue
        if len(steps):
            take(pc.min(steps).as_py(), pc.max(steps).as_py())
    if stats_records_file(run, rank).exists():
        old = read_records(stats_records_file(run, rank))["step"]
        if len(old):
            take(int(old.min()), int(old.max()))
    return None if lo is None or hi is None else (lo, hi)


def store_signature(run: str | os.PathLike[str], rank: int) -> tuple:
    """Equal while the rank's store is unchanged (nothing appended, sealed or replaced)."""
    old = stats_records_file(run, rank)
    size = old.stat().st_size if old.exists() else -1
    return (signature(stats_rank_dir(run, rank)), size)


def _pairs(table: pa.Table) -> tuple[np.ndarray, list[str], list[str]]:
    """Per row, ``kind * len(names) + name`` over the table's distinct kinds and names."""
    kinds: dict[str, int] = {}
    names: dict[str, int] = {}
    kind_id = dictionary_ids(table.column("kind"), kinds)
    name_id = dictionary_ids(table.column("name"), names)
    small = len(kinds) * max(1, len(names)) < 1 << 31
    pair = kind_id if small else kind_id.astype(np.int64)
    pair *= max(1, len(names))
    pair += name_id
    return pair, list(kinds), list(names)


def tensor_columns(table: pa.Table) -> tuple[np.ndarray, tuple[tuple[str, str], ...]]:
    """Per row, the column of its (kind, name); the tensors in order of first appearance."""
    pair, kinds, names = _pairs(table)
    return _columns_of(pair, kinds, names)


def _columns_of(pair: np.ndarray, kinds: list[str], names: list[str]) -> tuple[np.ndarray, tuple]:
    width = max(1, len(names))
    present = np.flatnonzero(np.bincount(pair, minlength=len(kinds) * width))
    # first appearance: the first rows hold almost every tensor (every step has the same layout)
    head = pair[: 1 << 16]
    seen, first = np.unique(head, return_index=True)
    late = np.setdiff1d(present, seen, assume_unique=True)
    if len(late) > 64:
        seen, first = np.unique(pair, return_index=True)
    else:
        late_first = np.asarray([int(np.argmax(pair == p)) for p in late], dtype=np.int64)
        seen, first = np.concatenate([seen, late]), np.concatenate([first, late_first])
    order = seen[np.argsort(first, kind="stable")]
    column_of = np.full(len(kinds) * width, -1, dtype=np.int64)
    column_of[order] = np.arange(len(order))
    tensors = tuple((kinds[p // width], names[p % width]) for p in order.tolist())
    return column_of[pair], tensors


def _regular(steps: np.ndarray, pair: np.ndarray) -> int:
    """The number of tensors a step when every step holds the same tensors in the same order, steps
    ascending (what a job writes unless its layout changed or it was resumed from an earlier step): the rows
    are then the matrix itself. 0 otherwise."""
    n = len(steps)
    width = int(np.argmax(steps != steps[0])) or n
    if n % width:
        return 0
    by_step = steps.reshape(-1, width)
    layout = pair.reshape(-1, width)
    if not (by_step == by_step[:, :1]).all() or not (np.diff(by_step[:, 0]) > 0).all():
        return 0
    if not (layout == layout[0]).all() or len(np.unique(layout[0])) != width:
        return 0
    return width


def _step_rows(steps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(unique steps ascending, row of each record)."""
    if len(steps) and np.all(steps[1:] >= steps[:-1]):  # in order, as written (no resume going back)
        change = np.empty(len(steps), dtype=bool)
        change[0] = True
        np.not_equal(steps[1:], steps[:-1], out=change[1:])
        return steps[change], np.cumsum(change) - 1
    return np.unique(steps, return_inverse=True)


def _kind_filter(table: pa.Table, kinds: Sequence[str] | None) -> pa.Table:
    if kinds is None or not table.num_rows:
        return table
    found: dict[str, int] = {}
    ids = dictionary_ids(table.column("kind"), found)
    wanted = [i for k, i in found.items() if k in set(kinds)]
    return table.filter(pa.array(np.isin(ids, wanted)))


def _check_stats(stats: Sequence[str]) -> None:
    unknown = [s for s in stats if s not in STATS and s != "numel"]
    if unknown:
        raise ValueError(f"unknown statistic(s) {unknown}; statistics: {', '.join(STATS)}")


def read_stats(
    run: str | os.PathLike[str],
    rank: int,
    stats: Sequence[str] = STATS,
    step_lo: int | None = None,
    step_hi: int | None = None,
    kinds: Sequence[str] | None = None,
) -> StatFrame:
    """One rank's statistics as steps x tensors matrices (:class:`StatFrame`); ``kinds`` only, if given.
    ``numel`` may be asked for beside the statistics (float64; NaN where a store holds no count)."""
    _check_stats(stats)
    table = _kind_filter(read_rows(run, rank, ["step", "kind", "name", *stats], step_lo, step_hi), kinds)
    return _frame(table, stats)


def read_frame(
    run: str | os.PathLike[str],
    rank: int,
    stats: Sequence[str] = STATS,
    step_lo: int | None = None,
    step_hi: int | None = None,
    kinds: Sequence[str] | None = None,
) -> tuple[StatFrame, TensorMeta]:
    """:func:`read_stats` and, from the same rows (one read), each tensor's dtype, shape and element count
    as the range's first row of it holds them (:func:`read_meta` of the range)."""
    _check_stats(stats)
    columns = list(dict.fromkeys(["step", "kind", "name", *stats, *META_COLUMNS]))
    table = _kind_filter(read_rows(run, rank, columns, step_lo, step_hi), kinds)
    return _frame(table, stats), _meta(table)


def _frame(table: pa.Table, stats: Sequence[str]) -> StatFrame:
    if not table.num_rows:
        return StatFrame(np.empty(0, dtype=np.int64), (), {s: np.empty((0, 0), np.float32) for s in stats})
    all_steps = _int_column(table.column("step"))
    pair, kind_list, name_list = _pairs(table)
    width = _regular(all_steps, pair)
    if width:  # the common case: the rows are the matrix, row by row
        names = max(1, len(name_list))
        tensors = tuple((kind_list[p // names], name_list[p % names]) for p in pair[:width].tolist())
        values = {}
        for stat in stats:
            dtype = np.float64 if stat in WIDE_COLUMNS else np.float32
            values[stat] = _float_column(_column(table, stat), dtype).reshape(-1, width)
        return StatFrame(all_steps[::width].copy(), tensors, values)
    steps, row = _step_rows(all_steps)
    col, tensors = _columns_of(pair, kind_list, name_list)
    values = {}
    for stat in stats:
        dtype = np.float64 if stat in WIDE_COLUMNS else np.float32
        matrix = np.full((len(steps), len(tensors)), np.nan, dtype=dtype)
        matrix[row, col] = _float_column(_column(table, stat), dtype)
        values[stat] = matrix
    return StatFrame(steps, tensors, values)


@dataclass(frozen=True)
class TensorMeta:
    """Each tensor's dtype and shape texts (None where the store holds none: a store written before they
    were kept), and its element count (-1: unknown), as the first step read holds them."""

    tensors: tuple[tuple[str, str], ...]
    dtypes: tuple[str | None, ...]
    shapes: tuple[str | None, ...]
    numel: tuple[int, ...]

    def of(self, kind: str, name: str) -> tuple[str | None, str | None, int]:
        try:
            i = self.tensors.index((kind, name))
        except ValueError:
            return None, None, -1
        return self.dtypes[i], self.shapes[i], self.numel[i]


def read_meta(
    run: str | os.PathLike[str], rank: int, step_lo: int | None = None, step_hi: int | None = None
) -> TensorMeta:
    """The dtype, shape and element count of every tensor of the rank, from the first segment holding a step
    of the range (every step of a segment has the same tensors but for reloads; reading one keeps this cheap
    on long runs); an old store's tensors with unknown metadata."""
    columns = ["step", "kind", "name", *META_COLUMNS]
    table = None
    for segment in segments(stats_rank_dir(run, rank)):
        if segment.overlaps(step_lo, step_hi):
            table = read_segment(segment, STATS_SCHEMA, columns, step_lo, step_hi)
            if table.num_rows:
                break
    if table is None or not table.num_rows:
        table = read_rows(run, rank, ["step", "kind", "name"], step_lo, step_hi)
    return _meta(table)


def _meta(table: pa.Table) -> TensorMeta:
    """Each tensor's metadata as the first of its rows in ``table`` holds it."""
    if not table.num_rows:
        return TensorMeta((), (), (), ())
    col, tensors = tensor_columns(table)
    first = np.full(len(tensors), -1, dtype=np.int64)
    rows = np.arange(len(col))[::-1]  # the first row of each tensor wins
    first[col[rows]] = rows

    rows = first.tolist()

    def values(name: str) -> list:
        # one scalar a tensor (a few hundred): pa.array of an index array would import pandas
        if name not in table.column_names:
            return [None] * len(rows)
        column = table.column(name)
        return [column[i].as_py() for i in rows]

    def texts(name: str) -> tuple[str | None, ...]:
        return tuple(v if isinstance(v, str) else None for v in values(name))

    numel = tuple(-1 if v is None else int(v) for v in values("numel"))
    return TensorMeta(tensors, texts("dtype"), texts("shape"), numel)


def read_stat_blocks(
    run: str | os.PathLike[str],
    rank: int,
    stat: str,
    step_lo: int | None = None,
    step_hi: int | None = None,
    block: int = 1,
    kinds: Sequence[str] | None = None,
) -> StatBlocks:
    """Per block of ``block`` steps (aligned: block b starts at a multiple of ``block``) and tensor, the
    lowest and highest ``stat`` and the data/NaN/Inf flags (see :class:`StatBlocks`)."""
    block = max(1, int(block))
    frame = read_stats(run, rank, tuple(dict.fromkeys((stat, *COUNT_STATS))), step_lo, step_hi, kinds)
    if not len(frame.steps):
        empty = np.empty((0, 0), dtype=bool)
        return StatBlocks(block, frame.steps, (), empty.astype(np.float32), empty.astype(np.float32),
                          empty, empty, empty)  # fmt: skip
    ids = frame.steps // block
    change = np.empty(len(ids), dtype=bool)
    change[0] = True
    np.not_equal(ids[1:], ids[:-1], out=change[1:])
    starts = np.flatnonzero(change)
    v = frame.values[stat].astype(np.float32, copy=False)
    finite = np.isfinite(v)
    low = np.fmin.reduceat(np.where(finite, v, np.inf), starts, axis=0)
    high = np.fmax.reduceat(np.where(finite, v, -np.inf), starts, axis=0)
    has_data = np.logical_or.reduceat(~np.isnan(frame.values["nans"]), starts, axis=0)
    has_nan = np.logical_or.reduceat(frame.values["nans"] > 0, starts, axis=0)
    has_inf = np.logical_or.reduceat(frame.values["infs"] > 0, starts, axis=0)
    low[np.isinf(low) & (low > 0)] = np.nan  # no finite value in the block
    high[np.isinf(high) & (high < 0)] = np.nan
    return StatBlocks(block, ids[starts] * block, frame.tensors, low, high, has_data, has_nan, has_inf)


def read_series(
    run: str | os.PathLike[str],
    rank: int,
    kind: str,
    name: str,
    stats: Sequence[str] = STATS,
    step_lo: int | None = None,
    step_hi: int | None = None,
) -> tuple[np.ndarray, dict[str, np.ndarray]] | None:
    """(steps, {stat: values}) of one tensor, by step; None when the rank has no such tensor."""
    table = read_rows(run, rank, ["step", "kind", "name", *stats], step_lo, step_hi)
    if not table.num_rows:
        return None
    pair, kinds, names = _pairs(table)
    if kind not in kinds or name not in names:
        return None
    sel = np.flatnonzero(pair == kinds.index(kind) * max(1, len(names)) + names.index(name))
    if not len(sel):
        return None
    steps, row = _step_rows(_int_column(table.column("step"))[sel])
    out = {}
    for stat in stats:
        dtype = np.float64 if stat in COUNT_STATS else np.float32
        values = np.full(len(steps), np.nan, dtype=dtype)
        values[row] = _float_column(table.column(stat), dtype)[sel]
        out[stat] = values
    return steps, out


# ---------------------------------------------------------------------------------------------- old store

STAT_RECORD = np.dtype([("step", "<i8"), ("id", "<i4"), ("stats", "<f4", (len(STATS),))])


def read_names(path: str | os.PathLike[str], start_byte: int = 0) -> tuple[list[tuple[int, str, str]], int]:
    """Old store: (id, kind, name) of the complete lines from ``start_byte`` on, and the byte offset after
    them."""
    out: list[tuple[int, str, str]] = []
    try:
        with open(path, "rb") as f:
            f.seek(start_byte)
            data = f.read()
    except FileNotFoundError:
        return out, start_byte
    end = data.rfind(b"\n") + 1  # a partial last line waits for the next read
    for raw in data[:end].splitlines():
        if not raw.strip():
            continue
        try:
            d = json.loads(raw)
            out.append((int(d["id"]), str(d["kind"]), str(d["name"])))
        except (ValueError, KeyError, TypeError):
            continue  # a damaged line costs its name, never the store
    return out, start_byte + end


def read_records(path: str | os.PathLike[str], start: int = 0) -> np.ndarray:
    """Old store: the complete records from record index ``start`` on (a memory map; empty when none)."""
    try:
        size = os.path.getsize(path)
    except OSError:
        return np.empty(0, dtype=STAT_RECORD)
    count = size // STAT_RECORD.itemsize - start
    if count <= 0:
        return np.empty(0, dtype=STAT_RECORD)
    return np.memmap(path, dtype=STAT_RECORD, mode="r", offset=start * STAT_RECORD.itemsize, shape=(count,))
