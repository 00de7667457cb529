"""DeepSpeed training worker for tests/test_deepspeed.py.

Run with launcher environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT: torchrun, or set by the test for
one process) and DS_ACCELERATOR=cpu. Trains a small MLP whose parameters have odd sizes (so ZeRO partitions
split parameters and pad the last part) with different data on every rank, and writes a JSON report:

- ``compare``: the monitor attached, and DeepSpeed's own ``safe_get_full_grad`` /
  ``safe_get_full_optimizer_state`` / ``safe_get_full_fp32_param`` taken at the same points (just before
  and just after the optimizer step, called on every rank in the same order: they are collectives). For
  every step and parameter the report holds the monitor's statistics (``Monitor.latest()``) and the
  reference ones, computed in float64 from the full tensors.
- ``losses``: the losses of the same run without and with the monitor (full coverage), for bitwise checks.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

FULL = {
    "xy_distribution": True,
    "all_xy": True,
    "wg_distribution": True,
    "mv_distribution": True,
    "param_distribution": True,
    "ur_distribution": True,
}
STATS = ("min", "max", "mean", "norm", "zeros", "nans", "infs")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
BETAS, ADAM_EPS, LR = (0.9, 0.999), 1e-8, 1e-2


class OddMLP(nn.Module):
    """Parameter sizes 91, 13, 13, 13, 65, 5 (200 in all): ZeRO-1/2 partition boundaries on 2 ranks fall
    inside a parameter, and ZeRO-3 pads every odd-sized parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(7, 13)
        self.norm = nn.LayerNorm(13)
        self.fc2 = nn.Linear(13, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.norm(self.fc1(x))))


def ds_config(args: argparse.Namespace) -> dict:
    config: dict = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": args.grad_acc,
        "gradient_clipping": 1.0,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": args.zero},
        "steps_per_print": 10**9,
    }
    if args.zero == 3:  # partition even tiny parameters (the default keeps < 1e5 elements whole)
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    if args.dtype == "fp16":  # dynamic loss scaling: steps with inf/NaN gradients are skipped
        config["fp16"] = {"enabled": True, "initial_scale_power": 8}
    if args.dtype == "bf16":
        config["bf16"] = {"enabled": True}
        if args.fp32_grad_accum:  # bf16 + ZeRO-1 + fp32 accumulation selects BF16_Optimizer
            config["data_types"] = {"grad_accum_dtype": "fp32"}
    return config


def batches(rank: int, steps: int, grad_acc: int, dtype: torch.dtype) -> list[tuple[torch.Tensor, ...]]:
    generator = torch.Generator().manual_seed(1000 + rank)  # different data on every rank
    out = []
    for _ in range(steps * grad_acc):
        x = torch.randn(4, 7, generator=generator)
        x[:, 0] = 0.0  # fc1.weight[:, 0] gets exactly zero gradients: the zeros statistic is not trivial
        x = x.to(dtype)
        y = torch.randn(4, 5, generator=generator).to(dtype)
        out.append((x, y))
    return out


def make_engine(args: argparse.Namespace):
    import deepspeed

    torch.manual_seed(0)
    model = OddMLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=ADAM_EPS, weight_decay=0.01)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(args))
    return engine


def train(engine, data, nan_step: int | None = None, on_step=None) -> list[float]:
    losses = []
    for i, (x, y) in enumerate(data):
        loss = nn.functional.mse_loss(engine(x), y)
        if nan_step is not None and engine.global_steps == nan_step:
            loss = loss * float("nan")  # every gradient NaN: the optimizer skips this step
        engine.backward(loss)
        boundary = engine.is_gradient_accumulation_boundary()
        engine.step()
        losses.append(loss.detach().float().item())
        if boundary and on_step is not None:
            on_step(i)
    return losses


# ------------------------------------------------------------------------------------ reference stats


def full_stats(t: torch.Tensor | None, eps: float = 1e-8) -> dict | None:
    """The monitor's statistics of a whole tensor, in float64 (min/max/mean/norm over finite elements)."""
    if t is None:
        return None
    d = t.detach().to(torch.float64).flatten().numpy()
    finite = d[np.isfinite(d)]
    has = finite.size > 0
    return {
        "min": float(finite.min()) if has else math.nan,
        "max": float(finite.max()) if has else math.nan,
        "mean": float(finite.sum() / finite.size) if has else math.nan,
        "norm": float(math.sqrt((finite * finite).sum())) if has else math.nan,
        "zeros": float((np.abs(d) <= eps).sum() / d.size) if d.size else 0.0,
        "nans": float(np.isnan(d).sum()),
        "infs": float(np.isinf(d).sum()),
    }


class Reference:
    """DeepSpeed's own full tensors, around the optimizer step (wrapped before the monitor wraps it)."""

    def __init__(self, engine, names: dict[int, str], full_params: bool) -> None:
        from deepspeed.utils import (
            safe_get_full_fp32_param,
            safe_get_full_grad,
            safe_get_full_optimizer_state,
        )

        self.engine, self.names, self.steps = engine, names, {}
        self._grad, self._state, self._fp32 = (
            safe_get_full_grad,
            safe_get_full_optimizer_state,
            safe_get_full_fp32_param,
        )
        self._full_params = full_params
        self.applied = 0  # optimizer updates made so far (Adam's t)
        optimizer = engine.optimizer
        original = optimizer.step

        def step(*a, **k):
            self.current = {"grad": self._grads(), "pieces": self._pieces("grad")}
            result = original(*a, **k)
            if not getattr(optimizer, "overflow", False):
                self.applied += 1
            self.current.update(self._after())
            self.current["pieces"].update(self._pieces("value", "moments"))
            return result

        optimizer.step = step

    def params(self):
        return [(self.names[id(p)], p) for p in self.engine.module.parameters()]

    def _zero0_state(self, p: torch.Tensor) -> dict:
        optimizer = self.engine.optimizer
        if hasattr(optimizer, "fp32_groups"):  # bf16/fp16 ZeRO-0: one fp32 master per parameter
            for lp_group, masters in zip(optimizer.fp16_groups, optimizer.fp32_groups, strict=True):
                for lp, master in zip(lp_group, masters, strict=True):
                    if lp is p:
                        return optimizer.optimizer.state[master]
        return optimizer.state[p]

    def _pieces(self, *what: str) -> dict:
        """Elements of each tensor the adapter gives on this rank (Shard pieces are parts of the whole)."""
        from trainmon.adapters import Shard
        from trainmon.adapters.deepspeed import DeepSpeedAdapter

        adapter, out = DeepSpeedAdapter(self.engine), {}
        for name, p in self.params():
            for kind in what:
                found = getattr(adapter, kind)(p)
                for i, piece in enumerate(found if isinstance(found, tuple) else (found,)):
                    sharded = isinstance(piece, Shard)
                    local = piece.local if sharded else piece
                    out[f"{kind}{i if kind == 'moments' else ''}/{name}"] = [local.numel(), sharded]
        return out

    def _grads(self) -> dict:
        return {name: full_stats(self._grad(p)) for name, p in self.params()}

    def _after(self) -> dict:
        out: dict = {"exp_avg": {}, "exp_avg_sq": {}, "param": {}, "update": {}, "ratio": {}}
        # Adam's t is AdamW's own counter, the same for every tensor it updates; it is not always the number
        # of updates: FP16_UnfusedOptimizer makes one zero-gradient step at init to create the state
        base = getattr(self.engine.optimizer, "optimizer", self.engine.optimizer)
        t = float(next(iter(base.state.values()))["step"]) if self.applied else 0.0
        c1, c2 = 1 - BETAS[0] ** t, 1 - BETAS[1] ** t
        for name, p in self.params():
            m, v = (self._state(p, key) for key in ("exp_avg", "exp_avg_sq"))
            if m is None:  # ZeRO-0: DeepSpeed has no accessor; the state of the tensor the optimizer updates
                state = self._zero0_state(p)
                m, v = state["exp_avg"], state["exp_avg_sq"]
            out["exp_avg"][name], out["exp_avg_sq"][name] = full_stats(m), full_stats(v)
            if self.applied:
                m64, v64 = m.double() / c1, (v.double() / c2).sqrt()
                out["update"][name] = full_stats(m64 / (v64 + ADAM_EPS))
                # m = v = 0 (a gradient always exactly zero) has ratio 0 by the monitor's convention
                out["ratio"][name] = full_stats(m64 / (v64 + (m64 == 0).double()))
            full = self._fp32(p) if self._full_params else None
            out["param"][name] = full_stats(full if full is not None else p)
        return out


def run_compare(args: argparse.Namespace, rank: int) -> dict:
    import trainmon

    engine = make_engine(args)
    names = {id(p): n for n, p in engine.module.named_parameters()}
    # fp32 runs: the monitor's value of a parameter is the fp32 one (the whole param, or ZeRO-3's partition)
    reference = Reference(engine, names, full_params=args.dtype == "fp32")
    if args.poison_rank == rank:  # registered before attach: the monitor sees the poisoned output
        engine.module.norm.register_forward_hook(
            lambda m, i, out: out * float("nan") if engine.global_steps == args.poison_step else out
        )
    mon = trainmon.attach(engine, config=dict(FULL), logdir=args.logdir)
    finish_collectives = _count_collectives_in(mon.buffer)
    dtype = DTYPES[args.dtype]
    steps: list[dict] = []

    def on_step(_i: int) -> None:
        latest = mon.latest()
        record = mon._latest[0]
        steps.append(
            {
                "step": latest.step,
                "engine_step": engine.global_steps - 1,
                "skipped": bool(record.skipped),
                "monitor": {key: dict(latest[key]) for key in latest},
                "ref": reference.current,
                "actv_micro_steps": sorted({r.micro_step for r in record.rows if r.kind == "actv"}),
                "finish_collectives": finish_collectives[-1],
            }
        )

    losses = train(engine, batches(rank, args.steps, args.grad_acc, dtype), args.nan_step, on_step)
    mon.close()
    adapter = _adapter(engine)
    return {
        "layout": adapter.layout,
        "optimizer": type(engine.optimizer).__name__,
        "global_steps": engine.global_steps,
        "skipped_steps": engine.skipped_steps,
        "grad_acc": engine.gradient_accumulation_steps(),
        "losses": losses,
        "steps": steps,
    }


def _adapter(engine):
    from trainmon.adapters.deepspeed import DeepSpeedAdapter

    return DeepSpeedAdapter(engine)


def _count_collectives_in(buffer) -> list[int]:
    """all_reduce calls made while the step buffer closes each step (the cross-rank merge of shards)."""
    counts: list[int] = []
    original_finish, original_all_reduce = buffer.finish, torch.distributed.all_reduce
    calls = [0]

    def all_reduce(*a, **k):
        calls[0] += 1
        return original_all_reduce(*a, **k)

    def finish(*a, **k):
        calls[0] = 0
        torch.distributed.all_reduce = all_reduce
        try:
            return original_finish(*a, **k)
        finally:
            torch.distributed.all_reduce = original_all_reduce
            counts.append(calls[0])

    buffer.finish = finish
    return counts


def run_losses(args: argparse.Namespace, rank: int) -> dict:
    """The same training twice in this process, without and with the monitor (full coverage)."""
    import trainmon

    dtype = DTYPES[args.dtype]
    data = batches(rank, args.steps, args.grad_acc, dtype)
    off = train(make_engine(args), data)
    engine = make_engine(args)
    mon = trainmon.attach(engine, config=dict(FULL), logdir=args.logdir)
    on = train(engine, data)
    collected = mon.latest().step if mon.latest() is not None else None
    wrapped = "step" in vars(engine.optimizer)
    mon.close()
    return {
        "off": [float.hex(v) for v in off],
        "on": [float.hex(v) for v in on],
        "last_collected": collected,
        "step_wrapped_while_attached": wrapped,
        "step_wrapped_after_close": "step" in vars(engine.optimizer),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("compare", "losses"), default="compare")
    parser.add_argument("--zero", type=int, default=2)
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32")
    parser.add_argument("--fp32-grad-accum", action="store_true")
    parser.add_argument("--grad-acc", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--nan-step", type=int, default=None, help="global step whose loss is made NaN")
    parser.add_argument("--poison-rank", type=int, default=None, help="rank whose norm output goes NaN")
    parser.add_argument("--poison-step", type=int, default=1)
    parser.add_argument("--logdir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--local_rank", type=int, default=None)  # the deepspeed launcher appends it
    args = parser.parse_args()

    import deepspeed

    # the CPU shared-memory comm op is JIT-compiled (70-90 s) at the first init; gloo does without it
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    if args.dtype == "fp16":
        # DeepSpeed refuses fp16 on a CPU without oneDNN fp16 kernels; torch computes fp16 on any CPU, so the
        # test lets DeepSpeed's real fp16 path (loss scaling, overflow checks, skipped steps) run here
        from deepspeed.accelerator import get_accelerator

        get_accelerator().is_fp16_supported = lambda: True
    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=60))
    rank = torch.distributed.get_rank()
    try:
        run = {"compare": run_compare, "losses": run_losses}[args.mode]
        result = run(args, rank)
        Path(f"{args.out}.rank{rank}.json").write_text(json.dumps(result))
    finally:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
