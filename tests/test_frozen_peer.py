"""``alert.on_nan: skip`` in a 2-process gloo group without DDP, when one rank stops stepping.

Rank 1 freezes before step FREEZE and stays frozen until rank 0 has finished. Rank 0 must not wait for it
longer than ``sync_timeout_s`` once (not the process group's timeout, at every step), must say once that the
ranks no longer agree and once that skipping is off, log no error, and still report the NaN of a later step
(no longer skipped: a rank that skipped alone would leave the replicas apart). When rank 1 comes back, its
first agreement fails at once and it says the same.
"""

from __future__ import annotations

import json

import pytest
from launch import run_worker_script

FREEZE, NAN_STEP, STEPS, SYNC_TIMEOUT_S, PG_TIMEOUT_S = 3, 8, 12, 2.0, 40

def worker_source(config: dict, nan_step: int = -1, wait_for_exchange: bool = False) -> str:
    """The 2-process job: rank 1 freezes before step FREEZE until rank 0 has finished; rank 0's loss is NaN
    at ``nan_step``; each rank reports its step times, skipped steps, waits at collectives, log lines and
    NaN steps. ``wait_for_exchange``: the test (never training) waits for each step's times exchange."""
    return f"""
import datetime, json, logging, math, sys, time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import trainmon
from trainmon.run.anomaly_table import read_anomalies
from trainmon.run.timing import TIMES


class Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append([record.levelname, record.getMessage(), record.exc_info is not None])


def worker(rank, port, tmp):
    tmp = Path(tmp)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{{port}}", rank=rank, world_size=2,
        timeout=datetime.timedelta(seconds={PG_TIMEOUT_S}),
    )
    lines = Lines()
    logging.getLogger("trainmon").addHandler(lines)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = trainmon.attach(model, optimizer, config={config!r}, logdir=tmp / "run")
    times, skipped, waits = [], [], []
    for step in range({STEPS}):
        if rank == 1 and step == {FREEZE}:
            while not (tmp / "rank0_done").exists():  # frozen until rank 0 has finished
                time.sleep(0.05)
        start = time.perf_counter()
        loss = model(torch.randn(4, 4)).square().mean()
        if rank == 0 and step == {nan_step}:
            loss = loss * float("nan")
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
        record, ready = mon._latest
        skipped.append(bool(record.skipped))
        if {wait_for_exchange!r}:
            if ready:
                ready()  # the test waits for the exchange here; training never does
            wait = float(record.timing.mine()[TIMES.index("wait")])
            waits.append(None if math.isnan(wait) else wait)
    mon.close()
    nan_steps = sorted({{a.step for a in read_anomalies(tmp / "run", rank) if a.rule == "nan"}})
    report = {{"times": times, "skipped": skipped, "waits": waits, "lines": lines.lines,
              "nan_steps": nan_steps}}
    (tmp / f"report{{rank}}.json").write_text(json.dumps(report))
    if rank == 0:
        (tmp / "rank0_done").write_text("")
    dist.barrier()  # the job's own group is unharmed
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(worker, args=(int(sys.argv[1]), sys.argv[2]), nprocs=2, join=True)
"""


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_frozen_peer_costs_one_bounded_wait_and_one_warning_each(tmp_path):
    config = {"wg_distribution": True, "alert": {"on_nan": "skip"}, "sync_timeout_s": SYNC_TIMEOUT_S}
    run_worker_script(worker_source(config, nan_step=NAN_STEP), tmp_path, timeout=140)
    reports = [json.loads((tmp_path / f"report{rank}.json").read_text()) for rank in (0, 1)]
    for report in reports:
        lines = report["lines"]
        assert [line for line in lines if line[0] in ("ERROR", "CRITICAL") or line[2]] == []
        agree = [m for _, m, _ in lines if "did not answer within sync_timeout_s=2s" in m]
        off = [m for _, m, _ in lines if "alert.on_nan: skip is off" in m]
        assert len(agree) == 1 and len(off) == 1, lines
        assert "NaN/Inf check" in agree[0]
        # the NaN after the freeze is reported, not skipped (skipping alone would split the replicas)
        assert not any(report["skipped"])
    times = reports[0]["times"]
    # rank 0 waited for the frozen rank once, about sync_timeout_s (not the group's 40 s), then went on
    assert max(times[FREEZE:]) >= SYNC_TIMEOUT_S * 0.9, times
    assert sorted(times[FREEZE:])[-2] < 1.5 and sum(times[FREEZE:]) < SYNC_TIMEOUT_S + 5.0, times
    # the NaN step's update landed (not skipped): every step from it on is NaN
    assert reports[0]["nan_steps"] == list(range(NAN_STEP, STEPS))
    # rank 1, back after rank 0 finished, found nobody to agree with at once
    assert sum(reports[1]["times"][FREEZE:]) < SYNC_TIMEOUT_S + 5.0, reports[1]["times"]




@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_frozen_peer_stops_the_exchange_of_step_times_with_one_warning_each(tmp_path):
    """The ranks exchange their step times in an asynchronous all-reduce waited for off the training thread.
    When rank 1 stops stepping, rank 0's training does not wait at all; its exchange times out once (the
    writer's wait, ``sync_timeout_s``), it says so once and records its own times from then on (no wait at
    collectives); rank 1, back, fails its next exchange and says the same."""
    # no all_ranks run (nothing written): the ranks exchange their times in an all-reduce of their own
    config = {"format": ["api"], "sync_timeout_s": SYNC_TIMEOUT_S}
    run_worker_script(worker_source(config, wait_for_exchange=True), tmp_path, timeout=140)
    reports = [json.loads((tmp_path / f"report{rank}.json").read_text()) for rank in (0, 1)]
    for report in reports:
        lines = report["lines"]
        assert [line for line in lines if line[0] in ("ERROR", "CRITICAL") or line[2]] == []
        said = "did not exchange their step times within sync_timeout_s=2s"
        stopped = [m for _, m, _ in lines if said in m]
        assert len(stopped) == 1, lines
        waits = report["waits"]
        assert all(w is not None for w in waits[:FREEZE]), waits  # exchanged: every rank's wait
        assert all(w is None for w in waits[FREEZE:]), waits  # alone: its own times, no wait
    # rank 0's training thread never waited for the frozen rank: no step near sync_timeout_s
    assert max(reports[0]["times"]) < SYNC_TIMEOUT_S / 2, reports[0]["times"]
