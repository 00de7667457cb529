"""torchtitan's way all at once, for tests/test_titan.py: the Llama of tests/titan_llama.py with torchtitan's
tensor parallel plan inside FSDP2 on a (dp, tp) = (2, 2) gloo mesh, each block compiled in place, a bf16
``MixedPrecisionPolicy``, two micro-batches a step, every kind of statistic on.

    python titan_worker.py OUT_DIR PORT JOB [JOB ...]        (4 ranks, 8 with ``pp``: RANK, WORLD_SIZE set)

Each JOB is ``NAME:OPTIONS`` and runs in turn in the same processes. OPTIONS (comma separated):

* ``compile``: each block compiled in place with ``aot_eager`` (after TP, before FSDP2, as torchtitan does);
  ``inductor``: with inductor instead (minutes of C++ compilation on a CPU: not in the test suite);
* ``bf16``: bf16 parameters, fp32 reduction (else fp32 throughout); ``sp``: sequence parallelism;
* ``nosync``: FSDP2 reduces the gradients on the last micro-batch only (``set_requires_gradient_sync``);
* ``pp``: 3D, a (pp, dp, tp) = (2, 2, 2) mesh on 8 ranks: each rank runs one pipeline stage (torchtitan's
  split of the model) under ``torch.distributed.pipelining``'s GPipe schedule, 2 micro-batches a step (then
  the losses are those of the last stage's ranks, and no NaN can be planted);
* ``off``: no monitor (what the monitored job must equal bitwise); ``params``: parameter-side kinds only (no
  activations nor their gradients);
* ``nan=S@R+R``: rank R's (and R's...) ``layers.0.attention_norm`` output multiplied by NaN in micro-batch
  0 of step S; ``on_nan=MODE``: ``alert.on_nan`` (continue, raise, skip);
* ``eps=MODULE@VALUE``: that RMSNorm's epsilon (a planted difference between two runs);
* ``steps=N`` (default 4).

Each rank writes ``OUT_DIR/NAME/rank_<r>.json``: the losses of every micro-batch, hashes of this rank's
parameters and Adam state (values and step counts) before and after every step, the step at which
``TrainingNaNError`` reached the loop and its message, the statistics of the whole tensors
(``DTensor.full_tensor()``) where the monitor takes them beside the monitor's own (``Monitor.latest()``), the
row names of every collected step, and trainmon's log lines. The monitored jobs write their run directory to
``OUT_DIR/NAME/run``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

import trainmon
from trainmon.anomaly.alerts import TrainingNaNError

sys.path.insert(0, str(Path(__file__).parent))
import titan_llama  # noqa: E402 - tests/ is not a package

MICRO_BATCHES = 2
CONFIG = {
    "xy_distribution": True,
    "all_xy": True,
    "wg_distribution": True,
    "mv_distribution": True,
    "ur_distribution": True,
    "param_distribution": True,
    "timing": {"enable": False},
}
PARAM_KINDS = ("grad_reduced", "param_origin", "param_updated", "exp_avg", "exp_avg_sq")


class Lines(logging.Handler):
    """trainmon's log lines of one job."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def options_of(text: str) -> dict[str, str]:
    return dict((o.split("=", 1) + [""])[:2] for o in text.split(",") if o)


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def stats_of(t: torch.Tensor) -> dict[str, float]:
    a = full(t).detach().to(torch.float64).numpy().ravel()
    finite = a[np.isfinite(a)]
    return {
        "min": float(finite.min()) if finite.size else float("nan"),
        "max": float(finite.max()) if finite.size else float("nan"),
        "norm": float(np.sqrt((finite * finite).sum())) if finite.size else float("nan"),
        "nans": int(np.isnan(a).sum()),
    }


def digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(local(t).detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def state_digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, object]:
    params = list(model.parameters())
    held = [optimizer.state[p] for p in params if p in optimizer.state]
    moments = [state[k] for state in held for k in ("exp_avg", "exp_avg_sq")]
    steps = [float(optimizer.state[p]["step"]) for p in params if p in optimizer.state]
    return {"params": digest(params), "moments": digest(moments), "steps": steps}


def main() -> None:
    out, port, jobs = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    lines = Lines()
    logging.getLogger("trainmon").addHandler(lines)
    for job in jobs:
        name, _, options = job.partition(":")
        lines.lines = []
        start = time.monotonic()
        result = run(out / name, options_of(options), rank)
        result["log"], result["seconds"] = lines.lines, time.monotonic() - start
        (out / name).mkdir(parents=True, exist_ok=True)
        (out / name / f"rank_{rank}.json").write_text(json.dumps(result))
        dist.barrier()
    dist.destroy_process_group()


def build(options: dict[str, str]):
    """The model (this rank's pipeline stage with ``pp``), parallelised torchtitan's way, its optimizer, this
    rank's data-parallel index and the pipeline schedule (None without ``pp``)."""
    from torch.distributed.device_mesh import init_device_mesh

    pipelined = "pp" in options
    shape, dims = ((2, 2, 2), ("pp", "dp", "tp")) if pipelined else ((2, 2), ("dp", "tp"))
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=dims)
    model = titan_llama.make(build_optimizer=False)[0]
    if pipelined:
        titan_llama.pipeline_stage(model, mesh["pp"].get_local_rank(), 2)
    if "eps" in options:
        module, _, value = options["eps"].partition("@")
        model.get_submodule(module).eps = float(value)
    titan_llama.apply_tp(model, mesh["tp"], sequence_parallel="sp" in options)
    if "compile" in options or "inductor" in options:
        titan_llama.apply_compile(model, "inductor" if "inductor" in options else "aot_eager")
    mp = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32} if "bf16" in options else None
    titan_llama.apply_fsdp(model, mesh["dp"], mp_policy=mp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    schedule = None
    if pipelined:
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

        pp = mesh["pp"]
        stage = PipelineStage(model, pp.get_local_rank(), 2, torch.device("cpu"), group=pp.get_group())
        schedule = ScheduleGPipe(stage, n_microbatches=MICRO_BATCHES, loss_fn=cross_entropy)
    return model, optimizer, mesh["dp"].get_local_rank(), schedule


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def run(folder: Path, options: dict[str, str], rank: int) -> dict:
    torch._dynamo.reset()  # each job's blocks compiled afresh: no job adds to another's recompile count
    model, optimizer, dp_rank, schedule = build(options)
    monitor = None
    if "off" not in options:
        config = {**CONFIG, "alert": {"on_nan": options.get("on_nan", "continue")}}
        if "params" in options:
            config.update(xy_distribution=False, all_xy=False)
        monitor = trainmon.attach(
            model, optimizer, config=config, logdir=str(folder / "run"), grad_acc_steps=MICRO_BATCHES
        )
    nan_step, nan_ranks = -1, set()
    if "nan" in options:
        step, _, ranks = options["nan"].partition("@")
        nan_step, nan_ranks = int(step), {int(r) for r in ranks.split("+")}
    poisoned = model.layers["0"].attention_norm if "0" in model.layers else None
    names = dict(model.named_parameters())
    result: dict = {"losses": [], "before": [], "after": [], "truth": [], "monitor": [], "rows": []}
    for step in range(int(options.get("steps", 4))):
        if schedule is not None:  # the schedule splits the batch into micro-batches and runs them
            inputs, labels = titan_llama.batch(step, dp_rank=dp_rank, dp_size=2)
            losses: list[torch.Tensor] = []
            if model.tok_embeddings is not None:  # the first stage takes the tokens, the last the labels
                schedule.step(inputs)
            else:
                schedule.step(target=labels, losses=losses)
            for loss in losses:
                if monitor is not None:
                    monitor.track("loss", loss)
                result["losses"].append(loss.item())
        for micro in range(MICRO_BATCHES if schedule is None else 0):
            inputs, labels = titan_llama.batch(step * MICRO_BATCHES + micro, dp_rank=dp_rank, dp_size=2)
            planted = (step, micro) == (nan_step, 0) and rank in nan_ranks
            poisoned.poison = torch.tensor(float("nan")) if planted else None
            if "nosync" in options:
                model.set_requires_gradient_sync(micro == MICRO_BATCHES - 1)
            loss = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten()) / MICRO_BATCHES
            poisoned.poison = None
            if monitor is not None:
                monitor.track("loss", loss)
            loss.backward()
            result["losses"].append(loss.item())
        truth = {}
        for name, p in names.items():
            if p.grad is not None:
                truth[f"grad_reduced/{name}"] = stats_of(p.grad)
            truth[f"param_origin/{name}"] = stats_of(p)
        result["before"].append(state_digest(model, optimizer))
        try:
            optimizer.step()
        except TrainingNaNError as error:
            result["raised"] = {"step": step, "message": str(error)}
            result["after"].append(state_digest(model, optimizer))
            break
        result["after"].append(state_digest(model, optimizer))
        for name, p in names.items():
            truth[f"param_updated/{name}"] = stats_of(p)
            if p in optimizer.state:
                truth[f"exp_avg/{name}"] = stats_of(optimizer.state[p]["exp_avg"])
                truth[f"exp_avg_sq/{name}"] = stats_of(optimizer.state[p]["exp_avg_sq"])
        optimizer.zero_grad()
        result["truth"].append(truth)
        latest = monitor.latest() if monitor is not None else None
        result["monitor"].append({key: dict(value) for key, value in latest.items()} if latest else {})
        result["rows"].append(sorted(latest.keys()) if latest else [])
    if monitor is not None:
        monitor.close()
    return result


if __name__ == "__main__":
    main()
