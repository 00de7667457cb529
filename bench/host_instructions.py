"""The monitor's host cost as instructions of the training thread, counted by callgrind: the deterministic
twin of ``bench/host_cost.py``, whose timings move by about a microsecond a tensor from one sitting to the
next on a shared machine. Same workload and stand-in kernels as that bench (its ``--backends triton``);
valgrind must be installed.

Each measurement is one process under ``valgrind --tool=callgrind`` that attaches the monitor (or not:
mode ``off``), runs ``--warmup`` steps, turns Python's collector off and counts ``--steps`` steps, and only
those: collection is switched on inside a C call (libc's ``qsort``, whose comparison callback runs the steps)
and only on the thread that makes it, so imports, attach, the writer's threads and process and valgrind's own
start are left out. The monitor's share of a step is a mode's count minus ``off``'s.

    python bench/host_instructions.py                                  # full, full_api, wgmv; both backends
    python bench/host_instructions.py --modes full_api --backends triton
    PYTHONPATH=/path/to/other/checkout python bench/host_instructions.py  # the same for other code
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent
# options the counted process gets
_PASSED = ("steps", "warmup", "layers", "d", "heads", "vocab", "seq", "batch_tensors")


def child(mode: str, backend: str, args: argparse.Namespace) -> None:
    """Inside valgrind: warm up, then run the counted steps inside ``qsort``'s comparison callback."""
    import gc
    import logging

    sys.path.insert(0, str(BENCH))
    import host_cost
    import torch

    import trainmon

    torch.set_num_threads(1)
    logging.getLogger("trainmon").setLevel(logging.CRITICAL)
    host_cost._use_backend(backend, args.batch_tensors)
    workload = argparse.Namespace(
        layers=args.layers, d=args.d, heads=args.heads, vocab=args.vocab, seq=args.seq, workload_dir=BENCH
    )
    model, optimizer, step = host_cost._workload(workload)
    with tempfile.TemporaryDirectory(prefix="tm-instr-") as logdir:
        monitor = None
        if mode != "off":
            monitor = trainmon.attach(model, optimizer, config=host_cost.MODES[mode], logdir=logdir)
        for _ in range(args.warmup):
            step(monitor)
        if monitor is not None:
            monitor.flush()
        gc.disable()

        def counted(a: int, b: int) -> int:
            for _ in range(args.steps):
                step(monitor)
            return 0

        compare = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)(counted)
        pair = (ctypes.c_int * 2)(1, 2)
        ctypes.CDLL(None).qsort(pair, 2, ctypes.sizeof(ctypes.c_int), compare)  # compares once: the steps
        if monitor is not None:
            monitor.close()
    sys.stdout.flush()
    os._exit(0)  # the writer process and threads are the monitor's close's business, not counted


def count(mode: str, backend: str, args: argparse.Namespace) -> float:
    """Instructions per counted step of ``mode`` on ``backend``."""
    with tempfile.TemporaryDirectory(prefix="tm-callgrind-") as folder:
        argv = [
            "valgrind",
            "--tool=callgrind",
            "--collect-atstart=no",
            "--toggle-collect=*qsort*",
            f"--callgrind-out-file={folder}/out",
            sys.executable,
            __file__,
            *[f"--{k.replace('_', '-')}={getattr(args, k)}" for k in _PASSED],
            "--child",
            mode,
            backend,
        ]
        env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore"}
        done = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
        found = re.search(r"Collected\s*:\s*([\d,]+)", done.stderr)
        if done.returncode != 0 or found is None:
            raise RuntimeError(f"callgrind run of {mode}/{backend} failed:\n{done.stderr[-2000:]}")
        return int(found.group(1).replace(",", "")) / args.steps


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--modes", nargs="+", default=["full", "full_api", "wgmv"])
    parser.add_argument("--backends", nargs="+", default=["native", "triton"], choices=["native", "triton"])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--d", type=int, default=32)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--batch-tensors", type=int, default=0, help="as bench/host_cost.py's")
    parser.add_argument("--child", nargs=2, metavar=("MODE", "BACKEND"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], args.child[1], args)
        return
    off = count("off", "native", args)
    print(f"off: {off / 1e6:.2f}M instructions a step", flush=True)
    for backend in args.backends:
        for mode in args.modes:
            on = count(mode, backend, args)
            share = (on - off) / 1e6
            print(f"{mode} / {backend}: {on / 1e6:.2f}M a step, the monitor's {share:.2f}M", flush=True)


if __name__ == "__main__":
    main()
