"""The monitor's overhead on FSDP2 (``fully_shard``), as ratios of paired blocks of steps.

Two gloo ranks train ../shared/bench/tinygpt.py sharded with FSDP2 (every block and the root) in alternating
blocks of steps on one model: monitor detached, then attached in the measured mode, and so on; the figure is
the median over pairs of (attached block's median step / the detached block's before it), as in
bench/overhead.py's blocks method. Both ranks run the same schedule (attach and close are collective-free,
the statistics' merges are collectives of the step).

    python bench/fsdp_overhead.py                       # wgmv and full, 6 pairs of 10 steps
    python bench/fsdp_overhead.py --modes wgmv --pairs 8 --steps 12 --layers 4
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
sys.path.insert(0, str(REPO / "bench"))
from overhead import DEFAULT_WORKLOAD, MODES  # noqa: E402


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import trainmon

    sys.path.insert(0, str(args.workload))
    import tinygpt

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)  # one core a rank on a 2-core machine
    torch.manual_seed(0)
    model = tinygpt.TinyGPT(layers=args.layers)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = tinygpt.batches(8, B=args.batch, seed=1 + rank)

    def steps(n: int, monitor=None) -> list[float]:
        times = []
        for i in range(n):
            batch = data[i % len(data)]
            dist.barrier()
            start = time.perf_counter()
            logits = model(batch[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
            if monitor is not None:
                monitor.track("loss", loss)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            times.append(time.perf_counter() - start)
        return times

    steps(args.warmup)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes:
            ratios = []
            for pair in range(args.pairs):
                off = statistics.median(steps(args.steps))
                config = {**MODES[mode], "format": ["tensorboard"]}
                monitor = trainmon.attach(model, optimizer, config=config, logdir=f"{tmp}/{mode}{pair}")
                on = statistics.median(steps(args.steps, monitor)[1:])  # the first step arms the hooks
                monitor.close()
                ratios.append(on / off)
            results[mode] = {"median": statistics.median(ratios), "ratios": ratios}
    if rank == 0:
        print(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--modes", nargs="+", default=["wgmv", "full"], choices=sorted(MODES))
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--steps", type=int, default=10, help="steps a block")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4, help="each rank's batch")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--workload", type=Path, default=DEFAULT_WORKLOAD)
    parser.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_main:
        rank_main(args)
        return
    with socket.socket() as s:  # a free loopback port for the ranks' rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(args.world)}
    argv = [a for a in sys.argv[1:]] + ["--rank-main"]
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, *argv], env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, text=True
        )
        for r in range(args.world)
    ]
    outs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        sys.exit("a rank failed")
    results = json.loads(outs[0].strip().splitlines()[-1])
    for mode, result in results.items():
        spread = ", ".join(f"{r:.3f}" for r in result["ratios"])
        print(f"FSDP2 {args.world} ranks, {mode}: {result['median']:.3f}x of the unmonitored step ({spread})")


if __name__ == "__main__":
    main()
