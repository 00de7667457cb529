"""Monitor overhead on the compiled reference workload (../shared/bench/tinygpt.py under torch.compile).

Paired runs: every round runs each mode in a fresh process (compiled code and the hooks it was traced with
live as long as their process, so an unmonitored block after a monitored one would not be unmonitored), the
modes alternating within the round; a run compiles the model, attaches the monitor to the compiled module
(``off``: none), trains ``--warmup`` unmeasured steps (compilation included), then ``--steps`` measured ones.
The figure of a mode is the median over rounds of (its mean step time / the ``off`` run's of the same round).

    python bench/compile_overhead.py                          # off, wgmv, full; inductor
    python bench/compile_overhead.py --backend aot_eager --rounds 3 --steps 20
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
    "wgmv": {"wg_distribution": True, "mv_distribution": True},
    "full": FULL,
    "full_interval10": {**FULL, "step_interval": 10},  # hooks stay in compiled code: the off steps' cost
}


def run_one(mode: str, backend: str, steps: int, warmup: int, workload: Path, size: dict) -> dict:
    """Inside the measuring subprocess: mean step time of ``steps`` steps after ``warmup``."""
    sys.path.insert(0, str(workload))
    import torch
    from tinygpt import batches, make, train  # the project's yardstick workload

    torch.set_num_threads(2)
    model, optimizer = make(**size)
    compiled = torch.compile(model, backend=backend)
    data = batches(warmup + steps, T=size.get("T", 128), vocab=size.get("vocab", 512))
    with tempfile.TemporaryDirectory(prefix="tm-bench-") as logdir:
        monitor = None
        if MODES[mode] is not None:
            import trainmon

            monitor = trainmon.attach(compiled, optimizer, config=MODES[mode], logdir=logdir)
        started = time.perf_counter()
        train(compiled, optimizer, data[:warmup])
        compile_s = time.perf_counter() - started
        times, _ = train(compiled, optimizer, data[warmup:])
        if monitor is not None:
            monitor.close()
    from torch._dynamo.utils import counters

    return {
        "mode": mode,
        "mean_s": statistics.fmean(times),
        "warmup_s": compile_s,
        "graph_breaks": sum(counters["graph_break"].values()),
        "graphs": counters["stats"]["unique_graphs"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--modes", nargs="+", default=["off", "wgmv", "full"], choices=list(MODES))
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--small", action="store_true", help="d=64, 2 layers (a quick look)")
    parser.add_argument("--workload", type=Path, default=DEFAULT_WORKLOAD)
    parser.add_argument("--json", type=Path, help="write the results here too")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    size = {"d": 64, "layers": 2} if args.small else {}
    if args.child:
        result = run_one(args.child, args.backend, args.steps, args.warmup, args.workload, size)
        print(json.dumps(result))
        return
    modes = ["off", *[m for m in args.modes if m != "off"]]
    rounds = []
    for r in range(args.rounds):
        order = modes if r % 2 == 0 else [modes[0], *reversed(modes[1:])]
        results = {}
        for mode in order:
            argv = [sys.executable, __file__, "--child", mode, "--backend", args.backend]
            argv += [
                "--steps",
                str(args.steps),
                "--warmup",
                str(args.warmup),
                "--workload",
                str(args.workload),
            ]
            argv += ["--small"] if args.small else []
            out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
            results[mode] = json.loads(out.strip().splitlines()[-1])
        rounds.append(results)
        line = ", ".join(f"{m} {results[m]['mean_s'] * 1000:.1f} ms" for m in modes)
        print(f"round {r}: {line}", flush=True)
    summary = {}
    for mode in modes[1:]:
        ratios = [rnd[mode]["mean_s"] / rnd["off"]["mean_s"] for rnd in rounds]
        summary[mode] = {
            "median_ratio": statistics.median(ratios),
            "ratios": ratios,
            "graph_breaks": max(rnd[mode]["graph_breaks"] for rnd in rounds),
            "graphs": max(rnd[mode]["graphs"] for rnd in rounds),
        }
        print(
            f"{mode}: {statistics.median(ratios):.3f}x of the compiled step without the monitor "
            f"(ratios {', '.join(f'{x:.3f}' for x in ratios)}); "
            f"graph breaks {summary[mode]['graph_breaks']}, graphs {summary[mode]['graphs']}"
        )
    off_ms = statistics.median(rnd["off"]["mean_s"] * 1000 for rnd in rounds)
    print(f"off: {off_ms:.1f} ms a step ({args.backend})")
    if args.json:
        args.json.write_text(
            json.dumps({"backend": args.backend, "rounds": rounds, "summary": summary}, indent=1)
        )


if __name__ == "__main__":
    main()
