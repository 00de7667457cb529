"""The statistics store the TensorBoard plugin's heatmaps read: values equal TensorBoard's, names before
records, resumable, and a torn last record is never read."""

from __future__ import annotations

import json

import numpy as np

from trainmon.run import records
from trainmon.run.layout import stats_names_file, stats_records_file
from trainmon.run.records import STATS, Row, StepRecord
from trainmon.run.statstore import STAT_RECORD, read_names, read_records
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


def test_store_holds_the_values_tensorboard_shows(tmp_path):
    sink = StatStoreSink(tmp_path, rank=2)
    for step in (3, 4):
        rec = StepRecord(step=step, rank=2, rows=ROWS, partials=P * (step - 2), wall_time=1.0)
        sink.write(rec, records.Derived(rec))
    sink.close()
    names, _ = read_names(stats_names_file(tmp_path, 2))
    assert names == [(0, "actv", "a.output"), (1, "actv", "b.output"), (2, "grad_reduced", "w")]
    got = read_records(stats_records_file(tmp_path, 2))
    assert got["step"].tolist() == [3, 3, 3, 4, 4, 4] and got["id"].tolist() == [0, 1, 2] * 2
    tb = TensorBoardSink(tmp_path / "tb", STATS)
    for i, step in enumerate((3, 4)):
        rec = StepRecord(step=step, rank=2, rows=ROWS, partials=P * (step - 2), wall_time=1.0)
        tags, values = tb.values(rec, records.Derived(rec))
        with np.errstate(over="ignore"):
            want = np.asarray(values, dtype=np.float32).reshape(3, len(STATS))
        np.testing.assert_array_equal(got["stats"][3 * i : 3 * i + 3], want)
        assert tags[0] == "actv/a.output/min"
    tb.close()
    # micro-steps merged exactly: a.output's min and max over both micro-steps, the inf counted
    assert got["stats"][0][STATS.index("min")] == -3.0 and got["stats"][0][STATS.index("max")] == 2.0
    assert got["stats"][0][STATS.index("infs")] == 1.0
    assert np.isinf(got["stats"][2][STATS.index("max")])


def test_a_resumed_writer_continues_the_ids_and_multi_chunk_names(tmp_path):
    rec = StepRecord(step=0, rank=0, rows=ROWS[:2], partials=P[:2], wall_time=0.0)
    first = StatStoreSink(tmp_path, rank=0, multi_chunk=True)
    first.write(rec, records.Derived(rec))
    first.close()
    resumed = StatStoreSink(tmp_path, rank=0, multi_chunk=True)
    rows = (row("actv", "b.output"), row("actv", "c.output", vpp=1))
    rec = StepRecord(step=1, rank=0, rows=rows, partials=P[:2], wall_time=0.0)
    resumed.write(rec, records.Derived(rec))
    resumed.close()
    lines = stats_names_file(tmp_path, 0).read_text().splitlines()
    assert [json.loads(x) for x in lines] == [
        {"id": 0, "kind": "actv", "name": "0:a.output"},
        {"id": 1, "kind": "actv", "name": "0:b.output"},
        {"id": 2, "kind": "actv", "name": "1:c.output"},
    ]
    assert read_records(stats_records_file(tmp_path, 0))["id"].tolist() == [0, 1, 1, 2]


def test_readers_skip_a_torn_record_and_a_partial_name_line(tmp_path):
    sink = StatStoreSink(tmp_path, rank=0)
    rec = StepRecord(step=7, rank=0, rows=ROWS[:2], partials=P[:2], wall_time=0.0)
    sink.write(rec, records.Derived(rec))
    sink.close()
    with open(stats_records_file(tmp_path, 0), "ab") as f:
        f.write(b"\x01" * (STAT_RECORD.itemsize - 3))
    with open(stats_names_file(tmp_path, 0), "ab") as f:
        f.write(b'{"id": 9, "kind"')
    assert len(read_records(stats_records_file(tmp_path, 0))) == 2
    assert len(read_records(stats_records_file(tmp_path, 0), start=1)) == 1
    assert len(read_records(stats_records_file(tmp_path, 0), start=2)) == 0
    names, offset = read_names(stats_names_file(tmp_path, 0))
    assert [n for _, _, n in names] == ["a.output", "b.output"]
    assert read_names(stats_names_file(tmp_path, 0), offset) == ([], offset)
    assert read_records(tmp_path / "missing.bin").shape == (0,)


def test_the_plugin_index_survives_a_damaged_name_line(tmp_path):
    from trainmon_tb.stat_index import StatIndex

    sink = StatStoreSink(tmp_path, rank=0)
    rec = StepRecord(step=0, rank=0, rows=ROWS[:2], partials=P[:2], wall_time=0.0)
    sink.write(rec, records.Derived(rec))
    sink.close()
    path = stats_names_file(tmp_path, 0)
    lines = path.read_text().splitlines()
    path.write_text(lines[0] + "\n" + "{damaged\n")  # b.output's name line lost
    index = StatIndex(tmp_path)
    index.refresh()
    hm = index.heatmap(0, "actv", "max", None, None, 10)
    assert hm.names == ["a.output"] and hm.values.shape == (1, 1)
    assert hm.values[0, 0] == 2.0
    assert index.series(0, "actv", "b.output", "max") is None
