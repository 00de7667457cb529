"""The statistics store (a columnar table per rank): values equal TensorBoard's, names once per segment,
resumable, read back as matrices, blocks and series, and the old store (``rank_<r>.bin``) still read."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
from old_layout import old_names_line

from trainmon.run import records
from trainmon.run.columnar import segments
from trainmon.run.layout import stats_names_file, stats_rank_dir, stats_records_file
from trainmon.run.records import STATS, Row, StepRecord
from trainmon.run.statstore import (
    STAT_RECORD,
    last_step,
    read_names,
    read_records,
    read_rows,
    read_series,
    read_stat_blocks,
    read_stats,
    stat_ranks,
)
from trainmon.writer.statstore import StatStoreSink
from trainmon.writer.tensorboard import TensorBoardSink


def row(kind: str, name: str, micro: int = 0, vpp: int = 0) -> Row:
    return Row(kind, name, vpp, micro, "forward", (4,), "float32")


def partials_of(*vectors: list[float]) -> np.ndarray:
    return np.asarray(vectors, dtype=np.float64)


ROWS = (
    row("actv", "a.output", 0),
    row("actv", "b.output", 0),
    row("actv", "a.output", 1),
    row("grad_reduced", "w"),
)
P = partials_of(
    [4, 0, 0, 1, -1.0, 2.0, 3.0, 9.0],
    [4, 1, 0, 0, 0.5, 1.5, 2.0, 3.0],
    [4, 0, 1, 0, -3.0, 1.0, -1.0, 11.0],
    [2, 0, 0, 0, 1e39, 2e39, 3e39, 5e78],  # beyond float32: +inf, as TensorBoard shows it
)


def _write(sink: StatStoreSink, step: int, rows=ROWS, partials=P) -> None:
    rec = StepRecord(step=step, rank=0, rows=rows, partials=partials, wall_time=1.0)
    sink.write(rec, records.Derived(rec))


def test_store_holds_the_values_tensorboard_shows(tmp_path):
    sink = StatStoreSink(tmp_path, rank=2)
    for step in (3, 4):
        _write(sink, step, partials=P * (step - 2))
    sink.close()
    frame = read_stats(tmp_path, 2)
    assert frame.tensors == (("actv", "a.output"), ("actv", "b.output"), ("grad_reduced", "w"))
    assert frame.steps.tolist() == [3, 4]
    tb = TensorBoardSink(tmp_path / "tb", STATS)
    for i, step in enumerate((3, 4)):
        rec = StepRecord(step=step, rank=2, rows=ROWS, partials=P * (step - 2), wall_time=1.0)
        tags, values = tb.values(rec, records.Derived(rec))
        with np.errstate(over="ignore"):
            want = np.asarray(values, dtype=np.float32).reshape(3, len(STATS))
        got = np.stack([frame.values[s][i] for s in STATS], axis=1).astype(np.float32)
        np.testing.assert_array_equal(got, want)
        assert tags[0] == "actv/a.output/min"
    tb.close()
    # micro-steps merged exactly: a.output's min and max over both micro-steps, the inf counted
    assert frame.values["min"][0, 0] == -3.0 and frame.values["max"][0, 0] == 2.0
    assert frame.values["infs"][0, 0] == 1.0 and frame.values["nans"][0, 1] == 1.0
    assert np.isinf(frame.values["max"][0, 2])
    # float32 for the values TensorBoard shows, float64 for the element counts
    assert frame.values["max"].dtype == np.float32 and frame.values["nans"].dtype == np.float64
    assert stat_ranks(tmp_path) == [2] and last_step(tmp_path, 2) == 4


def test_names_once_per_segment_and_float_columns(tmp_path):
    """Parquet keeps the names in a dictionary (not once per value) and the statistics as floats."""
    sink = StatStoreSink(tmp_path, rank=0)
    for step in range(50):
        _write(sink, step)
    sink.close()
    (segment,) = segments(stats_rank_dir(tmp_path, 0))
    assert segment.path.name == "part-00000-0-49.parquet"
    meta = pq.ParquetFile(segment.path).metadata
    name = meta.row_group(0).column(meta.schema.names.index("name"))
    assert "RLE_DICTIONARY" in name.encodings and name.dictionary_page_offset is not None
    schema = pq.read_schema(segment.path)
    assert str(schema.field("name").type) == "dictionary<values=string, indices=int32, ordered=0>"
    assert [str(schema.field(s).type) for s in STATS] == ["float"] * 5 + ["double"] * 2
    assert read_rows(tmp_path, 0).num_rows == 150


def test_segments_by_step_range_and_reads_of_a_range(tmp_path):
    sink = StatStoreSink(tmp_path, rank=1)
    sink._store.segment_steps = 10  # segment k holds steps 10k .. 10k+9
    for step in range(0, 35):
        p = P.copy()
        p[:, records.MAX] += step
        _write(sink, step, partials=p)
    assert [s.sealed for s in segments(stats_rank_dir(tmp_path, 1))][-1] is False  # steps 30.. still open
    mid = read_stats(tmp_path, 1, ("max",), 8, 31)  # two sealed segments, some of a third, the stream
    assert mid.steps.tolist() == list(range(8, 32))
    sink.close()
    names = [s.path.name for s in segments(stats_rank_dir(tmp_path, 1))]
    assert names == ["part-00000-0-9.parquet", "part-00001-10-19.parquet", "part-00002-20-29.parquet",
                     "part-00003-30-34.parquet"]  # fmt: skip
    whole = read_stats(tmp_path, 1, ("max",), 8, 31)
    np.testing.assert_array_equal(whole.values["max"], mid.values["max"])
    assert whole.values["max"][0, 0] == 2.0 + 8  # a.output's max at step 8
    steps, values = read_series(tmp_path, 1, "actv", "b.output", ("max", "nans"))
    assert steps.tolist() == list(range(35)) and values["max"][10] == 1.5 + 10
    assert read_series(tmp_path, 1, "actv", "missing", ("max",)) is None


def test_blocks_for_zoomed_out_views(tmp_path):
    sink = StatStoreSink(tmp_path, rank=0)
    for step in range(10):
        p = P.copy()
        p[1, records.MAX] = float(step)  # b.output's max: the step
        p[1, records.NANS] = 1.0 if step == 6 else 0.0
        p[2, records.INFS] = 1.0 if step == 1 else 0.0  # a.output's second micro-step
        _write(sink, step, partials=p)
    sink.close()
    blocks = read_stat_blocks(tmp_path, 0, "max", block=4)
    assert blocks.starts.tolist() == [0, 4, 8]
    b = blocks.tensors.index(("actv", "b.output"))
    assert blocks.low[:, b].tolist() == [0.0, 4.0, 8.0] and blocks.high[:, b].tolist() == [3.0, 7.0, 9.0]
    assert blocks.has_nan[:, b].tolist() == [False, True, False]
    assert blocks.has_inf[:, 0].tolist() == [True, False, False]  # a.output held an inf at step 1
    assert blocks.has_data.all()
    only = read_stat_blocks(tmp_path, 0, "max", 5, 9, block=4, kinds=["grad_reduced"])
    assert only.starts.tolist() == [4, 8] and only.tensors == (("grad_reduced", "w"),)


def test_a_resumed_writer_continues_with_multi_chunk_names(tmp_path):
    first = StatStoreSink(tmp_path, rank=0, multi_chunk=True)
    _write(first, 0, rows=ROWS[:2], partials=P[:2])
    first.close()
    resumed = StatStoreSink(tmp_path, rank=0, multi_chunk=True)
    _write(resumed, 1, rows=(row("actv", "b.output"), row("actv", "c.output", vpp=1)), partials=P[:2])
    resumed.close()
    frame = read_stats(tmp_path, 0, ("max",))
    assert frame.tensors == (("actv", "0:a.output"), ("actv", "0:b.output"), ("actv", "1:c.output"))
    assert np.isnan(frame.values["max"][1, 0]) and frame.values["max"][1, 2] == 1.5
    assert [s.seq for s in segments(stats_rank_dir(tmp_path, 0))] == [0, 1]


def test_a_name_that_utf8_cannot_hold_is_written_escaped(tmp_path):
    sink = StatStoreSink(tmp_path, rank=0)
    _write(sink, 0, rows=(row("actv", "bad\udc80name.output"),), partials=P[:1])
    sink.close()
    assert read_stats(tmp_path, 0, ("max",)).tensors == (("actv", "bad\\udc80name.output"),)


# -- the old store -------------------------------------------------------------------------------------------


def _old_store(run, rank: int, names: list[tuple[int, str, str]], recs: list[tuple[int, int, list[float]]]):
    stats_names_file(run, rank).parent.mkdir(parents=True, exist_ok=True)
    stats_names_file(run, rank).write_bytes(b"".join(old_names_line(i, k, n) for i, k, n in names))
    arr = np.zeros(len(recs), dtype=STAT_RECORD)
    for j, (step, i, values) in enumerate(recs):
        arr[j] = (step, i, values)
    stats_records_file(run, rank).write_bytes(arr.tobytes())


OLD_NAMES = [(0, "actv", "a.output"), (1, "grad_reduced", "w")]
OLD_RECS = [(3, 0, [1, 2, 3, 4, 0, 0, 0]), (3, 1, [5, 6, 7, 8, 0, 1, 0]), (4, 0, [9, 10, 11, 12, 0.5, 0, 2])]


def test_the_old_store_is_read_as_the_same_frame(tmp_path):
    _old_store(tmp_path, 5, OLD_NAMES, OLD_RECS)
    frame = read_stats(tmp_path, 5)
    assert stat_ranks(tmp_path) == [5]
    assert frame.tensors == (("actv", "a.output"), ("grad_reduced", "w")) and frame.steps.tolist() == [3, 4]
    assert frame.values["max"].tolist() == [[2.0, 6.0], [10.0, pytest.approx(np.nan, nan_ok=True)]]
    assert frame.values["nans"][0, 1] == 1.0 and frame.values["infs"][1, 0] == 2.0


def test_old_readers_skip_a_torn_record_and_a_partial_name_line(tmp_path):
    _old_store(tmp_path, 0, OLD_NAMES, OLD_RECS[:2])
    with open(stats_records_file(tmp_path, 0), "ab") as f:
        f.write(b"\x01" * (STAT_RECORD.itemsize - 3))
    with open(stats_names_file(tmp_path, 0), "ab") as f:
        f.write(b'{"id": 9, "kind"')
    assert len(read_records(stats_records_file(tmp_path, 0))) == 2
    assert len(read_records(stats_records_file(tmp_path, 0), start=1)) == 1
    names, offset = read_names(stats_names_file(tmp_path, 0))
    assert [n for _, _, n in names] == ["a.output", "w"]
    assert read_names(stats_names_file(tmp_path, 0), offset) == ([], offset)
    assert read_records(tmp_path / "missing.bin").shape == (0,)
    assert read_stats(tmp_path, 0, ("max",)).values["max"].tolist() == [[2.0, 6.0]]


def test_the_plugin_index_survives_a_damaged_name_line_of_the_old_store(tmp_path):
    from trainmon_tb.stat_index import StatIndex

    _old_store(tmp_path, 0, OLD_NAMES, OLD_RECS)
    path = stats_names_file(tmp_path, 0)
    path.write_text(json.dumps({"id": 0, "kind": "actv", "name": "a.output"}) + "\n{damaged\n")  # w lost
    index = StatIndex(tmp_path)
    index.refresh()
    hm = index.heatmap(0, "actv", "max", None, None, 10)
    assert hm.names == ["a.output"] and hm.values.shape == (1, 2)
    assert hm.values[0].tolist() == [2.0, 10.0]
    assert index.series(0, "grad_reduced", "w", "max") is None
