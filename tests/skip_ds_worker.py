"""DeepSpeed worker for tests/test_skip_deepspeed.py: ``alert.on_nan: skip`` at every ZeRO stage.

Run with launcher environment (torchrun, or RANK/WORLD_SIZE/MASTER_* set by the test for one process) and
DS_ACCELERATOR=cpu. Trains :class:`MaskedMLP` with a WarmupLR scheduler for ``--steps`` steps; at global step
``--nan-step`` the ``poison`` module of rank ``--poison-rank`` only writes a NaN into its output, which the
model masks right after (as attention masking does): the monitor sees a NaN activation, yet every gradient
stays finite, so DeepSpeed's own overflow checks find nothing and the update would land without the monitor.

After every optimizer step the report holds digests of the model parameters, DeepSpeed's fp32 master
copies and Adam moments (gathered where partitioned: collectives, called on every rank in the same order),
the engine's skipped_steps, the LR scheduler's count, the loss scale, and the monitor's record.
``--overflow-steps`` make the loss NaN (every gradient NaN, on every rank): DeepSpeed's own overflow steps.
``--on-nan raise`` / ``exit``: training stops where ``engine.step()`` raises (TrainingNaNError, SystemExit);
the report's ``stopped`` holds what was raised, at which step, and the digests right after it.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib
import json
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Poison(nn.Module):
    """Identity, except that one element becomes NaN when ``armed`` (a stand-in for a layer gone bad)."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.armed:
            return x
        mask = torch.zeros_like(x, dtype=torch.bool)
        mask[0, 0] = True
        return x.masked_fill(mask, float("nan"))  # its backward passes no gradient to the NaN element


class MaskedMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(7, 13)
        self.norm = nn.LayerNorm(13)
        self.poison = Poison()
        self.fc2 = nn.Linear(13, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nan_to_num(self.poison(self.norm(self.fc1(x))), nan=0.0)  # masked: gradients stay finite
        return self.fc2(torch.tanh(h))


def ds_config(args: argparse.Namespace) -> dict:
    config: dict = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": args.zero},
        "steps_per_print": 10**9,
        "scheduler": {
            "type": "WarmupLR",
            "params": {
                "warmup_min_lr": 1e-3,
                "warmup_max_lr": 1e-2,
                "warmup_num_steps": 100,
                "warmup_type": "linear",
            },
        },
    }
    if args.zero == 3:
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    if args.dtype == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 8}
    if args.dtype == "bf16":
        config["bf16"] = {"enabled": True}
        if args.fp32_grad_accum:  # bf16 + ZeRO-1 + fp32 accumulation selects BF16_Optimizer
            config["data_types"] = {"grad_accum_dtype": "fp32"}
    return config


def _digest(t: torch.Tensor | None) -> str | None:
    if t is None:
        return None
    t = t.detach().contiguous().cpu()
    return hashlib.sha256(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()


def snapshot(engine) -> dict:
    """Digests of every parameter: the model's (gathered under ZeRO-3), the fp32 master and Adam moments."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out: dict = {}
    named = list(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in named], enabled=args_zero(engine) == 3):
        for name, p in named:
            out[f"param/{name}"] = _digest(p)
    if args_zero(engine) > 0 or type(engine.optimizer).__name__ == "BF16_Optimizer":
        for name, p in named:
            out[f"fp32/{name}"] = _digest(safe_get_full_fp32_param(p))
            for key in ("exp_avg", "exp_avg_sq"):
                out[f"{key}/{name}"] = _digest(safe_get_full_optimizer_state(p, key))
    else:  # ZeRO-0: the base optimizer's own state, whole on every rank
        base = getattr(engine.optimizer, "optimizer", engine.optimizer)
        for i, (tensor, state) in enumerate(base.state.items()):
            out[f"master{i}"] = _digest(tensor)
            for key in ("exp_avg", "exp_avg_sq"):
                out[f"{key}{i}"] = _digest(state.get(key))
            out[f"step{i}"] = str(float(state.get("step", 0)))
    return out


def args_zero(engine) -> int:
    return int(engine.zero_optimization_stage())


def run(args: argparse.Namespace, rank: int) -> dict:
    import deepspeed

    import trainmon
    import trainmon.anomaly.alerts

    dtype = DTYPES[args.dtype]
    torch.manual_seed(0)
    model = MaskedMLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(args))
    config = {"xy_distribution": True, "all_xy": True, "wg_distribution": True, "mv_distribution": True}
    if not args.no_skip:
        config["alert"] = {"on_nan": args.on_nan, "max_skips": args.max_skips, "exit_code": 5}
    overflow_steps = {int(s) for s in args.overflow_steps.split(",") if s}
    mon = trainmon.attach(engine, config=config, logdir=args.logdir)
    generator = torch.Generator().manual_seed(1000 + rank)
    steps: list[dict] = []
    stopped = None
    for _ in range(args.steps):
        x = torch.randn(4, 7, generator=generator).to(dtype)
        y = torch.randn(4, 5, generator=generator).to(dtype)
        step = engine.global_steps
        engine.module.poison.armed = rank == args.poison_rank and step == args.nan_step
        loss = nn.functional.mse_loss(engine(x), y)
        if step in overflow_steps:  # every gradient NaN: DeepSpeed's own overflow check skips the step
            loss = loss * float("nan")
        engine.backward(loss)
        try:
            engine.step()
        except (trainmon.anomaly.alerts.TrainingNaNError, SystemExit) as error:
            what = type(error).__name__
            detail = error.code if isinstance(error, SystemExit) else str(error)
            stopped = {"step": step, "raised": what, "detail": detail, "weights": snapshot(engine)}
            break
        record = mon._latest[0] if mon._latest is not None else None
        steps.append(
            {
                "step": step,
                "loss": float(loss.detach().float()),
                "weights": snapshot(engine),
                "skipped_steps": engine.skipped_steps,
                "lr_steps": engine.lr_scheduler.last_batch_iteration,
                "loss_scale": float(getattr(engine.optimizer, "loss_scale", 1.0)),
                "record_step": None if record is None else record.step,
                "record_skipped": None if record is None else bool(record.skipped),
                "record_reason": None if record is None else record.skip_reason,
            }
        )
    mon.close()
    return {
        "optimizer": type(engine.optimizer).__name__,
        "skips_steps": bool(getattr(mon._optimizer_collector._adapter, "skips_steps", False)),
        "step_wrapped_after_close": "step" in vars(engine.optimizer),
        "overflow_attr_after_close": "overflow" in vars(engine.optimizer),
        "steps": steps,
        "stopped": stopped,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--zero", type=int, default=2)
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="fp32")
    parser.add_argument("--fp32-grad-accum", action="store_true")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--nan-step", type=int, default=2)
    parser.add_argument("--poison-rank", type=int, default=0)
    parser.add_argument("--no-skip", action="store_true", help="alert.on_nan left at its default")
    parser.add_argument("--on-nan", choices=("skip", "raise", "exit"), default="skip")
    parser.add_argument("--max-skips", type=int, default=10)
    parser.add_argument("--overflow-steps", default="", help="steps whose loss is made NaN (comma list)")
    parser.add_argument("--logdir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--local_rank", type=int, default=None)
    args = parser.parse_args()

    import deepspeed

    # the CPU shared-memory comm op is JIT-compiled (70-90 s) at the first init; gloo does without it
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    if args.dtype == "fp16":  # as in tests/ds_worker.py: DeepSpeed's real fp16 path on any CPU
        from deepspeed.accelerator import get_accelerator

        get_accelerator().is_fp16_supported = lambda: True
    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=60))
    rank = torch.distributed.get_rank()
    try:
        Path(f"{args.out}.rank{rank}.json").write_text(json.dumps(run(args, rank)))
    finally:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
