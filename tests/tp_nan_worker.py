"""Tensor-parallel runs in which some ranks make a NaN, for tests/test_origin_merged.py.

    python tp_nan_worker.py OUT WORLD PORT PLANTING [PLANTING ...]

Each PLANTING (comma-separated ranks, e.g. ``1`` or ``0,1``) is one run, in turn in the same processes, into
the run directory ``OUT/nan_<PLANTING>`` (``,`` as ``_``): the torchtitan-style Llama of tests/titan_llama.py
with its tensor parallelism over all WORLD ranks (no sequence parallelism: the residual stream is
replicated), or with WORLD 4 inside FSDP2 on a (dp, tp) = (2, 2) mesh, every activation collected
(``xy_distribution``, ``all_xy``). At step ``NAN_STEP`` a forward
hook on ``layers.0.attention_norm`` turns that module's output into NaN on the planting ranks only: their
tensor-parallel partners compute from finite inputs, and the NaN reaches them through the layers' collectives
and through the statistics merged over the group.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import trainmon

sys.path.insert(0, str(Path(__file__).parent))
import titan_llama  # noqa: E402 - tests/ is not a package

STEPS = 3
NAN_STEP = 1
PLANTED = "layers.0.attention_norm"
CONFIG = {"xy_distribution": True, "all_xy": True}


def run_dir(out: Path, planting: str) -> Path:
    return out / f"nan_{planting.replace(',', '_')}"


def train(run: Path, tp_mesh: object, dp_mesh: object, poisons: bool) -> None:
    model, optimizer = titan_llama.make(
        dim=32, n_layers=2, tp_mesh=tp_mesh, dp_mesh=dp_mesh, sequence_parallel=False
    )
    dp_rank, dp_size = (dp_mesh.get_local_rank(), dp_mesh.size()) if dp_mesh is not None else (0, 1)
    step = 0

    def plant(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
        # a product, not a new tensor: the output stays in the graph, so every rank runs the same backward
        # (and the same collectives in it)
        return output * float("nan") if poisons and step == NAN_STEP else None

    model.get_submodule(PLANTED).register_forward_hook(plant)
    monitor = trainmon.attach(model, optimizer, config=CONFIG, logdir=str(run))
    for step in range(STEPS):  # plant reads it
        inputs, labels = titan_llama.batch(step, batch_size=2, seq_len=8, dp_rank=dp_rank, dp_size=dp_size)
        loss = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())
        monitor.track("loss", loss)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    monitor.close()


def main() -> None:
    out, world, port, plantings = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4:]
    rank = int(os.environ["RANK"])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    dp = 2 if world == 4 else 1
    mesh = init_device_mesh("cpu", (dp, world // dp), mesh_dim_names=("dp", "tp"))
    dp_mesh = mesh["dp"] if dp > 1 else None
    for planting in plantings:
        train(run_dir(out, planting), mesh["tp"], dp_mesh, rank in {int(r) for r in planting.split(",")})
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
