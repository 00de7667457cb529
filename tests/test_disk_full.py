"""A run folder on a real tmpfs that fills up mid-run (issue 21, points 2, 3 and 14): a NaN still raises and
alerts (saying it could not be recorded, and recorded once there is room), every file stays readable by its
standard reader, and the steps after space returns are written after the whole records before the fault.
``attach`` on a full disk names the folder and what to do."""

from __future__ import annotations

import errno
import logging
import threading
from pathlib import Path

import duckdb
import numpy as np
import pandas as pd
import pytest
import torch
from conftest import FULL_OUTPUTS
from poison_model import make_model, train_step
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import trainmon
from tests.tmpfs import fill, tmpfs
from trainmon.anomaly.alerts import TrainingNaNError
from trainmon.anomaly.log import AnomalyLog
from trainmon.csvtb.tb2csv import read_scalars
from trainmon.gradprobe.reader import RankFingerprints
from trainmon.run.anomaly_table import read_anomalies
from trainmon.run.columnar import segments
from trainmon.run.layout import anomalies_rank_dir, rank_dir, stats_dir, stats_rank_dir, steps_rank_dir
from trainmon.run.records import STATS, Anomaly, Derived, Row, StepRecord
from trainmon.run.statstore import read_stats
from trainmon.writer.csv import CsvSink
from trainmon.writer.statstore import StatStoreSink
from trainmon.writer.tensorboard import TensorBoardSink

FULL = {
    "xy_distribution": True,
    "all_xy": True,
    "wg_distribution": True,
    "mv_distribution": True,
    "param_distribution": True,
    "grad_probe": {"enable": True, "grad_level": "L1", "sample_size": 16},
    **FULL_OUTPUTS,  # every file these tests read whole after a full disk (CSV, each tensor's scalars)
}


def _scalar_steps(run: Path) -> set[int]:
    acc = EventAccumulator(str(rank_dir(run, 0)), size_guidance={"scalars": 0})
    acc.Reload()
    return {e.step for e in acc.Scalars("actv/fc1.output/max")}


@pytest.mark.timeout(120)
def test_every_file_reads_whole_and_goes_on_after_the_disk_was_full(tmp_path, caplog):
    with tmpfs(tmp_path / "disk", "2m") as disk:
        run = disk / "run"
        model, optimizer = make_model()
        mon = trainmon.attach(model, optimizer, config=FULL, logdir=run)
        for step in range(5):
            train_step(model, optimizer, step)
        assert mon.flush(30)
        ballast = fill(disk)
        with caplog.at_level(logging.ERROR, "trainmon"):
            for step in range(5, 10):
                train_step(model, optimizer, step, poison=step == 7)
            assert mon.flush(30)
        assert any("No space left" in r.getMessage() or r.exc_info for r in caplog.records)
        ballast.unlink()  # space returns
        for step in range(10, 15):
            train_step(model, optimizer, step)
        mon.close()

        written = set(range(5)) | set(range(10, 15))
        outcome = {reader: _reads_whole(reader, run, written) for reader in _READERS}
        assert outcome == dict.fromkeys(_READERS, "ok")


def _reads_whole(reader: str, run: Path, written: set[int]) -> str:
    """"ok" when ``reader`` reads every output of its kind whole: the steps written before the disk filled
    and after space returned, nothing else, every record intact; else what went wrong."""
    everything = set(range(15))
    try:
        if reader == "EventAccumulator":  # TensorBoard's own reader
            assert written <= _scalar_steps(run) <= everything
        elif reader == "tb2csv":  # trainmon's reader, which stops at a CRC mismatch
            assert written <= set(read_scalars(rank_dir(run, 0))["actv/fc1.output/max"]) <= everything
        elif reader == "pandas":  # every CSV, each line one row of its own step
            for path in sorted(rank_dir(run, 0).glob("*.csv")):
                frame = pd.read_csv(path)
                assert written <= set(frame["step"]) <= everything, path.name
                assert frame["step"].is_monotonic_increasing, path.name
        elif reader == "statstore":  # every row whole and named, every step, sealed: DuckDB reads it too
            frame = read_stats(run, 0, ("max", "nans"))
            assert len(frame.tensors) >= 8 and all(kind and name for kind, name in frame.tensors)
            assert written <= set(frame.steps.tolist()) <= everything
            assert (np.diff(frame.steps) > 0).all() and not np.isnan(frame.values["nans"]).any()
            for partition in (stats_rank_dir(run, 0), anomalies_rank_dir(run, 0), steps_rank_dir(run, 0)):
                assert all(s.sealed for s in segments(partition)), partition  # sealed once space returned
            table = f"read_parquet('{stats_dir(run)}/*/*.parquet', hive_partitioning = true)"
            per_step = "SELECT step, count(*), count(DISTINCT (kind, name)) FROM {} GROUP BY step"
            rows = duckdb.sql(per_step.format(table)).fetchall()
            assert {step for step, _, _ in rows} == set(frame.steps.tolist())
            assert {(n, d) for _, n, d in rows} == {(len(frame.tensors), len(frame.tensors))}
        elif reader == "gradprobe":  # every step line points at whole data
            probe = RankFingerprints(run, 0)
            assert written <= set(probe.steps) <= everything
            assert all(len(fingerprints) == 4 for _, fingerprints in probe)
        elif reader == "anomalies":  # the NaN of step 7 was recorded once there was room again
            assert 7 in {a.step for a in read_anomalies(run, 0) if a.rule in ("nan", "inf")}
    except Exception as e:  # noqa: BLE001 - the outcome names it
        return f"{type(e).__name__}: {e}"[:300]
    return "ok"


_READERS = ("EventAccumulator", "tb2csv", "pandas", "statstore", "gradprobe", "anomalies")


@pytest.mark.timeout(120)
def test_a_nan_on_a_full_disk_raises_and_alerts_and_is_recorded_when_space_returns(tmp_path):
    alerts: list[trainmon.Alert] = []
    with tmpfs(tmp_path / "disk", "2m") as disk:
        run = disk / "run"
        model, optimizer = make_model()
        config = {**FULL, "alert": {"on_nan": "raise", "rate_limit_s": 0}}
        mon = trainmon.attach(model, optimizer, config=config, logdir=run, on_alert=alerts.append)
        for step in range(3):
            train_step(model, optimizer, step)
        assert mon.flush(30)
        ballast = fill(disk)
        with pytest.raises(TrainingNaNError, match="at step 3 on rank 0"):
            train_step(model, optimizer, 3, poison=True)
        assert [a.step for a in alerts] == [3]
        assert "not recorded yet" in alerts[0].text and "No space left on device" in alerts[0].text
        assert not any(a.step == 3 for a in read_anomalies(run, 0))
        ballast.unlink()
        mon.close()  # kept in memory until now: written once there is room
        recorded = [a for a in read_anomalies(run, 0) if a.step == 3]
        assert {a.rule for a in recorded} >= {"nan"} and any(a.origin for a in recorded)


@pytest.mark.timeout(60)
def test_attach_on_a_full_disk_names_the_folder_and_what_to_do(tmp_path):
    with tmpfs(tmp_path / "disk", "1m") as disk:
        fill(disk)
        model, optimizer = make_model()
        with pytest.raises(OSError) as caught:
            trainmon.attach(model, optimizer, config=FULL, logdir=disk / "run")
        assert caught.value.errno == errno.ENOSPC
        text = str(caught.value)
        assert f"cannot write the run folder {disk / 'run'}" in text
        assert "free space on its disk" in text and "logdir=" in text


# -- each writer on its own: a step too big for the room left is cut back off, the next one follows it


def _record(step: int, n: int = 300) -> StepRecord:
    shape, dtype = torch.Size([4, 8]), torch.float32
    rows = tuple(Row("actv", f"layers.{i}.mlp.output", 0, 0, "forward", shape, dtype) for i in range(n))
    partials = np.tile(np.array([32.0, 1.0, 0.0, 0.0, -1.5, 2.5, 3.0, 9.0]), (n, 1))
    return StepRecord(step, 0, rows, partials, 1.75e9 + step)


def _write(writer: str, target: object, step: int) -> None:
    record = _record(step)
    if writer == "anomalies":
        rows = enumerate(record.rows)
        target.write_step(step, [Anomaly(step, 0, "actv", r.name, "nans", 1, "nan", seq=i) for i, r in rows])
    else:
        target.write(record, Derived(record))


def _steps_read(writer: str, run: Path) -> list[int]:
    if writer == "csv":
        return sorted(set(pd.read_csv(rank_dir(run, 0) / "actv.csv")["step"]))
    if writer == "tensorboard":
        acc = EventAccumulator(str(rank_dir(run, 0)), size_guidance={"scalars": 0})
        acc.Reload()
        return sorted({e.step for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)})
    if writer == "statstore":
        frame = read_stats(run, 0, ("max",))
        assert len(frame.tensors) == 300 and not np.isnan(frame.values["max"]).any()  # whole steps only
        return frame.steps.tolist()
    return sorted({a.step for a in read_anomalies(run, 0)})


@pytest.mark.parametrize("writer", ["csv", "tensorboard", "statstore", "anomalies"])
@pytest.mark.timeout(60)
def test_a_write_the_disk_cuts_short_is_cut_back_off(tmp_path, writer):
    with tmpfs(tmp_path / "disk", "1m") as disk:
        run = disk / "run"
        target = {
            "csv": lambda: CsvSink(rank_dir(run, 0), STATS),
            "tensorboard": lambda: TensorBoardSink(rank_dir(run, 0), STATS),
            "statstore": lambda: StatStoreSink(run, 0),
            "anomalies": lambda: AnomalyLog(run, 0, max_per_step=1000),
        }[writer]()
        _write(writer, target, 0)
        ballast = fill(disk)  # the file's last page has room for part of the next step only
        failed = None
        try:
            _write(writer, target, 1)  # anomalies: kept in memory
        except OSError as e:
            failed = e
        ballast.unlink()
        _write(writer, target, 2)
        target.close()
        assert _steps_read(writer, run) == ([0, 1, 2] if writer == "anomalies" else [0, 2])
        if writer != "anomalies":
            assert failed is not None and failed.errno == errno.ENOSPC
            assert failed.filename and Path(failed.filename).is_relative_to(run)  # the file is named


@pytest.mark.timeout(60)
def test_a_seal_the_full_disk_refuses_keeps_the_stream_and_is_made_once_there_is_room(tmp_path, caplog):
    """The statistics store seals a stream into Parquet when a step leaves its segment; a full disk refuses
    the Parquet file: the stream stays as it was, read whole, and it is sealed at close once there is room
    (not only by the next job to write the run)."""
    with tmpfs(tmp_path / "disk", "1m") as disk:
        run = disk / "run"
        sink = StatStoreSink(run, 0)
        _write("statstore", sink, 0)
        _write("statstore", sink, 1)
        ballast = fill(disk)
        with caplog.at_level(logging.WARNING, "trainmon"):
            with pytest.raises(OSError):
                _write("statstore", sink, 1000)  # ends the stream of segment 0 (its seal fails), and fails
            for _ in range(1200):  # the seal runs in the background (behind other seals of the process)
                if any("stays readable" in r.getMessage() for r in caplog.records):
                    break
                threading.Event().wait(0.05)
        said = [r.getMessage() for r in caplog.records if "stays readable" in r.getMessage()]
        assert len(said) == 1 and "No space left on device" in said[0]
        # segment 0 unsealed; and, when the failed seal's partial file was removed before step 1000's stream
        # was opened (a race with the background seal), that stream too, holding nothing
        live = [(s.sealed, s.lo) for s in segments(stats_rank_dir(run, 0))]
        assert live in ([(False, 0)], [(False, 0), (False, 1000)]), live
        assert read_stats(run, 0, ("max",)).steps.tolist() == [0, 1]
        ballast.unlink()
        _write("statstore", sink, 1001)
        sink.close()
        found = segments(stats_rank_dir(run, 0))
        assert [(s.sealed, s.lo, s.hi) for s in found] == [(True, 0, 1), (True, 1001, 1001)]
        assert read_stats(run, 0, ("max",)).steps.tolist() == [0, 1, 1001]
