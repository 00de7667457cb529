"""The writer process (issue 28, point 2): the format outputs (TensorBoard, CSV, the statistics store, the
manifest) are written by a child process fed by the writer thread, so that their encoding never takes the GIL
from the training loop. It writes what the writer thread wrote; its warnings are logged in the training
process; a writer process killed mid-run is said once and the outputs go on from the writer thread; one that
stalls never holds training up; a training process killed with SIGKILL leaves it to write everything it was
handed; one that cannot start leaves the outputs to the writer thread, said once. Real child processes, real
signals, real files."""

from __future__ import annotations

import errno
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import FULL_OUTPUTS
from poison_model import make_model, train_step
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import trainmon
from trainmon.config import load_config
from trainmon.run.anomaly_table import read_anomalies
from trainmon.run.columnar import segments
from trainmon.run.layout import rank_dir, stats_rank_dir, steps_rank_dir, summary_file
from trainmon.run.manifest import read_manifest
from trainmon.run.records import Kind, Row, StepRecord
from trainmon.run.statstore import read_stats
from trainmon.run.steptable import read_steps
from trainmon.run.summary import read_summary
from trainmon.run.timetable import read_timing
from trainmon.writer import process as process_module
from trainmon.writer.outputs import plan_sinks
from trainmon.writer.sinkplan import open_sinks
from trainmon.writer.thread import WriterThread

# the outputs these tests compare: CSV and every tensor's scalars (issue 33 made them a choice)
XY = {"xy_distribution": True, "all_xy": True, "wg_distribution": True, **FULL_OUTPUTS}
TESTS = Path(__file__).resolve().parent


@pytest.fixture
def fresh_process(monkeypatch):
    """A writer process of this test's own (it kills or stops it): later attaches start another one."""
    monkeypatch.setattr(process_module, "_shared", None)


def _pid(mon) -> int:
    pid = mon._outputs.process_pid
    assert pid is not None, "the outputs are not written by a writer process"
    return pid


def _event_steps(run: Path) -> list[int]:
    acc = EventAccumulator(str(rank_dir(run, 0)), size_guidance={"scalars": 0})
    acc.Reload()
    return sorted({e.step for e in acc.Scalars("actv/fc1.output/max")})


def _csv_steps(run: Path) -> list[int]:
    return sorted(set(pd.read_csv(rank_dir(run, 0) / "actv.csv")["step"]))


def _store_steps(run: Path) -> list[int]:
    frame = read_stats(run, 0, ("max", "nans"))
    assert not np.isnan(frame.values["nans"]).any()  # whole steps only
    return frame.steps.tolist()


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.timeout(120)
def test_the_writer_process_writes_what_the_writer_thread_writes(tmp_path, monkeypatch):
    """The same training with ``TRAINMON_WRITER=thread``: the same CSV bytes, TensorBoard scalars, statistics
    store and manifest names; and the writer process is a ``trainmon.writer.child`` without torch."""
    config = {**XY, "mv_distribution": True, "param_distribution": True}
    for mode in ("process", "thread"):
        monkeypatch.setenv("TRAINMON_WRITER", mode)
        model, optimizer = make_model()
        with trainmon.attach(model, optimizer, config=config, logdir=tmp_path / mode) as mon:
            if mode == "process":
                pid = _pid(mon)
                assert "trainmon.writer.child" in Path(f"/proc/{pid}/cmdline").read_text()
                assert "torch" not in Path(f"/proc/{pid}/maps").read_text()  # no torch library loaded
            else:
                assert mon._outputs.process_pid is None
            for step in range(6):
                train_step(model, optimizer, step, poison=step == 4)
    process, thread = tmp_path / "process", tmp_path / "thread"
    csvs = sorted(p.name for p in rank_dir(thread, 0).glob("*.csv"))
    assert csvs == sorted(p.name for p in rank_dir(process, 0).glob("*.csv")) and "actv.csv" in csvs
    for name in csvs:
        assert (rank_dir(process, 0) / name).read_bytes() == (rank_dir(thread, 0) / name).read_bytes(), name
    accs = []
    for run in (process, thread):
        acc = EventAccumulator(str(rank_dir(run, 0)), size_guidance={"scalars": 0})
        acc.Reload()
        accs.append(acc)
    tags = accs[1].Tags()["scalars"]
    assert len(tags) > 50 and accs[0].Tags()["scalars"] == tags
    for tag in tags:
        got, want = ([(e.step, e.value) for e in a.Scalars(tag)] for a in accs)
        if tag.startswith("time/"):  # the step times of two runs: the same steps, their own values
            assert [s for s, _ in got] == [s for s, _ in want] == list(range(6)), tag
            continue
        np.testing.assert_array_equal(np.array(got), np.array(want))
    stores = [read_stats(run, 0, ("min", "max", "norm", "nans")) for run in (process, thread)]
    assert stores[0].tensors == stores[1].tensors and stores[0].steps.tolist() == list(range(6))
    for stat in ("min", "max", "norm", "nans"):
        np.testing.assert_array_equal(stores[0].values[stat], stores[1].values[stat])
    manifests = [read_manifest(run) for run in (process, thread)]
    assert manifests[0]["names"] == manifests[1]["names"] and manifests[0]["last_step"] == 5
    assert all(segment.sealed for segment in segments(stats_rank_dir(process, 0)))
    # the step log (steps table, timing table, summary), which the writer process keeps: the same rows
    rows = [read_steps(run, 0).drop_columns(["wall_time"]).to_pydict() for run in (process, thread)]
    assert rows[0] == rows[1] and rows[0]["step"] == list(range(6)) and rows[0]["anomalies"][4] > 0
    assert [read_timing(run, 0)["step"].to_pylist() for run in (process, thread)] == [list(range(6))] * 2
    summaries = [read_summary(summary_file(run, 0)) for run in (process, thread)]
    assert [(s.steps, s.last_step, s.anomalies, s.counts) for s in summaries] == [
        (6, 5, summaries[1].anomalies, summaries[1].counts)
    ] * 2
    assert summaries[0].first["nan"].step == 4 and summaries[0].timed == 6


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["process", "thread"])
def test_a_failing_output_says_the_same_from_the_writer_process(tmp_path, monkeypatch, caplog, mode):
    """A CSV file that cannot be written (a folder in its place): the same error, with its traceback, in the
    training process's log, whichever writes it; the other outputs go on."""
    monkeypatch.setenv("TRAINMON_WRITER", mode)
    run = tmp_path / "run"
    (rank_dir(run, 0) / "actv.csv").mkdir(parents=True)
    model, optimizer = make_model()
    logged = caplog.at_level(logging.WARNING, "trainmon")
    with logged, trainmon.attach(model, optimizer, config=XY, logdir=run) as mon:
        for step in range(3):
            train_step(model, optimizer, step)
        assert mon.flush(30)  # the writer process's records are logged before its flush is confirmed
        errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    said = [r.getMessage() for r in errors]
    assert said == ["trainmon: sink CsvSink writing step 0 failed; training continues"]
    assert errors[0].exc_info is not None and "IsADirectoryError" in caplog.text
    assert _event_steps(run) == [0, 1, 2] and _store_steps(run) == [0, 1, 2]
    assert sorted(set(pd.read_csv(rank_dir(run, 0) / "grad_unreduced.csv")["step"])) == [0, 1, 2]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["process", "thread"])
def test_attach_on_a_run_folder_that_cannot_be_written_raises_the_same_error(tmp_path, monkeypatch, mode):
    """The writer process meets the error opening the outputs: attach raises it as the writer thread would,
    same type, errno, file and advice."""
    monkeypatch.setenv("TRAINMON_WRITER", mode)
    run = tmp_path / "run"
    run.mkdir()
    rank_dir(run, 0).write_text("a file where the rank's folder goes")
    model, optimizer = make_model()
    with pytest.raises(FileExistsError) as caught:
        trainmon.attach(model, optimizer, config=XY, logdir=run)
    assert caught.value.errno == errno.EEXIST
    assert caught.value.strerror == (
        f"trainmon.attach: cannot write the run folder {run}: File exists ({rank_dir(run, 0)}). To go on, "
        "check that it can be written, or pass logdir= naming a folder on another disk (format: api writes "
        "no files at all)"
    )


@pytest.mark.timeout(120)
def test_a_writer_process_killed_mid_run_is_said_once_and_the_outputs_go_on(tmp_path, caplog, fresh_process):
    run = tmp_path / "run"
    model, optimizer = make_model()
    with caplog.at_level(logging.WARNING, "trainmon"):
        mon = trainmon.attach(model, optimizer, config=XY, logdir=run)
        for step in range(5):
            train_step(model, optimizer, step)
        assert mon.flush(30)
        pid = _pid(mon)
        for step in range(5, 8):  # handed over, never confirmed: they may be lost with the process
            train_step(model, optimizer, step)
        while mon.writer.pending:
            time.sleep(0.01)
        os.kill(pid, signal.SIGKILL)
        while not mon._outputs.process.session.gone:
            time.sleep(0.01)
        for step in range(8, 12):
            train_step(model, optimizer, step, poison=step == 10)
        mon.close()
    said = [r.getMessage() for r in caplog.records if "ended unexpectedly" in r.getMessage()]
    assert said == [
        f"trainmon: the writer process (pid {pid}) ended unexpectedly (killed by SIGKILL); 3 steps handed to "
        "it since its last confirmed flush (steps 5..7) may be missing. The outputs are written from the "
        "writer thread from step 8 on; training goes on"
    ]
    assert mon._outputs.process_pid is None
    expected = {0, 1, 2, 3, 4, 8, 9, 10, 11}
    for steps in (_event_steps(run), _csv_steps(run), _store_steps(run)):
        assert expected <= set(steps) <= set(range(12)), steps
    assert all(segment.sealed for segment in segments(stats_rank_dir(run, 0)))  # the killed one's too
    manifest = read_manifest(run)
    assert manifest["last_step"] == 11 and "closed" in manifest and "fc1.output" in manifest["names"]["actv"]
    assert {a.step for a in read_anomalies(run, 0) if a.rule == "nan"} == {10, 11}
    # the step log goes on in the writer thread, from the summary the writer process left
    steps = read_steps(run, 0)["step"].to_pylist()
    assert expected <= set(steps) <= set(range(12)) and steps == sorted(steps)
    assert all(segment.sealed for segment in segments(steps_rank_dir(run, 0)))
    summary = read_summary(summary_file(run, 0))
    assert (summary.first_step, summary.last_step, summary.steps) == (0, 11, len(steps))
    assert summary.first["nan"].step == 10 and summary.counts["nan"] >= 2


@pytest.mark.timeout(120)
def test_a_writer_process_found_dead_at_close_is_said_and_the_run_closed(tmp_path, caplog, fresh_process):
    run = tmp_path / "run"
    model, optimizer = make_model()
    with caplog.at_level(logging.WARNING, "trainmon"):
        mon = trainmon.attach(model, optimizer, config=XY, logdir=run)
        for step in range(4):
            train_step(model, optimizer, step)
        assert mon.flush(30)
        pid = _pid(mon)
        os.kill(pid, signal.SIGKILL)
        while not mon._outputs.process.session.gone:
            time.sleep(0.01)
        mon.close()
    said = [r.getMessage() for r in caplog.records if "ended unexpectedly" in r.getMessage()]
    assert len(said) == 1 and "every step handed to it was confirmed written" in said[0], said
    assert _event_steps(run) == _csv_steps(run) == _store_steps(run) == list(range(4))
    assert all(segment.sealed for segment in segments(stats_rank_dir(run, 0)))  # sealed by the writer thread
    manifest = read_manifest(run)
    assert manifest["last_step"] == 3 and "closed" in manifest


@pytest.mark.timeout(120)
def test_a_stalled_writer_process_never_holds_training_up(tmp_path, caplog, fresh_process, monkeypatch):
    """The writer process stopped (SIGSTOP: storage that hangs): the pipe fills, the writer thread waits on
    it and the queue drops steps as it would for a stalled disk; the NaN of a dropped step is still found,
    alerted and noted for on_nan in the training process. Once it goes on, every accepted step is written."""
    monkeypatch.setattr(process_module, "PIPE_BYTES", 4096)  # fills in a few steps
    run = tmp_path / "run"
    alerts: list[trainmon.Alert] = []
    model, optimizer = make_model()
    mon = trainmon.attach(model, optimizer, config={**XY, "alert": {"rate_limit_s": 0}}, logdir=run,
                          on_alert=alerts.append)  # fmt: skip
    pid = _pid(mon)
    os.kill(pid, signal.SIGSTOP)
    try:
        with caplog.at_level(logging.WARNING, "trainmon"):
            for step in range(60):
                train_step(model, optimizer, step, poison=step == 45)
            assert mon.writer.dropped >= 15 and mon.flush(0.0) is False
            for _ in range(300):
                if any(a.step == 45 for a in alerts):
                    break
                time.sleep(0.05)
            alert = next(a for a in alerts if a.step == 45)
            assert "NaN at step 45" in alert.text and "statistics were not written" in alert.text
            found = mon._anomalies.take_non_finite()
            assert found is not None and found.step == 45
    finally:
        os.kill(pid, signal.SIGCONT)
    mon.close()
    accepted = mon.writer.submitted
    assert accepted + mon.writer.dropped == 60 and accepted <= 45
    assert _event_steps(run) == _csv_steps(run) == _store_steps(run) == list(range(accepted))
    # the records of the dropped step, which waited while the writer process was stopped, are in its summary
    summary = read_summary(summary_file(run, 0))
    assert summary.last_step == accepted - 1 and summary.first["nan"].step == 45
    assert read_steps(run, 0)["step"].to_pylist() == list(range(accepted))
    said = [r.getMessage() for r in caplog.records]
    assert any(f"dropped step {accepted} of rank 0" in m and "counters are checked" in m for m in said)


@pytest.mark.timeout(120)
def test_on_nan_raise_never_waits_on_a_stalled_writer(tmp_path, fresh_process, monkeypatch):
    """``on_nan: raise`` looks at each step's statistics itself: with the writer process stopped (storage that
    hangs), steps without a NaN go on at once, and the NaN step raises, naming where the NaN was born,
    after at most NAN_WAIT_S for the writer's rules (which never come). Waiting on the writer each step, as
    a flush does, would hang here for good."""
    from trainmon.writer import lifecycle

    monkeypatch.setattr(process_module, "PIPE_BYTES", 4096)  # fills in a few steps
    monkeypatch.setattr(lifecycle, "NAN_WAIT_S", 0.5)
    monkeypatch.setattr(lifecycle, "CLOSE_TIMEOUT_S", 1.0)
    model, optimizer = make_model()
    config = {**XY, "alert": {"on_nan": "raise"}}
    mon = trainmon.attach(model, optimizer, config=config, logdir=tmp_path / "run")
    pid = _pid(mon)
    os.kill(pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        for step in range(60):
            train_step(model, optimizer, step)
        assert mon.writer.dropped > 0  # the writer was stuck the whole time
        with pytest.raises(trainmon.TrainingNaNError) as raised:
            train_step(model, optimizer, 60, poison=True)
        assert time.monotonic() - start < 30
        assert "step 60" in str(raised.value) and "fc1" in str(raised.value)
    finally:
        os.kill(pid, signal.SIGCONT)
        mon.close()


@pytest.mark.timeout(120)
def test_ctrl_c_does_not_reach_the_writer_process_and_sigterm_ends_it_whole(tmp_path, caplog, fresh_process):
    """SIGINT (Ctrl-C reaches the terminal's whole process group) is the training script's to handle: the
    writer process goes on. SIGTERM ends it once it has written what it holds; the outputs go on from the
    writer thread."""
    run = tmp_path / "run"
    model, optimizer = make_model()
    with caplog.at_level(logging.WARNING, "trainmon"):
        mon = trainmon.attach(model, optimizer, config=XY, logdir=run)
        pid = _pid(mon)
        for step in range(3):
            train_step(model, optimizer, step)
        os.kill(pid, signal.SIGINT)
        for step in range(3, 5):
            train_step(model, optimizer, step)
        assert mon.flush(30) and _running(pid) and mon._outputs.process_pid == pid
        os.kill(pid, signal.SIGTERM)
        while not mon._outputs.process.session.gone:
            time.sleep(0.01)
        assert read_manifest(run)["last_step"] == 4 and "closed" in read_manifest(run)
        for step in range(5, 7):
            train_step(model, optimizer, step)
        mon.close()
    said = [r.getMessage() for r in caplog.records if "writer process" in r.getMessage()]
    assert said == [
        f"trainmon: the writer process (pid {pid}) ended unexpectedly (exit status 0); every step handed to "
        "it was confirmed written. The outputs are written from the writer thread from step 5 on; training "
        "goes on"
    ]
    assert _event_steps(run) == _csv_steps(run) == _store_steps(run) == list(range(7))
    assert read_manifest(run)["last_step"] == 6


def _records(steps: int) -> list[StepRecord]:
    """Steps whose rows change layout every other step (20 layouts around one that keeps coming back), with
    names no file system or UTF-8 makes easy, collectives, skips and a skip reason."""
    odd = ["fc1.output", "caf\u00e9.w", "lone\udc80surrogate", "nul\x00name", 'quote",comma', "x" * 300]
    shape, dtype = torch.Size([4, 2]), torch.float32
    base = tuple(Row(Kind.ACTV, name, 0, 0, "forward", shape, dtype) for name in odd)  # a Kind, not its text
    out = []
    for step in range(steps):
        rows = base
        if step % 2:
            extra = Row("grad_reduced", f"layer{step // 2}.weight", 1, step % 3, "optimizer", torch.Size([]),
                        torch.bfloat16)  # fmt: skip
            rows = (*base, extra)
        partials = np.arange(len(rows) * 8, dtype=np.float64).reshape(-1, 8) + step
        partials[:, 0] = 8
        partials[0, 1] = step % 5  # NaNs now and then
        collectives = np.arange(len(rows), dtype=np.int64)
        reason = "NaN on rank \udc81 3" if step == 7 else ""
        out.append(StepRecord(step, 0, rows, partials, 1.75e9 + step, step == 9, collectives, reason))
    return out


@pytest.mark.timeout(120)
def test_every_row_layout_and_name_reaches_the_writer_process_whole(tmp_path, fresh_process):
    """The records as the writer process decodes them make the same files as the same records written here:
    40 steps over 21 row layouts (so layouts leave both sides' caches and come back), odd names."""
    plan = {run: plan_sinks(load_config({"ndigits": None, **FULL_OUTPUTS}), tmp_path / run, 0, False, world=1)
            for run in ("process", "thread")}  # fmt: skip
    session = process_module.open_session(plan["process"], None, tmp_path / "process")
    ended = lambda *a: pytest.fail("the writer process ended")  # noqa: E731
    writers = {
        "process": WriterThread([process_module.ProcessSink(session, ended)], 64),
        "thread": WriterThread(open_sinks(plan["thread"]), 64),
    }
    for record in _records(40):
        for writer in writers.values():
            assert writer.submit(record)
    for writer in writers.values():
        assert writer.close(60)
    for name in ("actv.csv", "grad_reduced.csv"):
        process, thread = (rank_dir(tmp_path / run, 0) / name for run in ("process", "thread"))
        assert process.read_bytes() == thread.read_bytes() and len(thread.read_bytes()) > 1000, name
    stores = [read_stats(tmp_path / run, 0, ("max", "nans")) for run in ("process", "thread")]
    assert stores[0].tensors == stores[1].tensors and len(stores[0].tensors) == 26
    np.testing.assert_array_equal(stores[0].values["max"], stores[1].values["max"])


KILLED = """
import os, signal, sys, time
sys.path.insert(0, sys.argv[2])
import torch, trainmon
from conftest import FULL_OUTPUTS
from poison_model import make_model, train_step
torch.set_num_threads(1)
model, optimizer = make_model()
mon = trainmon.attach(model, optimizer, logdir=sys.argv[1], config={"xy_distribution": True, "all_xy": True,
                      "wg_distribution": True, "format": ["tensorboard", "csv"],
                      "tensorboard_tensors": "all"})
pid = mon._outputs.process_pid
os.kill(pid, signal.SIGSTOP)  # it is handed every step and writes none of them before the job is killed
for step in range(30):
    train_step(model, optimizer, step)
while mon.writer.pending:
    time.sleep(0.01)
print(pid, flush=True)
time.sleep(600)
"""


@pytest.mark.timeout(120)
def test_a_training_process_killed_leaves_the_writer_process_to_write_everything_it_was_handed(tmp_path):
    run = tmp_path / "run"
    script = tmp_path / "killed.py"
    script.write_text(KILLED)
    job = subprocess.Popen([sys.executable, str(script), str(run), str(TESTS)], stdout=subprocess.PIPE,
                           text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    try:
        pid = int(job.stdout.readline())
    finally:
        job.kill()
        job.wait(30)
    assert _running(pid) and "closed" not in (read_manifest(run) or {})
    os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + 60
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(pid)  # it wrote what it held and exited
    assert _event_steps(run) == _csv_steps(run) == _store_steps(run) == list(range(30))
    assert all(segment.sealed for segment in segments(stats_rank_dir(run, 0)))
    # the step log too: it was handed every step's end
    assert read_steps(run, 0)["step"].to_pylist() == list(range(30))
    assert all(segment.sealed for segment in segments(steps_rank_dir(run, 0)))
    assert read_summary(summary_file(run, 0)).last_step == 29
    manifest = read_manifest(run)
    assert manifest["last_step"] == 29 and "closed" in manifest


@pytest.mark.timeout(120)
@pytest.mark.parametrize("interpreter", ["/nonexistent/python3", "/bin/false"])
def test_a_writer_process_that_cannot_start_leaves_the_outputs_to_the_writer_thread(
    tmp_path, caplog, fresh_process, monkeypatch, interpreter
):
    """No usable interpreter, or one that fails at once (as an import error would): said once, and the
    writer thread writes the outputs as before."""
    monkeypatch.setattr(sys, "executable", interpreter)
    run = tmp_path / "run"
    model, optimizer = make_model()
    logged = caplog.at_level(logging.WARNING, "trainmon")
    with logged, trainmon.attach(model, optimizer, config=XY, logdir=run) as mon:
        assert mon._outputs.process_pid is None
        for step in range(3):
            train_step(model, optimizer, step)
    said = [r.getMessage() for r in caplog.records if "writer process" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("trainmon: the writer process could not be started (")
    assert interpreter in said[0] if "nonexistent" in interpreter else "exit status 1" in said[0]
    assert _event_steps(run) == _csv_steps(run) == _store_steps(run) == [0, 1, 2]


@pytest.mark.timeout(60)
def test_trainmon_writer_thread_keeps_the_outputs_in_the_writer_thread(tmp_path, caplog, monkeypatch):
    monkeypatch.setenv("TRAINMON_WRITER", "thread")
    model, optimizer = make_model()
    run = tmp_path / "run"
    logged = caplog.at_level(logging.WARNING, "trainmon")
    with logged, trainmon.attach(model, optimizer, config=XY, logdir=run) as mon:
        assert mon._outputs.process_pid is None and mon._outputs.sinks
        train_step(model, optimizer, 0)
    assert not caplog.records and _csv_steps(run) == [0]


@pytest.mark.timeout(120)
def test_the_monitors_of_a_process_share_one_writer_process(tmp_path):
    """Two monitors at once (two models), interleaved: one writer process; each run whole, closed in turn."""
    (a_model, a_opt), (b_model, b_opt) = make_model(), make_model(hidden=8)
    a = trainmon.attach(a_model, a_opt, config=XY, logdir=tmp_path / "a")
    b = trainmon.attach(b_model, b_opt, config=XY, logdir=tmp_path / "b")
    assert _pid(a) == _pid(b)
    for step in range(5):
        train_step(a_model, a_opt, step)
        train_step(b_model, b_opt, step)
    a.close()
    assert _csv_steps(tmp_path / "a") == list(range(5)) and "closed" in read_manifest(tmp_path / "a")
    for step in range(5, 7):
        train_step(b_model, b_opt, step)
    b.close()
    for run, steps in ((tmp_path / "a", list(range(5))), (tmp_path / "b", list(range(7)))):
        assert _event_steps(run) == _csv_steps(run) == _store_steps(run) == steps
    assert read_manifest(tmp_path / "b")["last_step"] == 6
