"""Faults around the writer (issue 21, points 9, 10 and 11): a writer that falls behind still checks every
step for NaN/Inf; a dump request for a tensor over the caps makes no copy of it; a run folder deleted under a
running job is noticed, said once, and written again."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import threading

import numpy as np
import pandas as pd
import pytest
from poison_model import make_model, train_step
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import trainmon
from trainmon.run.anomaly_table import read_anomalies
from trainmon.run.columnar import segments
from trainmon.run.dumps import DumpRequest, append_request, list_dumps
from trainmon.run.layout import anomalies_rank_dir, rank_dir, stats_rank_dir, steps_rank_dir, summary_file
from trainmon.run.manifest import read_manifest
from trainmon.run.records import Derived, StepRecord
from trainmon.run.statstore import read_stats
from trainmon.run.steptable import read_steps
from trainmon.run.summary import read_summary
from trainmon.step import capture
from trainmon.writer import dumps as writer_dumps

# CSV and every tensor's scalars: the files these tests read (asked for since issue 33)
XY = {"xy_distribution": True, "all_xy": True, "wg_distribution": True, "format": ["tensorboard", "csv"],
      "tensorboard_tensors": "all"}  # fmt: skip


# -- 9: a writer backlog never skips the NaN check -----------------------------------------------------------


class Stalled:
    """A sink standing for storage that stalls (a hung network file system): each write waits for ``go``."""

    def __init__(self) -> None:
        self.go = threading.Event()

    def write(self, record: StepRecord, derived: Derived) -> None:
        self.go.wait(60)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.mark.timeout(120)
def test_a_nan_step_the_writer_had_no_room_for_is_still_checked_alerted_and_recorded(tmp_path, caplog):
    run = tmp_path / "run"
    alerts: list[trainmon.Alert] = []
    model, optimizer = make_model()
    mon = trainmon.attach(model, optimizer, config={**XY, "alert": {"rate_limit_s": 0}}, logdir=run,
                          on_alert=alerts.append)  # fmt: skip
    stalled = Stalled()
    mon.writer.sinks.insert(0, stalled)
    with caplog.at_level(logging.WARNING, "trainmon"):
        for step in range(60):
            train_step(model, optimizer, step, poison=step == 45)
        assert mon.writer.dropped >= 60 - 33  # everything past the queue (32) and the step being written
        assert mon.flush(0.0) is False  # still stalled; the dropped steps are checked meanwhile
        deadline = threading.Event()
        for _ in range(300):  # the check runs on its own thread, which never waits for the disk
            if any(a.step == 45 for a in alerts):
                break
            deadline.wait(0.05)
        alert = next(a for a in alerts if a.step == 45)
        assert "NaN at step 45" in alert.text and "statistics were not written" in alert.text
        found = mon._anomalies.take_non_finite()  # what on_nan acts on
        assert found is not None and found.step == 45
        stalled.go.set()
        mon.close()
    recorded = [a for a in read_anomalies(run, 0) if a.step == 45]
    assert {a.rule for a in recorded} == {"nan"} and any(a.origin for a in recorded)
    assert 45 not in set(pd.read_csv(rank_dir(run, 0) / "actv.csv")["step"])  # its output was dropped
    said = [r.getMessage() for r in caplog.records]
    assert any("dropped step 32 of rank 0" in m and "NaN/Inf counters are checked" in m for m in said)
    assert any(f"{mon.writer.dropped} of 60 steps were dropped" in m for m in said)  # the total, at close


FIRST_STEP = """
import sys, torch, trainmon
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
mon = trainmon.attach(model, optimizer, logdir=sys.argv[1], xy_distribution=True)
loaded = set(sys.modules)
model(torch.randn(2, 8)).sum().backward()
optimizer.step()
assert mon.flush(60)
print(sorted(m for m in set(sys.modules) - loaded if m.split(".")[0] in ("pandas", "pyarrow")))
mon.close()
"""


@pytest.mark.timeout(120)
def test_the_writer_threads_first_step_imports_nothing_heavy(tmp_path):
    """pyarrow imports pandas the first time it builds an array (0.3-0.4 s on two cores): done on the writer
    thread at the first step, that stall filled the 32-step queue of a fast loop and dropped steps 32.. of
    every such job. It happens when the columnar writers are made, at attach."""
    script = tmp_path / "first_step.py"
    script.write_text(FIRST_STEP)
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "run")], capture_output=True, text=True,
                         timeout=100, env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


# -- 10: dump caps apply before copying ----------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_dump_over_the_step_cap_is_skipped_before_any_copy(tmp_path, monkeypatch, caplog):
    """With a 6 KiB step cap, fc2.weight (4 x 256 float32, 4 KiB) is dumped once and fc1.weight (256 x 8,
    8 KiB) never: neither it (nor its gradient or Adam state) nor anything past the cap is copied."""
    run = tmp_path / "run"
    monkeypatch.setattr(writer_dumps, "DEFAULT_MAX_BYTES_PER_STEP", 6 << 10)
    copies: list[int] = []
    real = capture.copy_to_host

    def counting(tensor):
        copies.append(tensor.numel() * tensor.element_size())
        return real(tensor)

    monkeypatch.setattr(capture, "copy_to_host", counting)
    model, optimizer = make_model(hidden=256)
    config = {**XY, "mv_distribution": True, "param_distribution": True}
    mon = trainmon.attach(model, optimizer, config=config, logdir=run)
    with mon, caplog.at_level(logging.WARNING):
        train_step(model, optimizer, 0)
        append_request(run, DumpRequest.new("fc*.weight", step=2))  # polled as step 2 is armed
        train_step(model, optimizer, 1)
        train_step(model, optimizer, 2)
        mon.flush()
    assert copies == [4096]  # nothing over the cap was copied
    assert [(e.kind, e.name) for e in list_dumps(run)] == [("grad_unreduced", "fc2.weight")]
    said = [r.getMessage() for r in caplog.records]
    assert any("'fc1.weight' (8192 bytes) at step 2 skipped before copying it: the step cap of 6144" in m
               for m in said)  # fmt: skip


# -- 11: a deleted run folder is noticed ---------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_run_folder_deleted_under_the_job_is_said_once_and_written_again(tmp_path, caplog):
    run = tmp_path / "run"
    model, optimizer = make_model()
    with caplog.at_level(logging.WARNING, "trainmon"):
        mon = trainmon.attach(model, optimizer, config=XY, logdir=run)
        for step in range(3):
            train_step(model, optimizer, step)
        assert mon.flush(30)
        shutil.rmtree(run)
        for step in range(3, 7):
            train_step(model, optimizer, step, poison=step == 5)
        mon.close()
    said = [r.getMessage() for r in caplog.records if "was deleted" in r.getMessage()]
    assert said == [f"trainmon: {run} was deleted while this job was writing to it; writing there again from "
                    "now on (what it held is gone)"]  # fmt: skip
    acc = EventAccumulator(str(rank_dir(run, 0)), size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("actv/fc1.output/max")] == [3, 4, 5, 6]
    assert sorted(set(pd.read_csv(rank_dir(run, 0) / "actv.csv")["step"])) == [3, 4, 5, 6]
    frame = read_stats(run, 0, ("max", "nans"))  # the statistics store: every tensor of every new step
    assert frame.steps.tolist() == [3, 4, 5, 6] and not np.isnan(frame.values["nans"]).any()
    assert ("actv", "fc1.output") in frame.tensors
    assert min(a.step for a in read_anomalies(run, 0)) == 5
    assert read_steps(run, 0).column("step").to_pylist() == [3, 4, 5, 6]
    summary = read_summary(summary_file(run, 0))  # the job's own summary, written again
    assert summary.last_step == 6 and summary.first["nan"].step == 5
    for partition in (stats_rank_dir(run, 0), anomalies_rank_dir(run, 0), steps_rank_dir(run, 0)):
        assert segments(partition) and all(s.sealed for s in segments(partition)), partition
    manifest = read_manifest(run)
    assert manifest["recreated_at_step"] == 3 and manifest["last_step"] == 6
    assert "fc1.output" in manifest["names"]["actv"]
