"""One gloo rank of the DDP-vs-FSDP2 comparison runs of tests/test_compare_microbatch.py.

    python compare_fsdp_worker.py OUT_DIR PORT JOB [JOB ...]       (RANK and WORLD_SIZE in the environment)

Each JOB trains the same small network (two residual blocks of Linear, GELU, LayerNorm, Linear; a Linear
head; MSE loss; Adam) from the same weights on the same data, into the run folder ``OUT_DIR/JOB``, with the
monitor at full coverage and :data:`MICRO` micro-batches a step. Every rank takes its own slice of each
step's global batch. JOB is ``LAYOUT[:CHANGE]``: LAYOUT ``ddp`` (DistributedDataParallel, the gradient
reduced on the last micro-batch only) or ``fsdp`` (FSDP2 ``fully_shard`` on each block and the root,
reduce-scattering every micro-batch); CHANGE ``eps`` (the LayerNorm of block 1 with eps 1e-3 instead of
1e-5) or ``lr`` (Adam's learning rate 10% larger). The jobs run in turn in the same processes (one start-up
for all).
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

import compare_runs  # noqa: E402 - tests/ is not a package

import trainmon  # noqa: E402

STEPS = 3
MICRO = 2
GLOBAL_BATCH = 32  # samples a step over every rank
CHANGED_NORM = "blocks.1.norm"
CHANGED_EPS = 1e-3
LR = 1e-2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.act = nn.GELU()
        self.norm = nn.LayerNorm(16)
        self.fc2 = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.norm(self.act(self.fc1(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def micro_batches(step: int, rank: int, world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's slice of the step's global batch, cut into :data:`MICRO` micro-batches."""
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(GLOBAL_BATCH, 8, generator=g), torch.randn(GLOBAL_BATCH, 4, generator=g)
    mine = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    return list(zip(x[mine].chunk(MICRO), y[mine].chunk(MICRO), strict=True))


def build(layout: str, change: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = Net()
    if change == "eps":
        net.get_submodule(CHANGED_NORM).eps = CHANGED_EPS
    model: nn.Module = net
    if layout == "ddp":
        model = nn.parallel.DistributedDataParallel(net)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in net.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(net, mesh=mesh)
    lr = LR * 1.1 if change == "lr" else LR
    return model, torch.optim.Adam(model.parameters(), lr=lr)


def train(run: Path, layout: str, change: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optimizer = build(layout, change)
    with trainmon.attach(model, optimizer, config=compare_runs.CONFIG, logdir=run, grad_acc_steps=MICRO):
        for step in range(STEPS):
            optimizer.zero_grad()
            for micro, (x, y) in enumerate(micro_batches(step, rank, world)):
                last = micro == MICRO - 1
                # DDP reduces on the last micro-batch only; FSDP2 reduce-scatters each one
                sync = model.no_sync() if layout == "ddp" and not last else contextlib.nullcontext()
                with sync:
                    (F.mse_loss(model(x), y) / MICRO).backward()
            optimizer.step()


def main() -> None:
    out, port, jobs = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    for job in jobs:
        layout, _, change = job.partition(":")
        train(out / job.replace(":", "_"), layout, change)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
