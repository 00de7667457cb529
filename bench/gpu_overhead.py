"""Monitor overhead on the GPU yardstick (``../shared/bench/gpt_cuda.py``), as ratios of paired runs.

The workload: a 16-layer pre-LN GPT (d=1024, 16 heads, seq 1024, batch 8, vocab 32768), bf16 autocast,
AdamW, on CUDA. Every run is a fresh process; within a round the modes run one after another in a rotated
order, so drift of the machine is shared by the runs a ratio compares. A run trains ``--warmup`` unmeasured
steps, then ``--steps`` measured ones (each bracketed by ``torch.cuda.synchronize``), then two probe steps:

* one collected step under ``torch.cuda.set_sync_debug_mode("warn")``: synchronising calls are counted;
* one collected step under ``torch.profiler``: CUDA kernels are counted (the "off" run gives the baseline).

Modes: off, full (xy + wg + mv + param, 6 ops, every step), wgmv, full_interval10, full_exact and
wgmv_exact (the same with ``alert.capture: exact``), full_exact_skip (full + ``capture: exact`` +
``on_nan: skip``), and msprobe_full / msprobe_wgmv when ``msprobe`` imports (its ``TrainerMon``, same
coverage, CSV). The figure per mode is the median over rounds of (mode step time / "off" step time of the
same round), for the median step time and for the mean (the mean counts the collected steps of an interval
schedule; the median hides them). Each run also reports its peak memory: ``torch.cuda.max_memory_allocated``
on CUDA, the process's peak RSS elsewhere.

    python bench/gpu_overhead.py                                  # on the GPU, all modes, 5 rounds
    python bench/gpu_overhead.py --modes full wgmv --rounds 3
    python bench/gpu_overhead.py --device cpu --layers 2 --d 64 --heads 4 --seq 32 --batch 2 --vocab 128 \\
        --steps 4 --warmup 1 --rounds 1                          # smoke run of the harness on a CPU

The workload is ``$TRAINMON_BENCH_WORKLOAD/gpt_cuda.py``, else ``../shared/bench/gpt_cuda.py``, else the
repository's copy ``bench/gpt_cuda.py`` (what a GPU machine that gets the repository alone runs).
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
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED_WORKLOAD = REPO.parent / "shared" / "bench"
DEFAULT_WORKLOAD = Path(
    os.environ.get("TRAINMON_BENCH_WORKLOAD")
    or (SHARED_WORKLOAD if (SHARED_WORKLOAD / "gpt_cuda.py").exists() else REPO / "bench")
)
# the kernels' tiling for a CPU run under Triton's interpreter (--small-tiles): the default's 64K-element
# chunks cost the interpreter seconds per tiny tensor
SMALL_TILES = {"chunk": 1 << 12, "block": 1 << 10, "rows": 4, "sign_bytes": 32}

OPS = ["min", "max", "norm", "zeros", "nans", "mean"]
FULL = {
    "xy_distribution": True,
    "all_xy": True,
    "wg_distribution": True,
    "mv_distribution": True,
    "param_distribution": True,
    "ops": OPS,
    "format": "csv",
}
WGMV = {"wg_distribution": True, "mv_distribution": True, "ops": OPS, "format": "csv"}
MODES: dict[str, dict | None] = {
    "off": None,
    "full": FULL,
    "wgmv": WGMV,
    "full_interval10": {**FULL, "step_interval": 10},
    # alert.capture: exact adds one small device-to-host read per collected step (the NaN/Inf counters)
    "full_exact": {**FULL, "alert": {"capture": "exact"}},
    "wgmv_exact": {**WGMV, "alert": {"capture": "exact"}},
    # on_nan: skip reads the step's NaN/Inf counters before the optimizer update (one read per collected step)
    "full_exact_skip": {**FULL, "alert": {"capture": "exact", "on_nan": "skip"}},
    "msprobe_full": FULL,
    "msprobe_wgmv": WGMV,
}


def msprobe_available() -> bool:
    try:
        from msprobe.pytorch import TrainerMon  # noqa: F401
    except Exception:  # noqa: BLE001 - any failure to import means "not here"
        return False
    return True


def _attach(mode: str, model, optimizer, logdir: str, first_step: int):
    """Starts monitoring for ``mode``; returns a callable that stops it."""
    config = MODES[mode]
    if config is None:
        return lambda: None
    if mode.startswith("msprobe_"):
        from msprobe.pytorch import TrainerMon

        os.environ["MONITOR_OUTPUT_DIR"] = logdir
        path = Path(logdir) / "msprobe_config.json"
        path.write_text(json.dumps({**config, "targets": {}}))
        monitor = TrainerMon(str(path), params_have_main_grad=False)
        monitor.set_monitor(model, optimizer=optimizer, grad_acc_steps=1)
        return lambda: None
    import trainmon

    monitor = trainmon.attach(model, optimizer, config=config, logdir=logdir, start_iteration=first_step)
    return monitor.close


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def _syncs_in(fn, device) -> int | None:
    """Synchronising calls torch reports while ``fn`` runs (CUDA only)."""
    import torch

    if device.type != "cuda":
        return None
    _sync(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    _sync(device)
    return sum("synchroniz" in str(w.message).lower() for w in caught)


def _kernels_in(fn, device) -> int | None:
    """CUDA kernels (copies and memsets excluded) launched while ``fn`` runs."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    if device.type != "cuda":
        return None
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        _sync(device)
    return sum(
        1
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset"))
    )


def run_child(mode: str, args: argparse.Namespace) -> dict:
    """Runs inside the measuring subprocess: one mode, one fresh process."""
    sys.path.insert(0, str(args.workload))
    import gpt_cuda
    import torch

    from trainmon import stats
    from trainmon.stats import triton_path

    device = torch.device(args.device)
    if args.small_tiles:
        triton_path.set_tiling(triton_path.Tiling(**SMALL_TILES))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(0)
    model = gpt_cuda.GPT(args.vocab, args.d, args.heads, args.layers, args.seq).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def train_step(i: int) -> None:
        gpt_cuda.step(model, optimizer, gpt_cuda.batch(i, args.batch, args.seq, args.vocab, device))

    # Steps are numbered from -warmup so that an interval-10 schedule collects steps 0, 10, 20, ...: the
    # measured window holds exactly steps/10 collected steps, and the probes below are collected steps.
    with tempfile.TemporaryDirectory(prefix="tm-gpu-bench-") as logdir:
        stop = _attach(mode, model, optimizer, logdir, -args.warmup)
        for i in range(args.warmup):
            train_step(i)
        times = []
        for i in range(args.steps):
            _sync(device)
            start = time.perf_counter()
            train_step(args.warmup + i)
            _sync(device)
            times.append(time.perf_counter() - start)
        syncs = kernels = None
        if device.type == "cuda":  # the probes count CUDA syncs and kernels: nothing to count elsewhere
            probe = args.warmup + args.steps
            for i in range(probe, probe + (-args.steps) % 10):  # on to the next collected step
                train_step(i)
            probe += (-args.steps) % 10
            syncs = _syncs_in(lambda: train_step(probe), device)
            for i in range(probe + 1, probe + 10):
                train_step(i)
            kernels = _kernels_in(lambda: train_step(probe + 10), device)
        stop()
    return {
        "peak_mib": _peak_mib(device),
        "triton": _triton_version(),
        "stats_unavailable": triton_path.unavailable(),
        "mode": mode,
        "median_s": statistics.median(times),
        "mean_s": statistics.fmean(times),
        "syncs": syncs,
        "kernels": kernels,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "backend_bf16": stats.backend_of(device, torch.bfloat16),
        "backend_fp32": stats.backend_of(device, torch.float32),
    }


def _peak_mib(device) -> float:
    """Peak memory of the run: the CUDA caching allocator's peak allocation, or the process's peak RSS."""
    import resource

    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _triton_version() -> str | None:
    try:
        import triton
    except Exception:  # noqa: BLE001 - not installed, or broken: the statistics use torch ops
        return None
    return triton.__version__


def _child(mode: str, args: argparse.Namespace) -> dict:
    argv = [sys.executable, __file__, "--child", mode, *_shape_argv(args)]
    out = subprocess.run(argv, check=True, capture_output=True, text=True, env={**os.environ})
    return json.loads(out.stdout.strip().splitlines()[-1])


def _shape_argv(args: argparse.Namespace) -> list[str]:
    names = ("device", "layers", "d", "heads", "seq", "batch", "vocab", "steps", "warmup", "workload")
    argv = [part for name in names for part in (f"--{name}", str(getattr(args, name)))]
    return argv + (["--small-tiles"] if args.small_tiles else [])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30, help="measured steps per run")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--d", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument(
        "--workload", type=Path, default=Path(os.environ.get("TRAINMON_BENCH_WORKLOAD", DEFAULT_WORKLOAD))
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument(
        "--small-tiles", action="store_true", help="small kernel tiles (CPU runs under TRITON_INTERPRET=1)"
    )
    parser.add_argument(
        "--time-budget",
        type=float,
        help="seconds: start no round that would end past it (at least one round runs)",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_child(args.child, args)))
        return
    if not (args.workload / "gpt_cuda.py").exists():
        raise SystemExit(f"error: workload not found: {args.workload}/gpt_cuda.py (set --workload)")
    modes = ["off"] + [m for m in args.modes if m != "off"]
    if not msprobe_available():
        skipped = [m for m in modes if m.startswith("msprobe_")]
        if skipped:
            print(f"msprobe does not import here: skipping {', '.join(skipped)}", flush=True)
        modes = [m for m in modes if not m.startswith("msprobe_")]

    runs: dict[str, list[dict]] = {m: [] for m in modes}
    started = time.monotonic()
    for round_index in range(args.rounds):
        elapsed = time.monotonic() - started
        if round_index and args.time_budget and elapsed * (round_index + 1) / round_index > args.time_budget:
            print(f"time budget: stopping after {round_index} rounds ({elapsed:.0f} s)", flush=True)
            break
        shift = round_index % len(modes)
        for mode in modes[shift:] + modes[:shift]:  # rotated so no mode always runs first
            runs[mode].append(_child(mode, args))
        print(
            f"round {round_index + 1}/{args.rounds}: "
            + ", ".join(f"{m} {runs[m][-1]['median_s'] * 1000:.1f} ms" for m in modes),
            flush=True,
        )

    first = runs["off"][0]
    print(
        f"\ndevice {first['device']}, torch {first['torch']}, triton {first['triton']}, statistics backend "
        f"bf16={first['backend_bf16']} fp32={first['backend_fp32']}"
    )
    header = f"{'mode':<16}{'median ms':>10}{'ratio med':>10}{'ratio mean':>11}{'min..max':>14}"
    print(header + f"{'kernels/step':>14}{'added':>8}{'syncs':>7}{'peak MiB':>10}")
    base_kernels = runs["off"][0]["kernels"]
    result = {"when": time.strftime("%Y-%m-%d %H:%M"), "args": _shape_argv(args), "modes": {}}
    for mode in modes:
        by_median = [r["median_s"] / o["median_s"] for r, o in zip(runs[mode], runs["off"], strict=True)]
        by_mean = [r["mean_s"] / o["mean_s"] for r, o in zip(runs[mode], runs["off"], strict=True)]
        kernels, syncs = runs[mode][0]["kernels"], runs[mode][0]["syncs"]
        added = None if kernels is None or base_kernels is None else kernels - base_kernels
        print(
            f"{mode:<16}{statistics.median(r['median_s'] for r in runs[mode]) * 1000:>10.1f}"
            f"{statistics.median(by_median):>10.3f}{statistics.median(by_mean):>11.3f}"
            f"{min(by_median):>7.3f}..{max(by_median):.3f}"
            f"{'-' if kernels is None else kernels:>14}{'-' if added is None else added:>8}"
            f"{'-' if syncs is None else syncs:>7}"
            f"{max(r['peak_mib'] for r in runs[mode]):>10.0f}"
        )
        result["modes"][mode] = {
            "ratio_median": statistics.median(by_median),
            "ratio_mean": statistics.median(by_mean),
            "kernels": kernels,
            "kernels_added": added,
            "syncs": syncs,
            "peak_mib": max(r["peak_mib"] for r in runs[mode]),
            "runs": runs[mode],
        }
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
