"""Worker for tests/test_reload_ranks.py: a 2-rank job (torchrun, gloo, CPU) whose monitor config file is
swapped under it while it trains.

``--engine ddp`` trains a DistributedDataParallel model with a torch optimizer, ``--engine zero2`` a
DeepSpeed ZeRO-2 engine (DS_ACCELERATOR=cpu). The model's parameter ``layers.<i>.*`` starts with every
element in ``[10 i, 10 i + 1)`` and the learning rate is so small that 400 steps move no element by more than
0.05: a statistic whose min and max fall outside its tensor's range belongs to another tensor (under ZeRO-2
the statistics of gradients, master weights and Adam moments are merged over the ranks' shards, so a rank
that names a row differently from the other mixes two tensors into one row).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SIZES = ((7, 9), (9, 5), (5, 3))  # odd sizes: ZeRO's partition boundaries fall inside parameters
LR = 1e-5


class Layered(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(i, o) for i, o in SIZES)
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for i, layer in enumerate(self.layers):
                for p in layer.parameters():
                    p.copy_(10.0 * i + torch.rand(p.shape, generator=generator))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x) / 100.0)
        return x


def build(engine_kind: str):
    model = Layered()
    if engine_kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model)
        optimizer = torch.optim.Adam(ddp.parameters(), lr=LR)

        def step(loss: torch.Tensor) -> None:
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

        return ddp, optimizer, step
    import deepspeed

    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": 2},
        "steps_per_print": 10**9,
    }
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

    def step(loss: torch.Tensor) -> None:
        engine.backward(loss)
        engine.step()

    return engine, None, step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", choices=("ddp", "zero2"), required=True)
    parser.add_argument("--config", required=True)
    parser.add_argument("--logdir", required=True)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--local_rank", type=int, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.engine == "zero2":
        import deepspeed

        # the CPU shared-memory comm op is JIT-compiled at the first init; gloo does without it
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
        deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=60))
    else:
        torch.distributed.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = torch.distributed.get_rank()

    import trainmon

    model, optimizer, step = build(args.engine)
    mon = trainmon.attach(model, optimizer, config=args.config, logdir=args.logdir)
    generator = torch.Generator().manual_seed(100 + rank)  # different data on each rank
    start = time.perf_counter()
    for _ in range(args.steps):
        x, y = torch.randn(4, 7, generator=generator), torch.randn(4, 3, generator=generator)
        step(nn.functional.mse_loss(model(x), y))
    print(f"rank {rank}: {args.steps} steps in {time.perf_counter() - start:.2f} s", flush=True)
    mon.close()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
