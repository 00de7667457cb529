"""Worker for tests/test_megatron.py: trains a tiny megatron-core GPTModel on the CPU (gloo) and writes losses
and the monitor's statistics as JSON. Run in a subprocess, one per rank (launcher-style env: RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT).

The data do not depend on the parallel layout: every step has the same global batch of ``GLOBAL_MICRO``
micro-batches; data-parallel rank r trains micro-batches r, r + dp, ... so a 1-process run (all micro-batches,
gradient accumulation) and a 2-process data-parallel run see the same samples and average the same gradients.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shim lives next to this file

from megatron_cpu_shim import causal_mask, install, seed  # noqa: E402

install()

from megatron.core import parallel_state  # noqa: E402
from megatron.core.distributed import (  # noqa: E402
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,  # noqa: E402
)
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402

VOCAB, SEQ, MBS, GLOBAL_MICRO = 128, 16, 2, 4
CONFIG = {
    "xy_distribution": True,
    "wg_distribution": True,
    "mv_distribution": True,
    "param_distribution": True,
    "ur_distribution": True,
    "format": ["csv"],
}


def build(args: argparse.Namespace) -> tuple[list[torch.nn.Module], object]:
    """The tiny GPT, wrapped in mcore DDP, and the Megatron optimizer, as Megatron-LM's setup builds them."""
    seed(1234)
    recompute = (
        {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
        if args.recompute
        else {}
    )
    config = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        use_cpu_initialization=True,  # the master weight is built whole and split: same init for any TP
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=args.tp,
        gradient_accumulation_fusion=False,  # needs a CUDA extension
        **recompute,
    )
    model = GPTModel(
        config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
    )
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=args.optimizer == "dist"
    )
    chunk = DistributedDataParallel(config, ddp_config, model)
    chunks = [chunk]
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=1e-2,
        use_distributed_optimizer=args.optimizer == "dist",
        clip_grad=1.0,
        bf16=False,
        fp16=False,
    )
    optimizer = get_megatron_optimizer(opt_config, chunks)
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = chunk.no_sync
    return chunks, optimizer


def micro_batch(step: int, index: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + index)
    tokens = torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=generator)
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(MBS, SEQ)
    losses = model(batch["tokens"], position_ids, causal_mask(SEQ), labels=batch["labels"])

    def loss_func(output):
        loss = output.float().mean()
        return loss, {"loss": loss.detach().clone()}  # the schedule divides loss in place

    return losses, loss_func


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--optimizer", choices=("fp32", "dist"), default="fp32")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--recompute", action="store_true")
    parser.add_argument("--trainmon", action="store_true")
    parser.add_argument("--logdir", default=None)
    parser.add_argument(
        "--enable", action="store_true", help="trainmon.enable_megatron + a Megatron-LM stand-in"
    )
    parser.add_argument(
        "--nan-at", type=int, default=None, help="run_nan: the step whose forward makes a NaN"
    )
    parser.add_argument("--alert", default=None, help="run_nan: the monitor's alert section, as JSON")
    args = parser.parse_args()
    torch.distributed.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp)
    if args.enable:
        run_enabled(args)
        return
    if args.nan_at is not None:
        run_nan(args)
        return
    chunks, optimizer = build(args)
    num_micro = GLOBAL_MICRO // parallel_state.get_data_parallel_world_size()

    monitor = None
    if args.trainmon:
        import trainmon

        monitor = trainmon.attach(
            chunks, optimizer, config=CONFIG, logdir=args.logdir, grad_acc_steps=num_micro
        )
    losses, stats = train(chunks, optimizer, args.steps, monitor)
    if monitor is not None:
        monitor.close()
    finish(args.out, losses, stats)


def train(chunks, optimizer, steps: int, monitor, on_step=None) -> tuple[list[float], list[dict]]:
    """``on_step(step, result of optimizer.step())``, when given, takes over checking that the update
    landed."""
    dp = parallel_state.get_data_parallel_world_size()
    dp_rank = parallel_state.get_data_parallel_rank()
    num_micro = GLOBAL_MICRO // dp
    losses, stats = [], []
    forward_backward = get_forward_backward_func()
    for step in range(steps):
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        data = iter([micro_batch(step, dp_rank + dp * i) for i in range(num_micro)])
        reduced = forward_backward(
            forward_step_func=forward_step,
            data_iterator=data,
            model=chunks,
            num_microbatches=num_micro,
            seq_length=SEQ,
            micro_batch_size=MBS,
            forward_only=False,
        )
        result = optimizer.step()
        if on_step is None:
            assert result[0]
        else:
            on_step(step, result)
        local = torch.stack([r["loss"] for r in reduced]).sum()
        torch.distributed.all_reduce(local, group=parallel_state.get_data_parallel_group())
        losses.append(float(local) / GLOBAL_MICRO)
        if monitor is not None:
            latest = monitor.latest()
            stats.append({"step": latest.step, **{key: dict(value) for key, value in latest.items()}})
    return losses, stats


def finish(out: str, losses: list[float], stats: list[dict]) -> None:
    rank = torch.distributed.get_rank()
    Path(f"{out}.rank{rank}.json").write_text(
        json.dumps({"losses": [x.hex() for x in losses], "stats": stats})
    )
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


NAN_MODULE = "decoder.layers.1.mlp"  # the module whose forward output turns NaN at --nan-at


def run_nan(args: argparse.Namespace) -> None:
    """A NaN made by ``NAN_MODULE``'s forward at step ``--nan-at`` on data-parallel rank 0 (its gradients
    then reach every rank through the reduction), with the monitor's ``alert`` section from ``--alert``.
    Writes, per step, what ``optimizer.step()`` returned and digests of the model parameters and of the
    optimizer state (main parameters, Adam moments and step counts)."""
    import hashlib

    import trainmon
    import trainmon.anomaly.alerts

    chunks, optimizer = build(args)
    steps_taken: list[int] = []  # the step now running, for the hook

    def poison(module, inputs, output):
        if steps_taken[-1] != args.nan_at or parallel_state.get_data_parallel_rank() != 0:
            return None
        first = output[0] if isinstance(output, tuple) else output
        poisoned = first * float("nan")
        return (poisoned, *output[1:]) if isinstance(output, tuple) else poisoned

    # registered before attach, so the monitor's hook sees the NaN output: the module is the origin
    dict(chunks[0].module.named_modules())[NAN_MODULE].register_forward_hook(poison)
    num_micro = GLOBAL_MICRO // parallel_state.get_data_parallel_world_size()
    config = {**CONFIG, "alert": json.loads(args.alert) if args.alert else {}}
    monitor = trainmon.attach(chunks, optimizer, config=config, logdir=args.logdir, grad_acc_steps=num_micro)

    def digest(tensors) -> str:
        h = hashlib.sha256()
        for t in tensors:
            h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    def optimizer_state():
        for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
            base = inner.optimizer
            for group in base.param_groups:
                for param in group["params"]:
                    state = base.state.get(param, {})
                    yield param
                    yield from (torch.as_tensor(state[key]) for key in sorted(state))

    records: list[dict] = []

    def on_step(step: int, result) -> None:
        ok, grad_norm, _ = result
        records.append(
            {
                "ok": ok,
                "grad_norm": grad_norm,
                "params": digest(p for c in chunks for p in c.parameters()),
                "optimizer": digest(optimizer_state()),
            }
        )
        steps_taken.append(step + 1)

    steps_taken.append(0)
    before = {"params": digest(p for c in chunks for p in c.parameters())}
    stopped = None
    try:
        losses, _ = train(chunks, optimizer, args.steps, monitor, on_step)
    except (trainmon.anomaly.alerts.TrainingNaNError, SystemExit) as error:  # alert.on_nan: raise / exit
        losses = []
        stopped = {
            "step": steps_taken[-1],
            "raised": type(error).__name__,
            "detail": error.code if isinstance(error, SystemExit) else str(error),
            "params": digest(p for c in chunks for p in c.parameters()),
            "optimizer": digest(optimizer_state()),
        }
    monitor.close()
    rank = torch.distributed.get_rank()
    Path(f"{args.out}.rank{rank}.json").write_text(
        json.dumps(
            {"losses": [x.hex() for x in losses], "before": before, "steps": records, "stopped": stopped}
        )
    )
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def run_enabled(args: argparse.Namespace) -> None:
    """``trainmon.enable_megatron`` against a stand-in for ``megatron.training`` (megatron-core 0.16.1
    ships without it, and Megatron-LM's ``pretrain`` needs CUDA): a module with Megatron-LM's function
    names, whose ``pretrain`` calls ``setup_model_and_optimizer`` and ``train_step`` as module globals, as
    Megatron-LM's does."""
    import types

    import trainmon

    megatron_args = types.SimpleNamespace(
        global_batch_size=GLOBAL_MICRO * MBS, micro_batch_size=MBS, data_parallel_size=1, iteration=0
    )
    package = types.ModuleType("megatron.training")
    package.__path__ = []
    training = types.ModuleType("megatron.training.training")
    package.get_args = training.get_args = lambda: megatron_args
    package.training = training
    sys.modules["megatron.training"], sys.modules["megatron.training.training"] = package, training
    outcome: dict = {}

    def setup_model_and_optimizer(model_provider, model_type, **kwargs):
        chunks, optimizer = build(args)
        megatron_args.iteration = 5  # what loading a checkpoint of iteration 5 leaves in args
        return chunks, optimizer, None

    def train_step(chunks, optimizer, steps):
        return train(chunks, optimizer, steps, handle.monitor)

    def pretrain(steps):
        chunks, optimizer, _ = training.setup_model_and_optimizer(None, None)
        outcome["result"] = training.train_step(chunks, optimizer, steps)

    training.setup_model_and_optimizer = setup_model_and_optimizer
    training.train_step = train_step
    training.pretrain = pretrain

    handle = trainmon.enable_megatron(config=CONFIG, logdir=args.logdir)  # the one line
    training.pretrain(args.steps)
    restored = training.setup_model_and_optimizer is not setup_model_and_optimizer
    handle.close()
    assert restored and training.setup_model_and_optimizer is setup_model_and_optimizer
    finish(args.out, *outcome["result"])


if __name__ == "__main__":
    main()
