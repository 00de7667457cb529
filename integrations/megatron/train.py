"""Runnable CPU example: a tiny megatron-core GPTModel, mcore DDP and the distributed optimizer, monitored.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 integrations/megatron/train.py \
        --logdir /tmp/megatron-example
    tensorboard --logdir /tmp/megatron-example

It writes only under --logdir (default: megatron-example in the system's temporary directory), nothing
into the checkout (not even __pycache__ for the modules it borrows from tests/).

megatron-core needs CUDA; to run here on the CPU this example installs the test-only CUDA->CPU shim
(tests/megatron_cpu_shim.py). On GPUs drop the shim: the trainmon line is the same.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

# the example borrows modules from tests/: importing them must not leave __pycache__ in the checkout
sys.dont_write_bytecode = True
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

import torch  # noqa: E402
from megatron_cpu_shim import install  # noqa: E402

install()  # CPU only: maps megatron-core's hard-coded "cuda" to the CPU

import megatron_worker as workload  # noqa: E402  (tiny GPTModel + mcore DDP + Megatron optimizer)
from megatron.core import parallel_state  # noqa: E402

import trainmon  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--logdir",
        type=Path,
        default=Path(tempfile.gettempdir()) / "megatron-example",
        help="run directory (same on every rank); default: megatron-example in the temporary directory",
    )
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    torch.distributed.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    options = workload.argparse.Namespace(optimizer="dist", tp=1, recompute=False)
    model, optimizer = workload.build(options)  # what Megatron-LM's setup_model_and_optimizer returns

    # the one line for custom loops (Megatron-LM scripts: trainmon.enable_megatron() before pretrain)
    monitor = trainmon.attach(
        model,
        optimizer,
        config={"xy_distribution": True, "wg_distribution": True, "mv_distribution": True},
        logdir=args.logdir,
        grad_acc_steps=workload.GLOBAL_MICRO // parallel_state.get_data_parallel_world_size(),
    )
    losses, _ = workload.train(model, optimizer, steps=args.steps, monitor=monitor)
    latest = monitor.latest()
    if torch.distributed.get_rank() == 0:
        print("losses:", [round(x, 4) for x in losses])
        print(
            "grad norm of output_layer.weight (whole tensor, from shards):",
            latest["grad_reduced/output_layer.weight"]["norm"],
        )
        print("written to", monitor.run_dir)
    monitor.close()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
