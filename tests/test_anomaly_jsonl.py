"""Anomaly records on disk: the columnar table (every field round trips, the per-step burst cap, one append
a step, a failed append cut back, a kill at any byte), and the JSON codec and old layout (``rank_<r>.jsonl``)
that summaries, the plugin and old runs use."""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import logging
import math
import os
import threading

import pytest

from trainmon.anomaly.log import AnomalyLog
from trainmon.run import columnar
from trainmon.run.anomalies import anomaly_from_json, anomaly_to_json, iter_anomalies
from trainmon.run.anomaly_table import read_anomalies
from trainmon.run.columnar import segments
from trainmon.run.layout import anomalies_file, anomalies_rank_dir
from trainmon.run.records import Anomaly


def _strict_loads(line: str) -> dict:
    def refuse(name: str) -> None:
        raise AssertionError(f"non-strict JSON constant {name} in {line}")

    return json.loads(line, parse_constant=refuse)


def _a(step: int = 3, seq: int = 0, **kw) -> Anomaly:
    base = dict(step=step, rank=1, kind="actv", name=f"layers.{seq}.mlp", stat="max", value=1.0, rule="nan",
                seq=seq)
    base.update(kw)
    return Anomaly(**base)


# -- JSON ------------------------------------------------------------------------------------------------


def test_to_json_golden_compact_in_field_order():
    a = Anomaly(step=7, rank=2, kind="actv", name="decoder.layers.0", stat="norm", value=1.5, rule="zscore")
    assert anomaly_to_json(a) == (
        '{"step":7,"rank":2,"kind":"actv","name":"decoder.layers.0","stat":"norm","value":1.5,'
        '"rule":"zscore","seq":0,"micro_step":0,"vpp_stage":0,"pp_stage":0,"phase":"forward",'
        '"baseline":null,"origin":false,"propagated":false,"collectives":0,"wall_time":0.0,"dump":null,'
        '"message":"","v":1}'
    )
    assert "\n" not in anomaly_to_json(a)


@pytest.mark.parametrize(
    ("value", "baseline", "wall_time", "written"),
    [
        (math.nan, math.inf, 12.5, ("nan", "inf", 12.5)),
        (-math.inf, None, 0.0, ("-inf", None, 0.0)),
        (math.inf, -math.inf, 1e300, ("inf", "-inf", 1e300)),
    ],
)
def test_round_trip_non_finite_as_strings(value, baseline, wall_time, written):
    a = _a(value=value, baseline=baseline, wall_time=wall_time, origin=True, dump="dumps/x.safetensors",
           message="é ü", phase="backward", pp_stage=3, collectives=9)
    line = anomaly_to_json(a)
    d = _strict_loads(line)
    assert (d["value"], d["baseline"], d["wall_time"]) == written
    b = anomaly_from_json(line)
    assert anomaly_to_json(b) == line
    for f in ("value", "baseline", "wall_time"):
        x, y = getattr(a, f), getattr(b, f)
        assert (x is None and y is None) or (math.isnan(x) and math.isnan(y)) or x == y
    assert (b.origin, b.dump, b.message, b.phase, b.pp_stage, b.collectives) == (
        True, "dumps/x.safetensors", "é ü", "backward", 3, 9)


def test_from_json_ignores_unknown_keys_and_defaults_missing_optional_ones():
    line = json.dumps({"step": 4, "rank": 0, "kind": "grad_reduced", "name": "w", "stat": "norm",
                       "value": "nan", "rule": "nan", "future_field": {"x": [1, 2]}, "v": 2})
    a = anomaly_from_json(line)
    assert a == Anomaly(step=4, rank=0, kind="grad_reduced", name="w", stat="norm", value=a.value,
                        rule="nan", v=2)
    assert math.isnan(a.value)
    assert (a.seq, a.phase, a.baseline, a.origin, a.dump) == (0, "forward", None, False, None)


@pytest.mark.parametrize(
    "line",
    [
        "not json",
        "[1, 2]",
        '{"step": 1, "rank": 0, "kind": "actv", "name": "x", "stat": "max", "value": 1.0}',  # no rule
        '{"step": "one", "rank": 0, "kind": "actv", "name": "x", "stat": "max", "value": 1, "rule": "nan"}',
        '{"step": 1, "rank": 0, "kind": "actv", "name": "x", "stat": "max", "value": "big", "rule": "nan"}',
        '{"step": 1, "rank": 0, "kind": "actv", "name": "x", "stat": "max", "value": null, "rule": "nan"}',
        '{"step": 1, "rank": 0, "kind": 5, "name": "x", "stat": "max", "value": 1, "rule": "nan"}',
    ],
)
def test_from_json_rejects_what_is_not_an_anomaly(line):
    with pytest.raises(ValueError):
        anomaly_from_json(line)


# -- AnomalyLog --------------------------------------------------------------------------------------------


def _stream(log: AnomalyLog):
    """The Arrow stream the log is appending to."""
    live = [s for s in segments(log.path) if not s.sealed]
    assert len(live) == 1
    return live[0].path


def test_log_path_and_records(tmp_path):
    with AnomalyLog(tmp_path, rank=5) as log:
        assert log.path == tmp_path / "plugins" / "trainmon" / "anomalies" / "rank=5"
        assert log.path == anomalies_rank_dir(tmp_path, 5)
        assert log.write_step(1, []) == []
        assert segments(log.path) == []  # a step without anomalies writes no record
        a, b = _a(step=1, seq=4), _a(step=1, seq=2)
        assert log.write_step(1, [a, b]) == [b, a]  # (phase, micro_step, seq) order
        assert read_anomalies(tmp_path, 5) == [dataclasses.replace(x, rank=5) for x in (b, a)]
    assert log.closed
    (segment,) = segments(log.path)
    assert segment.sealed and segment.path.name == "part-00000-1-1.parquet"
    assert read_anomalies(tmp_path, 5) == [dataclasses.replace(x, rank=5) for x in (b, a)]
    with pytest.raises(ValueError, match="closed"):
        log.write_step(2, [_a(step=2)])


def test_every_field_round_trips_through_the_table(tmp_path):
    a = _a(step=4, seq=3, value=math.nan, baseline=math.inf, wall_time=12.5, origin=True, propagated=True,
           dump="plugins/trainmon/dumps/step_4/rank_1", message="é ü", phase="backward", pp_stage=3,
           vpp_stage=1, micro_step=2, collectives=9, stat="nans", kind="grad_reduced", rule="inf")
    b = _a(step=4, seq=5, value=-math.inf, baseline=None)
    with AnomalyLog(tmp_path, rank=1) as log:
        log.write_step(4, [a, b])
        live = read_anomalies(tmp_path, 1)  # from the open Arrow stream
    sealed = read_anomalies(tmp_path, 1)  # from the Parquet segment
    for got in (live, sealed):
        assert [anomaly_to_json(x) for x in got] == [anomaly_to_json(b), anomaly_to_json(a)]  # forward first
    assert read_anomalies(tmp_path, 1, step_lo=5) == [] and len(read_anomalies(tmp_path, 1, 4, 4)) == 2


def test_burst_cap_exact_output(tmp_path):
    anomalies = [
        _a(seq=1, phase="backward"),
        _a(seq=9, phase="forward", micro_step=1),
        _a(seq=5, phase="optimizer"),
        _a(seq=7, phase="forward", micro_step=0),
        _a(seq=12, phase="forward", micro_step=1, collectives=4, pp_stage=2, wall_time=8.0),
        _a(seq=0, phase="comm"),
    ]
    log = AnomalyLog(tmp_path, rank=1, max_per_step=2)
    written = log.write_step(3, anomalies)
    log.close()
    summary = Anomaly(step=3, rank=1, kind="*", name="*", stat="*", value=4.0, rule="suppressed",
                      seq=12, micro_step=1, phase="forward", collectives=4, pp_stage=2, wall_time=8.0,
                      message="4 more anomalies at this step not recorded (at most 2 a step)")
    assert written == [anomalies[3], anomalies[1], summary]
    assert read_anomalies(tmp_path, 1) == written


def test_burst_cap_not_applied_at_the_limit(tmp_path):
    anomalies = [_a(seq=i) for i in range(3)]
    with AnomalyLog(tmp_path, rank=1, max_per_step=3) as log:
        assert log.write_step(3, anomalies) == anomalies
    with pytest.raises(ValueError):
        AnomalyLog(tmp_path, rank=1, max_per_step=-1)


def test_each_step_is_one_write_on_an_append_fd(tmp_path, monkeypatch):
    log = AnomalyLog(tmp_path, rank=0)
    log.write_step(1, [_a(step=1, seq=0)])
    fd = log._records._fd
    assert os.O_APPEND & fcntl.fcntl(fd, fcntl.F_GETFL)
    calls = []
    real_write = os.write

    def spy(f, data):
        if f == fd:
            calls.append(bytes(data))
        return real_write(f, data)

    monkeypatch.setattr(os, "write", spy)
    log.write_step(2, [_a(step=2, seq=i) for i in range(10)])
    log.write_step(3, [_a(step=3, seq=i) for i in range(3)])
    monkeypatch.undo()
    log.close()
    assert len(calls) == 2
    assert [len(x) for x in (read_anomalies(tmp_path, 0, s, s) for s in (1, 2, 3))] == [1, 10, 3]


def test_reopening_appends(tmp_path):
    with AnomalyLog(tmp_path, rank=0) as log:
        log.write_step(1, [_a(step=1)])
    with AnomalyLog(tmp_path, rank=0) as log:
        log.write_step(2, [_a(step=2)])
    assert [a.step for a in read_anomalies(tmp_path, 0)] == [1, 2]
    assert [s.path.name for s in segments(log.path)] == ["part-00000-1-1.parquet", "part-00001-2-2.parquet"]


def test_a_failed_append_is_cut_back_and_the_next_step_is_written(tmp_path, monkeypatch):
    """Disk full in the middle of an append: the torn batch is truncated away, the stream ends there, the
    step's records wait in memory, and with the next step they go to a new stream; every whole step stays
    readable, in order."""
    handed: list = []

    def hold(stream, seq, schema, options, failed=None):  # the ended streams stay as they are
        handed.append(stream)
        done = threading.Event()
        done.set()
        return done

    monkeypatch.setattr(columnar._SEALER, "submit", hold)
    log = AnomalyLog(tmp_path, rank=0)
    log.write_step(1, [_a(step=1)])
    stream = _stream(log)
    size = stream.stat().st_size
    real_write = os.write

    def half_then_full(fd, data):
        real_write(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(os, "write", half_then_full)
        assert len(log.write_step(2, [_a(step=2, seq=i) for i in range(5)])) == 5  # never raises
    assert log.error is not None and log.error.errno == errno.ENOSPC
    assert handed == [stream] and stream.stat().st_size == size  # cut back to the last whole batch, ended
    assert [a.step for a in read_anomalies(tmp_path, 0)] == [1]
    log.write_step(3, [_a(step=3)])
    assert log.error is None
    steps = [1, 2, 2, 2, 2, 2, 3]
    assert [a.step for a in read_anomalies(tmp_path, 0)] == steps
    log.close()
    assert [s.path.name for s in segments(log.path)] == ["_open-00000-1.arrows", "_open-00001-2.arrows"]
    monkeypatch.undo()
    assert [a.step for a in read_anomalies(tmp_path, 0)] == steps
    AnomalyLog(tmp_path, rank=0).close()  # the next writer seals what it finds
    assert [s.path.name for s in segments(log.path)] == ["part-00000-1-1.parquet", "part-00001-2-3.parquet"]
    assert [a.step for a in read_anomalies(tmp_path, 0)] == steps


def test_crash_at_any_byte_keeps_every_complete_step(tmp_path, caplog):
    steps = {s: [_a(step=s, seq=i, value=math.nan if i else 2.0) for i in range(s)] for s in (1, 2, 3)}
    log = AnomalyLog(tmp_path / "run", rank=1)
    ends = []
    for s, anomalies in steps.items():
        log.write_step(s, anomalies)
        ends.append(_stream(log).stat().st_size)
    data = _stream(log).read_bytes()
    log.close()
    crashed = anomalies_rank_dir(tmp_path / "crashed", 1)
    crashed.mkdir(parents=True)
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        for cut in range(len(data) + 1):  # the writer killed after `cut` bytes
            (crashed / "_open-00000-1.arrows").write_bytes(data[:cut])
            got = [anomaly_to_json(a) for a in read_anomalies(tmp_path / "crashed", 1)]
            done = [s for s, end in zip(steps, ends, strict=True) if end <= cut]
            assert got == [anomaly_to_json(dataclasses.replace(a, rank=1)) for s in done for a in steps[s]]
    assert not caplog.records


# -- reading the old layout ---------------------------------------------------------------------------------


def test_old_layout_partial_last_line_is_skipped(tmp_path, caplog):
    path = anomalies_file(tmp_path, 0)
    path.parent.mkdir(parents=True)
    path.write_text(anomaly_to_json(_a(step=1)) + "\n" + anomaly_to_json(_a(step=2)) + "\n")
    with open(path, "ab") as f:
        f.write(anomaly_to_json(_a(step=3)).encode()[:-1])  # complete JSON, but no newline yet
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        assert [a.step for a in iter_anomalies(path)] == [1, 2]
        assert [a.step for a in read_anomalies(tmp_path, 0)] == [1, 2]  # the old layout is still read
    assert not caplog.records


def test_malformed_lines_are_skipped_and_the_file_noted_damaged_once(tmp_path, caplog):
    from trainmon.run.damage import damaged

    path = tmp_path / "rank_0.jsonl"
    path.write_bytes(
        (anomaly_to_json(_a(step=1)) + "\n"
         + "{garbage\n"
         + "\n"
         + anomaly_to_json(_a(step=2)) + "\n").encode()
        + b"\xff\xfe\n"
        + (anomaly_to_json(_a(step=3)) + "\n").encode()
    )
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        assert [a.step for a in iter_anomalies(path)] == [1, 2, 3]
        assert [a.step for a in iter_anomalies(path)] == [1, 2, 3]  # read twice: still one file noted
    assert not caplog.records  # whoever shows the run says it (analyze, the tab), once
    [found] = damaged(tmp_path)
    assert found.path == path
    assert found.why.startswith("line 2: malformed anomaly line: ")
    assert "(2 malformed lines skipped)" in found.why



def test_records_that_cannot_be_encoded_do_not_hold_up_later_steps(tmp_path, monkeypatch, caplog):
    """A step whose records the table cannot take (not a disk error: kept in memory would fail for ever) is
    dropped, counted and logged; the steps after it are recorded."""
    log = AnomalyLog(tmp_path, rank=0)
    log.write_step(1, [_a(step=1)])
    real = log._encoder.encode

    def refuse_step_2(records):
        if records[0].step == 2:
            raise ValueError("cannot encode")
        return real(records)

    monkeypatch.setattr(log._encoder, "encode", refuse_step_2)
    with caplog.at_level(logging.ERROR, "trainmon"):
        log.write_step(2, [_a(step=2)])
    log.write_step(3, [_a(step=3)])
    log.close()
    assert [a.step for a in read_anomalies(tmp_path, 0)] == [1, 3]
    assert log.lost == 1 and "1 anomaly records of step 2 cannot be stored" in caplog.text
