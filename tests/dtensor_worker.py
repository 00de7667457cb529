"""Training runs of PyTorch's own parallel stack with the monitor on, for tests/test_dtensor.py.

    python dtensor_worker.py OUT_DIR WORLD PORT JOB [JOB ...]

Each JOB is ``[titan/]LAYOUT[:OPTIONS]`` and runs in turn in the same processes (one start-up for all).
The model is a small GPT, or with ``titan/`` the torchtitan-style Llama of tests/titan_llama.py (whose
tensor parallelism is torchtitan's plan: attention and SwiGLU projections, with ``sp`` sequence parallelism
of the norms and the residual stream). LAYOUT is ``single`` (no parallelism: the reference; WORLD 1),
``fsdp`` (FSDP2 ``fully_shard`` on every block and the root over all ranks), ``tp`` (tensor parallelism over
all ranks; for the GPT, of the blocks' MLPs: fc1 column-wise, fc2 row-wise) or ``2d`` (the same TP inside
FSDP2 on a (dp, tp) = (2, 2) mesh). OPTIONS (comma separated): ``bf16`` (MixedPrecisionPolicy: bf16
parameters, fp32 reduction), ``keep`` (reshard_after_forward=False), ``offload`` (CPUOffloadPolicy), ``off``
(no monitor: the losses to compare with), ``part<R>of<N>`` (train on the R-th of N slices of each global
batch, what data-parallel rank R sees), ``rank0`` (``module_ranks: [0]``), ``compile`` (each block compiled
in place with ``aot_eager`` and ``fullgraph=True`` before FSDP2, as torchtitan does), ``sp`` (sequence
parallelism, titan only).

Every data-parallel rank takes its own slice of one global batch, so the single-process reference that
trains on the whole global batch computes the same gradients. Each rank writes ``OUT_DIR/<JOB>/rank_<r>.json``
(``,`` and ``:`` of JOB as ``_``): the monitor's statistics of every step (``Monitor.latest()``), the losses,
and the statistics of the whole tensors (``DTensor.full_tensor()``) taken by the loop itself at the points
where the monitor takes them.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import trainmon

sys.path.insert(0, str(Path(__file__).parent))
import titan_llama  # noqa: E402 - tests/ is not a package

STEPS = 3
VOCAB, D, HEADS, LAYERS, T = 96, 32, 4, 2, 8
GLOBAL_BATCH = 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(D)
        self.ln2 = nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D, bias=False)  # a key bias has no gradient: only noise
        self.proj = nn.Linear(D, D)
        self.fc1 = nn.Linear(D, 4 * D)
        self.fc2 = nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (y.view(b, t, HEADS, d // HEADS).transpose(1, 2) for y in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


CONFIG = {
    "wg_distribution": True,
    "mv_distribution": True,
    "param_distribution": True,
    "xy_distribution": True,
    "all_xy": True,
    "ur_distribution": True,
    "format": ["api"],  # in memory: Monitor.latest() is all the test reads
}


def global_batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (GLOBAL_BATCH, T + 1), generator=g)


def stats_of(t: torch.Tensor) -> dict[str, float]:
    a = t.detach().to(torch.float64).cpu().numpy().ravel()
    return {
        "min": float(a.min()),
        "max": float(a.max()),
        "mean": float(a.mean()),
        "norm": float(np.sqrt((a * a).sum())),
    }


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def job_dir(job: str) -> str:
    return job.replace(":", "_").replace(",", "_").replace("/", "_")


def main() -> None:
    out, world, port, jobs = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4:]
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        dist.init_process_group("gloo", rank=rank, world_size=world)
    for job in jobs:
        layout, _, options = job.partition(":")
        steps = run(layout, set(filter(None, options.split(","))), world)
        folder = out / job_dir(job)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"rank_{rank}.json").write_text(json.dumps(steps))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def run(layout: str, options: set[str], world: int) -> list[dict]:
    model_name, _, layout = layout.rpartition("/")
    titan = model_name == "titan"
    torch.manual_seed(0)
    model = titan_llama.make(build_optimizer=False)[0] if titan else GPT()
    vocab = model.args.vocab_size if titan else VOCAB
    dp_mesh = tp_mesh = None
    if layout != "single":
        from torch.distributed.device_mesh import init_device_mesh

        if layout == "2d":
            mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
            dp_mesh, tp_mesh = mesh["dp"], mesh["tp"]
        else:
            mesh = init_device_mesh("cpu", (world,))
            dp_mesh = mesh if layout == "fsdp" else None
            tp_mesh = mesh if layout == "tp" else None
    if tp_mesh is not None and titan:
        # compiled blocks lose the gradient of the vocabulary-parallel embedding's output (torch 2.13, see
        # titan_llama), so a compiled job keeps the embedding and output whole, comparable with one process
        vocab_parallel = "compile" not in options
        titan_llama.apply_tp(model, tp_mesh, sequence_parallel="sp" in options, vocab_parallel=vocab_parallel)
    elif tp_mesh is not None:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        for block in model.blocks:
            parallelize_module(block, tp_mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    if "compile" in options:  # torchtitan's order: TP, then each block compiled in place, then FSDP2
        for block in model.layers.values() if titan else model.blocks:
            block.compile(backend="aot_eager", fullgraph=True)
    if dp_mesh is not None and titan:
        titan_llama.apply_fsdp(model, dp_mesh)
    elif dp_mesh is not None:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        kwargs = {"mesh": dp_mesh, "reshard_after_forward": "keep" not in options}
        if "bf16" in options:
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if "offload" in options:
            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
        for block in model.blocks:
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = {**CONFIG, "module_ranks": [0]} if "rank0" in options else CONFIG
    if "fwd" in options:
        config = {**config, "forward_only": True}
    if "params" in options:
        config = {**config, "xy_distribution": False, "all_xy": False}
    monitor = None if "off" in options else trainmon.attach(model, optimizer, config=config)

    dp_rank, dp_size = (dp_mesh.get_local_rank(), dp_mesh.size()) if dp_mesh is not None else (0, 1)
    for option in options:
        if option.startswith("part"):
            dp_rank, dp_size = map(int, option[4:].split("of"))
    names = dict(model.named_parameters())
    steps = []
    for step in range(STEPS):
        if titan:
            inputs, labels = titan_llama.batch(step, dp_rank=dp_rank, dp_size=dp_size)
        else:
            batch = global_batch(step).chunk(dp_size)[dp_rank]
            inputs, labels = batch[:, :-1], batch[:, 1:]
        logits = model(inputs)
        loss = F.cross_entropy(logits.float().reshape(-1, vocab), labels.reshape(-1))
        if monitor is not None:
            monitor.track("loss", loss)
        optimizer.zero_grad()
        loss.backward()
        truth: dict[str, dict[str, float]] = {}
        for name, p in names.items():
            truth[f"grad_reduced/{name}"] = stats_of(full(p.grad))
            if dp_mesh is None:  # else each data-parallel rank's own gradient, before the reduction
                truth[f"grad_unreduced/{name}"] = stats_of(full(p.grad))
            truth[f"param_origin/{name}"] = stats_of(full(p))
        optimizer.step()
        for name, p in names.items():
            truth[f"param_updated/{name}"] = stats_of(full(p))
            state = optimizer.state[p]
            truth[f"exp_avg/{name}"] = stats_of(full(state["exp_avg"]))
            truth[f"exp_avg_sq/{name}"] = stats_of(full(state["exp_avg_sq"]))
        latest = monitor.latest() if monitor is not None else None
        steps.append(
            {
                "loss": loss.item(),
                "monitor": {key: dict(value) for key, value in latest.items()} if latest else {},
                "truth": truth if monitor is not None else {},
            }
        )
    if monitor is not None:
        monitor.close()
    return steps


if __name__ == "__main__":
    main()
