"""Where a collected step's time goes on a GPU: the host's share against the device's, the kernels, the hot
Python functions. bench/gpu_overhead.py says what a mode costs; this says why.

Each mode runs in a fresh process on the GPU yardstick (bench/gpt_cuda.py): warm-up steps (the first
collected step compiles the kernels), then ``--steps`` steps timed twice over:

- **host ms**: from the step's start to its return, with nothing synchronised inside it: the Python of the
  training loop, torch's dispatch, the hooks and the monitor. Each step starts on an idle device, so this is
  the time to issue the step;
- **step ms**: the same step up to the device's end (synchronised).

Where host ms is close to step ms the step is host-bound: the device waits for launches and the monitor's
Python is what costs. Then one collected step under ``torch.profiler`` (the device's busy time: the sum of
kernel times, the monitor's Triton kernels apart, the longest kernels by name) and ``--cprofile`` steps under
cProfile (the training thread's hottest functions by own time; cProfile slows Python about twice over, so
the shares, not the times, are what it says).

    python bench/gpu_profile.py                          # off, full, full_api, wgmv on the yardstick
    python bench/gpu_profile.py --modes full --json p.json
    python bench/gpu_profile.py --device cpu --layers 1 --d 32 --heads 2 --seq 16 --vocab 64 --batch 2
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))  # this tree's trainmon
sys.path.insert(0, str(BENCH))
import gpu_overhead  # noqa: E402 - bench/ is not a package: found through the path set just above


def _monitor_kernel_names() -> frozenset[str]:
    """The launchable kernels of trainmon.stats.triton_kernels (public names that take a grid), read from the
    module so that a new kernel is counted as the monitor's without a list to keep up to date."""
    try:
        from trainmon.stats import triton_kernels
    except Exception:  # noqa: BLE001 - no Triton: no kernels of the monitor's to tell apart
        return frozenset()
    return frozenset(
        name
        for name, value in vars(triton_kernels).items()
        if not name.startswith("_") and hasattr(value, "__getitem__")
    )


MONITOR_KERNELS = _monitor_kernel_names()


def _kernel_times(fn, sync) -> list[tuple[str, float]]:
    """(name, microseconds) of every CUDA kernel ``fn`` launches (copies and memsets excluded)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        sync()
    return [
        (e.name, e.time_range.elapsed_us())
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset"))
    ]


def _is_monitor_kernel(name: str) -> bool:
    return name in MONITOR_KERNELS


def kernel_summary(kernels: list[tuple[str, float]], top: int = 10) -> dict:
    """The device's busy time, the monitor's share of it and the longest kernels by name."""
    by_name: dict[str, list[float]] = {}
    for name, us in kernels:
        by_name.setdefault(name, []).append(us)
    ranked = sorted(by_name.items(), key=lambda item: -sum(item[1]))
    monitor = [us for name, us in kernels if _is_monitor_kernel(name)]
    return {
        "kernels": len(kernels),
        "busy_ms": sum(us for _, us in kernels) / 1e3,
        "monitor_kernels": len(monitor),
        "monitor_ms": sum(monitor) / 1e3,
        "top": [
            {
                "name": name[:90],
                "calls": len(times),
                "ms": sum(times) / 1e3,
                "monitor": _is_monitor_kernel(name),
            }
            for name, times in ranked[:top]
        ],
    }


def hot_functions(profiler: cProfile.Profile, top: int, steps: int) -> list[dict]:
    """The ``top`` functions by own time, per step: calls, own and cumulative milliseconds."""
    rows = []
    for (path, line, name), (_, calls, own, cumulative, _) in pstats.Stats(profiler).stats.items():
        where = f"{path.replace(str(BENCH.parent) + '/', '')}:{line}({name})" if line else name
        rows.append(
            {
                "function": where,
                "calls": calls / steps,
                "own_ms": own * 1e3 / steps,
                "cum_ms": cumulative * 1e3 / steps,
            }
        )
    return sorted(rows, key=lambda row: -row["own_ms"])[:top]


def run_child(mode: str, args: argparse.Namespace) -> dict:
    """Runs inside the measuring subprocess: one mode, one fresh process."""
    import torch

    device = torch.device(args.device)
    model, optimizer, train_step = gpu_overhead.build_workload(args)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    host, whole = [], []
    with tempfile.TemporaryDirectory(prefix="tm-gpu-profile-") as logdir:
        attached = gpu_overhead._attach(mode, model, optimizer, logdir)
        for i in range(args.warmup):
            train_step(i)
        step = args.warmup
        for step in range(args.warmup, args.warmup + args.steps):
            sync()
            start = time.perf_counter()
            train_step(step)
            issued = time.perf_counter()
            sync()
            host.append(issued - start)
            whole.append(time.perf_counter() - start)
        kernels = None
        if device.type == "cuda":
            step += 1
            kernels = kernel_summary(_kernel_times(lambda: train_step(step), sync))
        profiler = cProfile.Profile()
        sync()
        profiler.enable()
        for i in range(step + 1, step + 1 + args.cprofile):
            train_step(i)
        profiler.disable()
        sync()
        attached.stop()
    return {
        "mode": mode,
        "host_ms": statistics.median(host) * 1e3,
        "step_ms": statistics.median(whole) * 1e3,
        "host_ms_all": [t * 1e3 for t in host],
        "step_ms_all": [t * 1e3 for t in whole],
        "device": kernels,
        "hot": hot_functions(profiler, args.top, max(1, args.cprofile)),
    }


def report(results: list[dict]) -> list[str]:
    lines = [
        "| mode | host ms | step ms | host / step | device busy ms | monitor kernels (ms) | kernels |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        dev = r["device"]
        busy = "-" if dev is None else f"{dev['busy_ms']:.1f}"
        mon = "-" if dev is None else f"{dev['monitor_kernels']} ({dev['monitor_ms']:.1f})"
        count = "-" if dev is None else str(dev["kernels"])
        lines.append(
            f"| {r['mode']} | {r['host_ms']:.1f} | {r['step_ms']:.1f} | {r['host_ms'] / r['step_ms']:.2f} "
            f"| {busy} | {mon} | {count} |"
        )
    for r in results:
        if r["device"]:
            lines.append(f"\n{r['mode']}: longest kernels of one step (name, calls, ms, monitor's)")
            lines += [
                f"  {k['name']} | {k['calls']} | {k['ms']:.2f} | {'*' if k['monitor'] else ''}"
                for k in r["device"]["top"]
            ]
        if r["mode"] != "off":
            lines.append(f"\n{r['mode']}: training thread under cProfile, per step: calls, own ms, cum ms")
            lines += [
                f"  {h['calls']:8.0f} {h['own_ms']:8.2f} {h['cum_ms']:8.2f}  {h['function'][-100:]}"
                for h in r["hot"]
            ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--modes", nargs="+", default=["off", "full", "full_api", "wgmv"], choices=list(gpu_overhead.MODES)
    )
    parser.add_argument("--steps", type=int, default=10, help="timed steps per mode")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--cprofile", type=int, default=3, help="steps under cProfile")
    parser.add_argument("--top", type=int, default=25, help="functions listed from cProfile")
    gpu_overhead.add_workload_arguments(parser)
    parser.add_argument("--json", type=Path, help="also write everything here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_child(args.child, args)))
        return
    results = []
    names = (
        "steps",
        "warmup",
        "cprofile",
        "top",
        "device",
        "layers",
        "d",
        "heads",
        "seq",
        "batch",
        "vocab",
        "workload",
    )
    argv = [part for name in names for part in (f"--{name}", str(getattr(args, name)))]
    for mode in args.modes:
        out = subprocess.run(
            [sys.executable, __file__, "--child", mode, *argv],
            capture_output=True,
            text=True,
            env={**os.environ},
        )
        if out.returncode != 0:
            print(
                f"{mode}: exit {out.returncode}\n" + "\n".join(out.stderr.strip().splitlines()[-15:]),
                flush=True,
            )
            continue
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
        r = results[-1]
        print(f"{mode}: host {r['host_ms']:.1f} ms, step {r['step_ms']:.1f} ms", flush=True)
    print("\n".join(report(results)), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
