"""Monitor overhead on the compiled reference workload (../shared/bench/tinygpt.py under torch.compile).

Paired blocks in one process per mode: two copies of the model (same weights, same batches), each compiled,
the monitor attached to one of them for the whole run (compiled code keeps the hooks it was traced with, so
one model cannot be measured with and without the monitor); blocks of ``--block`` steps (default: one)
alternate between the unmonitored and the monitored copy, ``--pairs`` times. The figure of a mode is the
ratio of the mean step times over all its pairs (the median of the pairs' ratios is printed next to it).
Load from other processes, which moves a shared 2-core machine's step time by tens of percent within
seconds, hits both copies alike the finer they alternate; the same ratio of the process's CPU time a step
(``time.process_time``: both threads' work, not the waits for a core) is printed too, as it is far less
moved by such load.

    python bench/compile_overhead.py                          # wgmv and full; inductor
    python bench/compile_overhead.py --backend aot_eager --pairs 20 --small
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from overhead import DEFAULT_WORKLOAD  # noqa: E402 - bench/ is not a package
from overhead import MODES as OVERHEAD_MODES  # noqa: E402

# bench/overhead.py's configs (hooks stay in compiled code: full_interval10 is the off steps' cost)
MODES: dict[str, dict | None] = {m: OVERHEAD_MODES[m] for m in ("off", "wgmv", "full", "full_interval10")}


def run_pairs(mode: str, backend: str, pairs: int, block: int, workload: Path, size: dict) -> dict:
    """Inside the measuring subprocess: per pair, the mean step time of a block unmonitored and monitored."""
    sys.path.insert(0, str(workload))
    import torch
    import torch.nn.functional as F
    from tinygpt import batches, make  # the project's yardstick workload

    import trainmon

    def train(model, optimizer, data):  # tinygpt's step, timed by the wall clock and the process's CPU time
        walls, cpus = [], []
        for batch in data:
            wall, cpu = time.perf_counter(), time.process_time()
            logits = model(batch[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            walls.append(time.perf_counter() - wall)
            cpus.append(time.process_time() - cpu)
        return walls, cpus

    torch.set_num_threads(2)
    off_model, off_optimizer = make(**size)
    on_model, on_optimizer = make(**size)
    # backend "none": the same pairs on the eager model, the control for a loaded machine
    off = off_model if backend == "none" else torch.compile(off_model, backend=backend)
    on = on_model if backend == "none" else torch.compile(on_model, backend=backend)
    data = batches(block, T=size.get("T", 128), vocab=size.get("vocab", 512))
    off_ms, on_ms, off_cpu, on_cpu = [], [], [], []
    with tempfile.TemporaryDirectory(prefix="tm-bench-") as logdir:
        monitor = trainmon.attach(on, on_optimizer, config=MODES[mode], logdir=logdir)
        started = time.perf_counter()
        for _ in range(3):  # compiles, then warms up
            train(off, off_optimizer, data)
            train(on, on_optimizer, data)
        warmup_s = time.perf_counter() - started
        for _ in range(pairs):
            wall, cpu = train(off, off_optimizer, data)
            off_ms.append(statistics.fmean(wall) * 1000)
            off_cpu.append(statistics.fmean(cpu) * 1000)
            wall, cpu = train(on, on_optimizer, data)
            on_ms.append(statistics.fmean(wall) * 1000)
            on_cpu.append(statistics.fmean(cpu) * 1000)
        monitor.close()
    from torch._dynamo.utils import counters

    return {
        "mode": mode,
        "ratios": [a / b for a, b in zip(on_ms, off_ms, strict=True)],
        "off_ms": off_ms,
        "on_ms": on_ms,
        "off_cpu_ms": off_cpu,
        "on_cpu_ms": on_cpu,
        "warmup_s": warmup_s,
        "graph_breaks": sum(counters["graph_break"].values()),
        "graphs": counters["stats"]["unique_graphs"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--modes", nargs="+", default=["wgmv", "full"], choices=list(MODES)[1:])
    parser.add_argument("--backend", default="inductor", help='"none": eager, the control')
    parser.add_argument("--pairs", type=int, default=30)
    parser.add_argument("--block", type=int, default=1)
    parser.add_argument("--small", action="store_true", help="d=64, 2 layers (a quick look)")
    parser.add_argument("--workload", type=Path, default=DEFAULT_WORKLOAD)
    parser.add_argument("--json", type=Path, help="write the results here too")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    size = {"d": 64, "layers": 2} if args.small else {}
    if args.child:
        print(json.dumps(run_pairs(args.child, args.backend, args.pairs, args.block, args.workload, size)))
        return
    results = {}
    for mode in args.modes:  # a fresh process each: compiled code and hooks live as long as their process
        argv = [
            sys.executable,
            __file__,
            "--child",
            mode,
            "--backend",
            args.backend,
            "--pairs",
            str(args.pairs),
        ]
        argv += [
            "--block",
            str(args.block),
            "--workload",
            str(args.workload),
            *(["--small"] if args.small else []),
        ]
        out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
        result = results[mode] = json.loads(out.strip().splitlines()[-1])
        ratios = result["ratios"]
        mean_ratio = statistics.fmean(result["on_ms"]) / statistics.fmean(result["off_ms"])
        cpu_ratio = statistics.fmean(result["on_cpu_ms"]) / statistics.fmean(result["off_cpu_ms"])
        print(
            f"{mode}: {mean_ratio:.3f}x the mean step without the monitor "
            f"(median of {len(ratios)} pairs' ratios {statistics.median(ratios):.3f}, "
            f"from {min(ratios):.3f} to {max(ratios):.3f}); CPU time a step {cpu_ratio:.3f}x; "
            f"unmonitored step "
            f"{statistics.fmean(result['off_ms']):.1f} ms ({args.backend}); "
            f"graph breaks {result['graph_breaks']}, graphs {result['graphs']}",
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps({"backend": args.backend, "results": results}, indent=1))


if __name__ == "__main__":
    main()
