"""The default run directory, one folder per job: ranks that attach seconds apart with no ``logdir`` write
into one run directory.

Two real 2-process jobs on 127.0.0.1, each with rank 1 attaching ~2.5 s after rank 0 (so their clocks name
different seconds): one whose gloo process group is up when they attach, one under torchrun's static
rendezvous (``TORCHELASTIC_RUN_ID=none``) with no process group at all, run twice on the same master port
(two jobs must not share a folder).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from launch import free_port

from trainmon import rundir
from trainmon.run.statstore import read_stats

# rank 1 attaches this long after rank 0: the two clocks name different seconds
LATE_S = 2.5

TRAIN = """
import os, sys, time
import torch
import trainmon

def train(rank, late_s):
    torch.set_num_threads(1)
    if rank == 1:
        time.sleep(late_s)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = trainmon.attach(model, optimizer, config={"wg_distribution": True})  # no logdir
    for _ in range(2):
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    monitor.close()
    return monitor.run_dir
"""

PROCESS_GROUP_WORKER = TRAIN + textwrap.dedent(
    """
    import datetime
    import torch.distributed as dist
    import torch.multiprocessing as mp

    def worker(rank, port, late_s):
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
            timeout=datetime.timedelta(seconds=60),
        )
        train(rank, late_s)
        dist.barrier()
        dist.destroy_process_group()

    if __name__ == "__main__":
        mp.spawn(worker, args=(int(sys.argv[1]), float(sys.argv[2])), nprocs=2, join=True)
    """
)

TORCHRUN_WORKER = TRAIN + textwrap.dedent(
    """
    if __name__ == "__main__":  # no process group: ranks know only torchrun's environment
        run_dir = train(int(os.environ["RANK"]), float(sys.argv[1]))
        with open(run_dir / f"env_rank{os.environ['RANK']}.txt", "w") as f:
            f.write(os.environ["TORCHELASTIC_RUN_ID"])
    """
)


def _env(runs: Path) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MONITOR_OUTPUT_DIR": str(runs)}
    for key in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", "SLURM_JOB_ID", "WORLD_SIZE"):
        env.pop(key, None)
    return env


def _folders(runs: Path) -> list[Path]:
    return sorted(p for p in runs.iterdir() if p.is_dir())


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_ranks_with_a_process_group_attaching_seconds_apart_share_one_folder(tmp_path):
    runs = tmp_path / "runs"
    script = tmp_path / "pg_worker.py"
    script.write_text(PROCESS_GROUP_WORKER)
    proc = subprocess.run(
        [sys.executable, str(script), str(free_port()), str(LATE_S)],
        env=_env(runs), capture_output=True, text=True, timeout=100,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    folders = _folders(runs)
    assert len(folders) == 1, folders
    assert sorted(p.name for p in folders[0].glob("rank_*")) == ["rank_0", "rank_1"]
    # rank 1's statistics in the shared folder (the statistics store: no CSV by default since issue 33)
    assert ("grad_reduced", "0.weight") in read_stats(folders[0], 1, ("norm",)).tensors


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_torchrun_static_rendezvous_without_process_group_one_folder_per_job(tmp_path):
    """``torchrun --master-port`` (static rendezvous) sets TORCHELASTIC_RUN_ID to ``none`` in every job: two
    jobs on the same port get two folders, each holding both ranks."""
    runs = tmp_path / "runs"
    script = tmp_path / "torchrun_worker.py"
    script.write_text(TORCHRUN_WORKER)
    port = free_port()
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", str(port), str(script), str(LATE_S),
    ]  # fmt: skip
    for job in range(2):
        proc = subprocess.run(command, env=_env(runs), capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr[-4000:]
        folders = _folders(runs)
        assert len(folders) == job + 1, folders
    for folder in folders:
        assert sorted(p.name for p in folder.glob("rank_*")) == ["rank_0", "rank_1"], folder
        assert (folder / "env_rank0.txt").read_text() == (folder / "env_rank1.txt").read_text() == "none"


def test_launcher_job_names():
    assert rundir.launcher_job_name({"TORCHELASTIC_RUN_ID": "exp/7 a"}) == "torchrun-exp_7_a"
    assert rundir.launcher_job_name({"TORCHELASTIC_RUN_ID": "none"}) is None  # names no job
    assert rundir.launcher_job_name({"TORCHELASTIC_RUN_ID": "none", "SLURM_JOB_ID": "812"}) == "slurm-812"
    assert rundir.launcher_job_name({"SLURM_JOB_ID": "812", "SLURM_STEP_ID": "3"}) == "slurm-812-3"
    assert rundir.launcher_job_name({}) is None


def test_without_store_the_launcher_id_names_the_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path))
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "5f0c2a")
    assert rundir.job_run_dir() == tmp_path / "torchrun-5f0c2a"


def test_several_ranks_and_nothing_to_agree_through_warns(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path))
    for key in ("TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setattr(rundir.time, "strftime", lambda fmt: "20250102-030405")
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        assert rundir.job_run_dir() == tmp_path / "20250102-030405"
    assert "Pass logdir= to trainmon.attach" in caplog.text
