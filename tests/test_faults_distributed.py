"""Issue 21's acceptance for writes: two processes (plain DDP, and DeepSpeed ZeRO-2, on gloo) write their
run to a small real tmpfs that fills up mid-run (tests/faults_worker.py). A NaN that appears while the disk is
full still raises on every rank (``on_nan: raise``), and once space returns every CSV parses with pandas,
every event file reads with TensorBoard's EventAccumulator to the last step written, the statistics store
(the columnar table the TensorBoard plugin reads) reads whole with trainmon's reader, the plugin and DuckDB,
every stream of it sealed, and the NaN is recorded."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import duckdb
import numpy as np
import pandas as pd
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from trainmon_tb.stat_index import StatIndex

from tests.faults_worker import FILL_AGAIN_AT, FILL_AT, FREE_AT, NAN_AT
from tests.tmpfs import tmpfs
from trainmon.run.anomaly_table import read_anomalies
from trainmon.run.columnar import segments
from trainmon.run.layout import rank_dir, stats_dir, stats_rank_dir
from trainmon.run.statstore import read_stats

WORKER = Path(__file__).with_name("faults_worker.py")
# written whole: before the disk filled, and after space returned until it filled again
WRITTEN = set(range(FILL_AT)) | set(range(FREE_AT, FILL_AGAIN_AT))
# torch + gloo may abort in C++ teardown after the work is done (see tests/test_deepspeed.py): run once more
_TEARDOWN_ABORT = "terminate called without an active exception"


def _launch(mode: str, disk: Path, out: Path) -> None:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        str(WORKER), "--mode", mode, "--disk", str(disk), "--out", str(out),
    ]  # fmt: skip
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for attempt in range(2):
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
        aborted = _TEARDOWN_ABORT in proc.stderr and "Traceback" not in proc.stderr.split(_TEARDOWN_ABORT)[0]
        if proc.returncode == 0 or not aborted or attempt:
            break
        shutil.rmtree(disk / "run", ignore_errors=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def _steps(events_dir: Path) -> set[int]:
    acc = EventAccumulator(str(events_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {e.step for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["ddp", "zero2"])
def test_a_full_disk_on_two_ranks_loses_no_nan_and_no_file(tmp_path, mode):
    out = tmp_path / "report"
    with tmpfs(tmp_path / "disk", "3m") as disk:
        _launch(mode, disk, out)
        run = disk / "run"
        for rank in (0, 1):
            report = json.loads(Path(f"{out}.rank{rank}.json").read_text())
            assert f"at step {NAN_AT} on rank" in report["raised"], (rank, report)
            # every event file of the rank reads to the last step written, past the fault
            assert WRITTEN <= _steps(rank_dir(run, rank)) <= set(range(NAN_AT + 1)), rank
            csvs = sorted(rank_dir(run, rank).glob("*.csv"))
            assert {p.stem for p in csvs} >= {"actv", "grad_unreduced", "param_origin", "exp_avg"}
            for path in csvs:
                steps = set(pd.read_csv(path)["step"])
                assert WRITTEN <= steps <= set(range(NAN_AT + 1)), (rank, path.name)
            nan = [a for a in read_anomalies(run, rank) if a.rule in ("nan", "inf")]
            assert min(a.step for a in nan) == NAN_AT, rank  # kept in memory, written once there was room
        tensors, fc1 = {}, {}
        for rank in (0, 1):  # the statistics store: every tensor of every step written, each row named
            frame = read_stats(run, rank, ("max", "nans"))
            assert WRITTEN <= set(frame.steps.tolist()) <= set(range(NAN_AT + 1)), rank
            assert frame.tensors and all(kind and name for kind, name in frame.tensors), rank
            assert not np.isnan(frame.values["nans"]).any(), rank  # whole steps only
            assert all(s.sealed for s in segments(stats_rank_dir(run, rank))), rank  # once space returned
            tensors[rank] = (len(frame.tensors), frame.steps.tolist())
            # under DDP the names start with "module."
            fc1[rank] = next(n for k, n in frame.tensors if k == "actv" and n.endswith("fc1.output"))
        index = StatIndex(run)  # what the TensorBoard plugin reads it with
        index.refresh()
        assert index.summary()["ranks"] == [0, 1]
        for rank in (0, 1):
            steps, _ = index.series(rank, "actv", fc1[rank], "max")
            assert WRITTEN <= set(steps.tolist()) <= set(range(NAN_AT + 1)), rank
        table = f"read_parquet('{stats_dir(run)}/*/*.parquet', hive_partitioning = true)"
        per_step = "SELECT rank, step, count(*) FROM {} GROUP BY rank, step ORDER BY rank, step"
        rows = duckdb.sql(per_step.format(table)).fetchall()
        assert rows == [(r, step, n) for r, (n, steps) in tensors.items() for step in steps]
