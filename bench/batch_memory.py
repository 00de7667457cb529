"""How the bound on a Triton batch's bytes trades launches for memory: the GPU yardstick's shapes, on the CPU.

On a GPU each batch launch costs the host about 0.1 ms (its table's upload, Triton's launcher), and the
tensors a batch holds stay alive until its launch: larger batches mean fewer launches and more memory held.
This runs the yardstick's model (``gpt_cuda.py``: d=1024, 16 heads, 8 x 1024 tokens, vocab 32768, bf16
autocast, AdamW) with ``--layers`` blocks on the CPU, the monitor at full coverage with nothing written
(``format: api``) on the Triton path's host side with stand-in kernels (as ``bench/host_cost.py
--backends triton``: tables, batches and launches run, no kernel reads anything), once per bound in a fresh
process, and once without the monitor. Per run: the launches of the last step and the process's peak
resident memory (``ru_maxrss``: the CPU's allocator hands tensors of this size back to the system when they
are freed, so the peak follows what is alive). The bound's own cost is the peak against the smallest
bound's; the monitor's imports and state are in every monitored run alike.

    python bench/batch_memory.py                              # off, 256, 512 and 1024 MiB, 4 layers
    python bench/batch_memory.py --batch-mib 256 1024 --layers 2 --steps 2
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent


def child(batch_mib: int, args: argparse.Namespace) -> dict:
    """Inside the measuring process: ``batch_mib`` 0 runs without the monitor."""
    sys.path.insert(0, str(BENCH))
    import host_cost
    import torch
    from gpt_cuda import GPT, batch, step

    import trainmon
    from trainmon.stats import triton_path

    torch.set_num_threads(args.threads)
    stand_in = host_cost._use_backend("triton")
    triton_path.BATCH_BYTES = batch_mib << 20  # the CPU's bound: device_memory() says nothing here
    torch.manual_seed(0)
    model = GPT(layers=args.layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = batch(0, device="cpu")
    launches = 0
    with tempfile.TemporaryDirectory(prefix="tm-batchmem-") as logdir:
        monitor = None
        if batch_mib:
            monitor = trainmon.attach(model, optimizer, config=host_cost.MODES["full_api"], logdir=logdir)
        for _ in range(args.steps):
            before = stand_in.launches
            step(model, optimizer, tokens)  # the yardstick's step: its loss and logits live as they do there
            if monitor is not None:
                monitor.flush()
            launches = stand_in.launches - before
        if monitor is not None:
            monitor.close()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    return {"batch_mib": batch_mib, "launches": launches, "peak_mib": peak / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch-mib", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="the first ones allocate the optimizer's state")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child, args)))
        return
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore"}
    passed = ["--layers", str(args.layers), "--steps", str(args.steps), "--threads", str(args.threads)]
    runs = []
    for mib in [0, *args.batch_mib]:
        done = subprocess.run(
            [sys.executable, __file__, *passed, "--child", str(mib)],
            capture_output=True,
            text=True,
            env=env,
            check=False,
        )
        if done.returncode != 0:
            raise SystemExit(f"the run with batch {mib} MiB failed:\n{done.stderr[-3000:]}")
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        run = runs[-1]
        label = "off" if not mib else f"{mib} MiB"
        print(f"{label:>9}: {run['launches']:3d} launches a step, peak {run['peak_mib']:.0f} MiB", flush=True)
    base = runs[1]["peak_mib"] if len(runs) > 1 else 0.0
    print(f"\n{args.layers} layers; peak against the {args.batch_mib[0]} MiB bound's:")
    for run in runs[1:]:
        extra = run["peak_mib"] - base
        print(f"  {run['batch_mib']:5d} MiB: {run['launches']:3d} launches, {extra:+.0f} MiB")
    if args.json:
        args.json.write_text(json.dumps({"layers": args.layers, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
