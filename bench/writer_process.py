"""What writing the outputs costs the training loop: the default outputs written by the writer process (the
default), by the writer thread (``TRAINMON_WRITER=thread``), and nothing written (``format: api``), against no
monitor at all, in rotating blocks of one process, so that the drift of a shared machine falls on every mode
alike. ``handoff`` is the writer process with next to nothing to write (the manifest and the step log:
``format: csv`` for a rank that writes no CSV): what the training process itself pays for handing every step
over, the writer process's own work taken out (on a machine with fewer free cores than busy threads, that
work still competes with training for a core; on a GPU host it runs on an idle one). The workload is
``host_cost.py``'s: the GPU yardstick's model at a tiny width (~1,650 rows a collected step), full coverage,
statistics by the native CPU kernel, torch on one thread.

Reported per mode: the median over blocks of the blocks' median step, the mean step, the cost over
``format: api`` per step (the median over rounds of each round's difference of block medians, with the
quartiles of those differences) and per monitored tensor, and the CPU time per step of the training process
(all its threads) and of the writer process.

    python bench/writer_process.py                       # 4 rounds of 100-step blocks
    python bench/writer_process.py --rounds 8 --block 150
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from host_cost import FULL, _user_heap, _workload  # noqa: E402

MODES = {
    "off": None,
    "api": ({**FULL, "format": "api"}, "process"),
    "thread": (FULL, "thread"),
    "process": (FULL, "process"),
    "handoff": ({**FULL, "format": ["csv"], "csv_ranks": [1]}, "process"),
}


def _cpu_self() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _cpu_of(pid: int | None) -> float:
    if pid is None:
        return 0.0
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--block", type=int, default=100, help="measured steps per block")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--heap", type=int, default=300_000, help="long-lived objects of the user script")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--d", type=int, default=32)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--workload-dir", type=Path, default=BENCH)
    args = parser.parse_args()

    import logging

    import torch

    import trainmon
    from trainmon import stats

    torch.set_num_threads(1)
    logging.getLogger("trainmon").setLevel(logging.ERROR)
    stats.set_backend("native")
    model, optimizer, step = _workload(args)
    heap = _user_heap(args.heap)
    medians: dict[str, list[float]] = {mode: [] for mode in MODES}
    means: dict[str, list[float]] = {mode: [] for mode in MODES}
    cpu: dict[str, list[tuple[float, float]]] = {mode: [] for mode in MODES}  # (training, writer) ms a step
    rows = 0
    order = list(MODES)
    with tempfile.TemporaryDirectory(prefix="tm-writer-") as logdir:
        for _ in range(args.warmup):
            step(None)
        for round_ in range(args.rounds):
            for mode in order[round_ % len(order) :] + order[: round_ % len(order)]:
                spec = MODES[mode]
                monitor = None
                if spec is not None:
                    config, writer = spec
                    os.environ["TRAINMON_WRITER"] = writer
                    run = Path(logdir) / f"{mode}{round_}"
                    monitor = trainmon.attach(model, optimizer, config=config, logdir=run,
                                              start_iteration=-args.warmup)  # fmt: skip
                for _ in range(args.warmup):
                    step(monitor)
                if monitor is not None:
                    monitor.flush()
                pid = monitor._outputs.process_pid if monitor is not None else None
                cpu_before = (_cpu_self(), _cpu_of(pid))
                times = []
                for _ in range(args.block):
                    start = time.perf_counter()
                    step(monitor)
                    times.append(time.perf_counter() - start)
                if monitor is not None:
                    monitor.flush()  # the writer process's share of these steps is done
                cpu[mode].append(tuple((b - a) * 1e3 / args.block
                                       for a, b in zip(cpu_before, (_cpu_self(), _cpu_of(pid)), strict=True)))
                if monitor is not None:
                    if monitor._latest is not None:
                        rows = len(monitor._latest[0].rows)
                    monitor.close()
                gc.collect()
                medians[mode].append(statistics.median(times) * 1e3)
                means[mode].append(statistics.fmean(times) * 1e3)
                print(f"round {round_} {mode:>8}: median {medians[mode][-1]:7.2f} ms, "
                      f"mean {means[mode][-1]:7.2f} ms", flush=True)  # fmt: skip
    del heap
    print(f"\n{'mode':<9}{'median ms':>10}{'mean ms':>9}{'over api ms':>12}{'quartiles':>16}{'us/tensor':>10}"
          f"{'cpu: training':>15}{'writer ms':>10}  (rows {rows})")  # fmt: skip
    for mode in MODES:
        med = statistics.median(medians[mode])
        diffs = [m - a for m, a in zip(medians[mode], medians["api"], strict=True)]
        over = statistics.median(diffs)
        q1, _, q3 = statistics.quantiles(diffs, n=4) if len(diffs) > 1 else (over, over, over)
        per_tensor = over * 1e3 / rows if rows and mode not in ("off", "api") else float("nan")
        training = statistics.median(c[0] for c in cpu[mode])
        writer = statistics.median(c[1] for c in cpu[mode])
        spread = f"{q1:.1f} .. {q3:.1f}"
        print(f"{mode:<9}{med:>10.2f}{statistics.median(means[mode]):>9.2f}{over:>12.2f}{spread:>16}"
              f"{per_tensor:>10.2f}{training:>15.2f}{writer:>10.2f}")  # fmt: skip
    print(f"({args.rounds} blocks of {args.block} steps a mode; medians over blocks of each block's median)")


if __name__ == "__main__":
    main()
