"""A training job killed with SIGKILL mid-run leaves every output readable up to whole steps: the statistics
store and anomaly records (Arrow streams with maybe a torn last batch), the per-step table, the summaries
(always whole documents), the TensorBoard events and the CSV; the next writer seals what the killed job left
open, after which DuckDB reads it all. The writer process outlives the job by the time it takes to write what
it was handed: it then closes the outputs it writes (the manifest says ``closed``)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import numpy as np
import pandas as pd
import pytest

from trainmon.anomaly.log import AnomalyLog
from trainmon.run.anomaly_table import read_anomalies
from trainmon.run.columnar import segments
from trainmon.run.layout import anomalies_rank_dir, stats_dir, stats_rank_dir, steps_rank_dir, summary_file
from trainmon.run.manifest import read_manifest
from trainmon.run.records import NON_FINITE_RULES
from trainmon.run.statstore import read_stats
from trainmon.run.steptable import read_steps
from trainmon.run.summary import read_summary
from trainmon.run.timing import TIMES
from trainmon.writer.statstore import StatStoreSink

NAN_STEP = 15

# Trains until killed; from NAN_STEP on, one layer's output is NaN at every step (anomaly records each step).
WORKER = f"""
import sys, time, torch
import trainmon
torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(6)])
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
mon = trainmon.attach(model, opt, logdir=sys.argv[1], xy_distribution=True, wg_distribution=True,
                      format=["tensorboard", "csv"], tensorboard_tensors="all")
def poison(module, inputs, output):
    return output * float("nan") if step >= {NAN_STEP} else output
model[2].register_forward_hook(poison)
step = 0
while True:
    loss = model(torch.randn(8, 16)).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    step += 1
    time.sleep(0.002)
"""


def _kill_mid_run(run: Path, tmp_path: Path, after_step: int) -> str:
    """Run the worker until it is past ``after_step``, kill it; what it logged."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = tmp_path / "worker.log"
    with open(log, "wb") as stderr:
        _run_and_kill(script, run, env, stderr, after_step)
    return log.read_text(errors="replace")


_DROPPED = re.compile(r"dropped step (\d+) of rank 0")
_CAUGHT_UP = re.compile(r"step\(s\) were dropped \(steps (\d+)\.\.(\d+)\)")


def _dropped(log: str) -> list[tuple[int, float]]:
    """The step ranges the worker's writer said it dropped while behind (the last one open when it was killed
    before catching up)."""
    ranges: list[list[float]] = []
    for line in log.splitlines():
        if m := _DROPPED.search(line):
            ranges.append([int(m.group(1)), float("inf")])
        elif (m := _CAUGHT_UP.search(line)) and ranges:
            ranges[-1][1] = int(m.group(2))
    return [(int(lo), hi) for lo, hi in ranges]


def _run_and_kill(script: Path, run: Path, env: dict, stderr, after_step: int) -> None:
    proc = subprocess.Popen([sys.executable, str(script), str(run)], env=env, stderr=stderr)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                s = read_summary(summary_file(run, 0))
            except ValueError:
                pytest.fail("a torn summary was read while the job ran")
            if s is not None and (s.last_step or 0) >= after_step:
                break
            assert proc.poll() is None, "the worker ended on its own"
            time.sleep(0.05)
        else:
            pytest.fail("the worker did not reach the step in time")
        time.sleep(0.013 * (after_step % 7))  # somewhere inside a later step
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    # the writer process writes what the job handed it, then closes its outputs, the manifest last
    deadline = time.monotonic() + 30
    while "closed" not in (read_manifest(run) or {}) and time.monotonic() < deadline:
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("after_step", [NAN_STEP + 10, NAN_STEP + 23])
def test_sigkill_mid_run_leaves_every_output_readable_up_to_whole_steps(tmp_path, after_step):
    run = tmp_path / "run"
    log = _kill_mid_run(run, tmp_path, after_step)

    summary = read_summary(summary_file(run, 0))  # a whole document, of a whole step
    assert summary.last_step >= after_step and summary.first["nan"].step == NAN_STEP

    # whole steps only: every tensor at every step read (steps the writer dropped while behind are absent)
    frame = read_stats(run, 0, ("max", "nans"))
    tensors = len(frame.tensors)
    assert tensors >= 20 and not np.isnan(frame.values["nans"]).any()
    assert (np.diff(frame.steps) > 0).all() and frame.steps[-1] >= summary.last_step
    assert (frame.values["nans"][frame.steps >= NAN_STEP] > 0).any(axis=1).all()

    steps = read_steps(run, 0).to_pydict()  # one row per ended step, in order, after the step's statistics
    assert steps["step"] == sorted(set(steps["step"])) and steps["step"][-1] >= summary.last_step
    assert set(frame.steps.tolist()) - set(steps["step"]) <= {int(frame.steps[-1])}
    assert set(steps["step"]) <= set(frame.steps.tolist())
    records = read_anomalies(run, 0)
    per_step = {s: 0 for s in steps["step"]}
    for a in records:
        per_step[a.step] = per_step.get(a.step, 0) + 1
    # every ended step has exactly its records (a step killed between its records and its row may follow)
    assert [per_step[s] for s in steps["step"]] == steps["anomalies"]
    # a step the writer dropped while behind has no statistics and no row, but its NaN/Inf was still checked
    # and recorded (issue 21): such records only for the steps it said it dropped
    unended = set(per_step) - set(steps["step"]) - {int(frame.steps[-1])}
    dropped = _dropped(log)
    assert all(any(lo <= s <= hi for lo, hi in dropped) for s in unended), (sorted(unended), dropped)
    assert not unended & set(frame.steps.tolist())
    assert {a.rule for a in records if a.step in unended} <= set(NON_FINITE_RULES)
    assert summary.anomalies <= len(records) and min(a.step for a in records) == NAN_STEP

    # TensorBoard's reader returns whole steps and no error
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "rank_0"), size_guidance={"scalars": 0})
    acc.Reload()
    tags = acc.Tags()["scalars"]
    counts = {len(acc.Scalars(t)) for t in tags}
    stat_tags = [t for t in tags if not t.startswith("time/")]  # and the step's times, time/<part>_ms
    assert len(stat_tags) == tensors * 7 and len(tags) - len(stat_tags) == len(TIMES)
    assert max(counts) - min(counts) <= 1
    assert min(counts) >= len(steps["step"]) - 1

    # the CSV: complete lines parse; every step but the last written is whole
    for path in sorted((run / "rank_0").glob("*.csv")):
        data = path.read_bytes()
        data = data[: data.rfind(b"\n") + 1]
        path.write_bytes(data)
        csv = pd.read_csv(path)
        sizes = csv.groupby("step").size()
        assert (sizes.iloc[:-1] == sizes.iloc[0]).all()

    # the writer process closed the statistics store and the steps table (sealed); the next writer (a resumed
    # job) seals what the killed job itself left open (its anomaly records): then DuckDB reads every row
    assert read_manifest(run)["last_step"] >= summary.last_step
    assert all(s.sealed for s in segments(steps_rank_dir(run, 0)))
    assert any(not s.sealed for s in segments(anomalies_rank_dir(run, 0)))
    StatStoreSink(run, 0).close()
    AnomalyLog(run, 0).close()
    assert all(s.sealed for s in segments(stats_rank_dir(run, 0)))
    assert all(s.sealed for s in segments(anomalies_rank_dir(run, 0)))
    table = f"read_parquet('{stats_dir(run)}/*/*.parquet', hive_partitioning = true)"
    ((rows,),) = duckdb.sql(f"SELECT count(*) FROM {table}").fetchall()
    assert rows == tensors * len(frame.steps)
    assert read_stats(run, 0, ("max",)).steps.tolist() == frame.steps.tolist()
