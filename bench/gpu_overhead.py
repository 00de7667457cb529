"""Monitor overhead on the GPU yardstick (``../shared/bench/gpt_cuda.py``), as ratios of paired runs: what a
user pays per step, and where the longest steps come from.

The workload: a 16-layer pre-LN GPT (d=1024, 16 heads, seq 1024, batch 8, vocab 32768), bf16 autocast,
AdamW, on CUDA. Every run is a fresh process; within a round the modes run one after another in a rotated
order, so drift of the machine is shared by the runs a ratio compares. A run numbers its steps from 0 (the
monitor's ``start_iteration`` too) and times every one (each bracketed by ``torch.cuda.synchronize``):

* ``--warmup`` steps, not measured: they hold every mode's first collected step, step 0, where Triton
  compiles the kernels (and the allocator, cuBLAS and the writer start). Its time is reported apart;
* ``--steps`` measured steps: the window. With ``step_interval: 10`` it holds only steady-state collected
  steps (10, 20, ...), exactly ``steps / 10`` of them when ``steps`` is a multiple of 10;
* two probe steps after the window, both collected steps: one under ``torch.cuda.set_sync_debug_mode("warn")``
  (synchronising calls counted) and one under ``torch.profiler`` (CUDA kernels counted; "off" gives the
  baseline).

Per run: mean, median, 90th percentile and longest step of the window; the garbage collections Python ran
inside the window, per generation, with their pauses (``gc.callbacks``); the steps the monitor collected
(read back from its steps table, or msprobe's CSV file names); the peak memory (``torch.cuda.
max_memory_allocated`` on CUDA, the process's peak RSS elsewhere); per step, the time to issue it (from its
start to the training step's return, before the closing sync) with the CPU time the training thread and the
whole process spent meanwhile, and the rows the monitor's last collected step of the window recorded. Per
mode: the median over rounds of (mode / "off" of the same round) for the mean step (the figure users pay: it
counts pauses and the collected steps of an interval schedule) and for the median step; the longest step
against the median "off" step of its round (the worst over rounds); collections summed over rounds; peak
memory against "off"; and where the time to issue a step goes (``issue_table``): the medians of the issue,
the training thread's CPU, the time it did not run and the other threads' CPU, and the monitor's host time
per row (the mode's median issue less off's of the same round, over the rows).

Modes: off, full (xy + wg + mv + param, 6 ops, every step), wgmv, full_api (full with ``format: api``:
nothing written), full_interval10, full_exact and wgmv_exact (the same with ``alert.capture: exact``),
full_exact_skip (full + ``capture: exact`` + ``on_nan: skip``), wgmv_untimed (wgmv with per-rank timing
off), and msprobe_full / msprobe_wgmv: msprobe's ``TrainerMon`` (``pip install
mindstudio-probe``) with the same coverage, written as CSV (trainmon's modes write CSV too). msprobe's modes
run in a round of their own after the first round (with their own "off" run), once: where msprobe does not
import they are reported as such and skipped.

    python bench/gpu_overhead.py                                  # on the GPU, all modes, 5 rounds
    python bench/gpu_overhead.py --modes full wgmv --rounds 3
    python bench/gpu_overhead.py --device cpu --layers 2 --d 64 --heads 4 --seq 32 --batch 2 --vocab 128 \\
        --steps 10 --warmup 1 --rounds 1                         # smoke run of the harness on a CPU

``--time-budget`` bounds the whole: a round starts only if one more round as long as the longest so far fits,
a run is stopped at the budget, and an unfinished round is dropped (the rounds done stay).

The workload is ``$TRAINMON_BENCH_WORKLOAD/gpt_cuda.py``, else ``../shared/bench/gpt_cuda.py``, else the
repository's copy ``bench/gpt_cuda.py`` (what a GPU machine that gets the repository alone runs).
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED_WORKLOAD = REPO.parent / "shared" / "bench"
DEFAULT_WORKLOAD = Path(
    os.environ.get("TRAINMON_BENCH_WORKLOAD")
    or (SHARED_WORKLOAD if (SHARED_WORKLOAD / "gpt_cuda.py").exists() else REPO / "bench")
)
# the kernels' tiling for a CPU run under Triton's interpreter (--small-tiles): the default's 64K-element
# chunks cost the interpreter seconds per tiny tensor
SMALL_TILES = {"chunk": 1 << 12, "block": 1 << 12, "rows": 4, "sign_bytes": 32}

OPS = ["min", "max", "norm", "zeros", "nans", "mean"]
FULL = {
    "xy_distribution": True,
    "all_xy": True,
    "wg_distribution": True,
    "mv_distribution": True,
    "param_distribution": True,
    "ops": OPS,
}  # trainmon's default outputs (TensorBoard events and CSV): what a user pays
WGMV = {"wg_distribution": True, "mv_distribution": True, "ops": OPS}
MODES: dict[str, dict | None] = {
    "off": None,
    "full": FULL,
    "wgmv": WGMV,
    # nothing written: what the writer's side costs the training thread is full over full_api
    "full_api": {**FULL, "format": "api"},
    "full_interval10": {**FULL, "step_interval": 10},
    # alert.capture: exact adds one small device-to-host read per collected step (the NaN/Inf counters)
    "full_exact": {**FULL, "alert": {"capture": "exact"}},
    "wgmv_exact": {**WGMV, "alert": {"capture": "exact"}},
    # on_nan: skip reads the step's NaN/Inf counters before the optimizer update (one read per collected step)
    "full_exact_skip": {**FULL, "alert": {"capture": "exact", "on_nan": "skip"}},
    # per-rank timing (on by default) left out: what the timing costs is wgmv over wgmv_untimed
    "wgmv_untimed": {**WGMV, "timing": {"enable": False}},
    "msprobe_full": {**FULL, "format": "csv"},  # msprobe 26 writes CSV only
    "msprobe_wgmv": {**WGMV, "format": "csv"},
}
LABELS = {  # what the tables call each mode
    "off": "off",
    "full": "full (xy + wg + mv + param)",
    "wgmv": "wg + mv",
    "full_api": "full, format: api (nothing written)",
    "full_interval10": "full, step_interval: 10",
    "full_exact": "full + capture: exact",
    "wgmv_exact": "wg + mv + capture: exact",
    "full_exact_skip": "full + capture: exact + on_nan: skip",
    "wgmv_untimed": "wg + mv, timing off",
    "msprobe_full": "msprobe TrainerMon, full",
    "msprobe_wgmv": "msprobe TrainerMon, wg + mv",
}
GENERATIONS = ("0", "1", "2")


def is_msprobe(mode: str) -> bool:
    return mode.startswith("msprobe_")


def interval_of(mode: str) -> int:
    config = MODES[mode]
    return 1 if config is None else int(config.get("step_interval", 1))


def msprobe_status() -> tuple[bool, str]:
    """Whether msprobe's monitor imports here, and what to say about it."""
    if importlib.util.find_spec("msprobe") is None:
        return False, "not installed"
    try:
        from msprobe.pytorch import TrainerMon  # noqa: F401
    except Exception as error:  # noqa: BLE001 - any failure to import means "not usable here"
        return False, f"does not import ({type(error).__name__}: {error})"
    try:
        version = importlib.metadata.version("mindstudio-probe")
    except importlib.metadata.PackageNotFoundError:
        version = "version unknown"
    return True, f"mindstudio-probe {version}"


class GcWatch:
    """The collections Python runs while ``on`` (in any thread: each one stops them all), per generation,
    with their pauses."""

    def __init__(self) -> None:
        self.on = False
        self.pauses: dict[str, list[float]] = {g: [] for g in GENERATIONS}
        self._start: float | None = None
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter() if self.on else None
        elif self._start is not None:
            self.pauses[str(info["generation"])].append(time.perf_counter() - self._start)
            self._start = None

    def close(self) -> None:
        gc.callbacks.remove(self._callback)

    def report(self) -> dict:
        return {
            g: {"count": len(p), "pause_ms": sum(p) * 1e3, "longest_ms": max(p, default=0.0) * 1e3}
            for g, p in self.pauses.items()
        }


@dataclass(frozen=True)
class Attached:
    """A mode's monitor in a run: how to stop it, and how many rows its latest collected step recorded (None:
    no trainmon monitor, or no collected step yet)."""

    stop: Callable[[], None]
    rows: Callable[[], int | None]


def _no_rows() -> int | None:
    return None


def _latest_rows(monitor) -> int | None:
    """The rows of the monitor's latest collected step, read from its host record as bench/host_cost.py
    reads them (no wait on the device: the record's row descriptions are host-side)."""
    latest = monitor._latest
    return None if latest is None else len(latest[0].rows)


def _attach(mode: str, model, optimizer, logdir: str) -> Attached:
    """Starts monitoring for ``mode`` (steps numbered from 0)."""
    config = MODES[mode]
    if config is None:
        return Attached(lambda: None, _no_rows)
    if is_msprobe(mode):
        from msprobe.pytorch import TrainerMon

        os.environ["MONITOR_OUTPUT_DIR"] = logdir
        path = Path(logdir) / "msprobe_config.json"
        path.write_text(json.dumps({**config, "targets": {}}))
        monitor = TrainerMon(str(path), params_have_main_grad=False)
        monitor.set_monitor(model, optimizer=optimizer, grad_acc_steps=1)
        return Attached(lambda: None, _no_rows)
    import trainmon

    monitor = trainmon.attach(model, optimizer, config=config, logdir=logdir, start_iteration=0)
    return Attached(monitor.close, lambda: _latest_rows(monitor))


def _collected_steps(mode: str, logdir: str) -> list[int] | None:
    """The steps the monitor wrote: trainmon's steps table, or the step ranges in msprobe's CSV file names
    (``grad_reduced_12-12.csv``); None where they cannot be read."""
    if MODES[mode] is None:
        return []
    try:
        if is_msprobe(mode):
            found: set[int] = set()
            for path in Path(logdir).rglob("*.csv"):
                match = re.search(r"_(\d+)-(\d+)\.csv$", path.name)
                if match:
                    found.update(range(int(match[1]), int(match[2]) + 1))
            return sorted(found)
        from trainmon.run.steptable import read_steps

        return sorted(read_steps(logdir, 0, ["step"]).column("step").to_pylist())
    except Exception as error:  # noqa: BLE001 - reported, not fatal: the timings still stand
        print(f"could not read the collected steps: {type(error).__name__}: {error}", file=sys.stderr)
        return None


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


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between the order statistics (numpy's default, statistics' "inclusive")."""
    ordered = sorted(values)
    at = q * (len(ordered) - 1)
    low = int(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def step_summary(times: list[float]) -> dict:
    """Mean, median, 90th percentile and longest of step times (seconds in, milliseconds out)."""
    ms = [t * 1e3 for t in times]
    return {
        "mean_ms": statistics.fmean(ms),
        "median_ms": statistics.median(ms),
        "p90_ms": percentile(ms, 0.9),
        "longest_ms": max(ms),
    }


@dataclass(frozen=True)
class StepClock:
    """One timed step, in seconds: ``step`` from its start to the device's end (synchronised); ``issue`` from
    its start to ``train_step``'s return, before the closing sync; the training thread's CPU time and the
    whole process's CPU time over the issue (the process's less the thread's: the other threads', such as
    the writer thread, the sealer, and on CUDA autograd's device thread, which runs the backward pass)."""

    step: float
    issue: float
    thread_cpu: float
    process_cpu: float


def run_child(mode: str, args: argparse.Namespace) -> dict:
    """Runs inside the measuring subprocess: one mode, one fresh process."""
    import torch

    from trainmon import stats
    from trainmon.stats import triton_path

    device = torch.device(args.device)
    if args.small_tiles:
        triton_path.set_tiling(triton_path.Tiling(**SMALL_TILES))
    if args.batch_mib:  # a fixed bound instead of the device's share, to compare the two
        triton_path.BATCH_BYTES = args.batch_mib << 20
        triton_path.BATCH_BYTES_RANGE = (triton_path.BATCH_BYTES, triton_path.BATCH_BYTES)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model, optimizer, train_step = build_workload(args)

    def timed_step(i: int) -> StepClock:
        _sync(device)
        start = time.perf_counter()
        # nested: the thread's CPU clock inside the process's, both inside the issue's wall clock, so that
        # thread CPU <= process CPU and thread CPU <= issue hold whatever the clocks' reading costs
        process_start, thread_start = time.process_time(), time.thread_time()
        train_step(i)
        thread_end, process_end = time.thread_time(), time.process_time()
        issued = time.perf_counter()
        _sync(device)
        return StepClock(
            time.perf_counter() - start,
            issued - start,
            thread_end - thread_start,
            process_end - process_start,
        )

    interval = interval_of(mode)
    window = (args.warmup, args.warmup + args.steps - 1)
    watch = GcWatch()
    with tempfile.TemporaryDirectory(prefix="tm-gpu-bench-") as logdir:
        attached = _attach(mode, model, optimizer, logdir)
        clocks = [timed_step(i) for i in range(args.warmup)]
        watch.on = True
        clocks += [timed_step(i) for i in range(window[0], window[1] + 1)]
        watch.on = False
        rows = attached.rows()  # the window's last collected step's, before the probes' steps
        syncs = kernels = None
        if device.type == "cuda":  # the probes count CUDA syncs and kernels: nothing to count elsewhere
            probe = window[1] + 1 + (-(window[1] + 1)) % interval  # the next collected step
            for i in range(window[1] + 1, probe):
                train_step(i)
            syncs = _syncs_in(lambda: train_step(probe), device)
            for i in range(probe + 1, probe + interval):
                train_step(i)
            kernels = _kernels_in(lambda: train_step(probe + interval), device)
        attached.stop()
        collected = _collected_steps(mode, logdir)
    watch.close()
    times = [c.step for c in clocks]
    first = collected[0] if collected else None
    return {
        "mode": mode,
        "interval": interval,
        "window": list(window),
        "step_ms": [t * 1e3 for t in times],  # every timed step, by step number (warm-up, then the window)
        # by step number too: the time to issue the step, and the CPU the training thread and the whole
        # process spent meanwhile (StepClock)
        "issue_ms": [c.issue * 1e3 for c in clocks],
        "thread_cpu_ms": [c.thread_cpu * 1e3 for c in clocks],
        "process_cpu_ms": [c.process_cpu * 1e3 for c in clocks],
        "rows": rows,
        **step_summary(times[window[0] :]),
        "longest_step": window[0] + max(range(args.steps), key=lambda k: times[window[0] + k]),
        "collected": collected,
        "collected_in_window": None
        if collected is None
        else [s for s in collected if window[0] <= s <= window[1]],
        "first_collected": None
        if first is None or first >= len(times)
        else {"step": first, "ms": times[first] * 1e3},
        "gc": watch.report(),
        "peak_mib": _peak_mib(device),
        "syncs": syncs,
        "kernels": kernels,
        "triton": _triton_version(),
        "stats_unavailable": triton_path.unavailable(),
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


class RunFailed(Exception):
    """A measuring process that timed out or failed; the message says which and why."""


def _child(mode: str, args: argparse.Namespace, timeout: float | None) -> dict:
    argv = [sys.executable, __file__, "--child", mode, *_shape_argv(args)]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, env={**os.environ}, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RunFailed(f"{mode}: stopped at the time budget ({timeout:.0f} s left for it)") from None
    if out.returncode != 0:
        tail = "\n".join(out.stderr.strip().splitlines()[-15:])
        raise RunFailed(f"{mode}: exit {out.returncode}\n{tail}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _shape_argv(args: argparse.Namespace) -> list[str]:
    names = ("device", "layers", "d", "heads", "seq", "batch", "vocab", "steps", "warmup", "workload")
    argv = [part for name in names for part in (f"--{name}", str(getattr(args, name)))]
    argv += ["--batch-mib", str(args.batch_mib)] if args.batch_mib else []
    argv += ["--small-tiles"] if args.small_tiles else []
    return argv + (["--compile", args.compile] if getattr(args, "compile", None) else [])


def _ratios(runs: list[dict], offs: list[dict], key: str, off_key: str | None = None) -> list[float]:
    """Per round: the run's ``key`` over the "off" run's ``off_key`` (the same key by default)."""
    return [r[key] / o[off_key or key] for r, o in zip(runs, offs, strict=True)]


ISSUE_COLUMNS = ("issue_ms", "thread_cpu_ms", "blocked_ms", "other_cpu_ms")


def issue_steps(run: dict) -> list[int]:
    """The window's steps whose issue figures speak for the run's mode: an interval mode's collected steps
    (its other steps are unmonitored ones), every step of the window otherwise."""
    low, high = run["window"]
    interval = run.get("interval", 1)
    if interval == 1:
        return list(range(low, high + 1))
    collected = run.get("collected_in_window")
    if collected is None:  # the steps table could not be read: the schedule says (steps numbered from 0)
        return [s for s in range(low, high + 1) if s % interval == 0]
    return list(collected)


def issue_columns(run: dict) -> dict[str, list[float]] | None:
    """Per issue step (ms): the issue, the training thread's CPU, blocked (the issue less the thread's CPU:
    the time it did not run) and the other threads' CPU (the process's less the thread's); None for a run
    that kept no issue times (one from before they were taken)."""
    if "issue_ms" not in run:
        return None
    steps = issue_steps(run)
    issue = [run["issue_ms"][s] for s in steps]
    thread = [run["thread_cpu_ms"][s] for s in steps]
    process = [run["process_cpu_ms"][s] for s in steps]
    return {
        "issue_ms": issue,
        "thread_cpu_ms": thread,
        "blocked_ms": [i - t for i, t in zip(issue, thread, strict=True)],
        "other_cpu_ms": [p - t for p, t in zip(process, thread, strict=True)],
    }


def host_us_per_row(run: dict, off: dict) -> float | None:
    """The monitor's host time per row in one round (us): the run's median issue less the median issue of
    the "off" run of its round, over the rows the run's collected step recorded (None where either run kept
    no issue times, or the run recorded no rows: "off", msprobe)."""
    mine, base = issue_columns(run), issue_columns(off)
    rows = run.get("rows")
    if mine is None or base is None or not rows or not mine["issue_ms"] or not base["issue_ms"]:
        return None
    return (statistics.median(mine["issue_ms"]) - statistics.median(base["issue_ms"])) * 1e3 / rows


def issue_summary(runs: list[dict], offs: list[dict]) -> dict | None:
    """One mode's issue figures over its rounds: the medians of each column over the issue steps of every
    round pooled, and the host time per row (per round against that round's "off" run; the median over
    rounds and their range)."""
    columns = [c for c in map(issue_columns, runs) if c is not None]
    if len(columns) < len(runs):
        return None
    pooled = {key: [v for c in columns for v in c[key]] for key in ISSUE_COLUMNS}
    if not pooled["issue_ms"]:
        return None
    per_row = [host_us_per_row(r, o) for r, o in zip(runs, offs, strict=True)]
    known = [v for v in per_row if v is not None]
    return {
        "steps": len(pooled["issue_ms"]),
        **{key: statistics.median(values) for key, values in pooled.items()},
        "rows": runs[0].get("rows"),
        "us_per_row": statistics.median(known) if known else None,
        "us_per_row_rounds": per_row,
    }


def summarise(mode: str, runs: list[dict], offs: list[dict], base: dict) -> dict:
    """One mode over its rounds, each run against the "off" run of its round; ``base`` is the first "off"
    run's kernel and sync counts."""
    pooled = [t for r in runs for t in r["step_ms"][r["window"][0] :]]
    by_mean, by_median = _ratios(runs, offs, "mean_ms"), _ratios(runs, offs, "median_ms")
    kernels, syncs = runs[0]["kernels"], runs[0]["syncs"]
    return {
        "label": LABELS[mode],
        "rounds": len(runs),
        "measured_steps": len(pooled),
        **step_summary([t / 1e3 for t in pooled]),
        "ratio_mean": statistics.median(by_mean),
        "ratio_mean_range": [min(by_mean), max(by_mean)],
        "ratio_median": statistics.median(by_median),
        "ratio_median_range": [min(by_median), max(by_median)],
        # the worst pause a user sees: the longest step of a run against the typical unmonitored step
        "longest_to_off_median": max(_ratios(runs, offs, "longest_ms", "median_ms")),
        "gc": {
            g: {
                "count": sum(r["gc"][g]["count"] for r in runs),
                "pause_ms": sum(r["gc"][g]["pause_ms"] for r in runs),
                "longest_ms": max(r["gc"][g]["longest_ms"] for r in runs),
            }
            for g in GENERATIONS
        },
        "window": runs[0]["window"],
        "collected_in_window": runs[0]["collected_in_window"],
        "first_collected": runs[0]["first_collected"]
        and {
            "step": runs[0]["first_collected"]["step"],
            "ms": [r["first_collected"]["ms"] for r in runs if r["first_collected"]],
        },
        "kernels": kernels,
        "kernels_added": None if kernels is None or base["kernels"] is None else kernels - base["kernels"],
        "syncs": syncs,
        "syncs_added": None if syncs is None or base["syncs"] is None else syncs - base["syncs"],
        "peak_mib": max(r["peak_mib"] for r in runs),
        "peak_vs_off": max(_ratios(runs, offs, "peak_mib")) - 1,
        "issue": issue_summary(runs, offs),
        "runs": runs,
    }


def _fmt(value, spec: str = "") -> str:
    return "-" if value is None else format(value, spec)


def table(result: dict) -> list[str]:
    """The summary table (markdown), a line per interval mode's warm-up and a line on msprobe."""
    modes = result["modes"]
    lines = [
        "| mode | mean ms | median ms | p90 ms | longest ms | **mean / off** | median / off "
        "| longest / off median | gc collections gen 0/1/2 | gc pauses ms gen 0/1/2 | syncs added "
        "| kernels added | peak MiB (vs off) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in modes.values():
        counts = "/".join(str(m["gc"][g]["count"]) for g in GENERATIONS)
        pauses = "/".join(f"{m['gc'][g]['pause_ms']:.0f}" for g in GENERATIONS)
        lines.append(
            f"| {m['label']} | {m['mean_ms']:.1f} | {m['median_ms']:.1f} | {m['p90_ms']:.1f} "
            f"| {m['longest_ms']:.1f} | **{m['ratio_mean']:.3f}** | {m['ratio_median']:.3f} "
            f"| {m['longest_to_off_median']:.2f} | {counts} | {pauses} | {_fmt(m['syncs_added'])} "
            f"| {_fmt(m['kernels_added'])} | {m['peak_mib']:.0f} ({m['peak_vs_off']:+.1%}) |"
        )
    off = modes.get("off")
    if off:
        lines.append(
            f"(steps {off['window'][0]}..{off['window'][1]} of each run measured, {off['measured_steps']} "
            f"steps a mode over {off['rounds']} round(s); ratios: median over rounds of mode / off of the "
            "same round; longest / off median: the worst run; gc: collections inside the measured steps, "
            "summed)"
        )
    for m in modes.values():
        first = m["first_collected"]
        if first is None:
            continue
        runs = ", ".join(f"{ms:.0f}" for ms in first["ms"])
        where = "in the warm-up" if first["step"] < m["window"][0] else "INSIDE the measured window"
        steps = m["collected_in_window"]
        if steps is None:
            inside = "unknown"
        else:
            inside = f"{len(steps)} ({', '.join(map(str, steps[:8]))}{', ...' if len(steps) > 8 else ''})"
        lines.append(
            f"{m['label']}: first collected step {first['step']} ({where}): {runs} ms; "
            f"collected steps in the window: {inside}"
        )
    lines += issue_table(result)
    msprobe = result.get("msprobe", {})
    line = f"msprobe: {msprobe.get('status', 'not asked for')}"
    if msprobe.get("note"):
        line += f"; {msprobe['note']}"
    lines.append(line)
    return lines


ISSUE_LEGEND = (
    "(issue: from a step's start to train_step's return, before the closing sync; medians over the measured "
    "steps, an interval mode's collected ones only. blocked = issue - the training thread's CPU: the time "
    "it did not run. blocked >> 0 with the other threads idle: it waited on the device (a sync, a full "
    "launch queue) or, on a busy machine, for a core; blocked ~ the other threads' CPU: it waited for them "
    "(the GIL; on CUDA autograd's device thread runs backward while the training thread waits). The writer "
    "process is not counted. host us a row: per round (the mode's issue - off's) / rows, the median over "
    "rounds)"
)


def issue_table(result: dict) -> list[str]:
    """Where the time to issue a step goes, per mode (nothing where no mode kept issue times)."""
    modes = [m for m in result["modes"].values() if m.get("issue")]
    if not modes:
        return []
    lines = [
        "",
        "| mode | steps | issue ms | training thread CPU ms | blocked ms | other threads' CPU ms | rows "
        "| host us a row |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m in modes:
        i = m["issue"]
        lines.append(
            f"| {m['label']} | {i['steps']} | {i['issue_ms']:.1f} | {i['thread_cpu_ms']:.1f} "
            f"| {i['blocked_ms']:.1f} | {i['other_cpu_ms']:.1f} | {_fmt(i['rows'])} "
            f"| {_fmt(i['us_per_row'], '.2f')} |"
        )
    return [*lines, ISSUE_LEGEND]


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The yardstick's device, shape and source (the options of every bench that trains it)."""
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
    parser.add_argument(
        "--compile",
        metavar="BACKEND",
        help="compile each block in place with this torch.compile backend (inductor; aot_eager on a CPU), "
        "as torchtitan does, before the monitor attaches: the compiled yardstick",
    )


def build_workload(args: argparse.Namespace):
    """The yardstick's model and AdamW on ``args.device`` (seeded), and a function that trains step ``i``."""
    sys.path.insert(0, str(args.workload))
    import gpt_cuda
    import torch

    device = torch.device(args.device)
    torch.manual_seed(0)
    model = gpt_cuda.GPT(args.vocab, args.d, args.heads, args.layers, args.seq).to(device)
    if getattr(args, "compile", None):
        for block in model.blocks:
            block.compile(backend=args.compile)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def train_step(i: int) -> None:
        gpt_cuda.step(model, optimizer, gpt_cuda.batch(i, args.batch, args.seq, args.vocab, device))

    return model, optimizer, train_step


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40, help="measured steps per run (a multiple of 10)")
    parser.add_argument("--warmup", type=int, default=5, help="unmeasured steps first (at least 1)")
    add_workload_arguments(parser)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument(
        "--small-tiles", action="store_true", help="small kernel tiles (CPU runs under TRITON_INTERPRET=1)"
    )
    parser.add_argument(
        "--batch-mib",
        type=int,
        default=0,
        help="bytes a Triton batch holds, fixed (default: the device's share, triton_path.batch_bytes)",
    )
    parser.add_argument(
        "--time-budget",
        type=float,
        help="seconds for everything: no round starts that would end past it, no run goes past it",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.warmup < 1:
        parser.error("--warmup must be at least 1: the first collected step (compilation) belongs there")
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if args.child:
        print(json.dumps(run_child(args.child, args)))
        return
    if not (args.workload / "gpt_cuda.py").exists():
        raise SystemExit(f"error: workload not found: {args.workload}/gpt_cuda.py (set --workload)")
    started = time.monotonic()

    def left() -> float | None:
        return None if args.time_budget is None else args.time_budget - (time.monotonic() - started)

    modes = ["off"] + [m for m in args.modes if m != "off" and not is_msprobe(m)]
    asked = [m for m in args.modes if is_msprobe(m)]
    usable, status = msprobe_status() if asked else (False, "not asked for")
    msprobe = {"status": status, "modes": asked if usable else [], "note": None}
    if asked and not usable:
        print(f"msprobe: {status}: skipping {', '.join(asked)}", flush=True)

    runs: dict[str, list[dict]] = {m: [] for m in modes}
    msprobe_runs: dict[str, dict] = {}
    longest_round = 0.0
    stopped = None
    round_index = 0
    while round_index < args.rounds and stopped is None:
        budget = left()
        if round_index and budget is not None and budget < longest_round:
            stopped = f"time budget: stopped after {round_index} round(s)"
            break
        began = time.monotonic()
        shift = round_index % len(modes)
        done: dict[str, dict] = {}
        try:
            for mode in modes[shift:] + modes[:shift]:  # rotated so no mode always runs first
                done[mode] = _child(mode, args, left())
        except RunFailed as error:
            if "time budget" not in str(error):
                raise SystemExit(f"error: {error}") from None
            stopped = f"{error}; round {round_index + 1} dropped"
            break
        for mode, run in done.items():
            runs[mode].append(run)
        longest_round = max(longest_round, time.monotonic() - began)
        round_index += 1
        print(
            f"round {round_index}/{args.rounds} ({time.monotonic() - began:.0f} s): "
            + ", ".join(f"{m} {runs[m][-1]['mean_ms']:.1f} ms" for m in modes),
            flush=True,
        )
        if round_index == 1 and msprobe["modes"]:
            msprobe_runs = _msprobe_round(msprobe, args, left, longest_round)
    if stopped:
        print(stopped, flush=True)
    if not runs["off"]:
        raise SystemExit(f"error: no round finished ({stopped})")

    offs = runs["off"]
    result = {
        "when": time.strftime("%Y-%m-%d %H:%M"),
        "args": _shape_argv(args),
        "rounds": len(offs),
        "stopped": stopped,
        "msprobe": msprobe,
        "modes": {},
    }
    base = offs[0]
    for mode in modes:
        result["modes"][mode] = summarise(mode, runs[mode], offs, base)
    msprobe_off = msprobe_runs.pop("off", None)
    for mode, run in msprobe_runs.items():
        result["modes"][mode] = summarise(mode, [run], [msprobe_off], msprobe_off)
    if msprobe_off:
        msprobe["off_run"] = msprobe_off

    first = offs[0]
    print(
        f"\ndevice {first['device']}, torch {first['torch']}, triton {first['triton']}, statistics backend "
        f"bf16={first['backend_bf16']} fp32={first['backend_fp32']}"
    )
    print("\n".join(table(result)))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


def _msprobe_round(msprobe: dict, args: argparse.Namespace, left, longest_round: float) -> dict[str, dict]:
    """msprobe's modes, once, with an "off" run of their own; skipped or cut short by the time budget."""
    budget = left()
    if budget is not None and budget < 2 * longest_round:
        msprobe["note"] = "not run: the time budget leaves no room for its round"
        return {}
    began = time.monotonic()
    # at most half of what is left: trainmon's rounds keep the other half
    deadline = None if budget is None else began + budget / 2
    done: dict[str, dict] = {}
    for mode in ["off", *msprobe["modes"]]:
        try:
            done[mode] = _child(mode, args, None if deadline is None else deadline - time.monotonic())
        except RunFailed as error:
            msprobe["note"] = f"{error}".splitlines()[0] + " (its round is dropped)"
            print(f"msprobe: {error}", flush=True)
            return {}
    print(
        f"msprobe round ({time.monotonic() - began:.0f} s): "
        + ", ".join(f"{m} {r['mean_ms']:.1f} ms" for m, r in done.items()),
        flush=True,
    )
    msprobe["note"] = "its rows are against the off run of their own round, once"
    return done


if __name__ == "__main__":
    main()
