"""Training worker for tests/test_faults_distributed.py (issue 21's acceptance): two processes under torchrun,
plain DDP or DeepSpeed ZeRO-2 on gloo, writing a run folder on a small tmpfs the test mounted. Rank 0 fills
that disk with a ballast file mid-run, removes it, fills it again, and a NaN then appears in rank 0's batch:
with ``on_nan: raise`` every rank must raise at that step though nothing can be written. The ballast goes
before the monitors close. Each rank writes ``OUT.rank<r>.json``: the error it raised."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import trainmon  # noqa: E402
from tests.tmpfs import fill  # noqa: E402
from trainmon.anomaly.alerts import TrainingNaNError  # noqa: E402

FILL_AT, FREE_AT, FILL_AGAIN_AT, NAN_AT, STEPS = 3, 6, 9, 10, 14
CONFIG = {
    "xy_distribution": True,
    "all_xy": True,
    "wg_distribution": True,
    "mv_distribution": True,
    "param_distribution": True,
    "alert": {"on_nan": "raise", "rate_limit_s": 0},
    # every file a full disk must not tear: CSV and each tensor's scalars too (asked for since issue 33)
    "format": ["tensorboard", "csv"],
    "tensorboard_tensors": "all",
}


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def batch(rank: int, step: int, poison: bool) -> torch.Tensor:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * rank + step))
    if poison and rank == 0:
        x[0, 0] = float("nan")
    return x


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("ddp", "zero2"), required=True)
    parser.add_argument("--disk", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    disk = Path(args.disk)
    torch.manual_seed(0)
    model = Tiny()
    if args.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=90))
        ddp = DistributedDataParallel(model)
        optimizer = torch.optim.Adam(ddp.parameters(), lr=1e-3)
        mon = trainmon.attach(ddp, optimizer, config=CONFIG, logdir=disk / "run")

        def train_step(x: torch.Tensor) -> None:
            loss = ddp(x).square().mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()

    else:
        import deepspeed

        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        engine, *_ = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            config={
                "train_micro_batch_size_per_gpu": 4,
                "zero_optimization": {"stage": 2},
                "zero_allow_untested_optimizer": True,
                "steps_per_print": 10**9,
            },
        )
        mon = trainmon.attach(engine, config=CONFIG, logdir=disk / "run")

        def train_step(x: torch.Tensor) -> None:
            loss = engine(x).square().mean()
            engine.backward(loss)
            engine.step()

    def on_rank0(action) -> None:
        mon.flush()  # the steps so far are on disk before it fills
        dist.barrier()
        if rank == 0:
            action()
        dist.barrier()

    ballast = disk / "ballast"
    raised = ""
    try:
        for step in range(STEPS):
            if step in (FILL_AT, FILL_AGAIN_AT):
                on_rank0(lambda: fill(disk))
            elif step == FREE_AT:
                on_rank0(ballast.unlink)
            train_step(batch(rank, step, poison=step == NAN_AT))
    except TrainingNaNError as e:
        raised = str(e)
    on_rank0(lambda: ballast.unlink(missing_ok=True))  # space returns before the monitors close
    mon.close()
    Path(f"{args.out}.rank{rank}.json").write_text(json.dumps({"raised": raised}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
