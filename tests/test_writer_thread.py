"""The writer thread (ordering, dropping, error isolation, ready callbacks, flush/close) and the
manifest sink it feeds."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time

import numpy as np
import pandas as pd
import pytest
import torch
from tbparse import SummaryReader

from trainmon.run import records
from trainmon.run.layout import manifest_path
from trainmon.run.manifest import read_manifest, write_manifest
from trainmon.run.records import Row, StepRecord
from trainmon.writer.csv import CsvSink
from trainmon.writer.manifest import Manifest, ManifestSink
from trainmon.writer.tensorboard import TensorBoardSink
from trainmon.writer.thread import RecordSink, WriterThread

pytestmark = [pytest.mark.timeout(60), pytest.mark.filterwarnings("ignore:The inplace keyword")]

ROWS = (Row("actv", "layers.0.output", 0, 0, "forward", torch.Size([2, 3]), torch.float32),
        Row("grad_reduced", "layers.0.weight", 0, 0, "optimizer", torch.Size([3]), torch.float32))


def rec(step: int, rows=ROWS) -> StepRecord:
    p = np.zeros((len(rows), records.N_PARTIALS))
    p[:, records.NUMEL] = 6
    p[:, records.MIN] = -step
    p[:, records.MAX] = step
    return StepRecord(step, 0, rows, p, 1000.0 + step)


class Recorder:
    def __init__(self):
        self.steps: list[int] = []
        self.derived: list[dict] = []
        self.flushes = 0
        self.closed = False

    def write(self, record, derived):
        self.steps.append(record.step)
        self.derived.append(derived)

    def flush(self):
        self.flushes += 1

    def close(self):
        self.closed = True


class Blocking(Recorder):
    def __init__(self):
        super().__init__()
        self.gate = threading.Event()
        self.entered = threading.Event()

    def write(self, record, derived):
        self.entered.set()
        assert self.gate.wait(30)
        super().write(record, derived)


class Failing(Recorder):
    def write(self, record, derived):
        raise RuntimeError(f"disk on fire at step {record.step}")


def warnings_of(caplog):
    return [r for r in caplog.records if r.name == "trainmon" and r.levelno == logging.WARNING]


def test_empty_record_is_fine_for_every_sink(tmp_path, caplog):
    w = WriterThread([TensorBoardSink(tmp_path / "rank_0", ["max"]), CsvSink(tmp_path / "rank_0", ["max"], 6),
                      ManifestSink(tmp_path, {})])
    assert w.submit(StepRecord(0, 0, (), np.zeros((0, records.N_PARTIALS)), 1.0))
    assert w.close(10)
    assert [p.name for p in (tmp_path / "rank_0").iterdir() if p.suffix == ".csv"] == []
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_sinks_satisfy_protocol(tmp_path):
    for s in (Recorder(), CsvSink(tmp_path, ["max"], 6), TensorBoardSink(tmp_path, ["max"]),
              ManifestSink(tmp_path, {})):
        assert isinstance(s, RecordSink)
        s.close()


def test_order_preserved_and_derived_once():
    a, b = Recorder(), Recorder()
    w = WriterThread([a, b], max_pending=1000)
    for s in range(200):
        assert w.submit(rec(s))
    assert w.flush(10)
    assert a.steps == b.steps == list(range(200))
    assert all(da is db for da, db in zip(a.derived, b.derived, strict=True))  # one derive per record, shared
    np.testing.assert_array_equal(a.derived[7].rows["max"], records.derive(rec(7).partials)["max"])
    assert w.written == 200 and w.dropped == 0
    assert w.close(10) and not w.alive


def test_full_queue_drops_without_blocking_and_warns_once_per_burst(caplog):
    caplog.set_level(logging.INFO, logger="trainmon")
    sink = Blocking()
    w = WriterThread([sink], max_pending=3)
    results = []
    start = time.perf_counter()
    for s in range(10):
        results.append(w.submit(rec(s)))
        if s == 0:
            assert sink.entered.wait(10)  # step 0 is being written (and blocks)
    assert time.perf_counter() - start < 1.0  # never waited for the blocked sink
    assert results == [True, True, True] + [False] * 7
    assert w.dropped == 7
    warns = warnings_of(caplog)
    assert len(warns) == 1 and "dropped step 3 " in warns[0].getMessage()  # the check of drops is off

    sink.gate.set()
    assert w.flush(10)
    assert sink.steps == [0, 1, 2]
    assert w.submit(rec(10))  # burst over
    assert any("7 step(s) were dropped (steps 3..9)" in r.getMessage() for r in caplog.records)

    assert w.flush(10)
    sink.gate.clear()
    sink.entered.clear()
    assert w.submit(rec(11)) and sink.entered.wait(10)
    for s in range(12, 20):
        w.submit(rec(s))
    assert len([r for r in warnings_of(caplog) if "is behind" in r.getMessage()]) == 2  # once per burst
    sink.gate.set()
    assert w.close(10)
    assert sink.steps == [0, 1, 2, 10, 11, 12, 13]


def test_failing_sink_is_logged_rate_limited_and_others_keep_writing(caplog):
    caplog.set_level(logging.INFO, logger="trainmon")
    bad, good = Failing(), Recorder()
    w = WriterThread([bad, good])
    for s in range(5):
        assert w.submit(rec(s))
    assert w.flush(10)
    assert good.steps == list(range(5))
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1  # the rest fall under the rate limit
    assert errors[0].exc_info is not None and "Failing" in errors[0].getMessage()
    assert w.close(10) and bad.closed and good.closed


def test_failing_flush_and_close_do_not_escape(caplog):
    class Angry(Recorder):
        def flush(self):
            raise OSError("flush failed")

        def close(self):
            raise OSError("close failed")

    w = WriterThread([Angry()])
    w.submit(rec(0))
    assert w.flush(10)
    assert w.close(10)
    assert any("flush" in r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)


def test_ready_called_before_partials_are_read():
    order = []
    buf = np.zeros((len(ROWS), records.N_PARTIALS))  # the "pinned buffer" of a non-blocking copy
    record = StepRecord(4, 0, ROWS, buf, 1.0)

    def ready():  # e.g. a CUDA event's synchronize: the copy lands only now
        order.append("ready")
        buf[:] = rec(4).partials

    class Check(Recorder):
        def write(self, record, derived):
            order.append("write")
            super().write(record, derived)

    sink = Check()
    w = WriterThread([sink])
    assert w.submit(record, ready)
    assert w.close(10)
    assert order == ["ready", "write"]
    assert sink.derived[0].rows["max"][0] == 4.0  # derived from the data that arrived in ready()


def test_failing_ready_skips_the_record(caplog):
    sink = Recorder()
    w = WriterThread([sink])

    def broken():
        raise RuntimeError("device lost")

    w.submit(rec(0), broken)
    w.submit(rec(1))
    assert w.close(10)
    assert sink.steps == [1]
    assert any("step 0" in r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)


def test_flush_waits_and_times_out():
    sink = Blocking()
    w = WriterThread([sink])
    w.submit(rec(0))
    assert sink.entered.wait(10)
    assert w.flush(timeout=0.2) is False
    sink.gate.set()
    assert w.flush(timeout=10) is True
    assert sink.flushes >= 1 and sink.steps == [0]
    assert w.close(10)


def test_close_writes_pending_closes_sinks_and_is_idempotent():
    sink = Recorder()
    w = WriterThread([sink], max_pending=100)
    for s in range(20):
        w.submit(rec(s))
    assert w.close(10)
    assert sink.steps == list(range(20)) and sink.closed and not w.alive
    assert w.submit(rec(99)) is False
    assert w.close(1) and w.flush(1)


def test_close_times_out_on_a_stuck_sink():
    sink = Blocking()
    w = WriterThread([sink])
    w.submit(rec(0))
    assert sink.entered.wait(10)
    assert w.close(timeout=0.2) is False
    sink.gate.set()
    assert w.close(timeout=10) is True


def test_end_to_end_tensorboard_csv_manifest(tmp_path, caplog):
    rank_dir = tmp_path / "rank_0"
    ops = ["min", "max", "mean", "norm"]
    w = WriterThread([TensorBoardSink(rank_dir, ops), CsvSink(rank_dir, ops, 6),
                      ManifestSink(tmp_path, {"world_size": 1})])
    for s in range(5):
        assert w.submit(rec(s))
    assert w.close(30)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    df = SummaryReader(str(rank_dir)).scalars
    assert len(df) == 5 * len(ROWS) * len(ops)
    assert set(df[df.tag == "actv/layers.0.output/max"]["value"]) == {0.0, 1.0, 2.0, 3.0, 4.0}
    assert list(pd.read_csv(rank_dir / "actv.csv")["step"]) == [0, 1, 2, 3, 4]
    man = read_manifest(tmp_path)
    assert man["names"] == {"actv": ["layers.0.output"], "grad_reduced": ["layers.0.weight"]}
    assert not any("tfevents" in p.name for p in rank_dir.iterdir() if p.suffix == ".csv")


# ------------------------------------------------------------------------------------ manifest


def test_write_manifest_is_atomic_json_with_schema_version(tmp_path):
    path = write_manifest(tmp_path, {"world_size": 8, "config": {"ops": ("min", "max"), "eps": float("inf")}})
    assert path == tmp_path / "plugins" / "trainmon" / "manifest.json"
    doc = json.loads(path.read_text())  # strict JSON: no NaN/Infinity tokens
    assert doc["schema_version"] == records.SCHEMA_VERSION
    assert doc["world_size"] == 8 and doc["config"] == {"ops": ["min", "max"], "eps": "inf"}
    assert [p.name for p in path.parent.iterdir()] == ["manifest.json"]  # no temporary left behind


def test_manifest_rewrites_only_when_names_change(tmp_path):
    m = Manifest(tmp_path, {"world_size": 2})
    writes = m.writes
    assert m.update_names({"actv": ["a", "b"]}) is True
    assert m.update_names({"actv": ["b", "a"]}) is False
    assert m.writes == writes + 1
    assert m.update_names({"actv": ["c"], "grad_reduced": ["w"]}) is True
    doc = read_manifest(tmp_path)
    assert doc["names"] == {"actv": ["a", "b", "c"], "grad_reduced": ["w"]}
    assert doc["kinds"] == ["actv", "grad_reduced"] and doc["world_size"] == 2


def test_manifest_sink_costs_nothing_for_a_known_layout(tmp_path):
    sink = ManifestSink(tmp_path, {"chunks": 2})  # several model chunks: names carry the vpp prefix
    rows = ROWS + (Row("actv", "layers.0.output", 1, 0, "forward", (2,), torch.float32),)
    for s in range(10):
        sink.write(rec(s, tuple(Row(*r) for r in rows)), None)
    assert sink.manifest.writes == 2  # the initial document, then the first layout's names
    assert read_manifest(tmp_path)["names"] == {"actv": ["0:layers.0.output", "1:layers.0.output"],
                                               "grad_reduced": ["0:layers.0.weight"]}


def test_manifests_of_two_ranks_merge(tmp_path):
    a = Manifest(tmp_path, {"world_size": 2})
    b = Manifest(tmp_path, {"world_size": 2})
    a.update_names({"actv": ["layers.0.output"]})
    b.update_names({"actv": ["layers.9.output"], "comm": ["all_reduce"]})
    doc = read_manifest(tmp_path)
    assert doc["names"] == {"actv": ["layers.0.output", "layers.9.output"], "comm": ["all_reduce"]}
    assert doc["created"] == a.payload["created"] <= b.payload["created"]
    assert manifest_path(tmp_path).exists()


EXIT_WITHOUT_CLOSE = r"""
import sys, time, numpy as np
from trainmon.run.records import Row, StepRecord
from trainmon.writer.thread import WriterThread

class Slow:
    def __init__(self, path): self.f = open(path, "a")
    def write(self, record, derived): time.sleep(0.05); self.f.write(f"{record.step}\n")
    def flush(self): self.f.flush()
    def close(self): self.f.write("closed\n"); self.f.close()

w = WriterThread([Slow(sys.argv[1])], max_pending=100)
for s in range(10):
    w.submit(StepRecord(s, 0, (), np.zeros((0, 8)), 1.0))
# no close(): the interpreter's exit must still write the 10 queued steps
"""


@pytest.mark.slow
def test_interpreter_exit_writes_pending_steps(tmp_path):
    out = tmp_path / "steps.txt"
    subprocess.run([sys.executable, "-c", EXIT_WITHOUT_CLOSE, str(out)], check=True, timeout=60)
    assert out.read_text().split() == [str(s) for s in range(10)] + ["closed"]
