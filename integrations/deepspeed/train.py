"""A small GPT trained with DeepSpeed and monitored by trainmon: one line after ``deepspeed.initialize``.

CPU, two processes, ZeRO-2 (any stage works: --zero 0/1/2/3; --bf16 for bf16):

    DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node 2 integrations/deepspeed/train.py --zero 2

Then ``tensorboard --logdir runs`` (one TensorBoard run per rank) and ``trainmon analyze RUN``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
from typing import Any

import deepspeed
import torch

import trainmon
from trainmon.demo import DemoSetup, TinyGPT, lm_loss, synthetic_batch

# What trainmon records (msprobe monitor keys; a JSON/YAML file path works as well):
# activations of every module, weight gradients (before and after the data-parallel reduction), Adam moments.
MONITOR_CONFIG = {
    "xy_distribution": True,
    "all_xy": True,
    "wg_distribution": True,
    "mv_distribution": True,
    "step_interval": 1,
}


def ds_config(zero: int, bf16: bool, grad_acc: int) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": grad_acc,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": zero},
        "zero_allow_untested_optimizer": True,  # a torch.optim.AdamW given as the client optimizer
        "steps_per_print": 10**9,
    }
    if bf16:
        config["bf16"] = {"enabled": True}
    return config


def build_engine(zero: int, bf16: bool = False, grad_acc: int = 1, setup: DemoSetup | None = None) -> Any:
    setup = setup or DemoSetup(batch=8, layers=4, dim=64)
    torch.manual_seed(0)
    model = TinyGPT(setup.vocab, setup.dim, 4, setup.layers, setup.seq)
    optimizer = torch.optim.AdamW(model.parameters(), lr=setup.lr)
    config = ds_config(zero, bf16, grad_acc)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def train_steps(engine: Any, steps: int, generator: torch.Generator, setup: DemoSetup | None = None) -> float:
    """``steps`` optimizer steps (each of ``gradient_accumulation_steps`` micro-batches); the last loss."""
    setup = setup or DemoSetup(batch=8, layers=4, dim=64)
    loss = 0.0
    for _ in range(steps * engine.gradient_accumulation_steps()):
        batch_loss = lm_loss(engine, synthetic_batch(setup, generator))
        engine.backward(batch_loss)
        engine.step()  # the optimizer steps (and trainmon ends a step) at accumulation boundaries
        loss = batch_loss.detach().item()
    return loss


def init_cpu_distributed() -> None:
    if deepspeed.get_accelerator().device_name() == "cpu":
        # DeepSpeed JIT-compiles a shared-memory collective op for CPUs at its first start (70-90 s, needs a
        # compiler); gloo works without it
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(minutes=5))


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--zero", type=int, default=2, choices=(0, 1, 2, 3), help="ZeRO stage")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--grad-acc", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--logdir", default=None, help="run directory (default runs/<date>-<time>)")
    parser.add_argument("--config", default=None, help="trainmon config file (default: MONITOR_CONFIG)")
    parser.add_argument("--local_rank", type=int, default=None)  # appended by the deepspeed launcher
    args = parser.parse_args()

    init_cpu_distributed()
    engine = build_engine(args.zero, args.bf16, args.grad_acc)

    # the one line:
    monitor = trainmon.attach(engine, config=args.config or MONITOR_CONFIG, logdir=args.logdir)

    generator = torch.Generator().manual_seed(100 + torch.distributed.get_rank())  # different data per rank
    for step in range(args.steps):
        loss = train_steps(engine, 1, generator)
        if torch.distributed.get_rank() == 0 and step % 5 == 0:
            print(f"step {engine.global_steps}: loss {loss:.4f}", flush=True)
    monitor.close()
    if torch.distributed.get_rank() == 0:
        print(f"trainmon wrote {monitor.run_dir}: tensorboard --logdir {monitor.run_dir.parent}", flush=True)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()  # gloo may abort at exit without it


if __name__ == "__main__":
    main()
