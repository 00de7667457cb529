"""2-process gloo worker for tests/test_compare.py: the comparison tests' network (tests/compare_runs.py) on
two ranks, each with its own batches, gradients averaged over the ranks by hand after backward. Variant
``base`` averages every gradient in float32; ``reduction`` rounds the averaged ``fc1.weight`` gradient to
bfloat16 (a gradient changed only after the reduction: what a collective in lower precision does).

Usage: ``python -m torch.distributed.run --standalone --nproc_per_node 2 compare_worker.py RUN VARIANT``.
"""

from __future__ import annotations

import datetime
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import compare_runs  # noqa: E402

import trainmon  # noqa: E402

REDUCED_IN_BF16 = "fc1.weight"


def main() -> None:
    run, variant = Path(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    net, opt = compare_runs.build("base")
    with trainmon.attach(net, opt, config=compare_runs.CONFIG, logdir=run):
        for x, y in compare_runs.batches("base", compare_runs.STEPS, rank):
            opt.zero_grad()
            F.mse_loss(net(x), y).backward()
            for name, param in net.named_parameters():
                dist.all_reduce(param.grad)
                param.grad /= world
                if variant == "reduction" and name == REDUCED_IN_BF16:
                    param.grad.copy_(param.grad.to(torch.bfloat16).float())
            opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
