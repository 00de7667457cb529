"""``trainmon demo``: train a small GPT-style model on the CPU, monitor on, with an injected loss spike."""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import torch

import trainmon
from trainmon.demo import DemoSetup, build, learning_rate, lm_loss, synthetic_batch

DEMO_CONFIG = {
    "xy_distribution": True,
    "all_xy": True,
    "wg_distribution": True,
    "mv_distribution": True,
    "ur_distribution": True,
    "param_distribution": True,
}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("demo", help="train a small GPT on the CPU with the monitor on")
    parser.add_argument("--logdir", default="runs/demo", help="run directory (default: runs/demo)")
    parser.add_argument("--steps", type=int, default=150, help="optimizer steps (default: 150)")
    parser.add_argument("--spike-step", type=int, default=None, help="step whose learning rate is blown up")
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(func=run)


def _prepare(logdir: Path) -> None:
    """Reuse the directory of an earlier demo; never delete anything that is not a trainmon run."""
    if not logdir.exists() or not any(logdir.iterdir()):
        return
    if not (logdir / "plugins" / "trainmon" / "manifest.json").exists():
        raise SystemExit(f"error: {logdir} exists and is not a trainmon run; choose another --logdir")
    shutil.rmtree(logdir)


def run(args: argparse.Namespace) -> int:
    if args.steps < 1:
        raise SystemExit("error: --steps must be >= 1")
    spike = args.spike_step if args.spike_step is not None else max(1, (2 * args.steps) // 3)
    setup = DemoSetup(spike_step=spike)
    logdir = Path(args.logdir)
    _prepare(logdir)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    model, optimizer = build(setup, args.seed)
    generator = torch.Generator().manual_seed(args.seed + 1)
    losses: list[float] = []
    started = time.perf_counter()
    with trainmon.attach(model, optimizer, config=DEMO_CONFIG, logdir=logdir) as monitor:
        for step in range(args.steps):
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(setup, step)
            loss = lm_loss(model, synthetic_batch(setup, generator))
            monitor.track("loss", loss)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())  # the demo prints the curve; the monitor itself never syncs
        monitor.flush()
    elapsed = time.perf_counter() - started
    worst = max(range(spike, len(losses)), key=losses.__getitem__, default=None)
    print(f"trained {args.steps} steps in {elapsed:.1f} s; loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    if worst is not None:
        print(
            f"injected a learning-rate spike (x{setup.spike_lr_factor:g}) at step {spike}; "
            f"loss peaked at {losses[worst]:.3f} at step {worst} (was {losses[spike - 1]:.3f})"
        )
    print(f"statistics: {logdir.resolve()}  (TensorBoard events and CSV under rank_0/)")
    print(f"view them:  tensorboard --logdir {logdir}")
    return 0
