"""How the ranks of a process group agree on config edits (trainmon.config.watch.ConfigReloads), on 2 gloo
processes: only rank 0's file counts, from attach on; an edit one rank cannot load is applied by none; an
edit every rank can load is applied by all at the same step.

Each rank is given its own config file, so that what a rank would read by itself differs from rank 0's.
"""

from __future__ import annotations

import json

import pytest
from launch import run_worker_script

STEPS, EDIT_A, EDIT_B = 60, 3, 30

WORKER = f"""
import datetime, json, logging, os, sys, time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import trainmon

FIRST = [
    {{"wg_distribution": True}},
    {{"wg_distribution": True, "xy_distribution": True, "step_interval": 2}},
]
# A: a webhook URL from an environment variable only rank 0 has; B: a plain schedule change
EDIT_A = {{"wg_distribution": True, "alert": {{"webhooks": [{{"url_env": "TM_TEST_HOOK"}}]}}}}
EDIT_B = {{"wg_distribution": True, "step_interval": 3}}


class Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def write(path, config):
    aside = path.with_suffix(".tmp")
    aside.write_text(json.dumps(config))
    os.replace(aside, path)


def worker(rank, port, tmp):
    tmp = Path(tmp)
    if rank == 0:
        os.environ["TM_TEST_HOOK"] = "http://127.0.0.1:9/hook"
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{{port}}", rank=rank, world_size=2,
        timeout=datetime.timedelta(seconds=60),
    )
    lines = Lines()
    logging.getLogger("trainmon").addHandler(lines)
    path = tmp / f"monitor{{rank}}.json"
    write(path, FIRST[rank])
    dist.barrier()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = trainmon.attach(model, optimizer, config=str(path), logdir=tmp / "run")
    history = []
    for step in range({STEPS}):
        if step == {EDIT_A}:
            write(path, EDIT_A if rank == 0 else {{"xy_distribution": True}})  # rank 1's file: never read
        if step == {EDIT_B} and rank == 0:
            write(path, EDIT_B)
        loss = model(torch.randn(4, 4)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        history.append([mon.config.step_interval, mon.config.xy_distribution, len(mon.config.alert.webhooks)])
        time.sleep(0.02)
    mon.close()
    (tmp / f"report{{rank}}.json").write_text(json.dumps({{"history": history, "lines": lines.lines}}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(worker, args=(int(sys.argv[1]), sys.argv[2]), nprocs=2, join=True)
"""


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_only_rank_0s_file_counts_and_every_rank_applies_an_edit_at_the_same_step_or_none_does(tmp_path):
    run_worker_script(WORKER, tmp_path, timeout=140)
    reports = [json.loads((tmp_path / f"report{rank}.json").read_text()) for rank in (0, 1)]
    history = reports[0]["history"]
    # the same config on both ranks at every step, from the first one: rank 0's (interval 1, no activations)
    assert reports[1]["history"] == history
    assert history[0] == [1, False, 0]
    # edit A (rank 1 cannot resolve its webhook URL) was applied by neither rank; edit B by both, at once
    assert all(webhooks == 0 for _, _, webhooks in history)
    changed = [step for step in range(1, STEPS) if history[step] != history[step - 1]]
    assert len(changed) == 1 and EDIT_B < changed[0] <= EDIT_B + 12, changed
    assert history[-1] == [3, False, 0]
    refused = [line for line in reports[1]["lines"] if "ignoring the edit" in line]
    assert len(refused) == 1 and "TM_TEST_HOOK" in refused[0], reports[1]["lines"]
    told = [line for line in reports[0]["lines"] if "ignoring the edit" in line]
    assert len(told) == 1 and "another rank could not load it" in told[0], reports[0]["lines"]
