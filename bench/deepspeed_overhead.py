"""Overhead of wg + mv monitoring on the two-process DeepSpeed ZeRO-2 example, as paired ratios.

One ``torchrun`` launch (2 processes, gloo, one thread each) trains the example's model
(integrations/deepspeed/train.py, at the reference workload's size: 8 layers, d=256, T=128, batch 8 per rank,
vocab 512) in alternating blocks of steps, monitor detached / attached (``wg_distribution`` +
``mv_distribution``: reduced gradients and Adam moments of every parameter, from ZeRO-2's local fragments,
merged with two all-reduces per step; TensorBoard and CSV written to a temporary directory). A pair's ratio is
the attached block's mean step time over the detached block's just before it; the figure is the median.
Pairing inside one launch cancels launch-to-launch variation (memory layout, frequency, neighbours).

    python bench/deepspeed_overhead.py                    # 8 pairs of 10-step blocks
    python bench/deepspeed_overhead.py --pairs 12 --block 20 --zero 3
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
EXAMPLE = REPO / "integrations" / "deepspeed"
WGMV = {"wg_distribution": True, "mv_distribution": True}


def worker(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(EXAMPLE))
    import torch
    from train import build_engine, init_cpu_distributed, train_steps  # the example's own code

    import trainmon
    from trainmon.demo import DemoSetup

    torch.set_num_threads(1)
    init_cpu_distributed()
    rank = torch.distributed.get_rank()
    setup = DemoSetup(vocab=512, seq=128, batch=8, layers=args.layers, dim=args.dim, lr=3e-4)
    engine = build_engine(args.zero, setup=setup)
    generator = torch.Generator().manual_seed(100 + rank)
    train_steps(engine, args.warmup, generator, setup)

    def block() -> float:
        torch.distributed.barrier()
        start = time.perf_counter()
        train_steps(engine, args.block, generator, setup)
        torch.distributed.barrier()
        return (time.perf_counter() - start) / args.block

    pairs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.pairs):
            off = block()
            monitor = trainmon.attach(engine, config=WGMV, logdir=os.path.join(tmp, f"pair{i}"))
            on = block()
            monitor.close()
            pairs.append((off, on))
    if rank == 0:
        ratios = [on / off for off, on in pairs]
        result = {
            "zero": args.zero,
            "world_size": torch.distributed.get_world_size(),
            "model": f"{args.layers} layers, d={args.dim}",
            "params": sum(p.numel() for p in engine.module.parameters()),
            "block_steps": args.block,
            "pairs": len(pairs),
            "off_step_s": statistics.median(off for off, _ in pairs),
            "on_step_s": statistics.median(on for _, on in pairs),
            "ratio_median": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
        }
        print(json.dumps(result), flush=True)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--zero", type=int, default=2)
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--block", type=int, default=10, help="optimizer steps per block")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        __file__, "--worker", *sys.argv[1:],
    ]  # fmt: skip
    proc = subprocess.run(command, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(proc.stderr[-5000:])
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))
    print(json.dumps(result, indent=2))
    print(
        f"ZeRO-{result['zero']}, {result['world_size']} processes: "
        f"wg+mv / off = {result['ratio_median']:.3f}x "
        f"(median of {result['pairs']} pairs, {result['ratio_min']:.3f} .. {result['ratio_max']:.3f}; "
        f"off {result['off_step_s'] * 1e3:.1f} ms/step)"
    )


if __name__ == "__main__":
    main()
