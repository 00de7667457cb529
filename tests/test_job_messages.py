"""Who says what in a job of several ranks (trainmon/joblog): a job-wide message (a config note, a target that
matches nothing) is said once for the job, by the rank that speaks for it; a message about one rank (a NaN it
found, a call that failed there) is said by that rank and names it; the run's first line, where the run is
and how to open it, is seen on stderr without any logging setup, once a job.

The two-process job runs with Python's default logging (no handler, root at WARNING), as a user's script
does, and each rank's stderr is read on its own."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from launch import free_port

import trainmon
from trainmon import joblog
from trainmon.config import load_config
from trainmon.joblog import Place, announce, job_wide, rank_note
from trainmon.step.job import JobShape

WORKER = textwrap.dedent(
    """
    import sys

    import torch
    import torch.distributed as dist
    from torch import nn

    import trainmon

    run, nan_rank = sys.argv[1], int(sys.argv[2])
    dist.init_process_group("gloo")  # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the environment
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    poison = {"on": False}
    model[0].register_forward_hook(lambda m, a, out: out * float("nan") if poison["on"] else out)
    # ops: ["id"] and the target "nope" are the same config note and target note on every rank
    config = {"targets": ["0", "nope"], "xy_distribution": True, "ops": ["norm", "nans", "id"]}
    monitor = trainmon.attach(model, optimizer, config=config, logdir=run)
    for step in range(3):
        poison["on"] = rank == nan_rank and step == 1
        loss = model(torch.randn(2, 4)).sum()
        monitor.track("loss", loss)
        if rank == nan_rank and step == 0:
            monitor.track("bad", "not a number")  # a failure of this rank only
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    monitor.close()
    dist.barrier()
    dist.destroy_process_group()
    """
)


def run_job(tmp_path: Path, nan_rank: int, world: int = 2) -> list[str]:
    """Each rank's stderr of a ``world``-rank gloo job with Python's default logging."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port = str(free_port())
    env = {**os.environ, "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(tmp_path / "run"), str(nan_rank)],
            env={**env, "RANK": str(r), "OMP_NUM_THREADS": "1"},
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    errs = []
    try:
        errs = [proc.communicate(timeout=150)[1] for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    for rank, proc in enumerate(procs):
        assert proc.returncode == 0, f"rank {rank}:\n{errs[rank][-4000:]}"
    return errs


def trainmon_lines(err: str) -> list[str]:
    """The lines trainmon printed (its messages and alerts; not the lines of a traceback)."""
    return [line for line in err.splitlines() if line.startswith("trainmon")]


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_two_rank_job_says_job_wide_messages_once_and_rank_messages_on_their_rank(tmp_path):
    run = tmp_path / "run"
    errs = run_job(tmp_path, nan_rank=1)
    lines = [trainmon_lines(err) for err in errs]

    def said(text: str) -> list[int]:
        return [rank for rank, mine in enumerate(lines) for line in mine if text in line]

    # where the run went: on rank 0's stderr, once, with no logging set up
    assert said(f"trainmon: run {run}: TensorBoard shows") == [0], lines
    assert said(f"tensorboard --logdir {run}") == [0]
    # job-wide: a config note (said while the config loads, before the monitor knows its place) and a target
    # note (said by the monitor), once for the job, by rank 0
    assert said("op 'id' in ops is not implemented and is ignored") == [0], lines
    assert said("target 'nope' matches no module or parameter of the model") == [0], lines
    # about one rank: said there only, naming it; rank 0 never repeats it
    assert said("trainmon: rank 1: track('bad') failed; training continues") == [1], lines
    assert said("NaN at step 1 rank 1") == [1], lines
    # nothing of trainmon's is said alike by both ranks
    assert set(lines[0]) & set(lines[1]) == set()


# ---------------------------------------------------------------------------------------------- the mechanism


@pytest.fixture
def placed():
    """Settle a place for the test and leave it after."""
    settled: list[Place] = []

    def settle(where: Place) -> None:
        settled.append(where)
        joblog.settle(where)

    yield settle
    for where in settled:
        joblog.leave(where)


def test_job_wide_messages_are_said_by_the_rank_that_speaks_for_the_job_only(placed, caplog):
    logger = logging.getLogger("trainmon")
    placed(Place(rank=1, world=4, speaks=False))
    job_wide(logger).warning("trainmon: said alike by every rank")
    logger.warning("trainmon: %sabout this rank", rank_note())
    assert [r.getMessage() for r in caplog.records] == ["trainmon: rank 1: about this rank"]
    placed(Place(rank=0, world=4, speaks=True))
    job_wide(logger).warning("trainmon: said alike by every rank")
    assert caplog.records[-1].getMessage() == "trainmon: said alike by every rank"


def test_a_process_alone_speaks_for_its_job_and_names_no_rank(placed, caplog):
    placed(Place(rank=0, world=1, speaks=True))
    assert rank_note() == ""
    job_wide(logging.getLogger("trainmon")).warning("trainmon: a note")
    assert [r.getMessage() for r in caplog.records] == ["trainmon: a note"]


def test_without_a_monitor_the_place_is_the_launchers(monkeypatch):
    monkeypatch.setattr(joblog, "_settled", None)  # no monitor's place, whatever an earlier test left open
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert joblog.place() == Place(rank=3, world=4, speaks=False)
    monkeypatch.setenv("RANK", "0")
    assert joblog.place().speaks
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    assert joblog.place() == Place(rank=0, world=1, speaks=True)


@pytest.mark.parametrize(
    ("module_ranks", "pp_stage", "speakers"),
    [
        ((), 0, [0]),
        ((0, 2), 0, [0]),
        ((2, 3), 0, [2]),  # rank 0 hooks no module: the first rank that does speaks
        ((7,), 0, [0]),  # no rank of the job is listed: rank 0
        ((), 1, [0, 1, 2, 3]),  # ranks 1-3 hold a later pipeline stage (in this test): each says its own
    ],
)
def test_the_rank_that_speaks_for_the_job(module_ranks, pp_stage, speakers):
    config = load_config({"module_ranks": list(module_ranks)})
    shapes = [JobShape(rank, sharded=False, pp_stage=pp_stage if rank else 0) for rank in range(4)]
    assert [shape.rank for shape in shapes if shape.speaks_for_job(config, 4)] == speakers
    assert JobShape(5, sharded=False).speaks_for_job(config, 1)  # a process alone


def test_a_monitor_settles_its_place_and_leaves_it_at_close(tmp_path):
    model = torch.nn.Linear(2, 2)
    monitor = trainmon.attach(model, torch.optim.SGD(model.parameters(), lr=0.1), logdir=tmp_path / "run")
    assert joblog.place() is monitor._place and monitor._place == Place(rank=0, world=1, speaks=True)
    monitor.close()
    assert joblog.place() is not monitor._place


# --------------------------------------------------------------------------------------- the run's first line


def test_the_first_line_is_printed_on_stderr_when_logging_would_not_show_it(capsys, caplog):
    announce(logging.getLogger("trainmon"), "trainmon: run R: tensorboard --logdir R")
    assert capsys.readouterr().err == "trainmon: run R: tensorboard --logdir R\n"
    assert not caplog.records  # INFO is below the root's WARNING: logging shows nothing


def test_the_first_line_is_logged_where_logging_shows_trainmons_info(capsys, caplog):
    with caplog.at_level(logging.INFO, "trainmon"):
        announce(logging.getLogger("trainmon"), "trainmon: run R")
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [(logging.INFO, "trainmon: run R")]
    assert capsys.readouterr().err == ""  # said once, by logging's handlers


def test_a_trainmon_logger_set_above_info_keeps_the_first_line_quiet(capsys):
    logger = logging.getLogger("trainmon")
    before = logger.level
    logger.setLevel(logging.WARNING)
    try:
        announce(logger, "trainmon: run R")
    finally:
        logger.setLevel(before)
    assert capsys.readouterr().err == ""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_single_process_prints_where_its_run_is_once_without_a_logging_setup(tmp_path):
    code = textwrap.dedent(
        """
        import sys, torch, trainmon
        model = torch.nn.Linear(2, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with trainmon.attach(model, optimizer, logdir=sys.argv[1]) as monitor:
            for _ in range(2):
                model(torch.randn(3, 2)).sum().backward()
                optimizer.step()
        """
    )
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    done = subprocess.run([sys.executable, "-c", code, str(run)], env=env, capture_output=True, text=True,
                          timeout=100)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert trainmon_lines(done.stderr) == [line for line in done.stderr.splitlines() if str(run) in line]
    assert len(trainmon_lines(done.stderr)) == 1, done.stderr
    assert f"tensorboard --logdir {run}" in done.stderr and done.stdout == ""
