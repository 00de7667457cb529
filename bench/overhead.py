"""Monitor overhead on the reference workload (../shared/bench/tinygpt.py), as ratios of paired runs.

Two designs, both paired:

* ``--method blocks`` (default): one fresh process per mode trains the workload in alternating blocks of
  steps, monitor detached / attached, on the same model; the figure is the median over pairs of
  (attached block median step / neighbouring detached block median step). Process-level noise (memory
  layout, frequency, other load), which is +-10% between processes on a 2-core machine, cancels out.
* ``--method processes``: a fresh subprocess per run, modes alternating within every round; the figure is
  the median over rounds of (mode step time / "off" step time of the same round).

    python bench/overhead.py                           # all modes
    python bench/overhead.py --modes full wgmv --pairs 8
    python bench/overhead.py --modes full wgmv --config-file   # the config as a watched file
    python bench/overhead.py --modes wgmv --baseline wgmv_untimed  # what per-rank timing adds
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_WORKLOAD = REPO.parent / "shared" / "bench"

FULL = {
    "xy_distribution": True,
    "all_xy": True,
    "wg_distribution": True,
    "mv_distribution": True,
    "param_distribution": True,
}
MODES: dict[str, dict | None] = {
    "off": None,
    "full": FULL,
    "wgmv": {"wg_distribution": True, "mv_distribution": True},
    "full_interval10": {**FULL, "step_interval": 10},
    "full_never": {**FULL, "start_step": 10**9},  # hooks armed for no step: the cost of an off step
    "full_ur": {**FULL, "ur_distribution": True},
    # alert.capture: exact: the step-boundary NaN/Inf read and the held activation references
    "full_exact": {**FULL, "alert": {"capture": "exact"}},
    "wgmv_exact": {"wg_distribution": True, "mv_distribution": True, "alert": {"capture": "exact"}},
    # per-rank time (on by default) against the same monitor without it: --modes X --baseline X_untimed
    "timing": {},  # the default config: nothing collected but the step's times
    "untimed": {"timing": {"enable": False}},
    "wgmv_untimed": {"wg_distribution": True, "mv_distribution": True, "timing": {"enable": False}},
    "full_untimed": {**FULL, "timing": {"enable": False}},
}


def run_one(mode: str, steps: int, warmup: int, workload: Path) -> dict:
    """Runs inside the measuring subprocess."""
    sys.path.insert(0, str(workload))
    import torch
    from tinygpt import batches, make, train  # the project's yardstick workload

    torch.set_num_threads(2)
    model, optimizer = make()
    data = batches(steps)
    with tempfile.TemporaryDirectory(prefix="tm-bench-") as logdir:
        monitor = None
        if MODES[mode] is not None:
            import trainmon

            monitor = trainmon.attach(model, optimizer, config=MODES[mode], logdir=logdir)
        times, _ = train(model, optimizer, data)
        if monitor is not None:
            monitor.close()
    return {"mode": mode, "median_s": statistics.median(times[warmup:]), "steps": steps}


def run_blocks(
    mode: str,
    pairs: int,
    block: int,
    warmup: int,
    workload: Path,
    as_file: bool = False,
    baseline: str | None = None,
) -> dict:
    """Inside one process: alternate detached/attached blocks on one model; returns per-pair ratios. With
    ``baseline`` the "off" blocks run attached in that mode instead of detached.

    A block is ``warmup`` unmeasured steps, then ``block`` measured ones; its figure is the mean step time
    (a mean, not a median, so that the collected steps of an interval schedule are counted). Attached blocks
    number their steps from ``-warmup``, so the measured steps are 0..block-1 and an interval-10 schedule
    collects exactly block/10 of them.
    """
    sys.path.insert(0, str(workload))
    import torch
    from tinygpt import batches, make, train

    import trainmon

    torch.set_num_threads(2)
    model, optimizer = make()
    data = batches(warmup + block)
    train(model, optimizer, data)  # warm up allocator and kernels
    ratios, off_ms, on_ms = [], [], []
    for _ in range(pairs):
        if baseline is None:
            off = statistics.fmean(train(model, optimizer, data)[0][warmup:])
        else:
            with tempfile.TemporaryDirectory(prefix="tm-bench-") as logdir:
                monitor = trainmon.attach(
                    model, optimizer, config=MODES[baseline], logdir=logdir, start_iteration=-warmup
                )
                off = statistics.fmean(train(model, optimizer, data)[0][warmup:])
                monitor.close()
        with tempfile.TemporaryDirectory(prefix="tm-bench-") as logdir:
            config = MODES[mode]
            if as_file:  # a watched file: the monitor stats it at every step boundary for edits
                path = Path(logdir) / "monitor.json"
                path.write_text(json.dumps(config))
                config = str(path)
            monitor = trainmon.attach(model, optimizer, config=config, logdir=logdir, start_iteration=-warmup)
            on = statistics.fmean(train(model, optimizer, data)[0][warmup:])
            monitor.close()
        ratios.append(on / off)
        off_ms.append(off * 1000)
        on_ms.append(on * 1000)
    return {"mode": mode, "ratios": ratios, "off_ms": off_ms, "on_ms": on_ms}


def _child(extra: list, args: argparse.Namespace, env: dict) -> dict:
    """Run this script in a fresh process for one measurement; it prints its result as JSON."""
    argv = [
        sys.executable,
        __file__,
        *map(str, extra),
        "--warmup",
        str(args.warmup),
        "--workload",
        str(args.workload),
    ]
    out = subprocess.run(argv, check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main_blocks(args: argparse.Namespace, modes: list[str], env: dict) -> dict:
    result = {"method": "blocks", "pairs": args.pairs, "block": args.block, "baseline": args.baseline,
              "modes": {}}  # fmt: skip
    off = args.baseline or "off"
    print(f"{'mode':<18}{off + ' ms':>14}{'on ms':>9}{'ratio (median of pairs)':>26}{'min..max':>16}")
    for mode in modes:
        extra = ["--run-blocks", mode, "--pairs", args.pairs, "--block", args.block]
        if args.baseline:
            extra += ["--baseline", args.baseline]
        data = _child([*extra, *(["--config-file"] if args.config_file else [])], args, env)
        ratio = statistics.median(data["ratios"])
        print(
            f"{mode:<18}{statistics.median(data['off_ms']):>14.1f}{statistics.median(data['on_ms']):>9.1f}"
            f"{ratio:>26.3f}{min(data['ratios']):>8.3f}..{max(data['ratios']):.3f}",
            flush=True,
        )
        result["modes"][mode] = {"ratio": ratio, **data}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--workload", type=Path, default=Path(os.environ.get("TRAINMON_BENCH_WORKLOAD", DEFAULT_WORKLOAD))
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--method", choices=["blocks", "processes"], default="blocks")
    parser.add_argument(
        "--pairs", type=int, default=6, help="blocks method: detached/attached pairs per mode"
    )
    parser.add_argument("--block", type=int, default=20, help="blocks method: measured steps per block")
    parser.add_argument(
        "--config-file",
        action="store_true",
        help="blocks method: give the config as a file (watched for edits at every step) instead of a dict",
    )
    parser.add_argument(
        "--baseline",
        choices=list(MODES),
        help="blocks method: the 'off' blocks run attached in this mode (e.g. wgmv_untimed), not detached",
    )
    parser.add_argument("--run", help=argparse.SUPPRESS)
    parser.add_argument("--run-blocks", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        print(json.dumps(run_one(args.run, args.steps, args.warmup, args.workload)))
        return
    if args.run_blocks:
        blocks = run_blocks(
            args.run_blocks,
            args.pairs,
            args.block,
            args.warmup,
            args.workload,
            args.config_file,
            args.baseline,
        )
        print(json.dumps(blocks))
        return
    if not (args.workload / "tinygpt.py").exists():
        raise SystemExit(f"error: workload not found: {args.workload}/tinygpt.py (set --workload)")
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    if args.method == "blocks":
        result = main_blocks(args, [m for m in args.modes if m != "off"], env)
        result["when"] = time.strftime("%Y-%m-%d %H:%M")
        if args.json:
            args.json.write_text(json.dumps(result, indent=2))
        return
    modes = ["off"] + [m for m in args.modes if m != "off"]
    times: dict[str, list[float]] = {m: [] for m in modes}
    ratios: dict[str, list[float]] = {m: [] for m in modes if m != "off"}
    for round_index in range(args.rounds):
        order = (
            modes[round_index % len(modes) :] + modes[: round_index % len(modes)]
        )  # rotate to spread drift
        this_round = {}
        for mode in order:
            this_round[mode] = _child(["--run", mode, "--steps", args.steps], args, env)["median_s"]
            times[mode].append(this_round[mode])
        for mode in ratios:
            ratios[mode].append(this_round[mode] / this_round["off"])
        print(
            f"round {round_index + 1}/{args.rounds}: "
            + ", ".join(f"{m} {this_round[m] * 1000:.1f} ms" for m in modes),
            flush=True,
        )
    print(f"\n{'mode':<18}{'median step':>14}{'ratio (median of pairs)':>26}{'min..max':>16}")
    print(f"{'off':<18}{statistics.median(times['off']) * 1000:>11.1f} ms{'1.000':>26}")
    result = {
        "when": time.strftime("%Y-%m-%d %H:%M"),
        "rounds": args.rounds,
        "steps": args.steps,
        "off_ms": statistics.median(times["off"]) * 1000,
        "modes": {},
    }
    for mode, values in ratios.items():
        med = statistics.median(values)
        print(
            f"{mode:<18}{statistics.median(times[mode]) * 1000:>11.1f} ms{med:>26.3f}"
            f"{min(values):>8.3f}..{max(values):.3f}"
        )
        result["modes"][mode] = {
            "ratio": med,
            "ratios": values,
            "median_ms": statistics.median(times[mode]) * 1000,
        }
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
