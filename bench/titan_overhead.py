"""The monitor's cost on torchtitan's way of training: the 2x2 job of tests/test_titan.py timed.

Four gloo ranks train tests/titan_llama.py's Llama with torchtitan's tensor-parallel plan inside FSDP2 on a
(dp, tp) = (2, 2) mesh, bf16 mixed precision, two micro-batches a step, eager or with each block compiled
(``aot_eager``). Each round builds the job afresh for every mode in turn (off first), so a monitored block
of steps has an unmonitored one beside it on the same load; the figure of a mode is the median over rounds
of (its median step / the round's unmonitored median step). Step times are rank 0's, each step started
behind a barrier.

    python bench/titan_overhead.py                          # eager and compiled, every mode, 5 rounds
    python bench/titan_overhead.py --ways compiled --modes off all --rounds 2 --steps 8

The results go to ``--out`` (JSON, rewritten after every round, so a cut-off run keeps what it measured)
before the table is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

WAYS = {"eager": "bf16", "compiled": "bf16,compile"}
MODES = ("off", "all", "wgmv", "all_interval10")


def monitor_config(mode: str, every_kind: dict) -> dict | None:
    if mode == "off":
        return None
    if mode == "wgmv":
        return {"wg_distribution": True, "mv_distribution": True, "timing": {"enable": False}}
    if mode == "all_interval10":
        return {**every_kind, "step_interval": 10}
    return dict(every_kind)


def rank_main(args: argparse.Namespace) -> None:
    import titan_llama
    import titan_worker
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch._dynamo.utils import counters

    import trainmon

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)  # four ranks share the machine's cores

    def measure(way: str, mode: str, logdir: str) -> tuple[list[float], int]:
        torch._dynamo.reset()  # each block compiled afresh: no graph serves two modes
        graphs = counters["stats"]["unique_graphs"]  # what dynamo compiled before (a reset keeps the count)
        options = titan_worker.options_of(WAYS[way])
        model, optimizer, dp_rank, _ = titan_worker.build(options)
        config = monitor_config(mode, titan_worker.CONFIG)
        monitor = None
        if config is not None:
            monitor = trainmon.attach(
                model, optimizer, config=config, logdir=logdir, grad_acc_steps=titan_worker.MICRO_BATCHES
            )
        times = []
        for step in range(args.warmup + args.steps):
            dist.barrier()
            start = time.perf_counter()
            for micro in range(titan_worker.MICRO_BATCHES):
                index = step * titan_worker.MICRO_BATCHES + micro
                inputs, labels = titan_llama.batch(index, dp_rank=dp_rank, dp_size=2)
                logits = model(inputs)
                loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten()) / titan_worker.MICRO_BATCHES
                if monitor is not None:
                    monitor.track("loss", loss)
                loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            times.append(time.perf_counter() - start)
        if monitor is not None:
            monitor.close()
        dist.barrier()
        return times[args.warmup :], counters["stats"]["unique_graphs"] - graphs

    results: dict = {"ways": {}, "args": {k: v for k, v in vars(args).items() if k != "out"}}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for way in args.ways:
                found = results["ways"].setdefault(way, {m: [] for m in args.modes})
                graphs = results.setdefault("graphs", {}).setdefault(way, {})
                for mode in args.modes:
                    times, graphs[mode] = measure(way, mode, f"{tmp}/{way}_{mode}_{round_}")
                    found[mode].append(statistics.median(times))
            if rank == 0:
                results["load"] = os.getloadavg()[0]
                args.out.write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def table(results: dict) -> list[str]:
    lines = [
        "| way | mode | median step | against off (median of rounds) | rounds | graphs compiled |",
        "|---|---|---|---|---|---|",
    ]
    for way, modes in results["ways"].items():
        off = modes.get("off", [])
        for mode, medians in modes.items():
            rounds = min(len(medians), len(off))
            if mode == "off":
                figure = "1.000x"
            elif rounds:
                figure = f"{statistics.median(medians[i] / off[i] for i in range(rounds)):.3f}x"
            else:
                figure = "-"
            step = f"{statistics.median(medians) * 1e3:.1f} ms" if medians else "-"
            graphs = results.get("graphs", {}).get(way, {}).get(mode, "-")
            lines.append(f"| {way} | {mode} | {step} | {figure} | {len(medians)} | {graphs} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ways", nargs="+", default=list(WAYS), choices=list(WAYS))
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10, help="measured steps of a block")
    parser.add_argument("--warmup", type=int, default=3, help="steps before them (compile, first merges)")
    parser.add_argument("--out", type=Path, default=Path("titan_overhead.json"))
    parser.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if "off" not in args.modes:
        args.modes = ["off", *args.modes]
    args.out = args.out.resolve()
    if args.rank_main:
        rank_main(args)
        return
    with socket.socket() as s:  # a free loopback port for the ranks' rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "4"}
    argv = [*sys.argv[1:], "--out", str(args.out), "--rank-main"]
    procs = [
        subprocess.Popen([sys.executable, __file__, *argv], env={**env, "RANK": str(r)}) for r in range(4)
    ]
    if any(p.wait() for p in procs):
        sys.exit("a rank failed")
    results = json.loads(args.out.read_text())
    print(f"4 gloo ranks, (dp, tp) = (2, 2), bf16; load average {results['load']:.1f}; {args.out}")
    print("\n".join(table(results)))


if __name__ == "__main__":
    main()
