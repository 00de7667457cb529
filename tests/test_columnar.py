"""The columnar tables as a dataset other tools read (DuckDB, pandas, Polars, pyarrow: one table with a
``rank`` column), and the life of a partition: streams sealed into Parquet segments, a killed job's streams
sealed by the next writer, half-sealed files ignored, readers while a stream is written."""

from __future__ import annotations

import os

import duckdb
import numpy as np
import pandas as pd
import polars as pl
import pyarrow as pa
import pyarrow.dataset as ds

from trainmon.anomaly.log import AnomalyLog
from trainmon.run.columnar import SegmentWriter, read_partition, read_stream, segments
from trainmon.run.layout import anomalies_dir, stats_dir, stats_rank_dir
from trainmon.run.records import STATS, Anomaly, Derived, Row, StepRecord
from trainmon.run.statstore import STATS_OPTIONS, STATS_SCHEMA, StatEncoder, read_stats
from trainmon.writer.statstore import StatStoreSink

ROWS = tuple(Row("actv", f"layers.{i}.output", 0, 0, "forward", (4,), "float32") for i in range(3))


def _stats_run(run, ranks=(0, 1, 2), steps=range(5)) -> None:
    for rank in ranks:
        sink = StatStoreSink(run, rank)
        for step in steps:
            p = np.tile(np.array([4.0, 0, 0, 0, -1.0, 1.0, 0.0, 4.0]), (3, 1))
            p[:, 5] = 100 * rank + step + np.arange(3)  # max = 100 rank + step + tensor
            rec = StepRecord(step, rank, ROWS, p, 0.0)
            sink.write(rec, Derived(rec))
        sink.close()


def test_every_rank_is_one_dataset_for_duckdb_pandas_polars_and_pyarrow(tmp_path):
    _stats_run(tmp_path)
    table = stats_dir(tmp_path)
    query = f"""
        SELECT rank, max(max) AS top FROM read_parquet('{table}/*/*.parquet', hive_partitioning = true)
        WHERE kind = 'actv' AND name = 'layers.2.output' GROUP BY rank ORDER BY rank"""
    assert duckdb.sql(query).fetchall() == [(0, 6.0), (1, 106.0), (2, 206.0)]
    frame = pd.read_parquet(table)
    assert len(frame) == 3 * 5 * 3 and sorted(frame["rank"].astype(int).unique()) == [0, 1, 2]
    assert frame[(frame["rank"].astype(int) == 1) & (frame["step"] == 4)]["max"].tolist() == [104, 105, 106]
    polars = pl.read_parquet(f"{table}/**/*.parquet", hive_partitioning=True)
    assert polars.filter(pl.col("rank") == 2)["max"].max() == 206.0
    dataset = ds.dataset(table, format="parquet", partitioning="hive")
    assert dataset.to_table(filter=ds.field("rank") == 0).num_rows == 15


def test_the_open_stream_is_hidden_from_other_tools_but_read_by_trainmon(tmp_path):
    """While a job runs, its current segment is an Arrow stream named ``_open-...``: dataset readers skip
    it (no error on a file that is not Parquet), trainmon's readers include it."""
    sink = StatStoreSink(tmp_path, 0)
    for step in range(3):
        rec = StepRecord(step, 0, ROWS, np.tile(np.array([4.0, 0, 0, 0, -1, 1, 0, 4]), (3, 1)), 0.0)
        sink.write(rec, Derived(rec))
    (live,) = segments(stats_rank_dir(tmp_path, 0))
    assert live.path.name == "_open-00000-0.arrows" and not live.sealed
    assert read_stats(tmp_path, 0).steps.tolist() == [0, 1, 2]
    assert ds.dataset(stats_dir(tmp_path), format="parquet", partitioning="hive").to_table().num_rows == 0
    sink.close()
    assert ds.dataset(stats_dir(tmp_path), format="parquet", partitioning="hive").to_table().num_rows == 9


def _batch(encoder: StatEncoder, step: int) -> pa.RecordBatch:
    kinds, names = encoder.indices([("actv", "a"), ("actv", "b")])
    values = {s: np.array([step, step + 0.5]) for s in STATS}
    return encoder.encode(step, kinds, names, values)


def test_a_killed_jobs_stream_is_sealed_by_the_next_writer(tmp_path):
    partition = tmp_path / "rank=0"
    writer = SegmentWriter(partition, STATS_SCHEMA, STATS_OPTIONS)
    encoder = StatEncoder()
    for step in range(4):
        writer.append(_batch(encoder, step), step)
    stream = segments(partition)[0].path
    data = stream.read_bytes()
    os.close(writer._fd)  # the job is killed: no seal, and its last append torn
    stream.write_bytes(data[:-7])
    (partition / "_seal-00000.parquet.tmp").write_bytes(b"PAR1 half written")  # a seal killed midway
    assert read_partition(partition, STATS_SCHEMA, ["step"]).column("step").to_pylist() == [0, 0, 1, 1, 2, 2]
    resumed = SegmentWriter(partition, STATS_SCHEMA, STATS_OPTIONS)
    resumed.append(_batch(StatEncoder(), 2), 2)  # resumed from a checkpoint at step 2
    resumed.close()
    assert sorted(p.name for p in partition.iterdir()) == ["part-00000-0-2.parquet", "part-00001-2-2.parquet"]
    steps = read_partition(partition, STATS_SCHEMA, ["step"]).column("step").to_pylist()
    assert steps == [0, 0, 1, 1, 2, 2, 2, 2]  # step 2 twice: written before the kill and after the resume


def test_a_stream_left_next_to_its_sealed_segment_is_not_read_twice(tmp_path):
    partition = tmp_path / "rank=0"
    writer = SegmentWriter(partition, STATS_SCHEMA, STATS_OPTIONS)
    encoder = StatEncoder()
    writer.append(_batch(encoder, 0), 0)
    stream = segments(partition)[0].path
    data = stream.read_bytes()
    writer.close()
    stream.write_bytes(data)  # killed after the rename, before the stream's removal
    assert [s.path.name for s in segments(partition)] == ["part-00000-0-0.parquet"]
    assert read_partition(partition, STATS_SCHEMA).num_rows == 2
    SegmentWriter(partition, STATS_SCHEMA, STATS_OPTIONS).close()
    assert sorted(p.name for p in partition.iterdir()) == ["part-00000-0-0.parquet"]


def test_an_empty_or_torn_schema_reads_as_no_rows(tmp_path):
    path = tmp_path / "_open-00000-0.arrows"
    for data in (b"", b"\xff\xff\xff\xff\x10\x00"):
        path.write_bytes(data)
        assert read_stream(path, STATS_SCHEMA).num_rows == 0


def test_a_torn_stream_is_no_damage_but_one_overwritten_is_read_up_to_the_damage_and_noted(tmp_path):
    """A stream cut anywhere at its end (a job killed mid-append, or appending now) is read to its last whole
    batch and noted nowhere; bytes overwritten before its end are damage: the batches before them are read and
    the file noted (issue 32)."""
    from trainmon.run import damage

    partition = stats_rank_dir(tmp_path, 0)
    writer = SegmentWriter(partition, STATS_SCHEMA, STATS_OPTIONS)
    encoder = StatEncoder()
    kinds, names = encoder.indices([("actv", "a"), ("actv", "b")])
    values = {s: np.array([1.0, 2.0]) for s in STATS}
    sizes = []
    stream = None
    for step in range(6):
        writer.append(encoder.encode(step, kinds, names, values), step)
        stream = stream or next(partition.glob("_open-*.arrows"))
        sizes.append(stream.stat().st_size)
    data = stream.read_bytes()
    writer._close_stream()  # as a job still running: no end-of-stream marker, never sealed
    damage.forget()
    for cut in range(sizes[0] - 3, len(data), 7):  # every cut after the first batch
        stream.write_bytes(data[:cut])
        whole = sum(size <= cut for size in sizes)
        assert read_stream(stream, STATS_SCHEMA).num_rows == 2 * whole
    assert damage.damaged(tmp_path) == []
    middle = bytearray(data)
    middle[sizes[2] + 8 : sizes[2] + 40] = b"\x00" * 32  # inside the 4th batch's message
    stream.write_bytes(bytes(middle))
    assert read_stream(stream, STATS_SCHEMA).num_rows == 2 * 3
    [found] = damage.damaged(tmp_path)
    assert found.path == stream and found.why.startswith(f"Arrow stream damaged at byte {sizes[2]} of")
    assert found.why.endswith("; the 3 whole batches before it are read")
    damage.forget()
    stream.write_bytes(b"garbage!" + data[8:])  # its start overwritten: nothing readable, and said
    assert read_stream(stream, STATS_SCHEMA).num_rows == 0
    assert [d.path for d in damage.damaged(tmp_path)] == [stream]
    damage.forget()


def test_anomaly_records_are_a_dataset_too(tmp_path):
    for rank in (0, 5):
        with AnomalyLog(tmp_path, rank) as log:
            log.write_step(3, [Anomaly(step=3, rank=rank, kind="actv", name="x", stat="nans", value=2.0,
                                       rule="nan", origin=rank == 5)])  # fmt: skip
    table = f"read_parquet('{anomalies_dir(tmp_path)}/*/*.parquet', hive_partitioning = true)"
    query = f"SELECT rank, step, name, rule, origin FROM {table} ORDER BY rank"
    assert duckdb.sql(query).fetchall() == [(0, 3, "x", "nan", False), (5, 3, "x", "nan", True)]
