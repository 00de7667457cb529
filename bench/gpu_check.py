"""Every GPU figure of trainmon from one command (run it through bench/gpu_check.sh).

On a machine with a CUDA GPU, with the torch and Triton installed there (nothing is downloaded; wheels carried
in ``.whl/`` are installed by gpu_check.sh first), in this order, within ``--budget`` (530 s: under 9
minutes with the wheels' install) on one H100 or H200; every step after the third takes what its budget
leaves it (rounds stop early, the sweep stops trying tilings), the later steps' shares kept for them:

1. ``tests/test_cuda.py``: no synchronising call in a collected step, kernels per step, GPU statistics equal
   to the CPU kernel's, losses bitwise equal with and without the monitor;
2. ``bench/launch_count.py``: Triton launches per collected step on the GPU benchmark's model;
3. ``bench/host_cost.py`` on this machine's CPU, short (full coverage, nothing written, the Triton host side
   with stand-in kernels): the monitor's host time per tensor where no GPU takes part, to set beside the
   development host's figure and tell this host's Python speed from what the GPU path adds; with
   ``--split``, that time per row split into the launcher, the batches' staging, the reducer's rows, the
   step buffer, the torch ops and the rest (hooks, schedule), to set beside the GPU host's own figure;
4. ``bench/gpu_kernel_sweep.py``: how fast the statistics kernels read memory for several tilings (block,
   chunk, warps) on the yardstick's parameter and activation sizes, against ``torch.sum`` of the same bytes,
   and whether every tiling gives the same statistics: what picks the kernels' tiling (``--no-sweep`` leaves
   it out; it is skipped where less than ``SWEEP_RESERVE_S`` would be left for step 5);
5. ``bench/gpu_overhead.py``: paired runs (a fresh process each, modes rotated within a round) of off, full,
   wg+mv, full with ``step_interval: 10`` and full + ``alert.capture: exact`` + ``alert.on_nan: skip`` on
   the GPU yardstick (bench/gpt_cuda.py, or ../shared/bench/gpt_cuda.py where present), and msprobe's
   monitor (full, wg+mv) in a round of its own where msprobe imports; rounds stop early rather than run
   past the time budget;
6. the compiled yardstick: ``bench/gpu_overhead.py --compile inductor`` (each block compiled in place before
   the monitor attaches, as torchtitan does) for off, wg+mv and full, in the ``COMPILED_RESERVE_S`` kept
   for it (``--no-compiled`` leaves it out);
7. the real stacks: ``bench/gpu_stacks.py``: megatron-core's GPTModel (local spec, bf16, distributed
   optimizer) through ``trainmon.enable_megatron``, DeepSpeed ZeRO-2 and ZeRO-3 in bf16, FSDP2, each at world
   size 1 with wg + mv on: whether it ran, the rows collected against those expected, whether the losses
   are bitwise equal with and without the monitor, the wg + mv overhead (paired runs), in the
   ``STACKS_RESERVE_S`` kept for it (``--no-stacks`` leaves it out; megatron-core and DeepSpeed come as
   carried wheels);

then prints one summary: the environment (device, CUDA, torch, Triton, the statistics backend in use, whether
the native ``crc32c`` is there, msprobe, the wheels carried) and a table with, per mode, the mean, median,
90th percentile and longest step, the mean and median against "off" of the same round, the longest step
against off's median, Python's garbage collections in the measured steps (per generation, with pauses), the
synchronising calls and kernels the monitor adds in one collected step, and peak memory against "off"; then
each mode's first collected step (in the warm-up: Triton compiles there) and the collected steps inside the
measured window; a second table of where the time to issue a step goes (the training thread's CPU, the time
it did not run, the other threads' CPU: ``gpu_overhead.issue_table``); the GPU host's own time per row (full's
issue less off's, over its rows) beside step 3's figure, and whether step 3 predicts it within 25%; wg + mv's
time blocked while issuing its step; then the sweep's best tiling and its table.

``--tiny``: the same on the CPU, as a dry run: Triton's interpreter runs the kernels (TRITON_INTERPRET=1 and
the Triton backend forced), on a one-layer model with one warm-up step and 10 measured ones (the stacks: one
round of one warm-up step and two measured ones, on gloo); test_cuda.py is collected and skipped. Its
numbers say nothing about a GPU; it shows the command works before a GPU is at hand.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
sys.path.insert(0, str(REPO))  # this tree's trainmon, not an installed one
sys.path.insert(0, str(BENCH))
import gpu_overhead  # noqa: E402 - bench/ is not a package: found through the path set just above

# gpu_overhead.py's modes, in the table's order; msprobe's run where msprobe imports (else the table says why)
MODES = ["off", "full", "wgmv", "full_interval10", "full_exact_skip", "msprobe_full", "msprobe_wgmv"]
TINY_SHAPE = ["--layers", "1", "--d", "32", "--heads", "2", "--vocab", "64"]
# the compiled yardstick's modes, and the seconds kept for it after step 5 (compiling takes a minute or so a
# process on a GPU machine; --tiny compiles with aot_eager, which needs no C++ compiler)
COMPILED_MODES = ["off", "wgmv", "full"]
COMPILED_RESERVE_S = 120.0  # one round of the three (issue 44: the stacks share the 9 minutes)
# the stacks (step 7): two processes (megatron-core; DeepSpeed ZeRO-2, ZeRO-3 and FSDP2), each stack two
# rounds of off and wg + mv runs of 13 steps on a 168M-parameter GPT
STACKS_RESERVE_S = 110.0
STACKS_TINY_RESERVE_S = 75.0  # one process for the four on the CPU: 45 s on a loaded 2-core machine
STACKS_ARGS = ["--rounds", "2", "--steps", "10", "--warmup", "3"]
STACKS_TINY_ARGS = ["--tiny", "--rounds", "1", "--steps", "2", "--warmup", "1"]


def crc32c_report() -> dict:
    """Whether the native ``crc32c`` module is there: without it TensorBoard event records take their CRC
    from a pure-Python table (trainmon.writer.tensorboard), much slower."""
    try:
        import crc32c  # noqa: F401
    except Exception as error:  # noqa: BLE001 - missing or broken: reported as such
        return {"native": False, "version": None, "error": f"{type(error).__name__}: {error}"}
    try:
        version = importlib.metadata.version("crc32c")
    except importlib.metadata.PackageNotFoundError:
        version = "version unknown"
    return {"native": True, "version": version, "error": None}


def package_version(distribution: str) -> str | None:
    """The installed version of a distribution (None where it is not installed), without importing it."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def carried_report() -> dict | None:
    """The wheels gpu_check.sh installed from ``.whl/`` (None where none were carried)."""
    names = os.environ.get("TRAINMON_CARRIED_WHEELS")
    if not names:
        return None
    site = os.environ.get("TRAINMON_CARRIED_SITE", "")
    return {
        "wheels": names.split(),
        "installed": bool(site),
        "site": site or None,
        "on_path": bool(site) and any(Path(p) == Path(site) for p in sys.path if p),
    }


def environment_report() -> dict:
    """What this machine runs: device, versions, the statistics backend the monitor picks, crc32c, msprobe."""
    import torch

    from trainmon import stats
    from trainmon.stats import triton_path

    info: dict = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception as error:  # noqa: BLE001 - missing or broken: reported as such
        info["triton"] = f"none ({type(error).__name__})"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["device"] = f"{props.name}, {props.total_memory / 2**30:.0f} GiB, sm_{props.major}{props.minor}"
        device = torch.device("cuda")
    else:
        info["device"] = "cpu (no CUDA device)"
        device = torch.device("cpu")
    info["backend"] = {
        "bf16": stats.backend_of(device, torch.bfloat16),
        "fp32": stats.backend_of(device, torch.float32),
    }
    info["triton_unavailable"] = triton_path.unavailable()
    from trainmon.step import buffer

    built = buffer.FastRows is not None
    info["hot_path"] = "native" if built else "python (trainmon.step._fastrows not built)"
    info["crc32c"] = crc32c_report()
    info["stacks"] = {name: package_version(name) for name in ("megatron-core", "deepspeed")}
    info["msprobe"] = gpu_overhead.msprobe_status()[1]
    info["carried"] = carried_report()
    return info


def run_step(title: str, argv: list[str], env: dict, timeout: float, stream: bool = False) -> tuple[int, str]:
    """Run one part; returns its exit code and output (streamed as it comes when ``stream``)."""
    print(f"\n== {title}: {' '.join(argv[1:])}", flush=True)
    start = time.monotonic()
    try:
        if stream:
            proc = subprocess.Popen(
                argv, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
            lines = []
            assert proc.stdout is not None
            for line in proc.stdout:
                print("   ", line, end="", flush=True)
                lines.append(line)
            code = proc.wait(timeout=max(1.0, timeout - (time.monotonic() - start)))
            output = "".join(lines)
        else:
            done = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
            code, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as error:
        code, output = 124, f"timed out after {timeout:.0f} s\n{error.stdout or ''}"
    print(f"   ({time.monotonic() - start:.0f} s, exit {code})", flush=True)
    return code, output


def pytest_summary(output: str) -> str:
    for line in reversed(output.strip().splitlines()):
        if any(word in line for word in ("passed", "failed", "skipped", "error", "no tests ran")):
            return line.strip("= ").strip()
    return output.strip().splitlines()[-1] if output.strip() else "no output"


def environment_lines(info: dict) -> list[str]:
    lines = [
        f"device: {info['device']}; torch {info['torch']} (CUDA {info['cuda']}), Triton {info['triton']}, "
        f"Python {info['python']}"
    ]
    backend = f"statistics backend: bf16={info['backend']['bf16']} fp32={info['backend']['fp32']}"
    if info["triton_unavailable"]:
        backend += f" (Triton kernels off: {info['triton_unavailable']})"
    lines.append(backend)
    lines.append(f"step buffer's hot path: {info.get('hot_path', 'not reported')}")
    crc = info["crc32c"]
    if crc["native"]:
        lines.append(f"crc32c: native {crc['version']} (TensorBoard event records)")
    else:
        lines.append(
            f"crc32c: MISSING ({crc['error']}): TensorBoard event records take their CRC in pure Python, "
            "slowing the writer; carry its wheel in .whl/ (bench/gpu_wheels.sh)"
        )
    lines.append(f"msprobe: {info['msprobe']}")
    stacks = info.get("stacks") or {}
    lines.append(
        "stacks: " + ", ".join(f"{name} {version or 'NOT installed'}" for name, version in stacks.items())
    )
    carried = info["carried"]
    if carried:
        where = f"installed into {carried['site']}" if carried["installed"] else "NOT installed (see above)"
        lines.append(f"carried wheels: {' '.join(carried['wheels'])}: {where}")
    return lines


def summary(
    info: dict,
    tiny: bool,
    tests: str,
    counts: dict | None,
    overhead: dict | None,
    seconds: float,
    host: dict | None = None,
    sweep: dict | None = None,
    compiled: dict | None = None,
    stacks: dict | None = None,
) -> str:
    lines = []
    if tiny:
        lines.append(
            "trainmon GPU check -- CPU DRY RUN under Triton's interpreter (--tiny): not a GPU figure"
        )
    else:
        lines.append("trainmon GPU check")
    lines += environment_lines(info)
    lines.append(f"tests/test_cuda.py: {tests}")
    if counts:
        launches = ", ".join(f"{k} {v:g}" for k, v in counts["triton_launches"].items())
        lines.append(
            f"launches per collected step (bench/launch_count.py, GPT {counts['layers']} layers, "
            f"{counts['rows']} rows): Triton {counts['triton_launches_total']:g} ({launches}); "
            f"torch-ops backend {counts['torch_ops_added']} ops"
        )
    else:
        lines.append("launches per collected step: bench/launch_count.py failed (see above)")
    lines.append(host_line(host))
    lines += host_split_lines(host)
    if overhead:
        stopped = f"; {overhead['stopped']}" if overhead["stopped"] else ""
        lines.append(
            f"overhead (bench/gpu_overhead.py {' '.join(overhead['args'])}): {overhead['rounds']} round(s), "
            f"a fresh process per run{stopped}"
        )
        lines.append("")
        lines += gpu_overhead.table(overhead)
        if tiny:
            lines.append("(on the CPU: no syncs or kernels to count; peak memory is the process's peak RSS)")
        lines += host_per_row_lines(host_per_row(overhead, host))
    else:
        lines.append("overhead: bench/gpu_overhead.py failed (see above)")
    lines += compiled_lines(compiled)
    lines += stacks_lines(stacks)
    lines += sweep_lines(sweep)
    lines.append(f"total {seconds / 60:.1f} min")
    return "\n".join(lines)


def compiled_lines(compiled: dict | None) -> list[str]:
    """The compiled yardstick's table (step 6), or why there is none."""
    if compiled is None:
        return ["", "compiled yardstick: bench/gpu_overhead.py --compile failed (see above)"]
    if "skipped" in compiled:
        return ["", f"compiled yardstick: skipped ({compiled['skipped']})"]
    stopped = f"; {compiled['stopped']}" if compiled["stopped"] else ""
    args = " ".join(compiled["args"])
    head = f"compiled yardstick (bench/gpu_overhead.py {args}): {compiled['rounds']} round(s)"
    return ["", head + stopped, *gpu_overhead.table(compiled)]


def stacks_lines(stacks: dict | None) -> list[str]:
    """The real stacks' table (step 7), or why there is none."""
    if stacks is None:
        return ["", "stacks: bench/gpu_stacks.py failed (see above)"]
    if "skipped" in stacks:
        return ["", f"stacks: skipped ({stacks['skipped']})"]
    import gpu_stacks

    head = "the real stacks, world size 1, wg + mv (bench/gpu_stacks.py: paired runs, deterministic kernels)"
    return ["", head, *gpu_stacks.table(stacks["stacks"]), *gpu_stacks.notes(stacks["stacks"])]


# short: full coverage with nothing written, 3 pairs of 30-step blocks (about 20 s on the development host)
HOST_COST_ARGS = ["--modes", "full_api", "--backends", "triton"]
HOST_COST_ARGS += ["--alloc-steps", "10", "--promotion-steps", "10"]
HOST_COST_ARGS += ["--split", "20"]  # and where a row's host time goes: launcher, staging, rows, step buffer


def host_line(host: dict | None) -> str:
    """The summary's line of bench/host_cost.py's figure on this machine's CPU."""
    rows = (host or {}).get("summary") or []
    if not rows or rows[0].get("host_us_per_tensor") is None:
        return "host cost on this CPU: bench/host_cost.py failed (see above)"
    r = rows[0]
    return (
        f"host cost on this CPU (bench/host_cost.py, {r['mode']}, Triton host side, no GPU): "
        f"{r['host_us_per_tensor']:.2f} us a monitored tensor, mean step {r['mean_ratio']:.3f}x, "
        f"gen2 {r['gen2_on']} on / {r['gen2_off']} off"
    )


# issue 44's goal for bench/host_cost.py: its figure within this share of the GPU host's own
HOST_COST_TOLERANCE = 0.25


def host_per_row(overhead: dict, host: dict | None) -> dict:
    """The GPU host's own time per row (bench/gpu_overhead.py's full mode: its issue less off's, over the
    rows of its collected step) beside bench/host_cost.py's figure on this machine's CPU, their ratio and
    whether it is within ``HOST_COST_TOLERANCE``; and where wg + mv's time to issue a step goes, beside off's
    (the share of its issue the training thread did not run: ``blocked_share``)."""
    modes = overhead["modes"]
    full = (modes.get("full") or {}).get("issue") or {}
    off = (modes.get("off") or {}).get("issue") or {}
    measured = full.get("us_per_row")
    rows = (host or {}).get("summary") or []
    predicted = rows[0].get("host_us_per_tensor") if rows else None
    ratio = predicted / measured if predicted is not None and measured and measured > 0 else None
    wgmv = (modes.get("wgmv") or {}).get("issue")
    return {
        "mode": "full",
        "us_per_row": measured,
        "rows": full.get("rows"),
        "issue_ms": full.get("issue_ms"),
        "off_issue_ms": off.get("issue_ms"),
        "host_cost_mode": rows[0].get("mode") if rows else None,
        "host_cost_us_per_row": predicted,
        "ratio": ratio,
        "within_tolerance": None if ratio is None else abs(ratio - 1) <= HOST_COST_TOLERANCE,
        "tolerance": HOST_COST_TOLERANCE,
        "wgmv": None
        if not wgmv
        else {
            **{key: wgmv[key] for key in gpu_overhead.ISSUE_COLUMNS},
            "blocked_share": wgmv["blocked_ms"] / wgmv["issue_ms"] if wgmv["issue_ms"] > 0 else None,
            "off": {key: off[key] for key in gpu_overhead.ISSUE_COLUMNS} if off else None,
        },
    }


def host_per_row_lines(figures: dict) -> list[str]:
    """The summary's lines of :func:`host_per_row`."""
    measured, predicted, ratio = figures["us_per_row"], figures["host_cost_us_per_row"], figures["ratio"]
    if measured is None:
        line = "GPU host per row: not measured (bench/gpu_overhead.py kept no issue times for full and off)"
    else:
        within = "unknown" if ratio is None else "yes" if figures["within_tolerance"] else "no"
        prediction, ratio_text = gpu_overhead._fmt(predicted, ".2f"), gpu_overhead._fmt(ratio, ".2f")
        line = (
            f"GPU host per row: {measured:.2f} us (mode full; issue on - off over {figures['rows']} rows) "
            f"against host_cost.py's {prediction} us on this CPU: host_cost / GPU = {ratio_text} "
            f"-> within {figures['tolerance']:.0%}: {within}"
        )
    lines = ["", line]
    wgmv = figures["wgmv"]
    if wgmv:
        off = wgmv["off"] or {}

        def beside_off(key: str) -> str:
            return f"{wgmv[key]:.1f} ms (off {gpu_overhead._fmt(off.get(key), '.1f')})"

        lines.append(
            f"wg + mv's issue: {beside_off('issue_ms')}: training thread CPU {beside_off('thread_cpu_ms')}, "
            f"blocked {beside_off('blocked_ms')} = {gpu_overhead._fmt(wgmv['blocked_share'], '.0%')} of "
            f"the issue, other threads' CPU {beside_off('other_cpu_ms')}"
        )
    return lines


def host_split_lines(host: dict | None) -> list[str]:
    """bench/host_cost.py's split of a row's host time into parts, where it ran."""
    import host_cost

    rows = (host or {}).get("summary") or []
    return host_cost.split_lines(rows[0]) if rows else []


# the sweep's part: the tilings are compiled once each (about a minute on a GPU), each timed 5 times; it runs
# only where at least SWEEP_RESERVE_S would be left for bench/gpu_overhead.py after it
SWEEP_ARGS = ["--repeat", "5", "--time-budget", "60"]  # no tiling starts after 60 s (compiling included)
# the dry run: two tilings of one block a chunk, which the interpreter runs in seconds
SWEEP_TINY_ARGS = ["--device", "cpu", "--scale", "2e-5", "--layers", "1", "--repeat", "1"]
SWEEP_TINY_ARGS += ["--tilings", "4096,4096,4", "2048,4096,8,fast4"]
SWEEP_TIMEOUT_S = 110.0
# what must be left after the sweep: the compiled yardstick's and the stacks' reserves and 70 s of
# bench/gpu_overhead.py (its figures were taken on the H200 before; the sweep's and the stacks' were not)
SWEEP_RESERVE_S = 300.0


def sweep_lines(sweep: dict | None) -> list[str]:
    """The summary's lines of bench/gpu_kernel_sweep.py: the fastest tiling of each kernel against the
    first one listed (the tiling in use), whether every tiling gave the same statistics, this device's
    choice, and the table."""
    if sweep is None:
        return ["kernel tilings: bench/gpu_kernel_sweep.py not run or failed (see above)"]
    if "skipped" in sweep:
        return [f"kernel tilings: bench/gpu_kernel_sweep.py skipped: {sweep['skipped']}"]
    import gpu_kernel_sweep

    rows = sweep["tilings"]
    current = rows[0]

    def name(r: dict) -> str:
        return gpu_kernel_sweep.label((r["kernel"], r["block"], r["chunk"], r["warps"], r["unroll"]))

    def best(key: str) -> str:
        top = max(rows, key=lambda r: r[key])
        return f"{top[key]:.0f} GB/s at {name(top)} (in use {name(current)}: {current[key]:.0f} GB/s)"

    differing = [name(r) for r in rows if not r["same_statistics"]]
    same = "yes, every tiling" if not differing else f"NO for {' '.join(differing)}"
    return [
        f"kernel tilings (bench/gpu_kernel_sweep.py, block,chunk,warps[,fastU]): stats_table "
        f"{best('table_gb_s')}; stats_batch {best('batch_gb_s')}; adam_table {best('adam_gb_s')}; "
        f"torch.sum {sweep['sum_gb_s']:.0f} GB/s; same statistics: {same}",
        "",
        *gpu_kernel_sweep.table_of(sweep).splitlines(),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tiny", action="store_true", help="CPU dry run under Triton's interpreter")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40, help="measured steps per run (a multiple of 10)")
    parser.add_argument("--warmup", type=int, default=5, help="unmeasured steps first (the first collected)")
    parser.add_argument(
        "--budget",
        type=float,
        help="seconds for the whole check (default 530: under 9 min with the wheels' install; with --tiny "
        "1500: a dry run's steps are small and fixed, and must finish however loaded the CPU is)",
    )
    parser.add_argument("--json", type=Path, help="also write everything measured here")
    parser.add_argument("--no-sweep", action="store_true", help="leave out bench/gpu_kernel_sweep.py")
    parser.add_argument(
        "--no-compiled", action="store_true", help="leave out the compiled yardstick (step 6)"
    )
    parser.add_argument("--no-stacks", action="store_true", help="leave out the real stacks (step 7)")
    args = parser.parse_args()
    if args.budget is None:
        args.budget = 1500.0 if args.tiny else 530.0
    start = time.monotonic()

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO), str(REPO / "tb_plugin"), env.get("PYTHONPATH", "")]
    ).rstrip(os.pathsep)
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    if args.tiny:
        env["TRITON_INTERPRET"] = "1"
        env["TRAINMON_STATS_BACKEND"] = "triton"
        env["CUDA_VISIBLE_DEVICES"] = ""
        os.environ.update(
            {k: env[k] for k in ("TRITON_INTERPRET", "TRAINMON_STATS_BACKEND", "CUDA_VISIBLE_DEVICES")}
        )
    try:
        info = environment_report()
    except ImportError as error:  # this installs nothing: say what the machine lacks
        needs = "trainmon needs torch, numpy and pyyaml (and pytest for tests/test_cuda.py)"
        raise SystemExit(f"error: {error}; {needs}") from None
    print("\n".join(environment_lines(info)), flush=True)
    if not args.tiny and info["device"].startswith("cpu"):
        raise SystemExit(
            "error: torch sees no CUDA device (for a dry run on the CPU: bench/gpu_check.sh --tiny)"
        )

    def left() -> float:
        return args.budget - (time.monotonic() - start)

    py = sys.executable
    code, output = run_step(
        "tests/test_cuda.py",
        [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "tests/test_cuda.py"],
        env,
        timeout=min(240, left()),
    )
    tests = (
        pytest_summary(output)
        if "No module named pytest" not in output
        else "not run: pytest is not installed"
    )
    if code not in (0, 5) and "pytest is not installed" not in tests:
        print("\n".join(output.strip().splitlines()[-40:]))

    with tempfile.TemporaryDirectory(prefix="tm-gpu-check-") as tmp:
        counts_json, overhead_json = Path(tmp) / "counts.json", Path(tmp) / "overhead.json"
        shape = TINY_SHAPE if args.tiny else []
        code, output = run_step(
            "bench/launch_count.py",
            [py, str(BENCH / "launch_count.py"), "--steps", "1", "--json", str(counts_json), *shape],
            env,
            timeout=min(180, left()),
        )
        print("\n".join("    " + line for line in output.strip().splitlines()[-4:]))
        counts = json.loads(counts_json.read_text()) if code == 0 and counts_json.exists() else None

        host_json = Path(tmp) / "host.json"
        blocks = ["--pairs", "3", "--block", "30"]
        if args.tiny:
            blocks = ["--pairs", "1", "--block", "10", "--heap", "10000"]
        code, output = run_step(
            "bench/host_cost.py (this machine's CPU)",
            [py, str(BENCH / "host_cost.py"), *HOST_COST_ARGS, *blocks, "--json", str(host_json)],
            env,
            timeout=min(120, left()),
        )
        print("\n".join("    " + line for line in output.strip().splitlines()[-3:]))
        host = json.loads(host_json.read_text()) if code == 0 and host_json.exists() else None

        sweep_json = Path(tmp) / "sweep.json"
        sweep: dict | None = None
        if args.no_sweep:
            sweep = {"skipped": "--no-sweep"}
        elif left() - SWEEP_TIMEOUT_S < SWEEP_RESERVE_S:
            sweep = {"skipped": f"{left():.0f} s left, bench/gpu_overhead.py comes first"}
        else:
            code, output = run_step(
                "bench/gpu_kernel_sweep.py",
                [py, str(BENCH / "gpu_kernel_sweep.py"), *(SWEEP_TINY_ARGS if args.tiny else SWEEP_ARGS)]
                + ["--json", str(sweep_json)],
                env,
                timeout=600.0 if args.tiny else SWEEP_TIMEOUT_S,
            )
            print("\n".join("    " + line for line in output.strip().splitlines()[-12:]))
            if code == 0 and sweep_json.exists():
                sweep = json.loads(sweep_json.read_text())

        if args.tiny:  # one warm-up step (the first collected), ten measured: interval 10 collects step 10
            sizes = ["--device", "cpu", *TINY_SHAPE, "--seq", "16", "--batch", "2", "--small-tiles"]
            sizes += ["--steps", "10", "--warmup", "1", "--rounds", "1"]
        else:
            sizes = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--rounds", str(args.rounds)]
        stacks_reserve = 0.0 if args.no_stacks else STACKS_TINY_RESERVE_S if args.tiny else STACKS_RESERVE_S
        reserve = (0.0 if args.no_compiled else COMPILED_RESERVE_S) + stacks_reserve
        budget = max(30.0, left() - 15 - reserve)
        code, output = run_step(
            "bench/gpu_overhead.py",
            [py, str(BENCH / "gpu_overhead.py"), "--modes", *MODES, *sizes, "--json", str(overhead_json)]
            + ["--time-budget", f"{budget:.0f}"],
            env,
            timeout=budget + 10,
            stream=True,
        )
        overhead = json.loads(overhead_json.read_text()) if code == 0 and overhead_json.exists() else None

        compiled: dict | None = {"skipped": "--no-compiled"}
        if not args.no_compiled:
            compiled_json = Path(tmp) / "compiled.json"
            backend = "aot_eager" if args.tiny else "inductor"
            rounds = ["--rounds", "1"] if args.tiny else ["--rounds", "1", "--steps", "20"]
            budget = max(30.0, left() - 10 - stacks_reserve)
            code, output = run_step(
                "bench/gpu_overhead.py --compile (the compiled yardstick)",
                [py, str(BENCH / "gpu_overhead.py"), "--modes", *COMPILED_MODES, *sizes, *rounds]
                + ["--compile", backend, "--json", str(compiled_json), "--time-budget", f"{budget:.0f}"],
                env,
                timeout=budget + 5,
                stream=True,
            )
            compiled = json.loads(compiled_json.read_text()) if code == 0 and compiled_json.exists() else None

        stacks: dict | None = {"skipped": "--no-stacks"}
        if not args.no_stacks:
            stacks_json = Path(tmp) / "stacks.json"
            budget = max(30.0, left() - 5)
            code, output = run_step(
                "bench/gpu_stacks.py (the real stacks)",
                [py, str(BENCH / "gpu_stacks.py"), *(STACKS_TINY_ARGS if args.tiny else STACKS_ARGS)]
                + ["--json", str(stacks_json), "--time-budget", f"{budget:.0f}"],
                env,
                timeout=budget + 10,
                stream=True,
            )
            stacks = json.loads(stacks_json.read_text()) if code == 0 and stacks_json.exists() else None

    seconds = time.monotonic() - start
    print(
        "\n" + summary(info, args.tiny, tests, counts, overhead, seconds, host, sweep, compiled, stacks),
        flush=True,
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "environment": info,
                    "tiny": args.tiny,
                    "test_cuda": tests,
                    "launch_count": counts,
                    "host_cost": host,
                    "overhead": overhead,
                    "host_per_row": None if overhead is None else host_per_row(overhead, host),
                    "kernel_sweep": sweep,
                    "compiled": compiled,
                    "stacks": stacks,
                    "seconds": seconds,
                },
                indent=2,
            )
            + "\n"
        )
    if counts is None or overhead is None or "failed" in tests or "error" in tests:
        sys.exit(1)


if __name__ == "__main__":
    main()
