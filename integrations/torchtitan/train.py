"""Runnable CPU example: torchtitan's own Trainer (its llama3 debug model, FSDP2 over 2 ranks), monitored.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 integrations/torchtitan/train.py \
        --logdir /tmp/torchtitan-example
    tensorboard --logdir /tmp/torchtitan-example/run

It writes only under --logdir (default: torchtitan-example in the system's temporary directory): the
tokenizer and text it trains on, torchtitan's outputs and trainmon's run (``run/``). Nothing goes into the
checkout (not even __pycache__ for the modules it borrows from tests/).

torchtitan 0.3.0 assumes an accelerator and a PyTorch nightly; to run here on the CPU with torch 2.13 this
example installs the test-only shim tests/torchtitan_cpu_shim.py (README.md says what each patch does). On
GPUs drop the shim: the trainmon line is the same.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

# the example borrows modules from tests/: importing them must not leave __pycache__ in the checkout
sys.dont_write_bytecode = True
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

import torch  # noqa: E402
import torchtitan_cpu_shim  # noqa: E402

torchtitan_cpu_shim.install()  # CPU and torch 2.13 only: see integrations/torchtitan/README.md

import torchtitan_worker as workload  # noqa: E402  (torchtitan's debug-model config on local files)
from torchtitan.tools.logging import init_logger  # noqa: E402

import trainmon  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--logdir",
        type=Path,
        default=Path(tempfile.gettempdir()) / "torchtitan-example",
        help="output folder (same on every rank); default: torchtitan-example in the temporary directory",
    )
    args = parser.parse_args()
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the text set is a local folder: never the Hub
    init_logger()
    rank = int(os.environ["RANK"])
    config = workload.trainer_config(args.logdir / f"assets_{rank}", args.logdir / "torchtitan")
    trainer = config.build()

    # the one line: after the Trainer is built, before it trains
    monitor = trainmon.attach(
        trainer,
        config={"xy_distribution": True, "wg_distribution": True, "mv_distribution": True},
        logdir=args.logdir / "run",
    )
    trainer.train()
    monitor.close()
    trainer.close()
    if rank == 0:
        print(f"run directory: {monitor.run_dir}")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
