"""``trainmon dump request`` on a run that has ended, or for a step that has passed, warns and says what
will happen (issue 15, point 8); the manifest records when rank 0's monitor closed."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

from trainmon.cli import main
from trainmon.read.runstate import run_state
from trainmon.run import records
from trainmon.run.manifest import read_manifest
from trainmon.run.records import Row, StepRecord
from trainmon.writer.csv import CsvSink
from trainmon.writer.dumps import RequestPoller
from trainmon.writer.manifest import ManifestSink
from trainmon.writer.statstore import StatStoreSink


def _record(step: int) -> StepRecord:
    rows = (Row("actv", "layers.0.output", 0, 0, "forward", torch.Size([2]), torch.float32),)
    p = np.array([[2, 0, 0, 0, -1.0, 1.0, 0.0, 2.0]])
    return StepRecord(step, 0, rows, p, time.time())


def _write_steps(sink, steps) -> None:
    for s in steps:
        rec = _record(s)
        sink.write(rec, records.derive(rec.partials))


def _request(capsys, run: Path, *extra: str) -> tuple[str, str]:
    assert main(["dump", "request", str(run), "--name", "layers.*", *extra]) == 0
    out, err = capsys.readouterr()
    assert len(out.strip()) == 32  # the request id is printed (and the request kept) in every case
    return out.strip(), err


def test_running_job_future_and_next_steps_are_quiet(tmp_path, capsys):
    store = StatStoreSink(tmp_path, 0)
    _write_steps(store, range(0, 8))
    manifest = ManifestSink(tmp_path, {"world_size": 1})
    _write_steps(manifest, range(0, 8))
    assert run_state(tmp_path).closed is None and run_state(tmp_path).last_step == 7
    assert _request(capsys, tmp_path, "--step", "8")[1] == ""
    assert _request(capsys, tmp_path)[1] == ""  # next
    store.close()


@pytest.mark.parametrize("output", ["statstore", "csv"])
def test_passed_step_warns(tmp_path, capsys, output):
    sink = StatStoreSink(tmp_path, 1) if output == "statstore" else CsvSink(tmp_path / "rank_1", ["max"])
    _write_steps(sink, range(3, 41))
    sink.close()
    assert run_state(tmp_path).last_step == 40
    rid, err = _request(capsys, tmp_path, "--step", "12")
    assert err == (
        f"trainmon dump: warning: step 12 has already passed in {tmp_path} (the latest step written is 40): "
        "the running job drops requests for steps behind it, so this one will not be served unless a job "
        f"attaches to {tmp_path} again and runs step 12 (resumed from an earlier checkpoint). "
        "Use --step next for the next collected step.\n"
    )
    assert [(r.id, r.step) for r in RequestPoller(tmp_path).poll()] == [(rid, 12)]
    assert "already passed" in _request(capsys, tmp_path, "--step", "40")[1]
    assert _request(capsys, tmp_path, "--step", "41")[1] == ""


def test_ended_run_warns(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    try:
        sink = ManifestSink(tmp_path, {"world_size": 2})
        _write_steps(sink, range(0, 150))
        before = time.time()
        sink.close()
        doc = read_manifest(tmp_path)
        assert doc["last_step"] == 149 and before <= doc["closed"] <= time.time()
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(doc["closed"]))
        cases = ((["--step", "200"], "when it reaches step 200"), ([], "at its first collected step"))
        for extra, at in cases:
            _, err = _request(capsys, tmp_path, *extra)
            assert err == (
                f"trainmon dump: warning: the run in {tmp_path} has ended (its monitor closed at {when}, "
                "last step 149): no job reads its requests now. The request is kept and is served only if a "
                f"job attaches to {tmp_path} again (resumed training), {at}.\n"
            )
        # a job that attaches to the run again rewrites the manifest without the mark
        ManifestSink(tmp_path, {"world_size": 2})
        assert "closed" not in read_manifest(tmp_path)
        assert _request(capsys, tmp_path, "--step", "200")[1] == ""
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()
