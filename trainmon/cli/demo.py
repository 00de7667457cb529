"""``trainmon demo``: train a small GPT-style model on the CPU with the monitor on, a loss spike and then
a NaN injected at a known module and step, and show what trainmon found, dumped and skipped."""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

import trainmon
from trainmon.read.dump_contents import load_dump
from trainmon.read.scan import scan
from trainmon.run.anomaly_table import anomaly_ranks, read_anomalies
from trainmon.run.dumps import DumpEntry, list_dumps
from trainmon.run.layout import dumps_dir, manifest_path, stats_dir
from trainmon.run.records import NON_FINITE_RULES, SKIPPED_RULE, SUPPRESSED_RULE, Anomaly

if TYPE_CHECKING:  # torch is imported when the demo runs: the CLI's other commands work without it
    from trainmon.demo import DemoSetup

DEMO_CONFIG = {
    "xy_distribution": True,
    "all_xy": True,
    "wg_distribution": True,
    "mv_distribution": True,
    "ur_distribution": True,
    "param_distribution": True,
    "alert": {
        "rules": [
            {"rule": "nan"},
            # the loss against its recent history (an EMA that flagged values do not move)
            {
                "rule": "turbulence",
                "kinds": ["scalar"],
                "stats": ["mean"],
                "threshold": 1.0,
                "beta": 0.9,
                "warmup": 10,
            },
        ],
        "dump": True,
        # the NaN's tensors are dumped at the step it appears, before the optimizer update, and that update
        # is skipped, so the weights stay finite and training goes on
        "capture": "exact",
        "on_nan": "skip",
    },
}
NAN_MODULE = "layers.2.mlp.fc2"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("demo", help="train a small GPT on the CPU with the monitor on")
    parser.add_argument("--logdir", default="runs/demo", help="run directory (default: runs/demo)")
    parser.add_argument("--steps", type=int, default=150, help="optimizer steps (default: 150)")
    parser.add_argument("--spike-step", type=int, default=None, help="step whose learning rate is blown up")
    parser.add_argument(
        "--nan-step",
        type=int,
        default=None,
        help=f"step whose forward of {NAN_MODULE} yields NaN (default: 10 before the end; -1: none)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(func=run)


def _prepare(logdir: Path) -> None:
    """Reuse the directory of an earlier demo; never delete anything that is not a trainmon run."""
    if not logdir.exists() or not any(logdir.iterdir()):
        return
    if not manifest_path(logdir).exists():
        raise SystemExit(f"error: {logdir} exists and is not a trainmon run; choose another --logdir")
    shutil.rmtree(logdir)


def run(args: argparse.Namespace) -> int:
    import torch

    from trainmon.demo import DemoSetup, build, learning_rate, lm_loss, synthetic_batch

    if args.steps < 1:
        raise SystemExit("error: --steps must be >= 1")
    spike = args.spike_step if args.spike_step is not None else max(1, (2 * args.steps) // 3)
    nan_step = args.nan_step if args.nan_step is not None else args.steps - 10
    setup = DemoSetup(spike_step=spike)
    logdir = Path(args.logdir)
    _prepare(logdir)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    model, optimizer = build(setup, args.seed)
    generator = torch.Generator().manual_seed(args.seed + 1)
    losses: list[float] = []
    current = {"step": -1}

    def inject_nan(module: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor | None:
        return output * float("nan") if current["step"] == nan_step else None

    # the fault the demo plants (not part of the monitor): runs before the monitor's own hook
    model.get_submodule(NAN_MODULE).register_forward_hook(inject_nan, prepend=True)
    started = time.perf_counter()
    with trainmon.attach(model, optimizer, config=DEMO_CONFIG, logdir=logdir) as monitor:
        for step in range(args.steps):
            current["step"] = step
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
    _report(args, logdir, losses, elapsed, setup, spike, nan_step)
    return 0


def _report(
    args: argparse.Namespace,
    logdir: Path,
    losses: list[float],
    elapsed: float,
    setup: DemoSetup,
    spike: int,
    nan_step: int,
) -> None:
    print(f"trained {args.steps} steps in {elapsed:.1f} s; loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    after_spike = range(spike, nan_step if 0 <= nan_step < len(losses) else len(losses))
    worst = max(after_spike, key=losses.__getitem__, default=None)
    if worst is not None:
        print(
            f"injected a learning-rate spike (x{setup.spike_lr_factor:g}) at step {spike}; "
            f"loss peaked at {losses[worst]:.3f} at step {worst} (was {losses[spike - 1]:.3f})"
        )
        flagged = sorted({a.step for a in _anomalies(logdir) if a.kind == "scalar" and a.name == "loss"})
        if flagged:
            print(f"trainmon flagged the loss at steps {_ranges(flagged)}")
    if 0 <= nan_step < len(losses):
        print(f"injected a NaN into the forward output of {NAN_MODULE} at step {nan_step}")
        first = _first_non_finite(logdir)
        if first is not None:
            print(
                f"trainmon found where the NaN started: step {first.step}, rank {first.rank}, {first.phase}, "
                f"{first.kind} {first.name}{' (origin)' if first.origin else ''}"
            )
        dumps = list_dumps(logdir)
        if first is not None:
            _report_exact_dumps(logdir, [d for d in dumps if d.step == first.step], first.step)
        skipped = sorted({a.step for a in _anomalies(logdir) if a.rule == SKIPPED_RULE})
        if skipped:
            went_on = (
                f" and training went on: loss {losses[-1]:.3f} at the last step"
                if skipped[-1] < len(losses) - 1
                else ""
            )
            print(
                f"the update of step {_ranges(skipped)} was skipped (alert.on_nan: skip), so the weights "
                f"stayed finite{went_on}"
            )
        if dumps:
            print(f"tensor dumps: {len(dumps)} under {dumps_dir(logdir)}  (trainmon dump ls {logdir})")
        print(f"find it again:  trainmon analyze {logdir} --rule nan,inf   (all anomalies: without --rule)")
        print(f"explain it:     trainmon analyze {logdir} --explain   (its inputs, the dumps to open)")
    print(
        f"statistics: {logdir.resolve()}  (TensorBoard's summary under rank_0/; every statistic of every "
        f"tensor in {stats_dir(logdir)}; msprobe CSV: trainmon export {logdir} --format csv)"
    )
    print(f"view them:  tensorboard --logdir {logdir}   (the trainmon tab: timeline, heatmaps, dumps)")


def _report_exact_dumps(logdir: Path, at_step: list[DumpEntry], step: int) -> None:
    """What alert.capture: exact dumped at the NaN's own step: the origin module's inputs and outputs."""
    calls = [d for d in at_step if d.reason.startswith("exact:") and d.kind == "actv"]
    if not calls:
        return
    import torch

    print(f"trainmon dumped its input and output at step {step}, before the update (alert.capture: exact):")
    for entry in calls:
        tensor, _ = load_dump(logdir / entry.path)
        bad = int((~torch.isfinite(tensor)).sum()) if tensor.is_floating_point() else 0
        state = f"{bad} of {tensor.numel()} values NaN/Inf" if bad else "all finite"
        print(f"  {entry.name:<28} {state:<32} {entry.path}")


def _anomalies(logdir: Path) -> list[Anomaly]:
    ranks = anomaly_ranks(logdir)
    return [a for rank in ranks for a in read_anomalies(logdir, rank) if a.rule != SUPPRESSED_RULE]


def _first_non_finite(logdir: Path) -> Anomaly | None:
    """The run's first NaN/Inf anomaly across ranks: what ``trainmon analyze --rule nan,inf`` names."""
    return scan(logdir, top=1, rules=NON_FINITE_RULES).first


def _ranges(steps: list[int]) -> str:
    """``[3, 4, 5, 9]`` -> ``"3-5, 9"``."""
    spans: list[list[int]] = []
    for s in steps:
        if spans and s == spans[-1][1] + 1:
            spans[-1][1] = s
        else:
            spans.append([s, s])
    return ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in spans)
