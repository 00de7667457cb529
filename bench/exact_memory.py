"""Memory that ``alert.capture: exact`` holds: references to a collected step's activations, kept from their
hook to the step-boundary check.

Each mode trains the reference workload in a fresh process (the CPU one, ../shared/bench/tinygpt.py, or the
GPU one, ../shared/bench/gpt_cuda.py, with ``--device cuda``) and reports the process's peak memory: peak RSS
on the CPU (``ru_maxrss``), ``torch.cuda.max_memory_allocated`` on a GPU. For ``full_exact`` it also reports
what the holder kept alive at the check (``HeldTensors.nbytes``: each storage once), which is an upper bound
of the extra memory: most of those tensors are saved for backward by autograd anyway, so they live through
the forward pass whether trainmon holds them or not; what the holder adds is that the ones backward has
freed stay until the optimizer's pre-step.

    python bench/exact_memory.py                  # CPU, modes off / full / full_exact, 3 rounds
    python bench/exact_memory.py --device cuda    # GPU workload
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from overhead import MODES as OVERHEAD_MODES  # bench/ is on sys.path when a bench script runs

REPO = Path(__file__).resolve().parents[1]
WORKLOADS = REPO.parent / "shared" / "bench"

MODES = {mode: OVERHEAD_MODES[mode] for mode in ("off", "full", "full_exact")}


def _train_cpu(mode: str, steps: int) -> dict:
    import resource

    import torch

    sys.path.insert(0, str(WORKLOADS))
    from tinygpt import batches, make, train

    torch.set_num_threads(2)
    model, optimizer = make()
    held = _watch_held()
    with tempfile.TemporaryDirectory(prefix="tm-mem-") as logdir:
        monitor = _attach(mode, model, optimizer, logdir)
        train(model, optimizer, batches(steps))
        if monitor is not None:
            monitor.close()
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {"mode": mode, "peak_mib": peak_kib / 1024, "held_mib": _mib(held)}


def _train_cuda(mode: str, steps: int) -> dict:
    import torch

    sys.path.insert(0, str(WORKLOADS))
    import gpt_cuda

    model, optimizer = gpt_cuda.make()
    held = _watch_held()
    with tempfile.TemporaryDirectory(prefix="tm-mem-") as logdir:
        monitor = _attach(mode, model, optimizer, logdir)
        data = [gpt_cuda.batch(i) for i in range(steps)]
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        for b in data:
            gpt_cuda.step(model, optimizer, b)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        if monitor is not None:
            monitor.close()
    return {"mode": mode, "peak_mib": peak / 2**20, "held_mib": _mib(held)}


def _attach(mode: str, model, optimizer, logdir: str):
    if MODES[mode] is None:
        return None
    import trainmon

    return trainmon.attach(model, optimizer, config=MODES[mode], logdir=logdir)


def _watch_held() -> list[int]:
    """Records ``HeldTensors.nbytes()`` at every boundary check (bench-only instrumentation)."""
    from trainmon.step import boundary

    sizes: list[int] = []
    check = boundary.BoundaryCheck.check

    def measured(self, *args, **kwargs):
        if self.held is not None:
            sizes.append(self.held.nbytes())
        return check(self, *args, **kwargs)

    boundary.BoundaryCheck.check = measured
    return sizes


def _mib(sizes: list[int]) -> float | None:
    return max(sizes) / 2**20 if sizes else None


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        train = _train_cuda if args.device == "cuda" else _train_cpu
        print(json.dumps(train(args.child, args.steps)))
        return 0

    results: dict[str, list[dict]] = {m: [] for m in args.modes}
    # a fixed mmap threshold: freed tensors go back to the system, so peak RSS is live memory rather than
    # glibc's heap retention, which otherwise varies by +-30 MB from run to run
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    for _ in range(args.rounds):
        for mode in args.modes:
            command = [
                sys.executable,
                __file__,
                "--child",
                mode,
                "--device",
                args.device,
                "--steps",
                str(args.steps),
            ]
            out = subprocess.run(command, check=True, capture_output=True, text=True, env=env).stdout
            results[mode].append(json.loads(out.strip().splitlines()[-1]))
    unit = "peak RSS" if args.device == "cpu" else "max_memory_allocated"
    base = statistics.median(r["peak_mib"] for r in results[args.modes[0]])
    print(f"{'mode':<12} {unit + ' MiB (median)':>28} {'vs ' + args.modes[0]:>10} {'held at check MiB':>18}")
    for mode, runs in results.items():
        peak = statistics.median(r["peak_mib"] for r in runs)
        held = runs[0]["held_mib"]
        held_text = f"{held:.1f}" if held is not None else "-"
        print(f"{mode:<12} {peak:>28.1f} {peak / base:>10.3f} {held_text:>18}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
