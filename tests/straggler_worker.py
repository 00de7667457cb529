"""A real gloo job of WORLD processes for tests/test_straggler.py: a small MLP trained STEPS steps, its
gradients summed with one all_reduce a step (a monitored collective), ranks slowed from step SLOW_FROM on:

- ``forward``: rank SLOW sleeps ``SLEEP_S`` inside its forward (a forward hook of the first layer); ranks 0
  and SLOW write their own TensorBoard events, so the job writes the all_ranks run (the ranks' times ride in
  its merge);
- ``mixed``: rank SLOW sleeps ``SLEEP_S`` before its forward (its data loading), and rank SLOW + 1 runs a full
  garbage collection every third step (a heap of objects makes it long);
- ``none``: nobody is slowed (the ranks' times go in an all-reduce of their own: no all_ranks run).

Usage: ``python straggler_worker.py SCENARIO WORLD STEPS SLOW SLOW_FROM PORT OUT``. The processes are forked
from one that imported torch already (a start of seconds, not of minutes, on two cores). Each rank writes
``OUT/alerts_<r>.json``: the straggler alerts it delivered (``on_alert``), with their step and lines.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import trainmon  # noqa: E402

SLEEP_S = 0.03


def worker(
    rank: int, scenario: str, world: int, steps: int, slow: int, slow_from: int, port: int, out: str
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=90),
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    position = {"step": 0}
    if scenario == "forward" and rank == slow:
        model[0].register_forward_hook(
            lambda *_: time.sleep(SLEEP_S) if position["step"] >= slow_from else None
        )
    heap = []
    if scenario == "mixed" and rank == slow + 1:
        heap = [[i] for i in range(400_000)]  # makes a full collection take tens of milliseconds
    config = {
        "timing": {"collectives": True},  # the all_reduce below is timed, without statistics
        "format": ["tensorboard"],
        "tensorboard_ranks": [0, slow] if scenario == "forward" else "auto",
        "alert": {"rules": [{"rule": "nan"}, {"rule": "straggler"}]},
    }
    alerts = []
    with trainmon.attach(
        model, optimizer, config=config, logdir=f"{out}/run", on_alert=alerts.append
    ) as monitor:
        g = torch.Generator().manual_seed(rank)
        for step in range(steps):
            position["step"] = step
            if scenario == "mixed" and rank == slow and step >= slow_from:
                time.sleep(SLEEP_S)  # the batch is late
            x = torch.randn(16, 32, generator=g)
            loss = F.mse_loss(model(x), torch.zeros(16, 8))
            optimizer.zero_grad()
            loss.backward()
            flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            dist.all_reduce(flat)  # the job's gradient reduction: everyone waits here for the slowest
            offset = 0
            for p in model.parameters():
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p) / world)
                offset += p.numel()
            if scenario == "mixed" and rank == slow + 1 and step >= slow_from and step % 3 == 0:
                gc.collect()
            optimizer.step()
        monitor.flush()
    del heap
    found = [
        {"step": a.step, "rank": a.rank, "lines": list(a.lines), "rules": [x.rule for x in a.anomalies],
         "phases": [x.name for x in a.anomalies if x.rule == "straggler"]}
        for a in alerts
    ]  # fmt: skip
    Path(out, f"alerts_{rank}.json").write_text(json.dumps(found))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    scenario, world, steps, slow, slow_from, port, out = sys.argv[1:8]
    # no writer process per rank: the tables read here are written by the writer thread
    os.environ["TRAINMON_WRITER"] = "thread"
    from trainmon.run.columnar import _load_pandas_now

    _load_pandas_now()  # once, before the fork, not in every rank at attach
    mp.start_processes(
        worker,
        args=(scenario, int(world), int(steps), int(slow), int(slow_from), int(port), out),
        nprocs=int(world),
        start_method="fork",
    )


if __name__ == "__main__":
    main()
