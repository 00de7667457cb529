"""TensorBoard event files: encoding, framing, readers (TB loaders, tbparse), truncation, the sink."""

from __future__ import annotations

import io
import math
import os
import re
import signal
import struct
import subprocess
import sys
import time
import warnings

import numpy as np
import pandas as pd
import pytest
import torch
from tbparse import SummaryReader
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
from tensorboard.compat.proto import event_pb2

from trainmon.run import records
from trainmon.run.records import Row, StepRecord
from trainmon.writer.tensorboard import (
    MAX_SUMMARY_BYTES,
    EventFile,
    TensorBoardSink,
    masked_crc32c,
    table_crc32c,
)

pytestmark = pytest.mark.filterwarnings("ignore:The inplace keyword")  # tbparse on pandas 3

GOLDEN_TAGS = ("actv/layers.0.mlp.fc1.output/min", "actv/layers.0.mlp.fc1.output/max", "grad_reduced/w/norm",
               "exp_avg/w/nans", "scalar/loss/mean", "actv/x/zeros")
GOLDEN = [
    (0, [-2.13, 2.82, 14.86, 0.0, 1.0 / 3.0, 0.0678]),
    (1, [float("nan"), float("inf"), float("-inf"), 3.0, 1e30, -1e-30]),
    (7, [1.5, -0.0, 65504.0, 2.0**-149, 123456789.0, 0.1]),
    (8, [1e300, -1e300, 1e-300, 3.5e38, 0.0, 0.0]),  # beyond float32: +-inf, 0
    (300, [-1.0, 1.0, 2.0, 3.0, 4.0, 5.0]),
]


def f32(x: float) -> float:
    with np.errstate(over="ignore"):
        return float(np.float32(x))


def same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


def events_of(path) -> list[event_pb2.Event]:
    """Every record, CRC-checked by TB's raw loader, parsed by the official protobuf class."""
    return [event_pb2.Event.FromString(r) for r in RawEventFileLoader(str(path)).Load()]


def write_golden(directory) -> EventFile:
    ef = EventFile(directory)
    for step, vals in GOLDEN:
        ef.write_scalars(step, 1000.0 + step, GOLDEN_TAGS, np.array(vals))
    ef.close()
    return ef


def record_ends(path) -> list[int]:
    """Byte offset where each TFRecord of the file ends (parsing the framing ourselves)."""
    data = path.read_bytes()
    ends, pos = [], 0
    while pos < len(data):
        (n,) = struct.unpack_from("<Q", data, pos)
        pos += 8 + 4 + n + 4
        ends.append(pos)
    assert pos == len(data)
    return ends


# ------------------------------------------------------------------------------------ framing


def bitwise_crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
    return crc ^ 0xFFFFFFFF


def test_crc32c_matches_reference_and_known_vector():
    assert bitwise_crc32c(b"123456789") == table_crc32c(b"123456789") == 0xE3069283  # the check value
    rng = np.random.default_rng(1)
    for n in (0, 1, 7, 64, 1000):
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        crc = bitwise_crc32c(data)
        assert table_crc32c(data) == crc  # the fallback
        assert table_crc32c(data[n // 2 :], table_crc32c(data[: n // 2])) == crc  # incremental
        assert masked_crc32c(data) == ((((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF)


def test_file_name_and_first_record(tmp_path):
    ef = EventFile(tmp_path / "rank_0")
    ef.close()
    assert ef.path.parent == tmp_path / "rank_0"
    m = re.fullmatch(r"events\.out\.tfevents\.(\d{10})\.(.+)\.(\d+)\.(\d+)", ef.path.name)
    assert m and int(m.group(3)) == os.getpid()
    (first,) = events_of(ef.path)
    assert first.file_version == "brain.Event:2"
    assert first.wall_time > 1e9 and first.step == 0 and not first.HasField("summary")


def test_two_writers_in_one_process_get_distinct_files(tmp_path):
    a, b = EventFile(tmp_path), EventFile(tmp_path)
    a.close()
    b.close()
    assert a.path != b.path


def test_encoding_round_trips_through_official_protos(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow warnings from the float32 cast
        ef = write_golden(tmp_path)
    events = events_of(ef.path)[1:]
    assert [e.step for e in events] == [s for s, _ in GOLDEN]
    for e, (step, vals) in zip(events, GOLDEN, strict=True):
        assert e.wall_time == 1000.0 + step
        assert [v.tag for v in e.summary.value] == list(GOLDEN_TAGS)
        for v, want in zip(e.summary.value, vals, strict=True):
            assert v.WhichOneof("value") == "simple_value"
            assert same(v.simple_value, f32(want))
        # our bytes are exactly what the protobuf library itself would produce
        assert e.SerializeToString() == event_pb2.Event.FromString(e.SerializeToString()).SerializeToString()


def test_bytes_identical_to_protobuf_serialization(tmp_path):
    ef = EventFile(tmp_path)
    tags = ["a/é/min", "b" * 300 + "/x/max"]  # non-ASCII tag; a tag longer than 127 bytes (2-byte varint)
    ef.write_scalars(2**40, 12.5, tags, np.array([1.0, -2.0]))
    ef.close()
    raw = list(RawEventFileLoader(str(ef.path)).Load())[1]
    ref = event_pb2.Event(wall_time=12.5, step=2**40)
    for t, v in zip(tags, (1.0, -2.0), strict=True):
        ref.summary.value.add(tag=t, simple_value=v)
    assert raw == ref.SerializeToString()


def test_negative_and_zero_steps(tmp_path):
    ef = EventFile(tmp_path)
    ef.write_scalars(0, 1.0, ["t"], np.array([1.0]))
    ef.write_scalars(-5, 1.0, ["t"], np.array([2.0]))
    ef.close()
    assert [e.step for e in events_of(ef.path)[1:]] == [0, -5]


def test_mismatched_lengths_rejected(tmp_path):
    with EventFile(tmp_path) as ef, pytest.raises(ValueError):
        ef.write_scalars(0, 1.0, ["a", "b"], np.array([1.0]))


def test_large_step_split_into_events_under_limit(tmp_path):
    tags = [f"actv/layers.{i}.self_attention.linear_qkv.output_{'x' * 40}/max" for i in range(12000)]
    vals = np.arange(len(tags), dtype=np.float64)
    ef = EventFile(tmp_path)
    ef.write_scalars(3, 5.0, tags, vals)
    ef.close()
    events = events_of(ef.path)[1:]
    assert len(events) > 1
    assert all(e.step == 3 for e in events)
    assert all(len(e.summary.SerializeToString()) <= MAX_SUMMARY_BYTES for e in events)
    got = [(v.tag, v.simple_value) for e in events for v in e.summary.value]
    assert got == [(t, float(v)) for t, v in zip(tags, vals, strict=True)]


def test_each_step_on_disk_when_write_returns(tmp_path):
    ef = EventFile(tmp_path)
    for step in range(3):
        ef.write_scalars(step, 1.0, ["a/b/c"], np.array([float(step)]))
        # another reader sees it without flush()/close()
        assert [e.step for e in events_of(ef.path)[1:]] == list(range(step + 1))
    ef.close()


# ------------------------------------------------------------------------------------ readers


def test_tbparse_and_event_accumulator_read_golden_values(tmp_path):
    write_golden(tmp_path)
    want = {(s, t): f32(v) for s, vals in GOLDEN for t, v in zip(GOLDEN_TAGS, vals, strict=True)}

    df = SummaryReader(str(tmp_path)).scalars
    got = {(int(r.step), r.tag): float(r.value) for r in df.itertuples()}
    assert len(df) == len(want) and got.keys() == want.keys()
    assert all(same(got[k], want[k]) for k in want)

    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == sorted(GOLDEN_TAGS)
    for t in GOLDEN_TAGS:
        evs = acc.Scalars(t)
        assert [e.step for e in evs] == [s for s, _ in GOLDEN]
        assert all(same(e.value, want[(e.step, t)]) for e in evs)
        assert [e.wall_time for e in evs] == [1000.0 + s for s, _ in GOLDEN]


def test_truncated_file_yields_every_complete_step(tmp_path):
    src = tmp_path / "src"
    ef = EventFile(src)
    tags = [f"actv/m{i}/max" for i in range(50)]
    for step in range(10):
        ef.write_scalars(step, 100.0 + step, tags, np.full(len(tags), float(step)))
    ef.close()
    data = ef.path.read_bytes()
    ends = record_ends(ef.path)  # ends[0] is the file_version record, ends[1 + s] is step s
    cuts = {7, ends[0] + 3, ends[3] - 1, ends[4], ends[4] + 5, ends[6] + 8 + 4 + 10, ends[9] - 4,
            len(data) - 1}
    for cut in sorted(cuts):
        d = tmp_path / f"cut_{cut}"
        d.mkdir()
        (d / ef.path.name).write_bytes(data[:cut])
        complete = [s for s in range(10) if ends[1 + s] <= cut]

        assert [e.step for e in events_of(d / ef.path.name)[1:]] == complete
        acc = EventAccumulator(str(d), size_guidance={"scalars": 0})
        acc.Reload()
        steps = [e.step for e in acc.Scalars(tags[0])] if complete else []
        assert steps == complete
        if complete:
            df = SummaryReader(str(d)).scalars
            assert sorted(set(df["step"])) == complete and len(df) == len(complete) * len(tags)
            assert (df["value"] == df["step"]).all()


# ------------------------------------------------------------------------------------ the sink


def row(kind, name, vpp=0, micro=0, shape=(2, 3)):
    return Row(kind, name, vpp, micro, "forward", torch.Size(shape), torch.float32)


def partials(numel, nans, infs, zeros, mn, mx, s, ss):
    return [numel, nans, infs, zeros, mn, mx, s, ss]


def test_sink_tags_and_values(tmp_path):
    ops = ["min", "max", "mean", "norm", "zeros", "nans", "infs"]
    sink = TensorBoardSink(tmp_path, ops, multi_chunk=False)
    rows = (row("actv", "layers.0.output"), row("grad_reduced", "layers.0.weight"))
    p = np.array([partials(6, 0, 0, 1, -2.0, 3.0, 6.0, 20.0), partials(6, 1, 1, 0, -1.0, 1.0, 0.0, 2.0)])
    rec = StepRecord(5, 0, rows, p, 123.0)
    sink.write(rec, records.Derived(rec))
    sink.close()
    (ev,) = events_of(sink.events.path)[1:]
    got = {v.tag: v.simple_value for v in ev.summary.value}
    assert list(got) == [records.tag(r.kind, r.name, op) for r in rows for op in ops]
    assert got["actv/layers.0.output/mean"] == 1.0
    assert got["actv/layers.0.output/norm"] == f32(math.sqrt(20.0))
    assert got["actv/layers.0.output/zeros"] == f32(1 / 6)
    assert got["grad_reduced/layers.0.weight/mean"] == 0.0
    assert got["grad_reduced/layers.0.weight/nans"] == 1.0 and got["grad_reduced/layers.0.weight/infs"] == 1.0
    assert ev.step == 5 and ev.wall_time == 123.0


def test_sink_all_nan_tensor_survives(tmp_path):
    sink = TensorBoardSink(tmp_path, ["min", "nans"])
    p = np.array([partials(4, 4, 0, 0, np.inf, -np.inf, 0.0, 0.0)])
    rec = StepRecord(0, 0, (row("actv", "x"),), p, 1.0)
    sink.write(rec, records.Derived(rec))
    sink.close()
    (ev,) = events_of(sink.events.path)[1:]
    assert math.isnan(ev.summary.value[0].simple_value) and ev.summary.value[1].simple_value == 4.0


def test_sink_merges_micro_steps_and_prefixes_chunks(tmp_path):
    sink = TensorBoardSink(tmp_path, ["min", "max", "mean", "nans"], multi_chunk=True)
    rows = (
        row("actv", "a", vpp=0, micro=0), row("actv", "b", vpp=0, micro=0),
        row("actv", "a", vpp=0, micro=1), row("actv", "a", vpp=1, micro=0),  # another chunk: own tag
        row("actv", "b", vpp=0, micro=1), row("actv_grad", "a", vpp=0, micro=0),
    )
    p = np.array([
        partials(6, 0, 0, 0, -1.0, 2.0, 3.0, 9.0), partials(6, 0, 0, 0, 0.0, 1.0, 1.0, 1.0),
        partials(6, 2, 0, 0, -5.0, 1.0, 2.0, 9.0), partials(6, 0, 0, 0, 7.0, 8.0, 45.0, 9.0),
        partials(6, 0, 0, 0, -3.0, 0.5, 1.0, 1.0), partials(6, 0, 0, 0, 1.0, 1.0, 6.0, 6.0),
    ])
    rec = StepRecord(1, 0, rows, p, 1.0)
    tags, vals = sink.values(rec, records.Derived(rec))
    expect_groups = [("actv", "0:a", [0, 2]), ("actv", "0:b", [1, 4]), ("actv", "1:a", [3]),
                     ("actv_grad", "0:a", [5])]
    assert tags == tuple(records.tag(k, n, op) for k, n, _ in expect_groups for op in sink.ops)
    want = []
    for _, _, idx in expect_groups:
        d = records.derive(records.merge(p[idx]))
        want.extend(float(d[op][0]) for op in sink.ops)
    assert np.array_equal(vals, np.array(want), equal_nan=True)
    by_tag = dict(zip(tags, vals, strict=True))
    assert by_tag["actv/0:a/nans"] == 2.0 and by_tag["actv/0:a/min"] == -5.0
    sink.close()


def test_sink_layout_change_between_steps(tmp_path):
    sink = TensorBoardSink(tmp_path, ["max"])
    layouts = [(row("actv", "a"),), (row("actv", "a"), row("actv", "b")), (row("actv", "a"),)]
    for step, rows in enumerate(layouts):
        p = np.array([partials(1, 0, 0, 0, 0.0, float(10 * step + i), 0.0, 0.0) for i in range(len(rows))])
        rec = StepRecord(step, 0, rows, p, 1.0)
        sink.write(rec, records.Derived(rec))
    sink.close()
    got = [(e.step, v.tag, v.simple_value) for e in events_of(sink.events.path)[1:] for v in e.summary.value]
    assert got == [(0, "actv/a/max", 0.0), (1, "actv/a/max", 10.0), (1, "actv/b/max", 11.0),
                   (2, "actv/a/max", 20.0)]


def test_sink_rejects_unknown_op_and_ignores_shape_dtype(tmp_path):
    with pytest.raises(ValueError, match="unknown statistic"):
        TensorBoardSink(tmp_path / "a", ["min", "median"])
    sink = TensorBoardSink(tmp_path / "b", ["min", "shape", "dtype", "min"])
    assert sink.ops == ("min",)
    sink.close()


CHILD = r"""
import sys, time, numpy as np, torch
from trainmon.run import records
from trainmon.run.records import Row, StepRecord
from trainmon.writer.csv import CsvSink
from trainmon.writer.tensorboard import TensorBoardSink
from trainmon.writer.thread import WriterThread
rank_dir = sys.argv[1]
rows = tuple(Row("actv", f"layers.{i}.output", 0, 0, "forward", torch.Size([4, 4]), torch.float32)
             for i in range(300))
w = WriterThread([TensorBoardSink(rank_dir, records.STATS), CsvSink(rank_dir, records.STATS, 6)],
                 max_pending=1000)
step = 0
while True:
    p = np.zeros((len(rows), 8)); p[:, 0] = 16; p[:, 5] = step
    w.submit(StepRecord(step, 0, rows, p, time.time()))
    step += 1
    if step % 8 == 0:
        w.flush()
"""


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_killed_writer_leaves_every_completed_step_readable(tmp_path):
    rank_dir = tmp_path / "rank_0"
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(rank_dir)])
    try:
        deadline = time.monotonic() + 30
        while not (rank_dir / "actv.csv").exists() or (rank_dir / "actv.csv").stat().st_size < 200_000:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    n_tags = 300 * len(records.STATS)
    (path,) = rank_dir.glob("events.out.tfevents.*")
    steps = [e.step for e in events_of(path)[1:]]  # CRC-checked; a cut last record is skipped
    assert steps == list(range(len(steps))) and len(steps) >= 5
    acc = EventAccumulator(str(rank_dir), size_guidance={"scalars": 0})
    acc.Reload()
    assert len(acc.Tags()["scalars"]) == n_tags
    assert [e.step for e in acc.Scalars("actv/layers.299.output/max")] == steps
    assert [e.value for e in acc.Scalars("actv/layers.7.output/max")] == [float(s) for s in steps]

    text = (rank_dir / "actv.csv").read_text()
    complete = text[: text.rfind("\n") + 1]  # at most the last line is partial
    df = pd.read_csv(io.StringIO(complete))
    assert df.notna().all().all() and len(df.columns) == 13
    assert (df["max"] == df["step"]).all()
    counts = df.groupby("step").size()
    assert list(counts.index) == list(range(len(counts))) and (counts.iloc[:-1] == 300).all()


def test_sink_enum_kind_tags_use_the_value(tmp_path):
    sink = TensorBoardSink(tmp_path, ["max"])
    rows = (Row(records.Kind.GRAD_REDUCED, "w", 0, 0, records.Phase.OPTIMIZER, (1,), torch.float32),)
    rec = StepRecord(0, 0, rows, np.zeros((1, 8)), 1.0)
    tags, _ = sink.values(rec, records.Derived(rec))
    assert tags == ("grad_reduced/w/max",)
    sink.close()
