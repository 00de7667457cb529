"""csv2tb speed against msprobe's ``csv2tensorboard_by_step`` on the same msprobe-format input.

    python bench/csv2tb.py [--msprobe-python /tmp/msprobe-venv/bin/python] [--ranks 2 --steps 100 --names 50]

Writes a synthetic msprobe monitor output (``<time>-rank<R>-<id>/<kind>_<a>-<b>.csv``, one file per step as
msprobe's default ``step_count_per_record: 1`` gives, the 8 kinds msprobe's converter accepts, actv with two
micro-steps, ops min,max,mean,norm,zeros,nans), converts it with ``trainmon csv2tb`` (in this process, the
default worker count) and, when an msprobe python is given and imports ``msprobe``, with msprobe's converter
in that interpreter (``process_num`` = the same worker count), then prints both times, the ratio, and checks
that both wrote the same number of scalars. Install msprobe into its own venv so it never touches .venv:

    python3 -m venv /tmp/msprobe-venv
    /tmp/msprobe-venv/bin/pip install torch==2.13.0
    /tmp/msprobe-venv/bin/pip install -c constraints.txt mindstudio-probe
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
from tensorboard.compat.proto import event_pb2

from trainmon.csvtb import convert

KINDS = (
    "actv",
    "actv_grad",
    "grad_unreduced",
    "grad_reduced",
    "param_origin",
    "param_updated",
    "exp_avg",
    "exp_avg_sq",
)
OPS = ("min", "max", "mean", "norm", "zeros", "nans")

MSPROBE_RUN = """
import sys, time
from msprobe.pytorch.monitor.csv2tb import csv2tensorboard_by_step
t = time.perf_counter()
csv2tensorboard_by_step(sys.argv[1], process_num=int(sys.argv[3]), output_dirpath=sys.argv[2])
print(time.perf_counter() - t)
"""


def make_input(root: Path, ranks: int, steps: int, names: int, seed: int = 0) -> int:
    """msprobe-format CSV under ``root``; returns the number of statistic values written."""
    rnd = random.Random(seed)
    values = 0
    for rank in range(ranks):
        d = root / f"Dec03_21-34-4{rank % 10}-rank{rank}-{rank:08x}"
        d.mkdir(parents=True)
        for kind in KINDS:
            micro = kind in ("actv", "actv_grad")
            header = (
                "vpp_stage,name,step"
                + (",micro_step" if micro else "")
                + ","
                + ",".join(OPS)
                + ",shape,dtype"
            )
            for step in range(steps):
                lines = [header]
                for m in (0, 1) if micro else (None,):
                    for i in range(names):
                        v = [f"{rnd.uniform(-3, 3):.6f}" for _ in OPS[:-1]] + ["0"]
                        mid = f",{m}" if micro else ""
                        lines.append(
                            f"0,layers.{i}.mlp.fc,{step}{mid},"
                            + ",".join(v)
                            + ',"[1024, 4096]",torch.bfloat16'
                        )
                        values += len(OPS)
                (d / f"{kind}_{step}-{step}.csv").write_text("\n".join(lines) + "\n")
    return values


def count_scalars(root: Path) -> int:
    n = 0
    for dirpath, _, files in os.walk(root):
        for f in files:
            if "tfevents" in f:
                for rec in RawEventFileLoader(os.path.join(dirpath, f)).Load():
                    ev = event_pb2.Event.FromString(rec)
                    n += len(ev.summary.value)
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--msprobe-python", default=None, help="python of a venv with mindstudio-probe installed")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--names", type=int, default=50)
    ap.add_argument("--workers", type=int, default=None, help="trainmon workers and msprobe process_num")
    args = ap.parse_args()
    workers = args.workers or min(os.cpu_count() or 1, args.ranks * len(KINDS))
    tmp = Path(tempfile.mkdtemp(prefix="csv2tb-bench-"))
    try:
        src = tmp / "monitor_output"
        n_values = make_input(src, args.ranks, args.steps, args.names)
        n_files = sum(len(files) for _, _, files in os.walk(src))
        size = sum(f.stat().st_size for f in src.rglob("*.csv"))
        print(
            f"input: {args.ranks} ranks x {len(KINDS)} kinds x {args.steps} steps x {args.names} names: "
            f"{n_files} files, {size / 2**20:.1f} MiB, {n_values} values; {os.cpu_count()} cores"
        )
        t = time.perf_counter()
        s = convert([src], tmp / "trainmon", workers=workers)
        ours = time.perf_counter() - t
        print(f"trainmon csv2tb (workers={workers}): {ours:.2f} s, {s.scalars / ours / 1e6:.2f} M values/s")
        assert s.scalars == n_values == count_scalars(tmp / "trainmon"), (s.scalars, n_values)
        py = args.msprobe_python
        ok = py and subprocess.run([py, "-c", "import msprobe"], capture_output=True).returncode == 0
        if not ok:
            print("msprobe: skipped (give --msprobe-python, the python of a venv with mindstudio-probe)")
            return
        out = subprocess.run(
            [py, "-c", MSPROBE_RUN, str(src), str(tmp / "msprobe"), str(min(workers, args.ranks))],
            capture_output=True,
            text=True,
            check=True,
        )
        theirs = float(out.stdout.strip().splitlines()[-1])
        n_theirs = count_scalars(tmp / "msprobe")
        print(
            f"msprobe csv2tensorboard_by_step (process_num={min(workers, args.ranks)}): {theirs:.2f} s, "
            f"{n_theirs} values"
        )
        assert n_theirs == n_values, (n_theirs, n_values)
        print(f"speed-up: {theirs / ours:.1f}x")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
