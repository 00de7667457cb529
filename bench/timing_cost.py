"""What per-rank timing (docs/timing.md) costs the training thread, measured inside the step.

A paired ratio (``bench/overhead.py --modes wgmv --baseline wgmv_untimed``) cannot resolve 0.5% on a 2-core
machine whose pairs spread by +-10%. This bench measures the timing's own work directly instead: it runs a
workload with the monitor attached and every method of the step timer (:class:`trainmon.step.timing.
StepTimer`: the hooks' clock readings, the step end, the garbage-collection callback, the row handed to the
writer) wrapped in a clock of its own, and reports that time per step against the step. The wrappers' own
clock readings are counted in, so the figure is an upper bound.

Two workloads, one process each:

* ``tinygpt``: the CPU benchmark of ``bench/overhead.py`` (``../shared/bench/tinygpt.py``, ~340 ms a step);
* ``yardstick``: the GPU yardstick's model (``gpt_cuda.py``: 16 layers, the same modules and hooks) at a
  tiny width on the CPU, as ``bench/host_cost.py`` runs it. Its timer time per step, over the yardstick's
  step on a GPU (``--gpu-step-ms``, 43 ms on an H200 unmonitored), estimates the share of a GPU step when
  no GPU is at hand (the device events a GPU adds are counted apart: ``points``, one event each).

    python bench/timing_cost.py                       # both workloads, wg + mv and full coverage
    python bench/timing_cost.py --workloads tinygpt --modes wgmv --steps 60
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO.parent / "shared" / "bench"
sys.path.insert(0, str(REPO))

sys.path.insert(0, str(REPO / "bench"))
from overhead import MODES as OVERHEAD_MODES  # noqa: E402 - bench/ is not a package

MODES = {mode: OVERHEAD_MODES[mode] for mode in ("wgmv", "full")}  # the configs overhead.py measures
TIMED_METHODS = (
    "forward_start",
    "forward_end",
    "backward_start",
    "backward_end",
    "optimizer_start",
    "collective_start",
    "collective_end",
    "on_gc",
    "start",
    "resume",
    "end",
    "ready_row",
    "vector",
    "timing",
)


class _Clock:
    """Every call of the wrapped methods and how long it took (a call from inside another wrapped one is
    counted in its caller's time only, never twice)."""

    def __init__(self) -> None:
        self.each: dict[str, list[float]] = {}
        self.outer: list[float] = []
        self._depth = 0

    def reset(self) -> None:
        self.outer = []
        self.each = {name: [] for name in self.each}

    def wrap(self, method):
        clock = time.perf_counter
        name = method.__name__
        self.each[name] = []

        @functools.wraps(method)
        def timed(*args, **kwargs):
            self._depth += 1
            t0 = clock()
            try:
                return method(*args, **kwargs)
            finally:
                took = clock() - t0
                self._depth -= 1
                if not self._depth:
                    self.each[name].append(took)
                    self.outer.append(took)

        return timed

    def per_step(self, steps: int) -> tuple[float, float]:
        """(typical, mean) seconds a step: the median call of each method times its calls, and the plain
        mean. The mean counts the calls during which the interpreter handed the GIL to another thread (the
        writer's, for its switch interval of 5 ms): a pause the timer did not cause but happened to hold."""
        typical = sum(statistics.median(calls) * len(calls) for calls in self.each.values() if calls) / steps
        return typical, sum(self.outer) / steps


def _wrap_timer(clock: _Clock) -> None:
    from trainmon.step import timing

    for name in TIMED_METHODS:
        setattr(timing.StepTimer, name, clock.wrap(getattr(timing.StepTimer, name)))


def _train_tinygpt(steps: int):
    sys.path.insert(0, str(BENCH))
    import torch
    from tinygpt import batches, make, train

    torch.set_num_threads(2)
    model, optimizer = make()
    data = batches(steps)
    train(model, optimizer, batches(3))  # warm the allocator and kernels before attaching
    return model, optimizer, lambda: train(model, optimizer, data)[0]


def _train_yardstick(steps: int):
    import torch
    from host_cost import _workload  # the yardstick's model at a tiny width, as host_cost measures it

    torch.set_num_threads(1)
    shape = argparse.Namespace(workload_dir=BENCH, vocab=64, d=32, heads=2, layers=16, seq=16)
    model, optimizer, step = _workload(shape)
    for _ in range(3):
        step(None)

    def run():
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            step(None)
            times.append(time.perf_counter() - t0)
        return times

    return model, optimizer, run


def measure(workload: str, mode: str, steps: int) -> dict:
    import trainmon

    clock = _Clock()
    _wrap_timer(clock)
    make = _train_tinygpt if workload == "tinygpt" else _train_yardstick
    model, optimizer, run = make(steps)
    with tempfile.TemporaryDirectory(prefix="tm-timing-") as logdir:
        monitor = trainmon.attach(model, optimizer, config=MODES[mode], logdir=logdir)
        run()  # warm-up pass: the first collected steps make rows and hooks
        clock.reset()
        times = run()
        monitor.close()
    step_s = statistics.fmean(times)
    typical, mean = clock.per_step(len(times))
    return {
        "workload": workload,
        "mode": mode,
        "steps": len(times),
        "step_ms": step_s * 1e3,
        "timer_us_per_step": typical * 1e6,
        "timer_us_per_step_mean": mean * 1e6,
        "timer_calls_per_step": len(clock.outer) / len(times),
        "share": typical / step_s,
        "share_mean": mean / step_s,
        "us_per_step_by_method": {
            name: statistics.median(calls) * len(calls) / len(times) * 1e6
            for name, calls in clock.each.items()
            if calls
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--workloads", nargs="+", default=["tinygpt", "yardstick"], choices=["tinygpt", "yardstick"]
    )
    parser.add_argument("--modes", nargs="+", default=["wgmv", "full"], choices=list(MODES))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument(
        "--gpu-step-ms", type=float, default=43.0, help="the yardstick's unmonitored GPU step"
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child[0], args.child[1], args.steps)))
        return
    results = []
    print(
        f"{'workload':<11}{'mode':<6}{'step ms':>9}{'timer us/step':>15}{'(mean)':>9}{'calls/step':>12}"
        f"{'share':>9}{'(mean)':>9}{'of a GPU step':>15}"
    )
    for workload in args.workloads:
        for mode in args.modes:
            argv = [sys.executable, __file__, "--steps", str(args.steps), "--child", workload, mode]
            out = subprocess.run(argv, check=True, capture_output=True, text=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            gpu = r["timer_us_per_step"] / (args.gpu_step_ms * 1e3) if workload == "yardstick" else None
            r["share_of_gpu_step"] = gpu
            results.append(r)
            print(
                f"{workload:<11}{mode:<6}{r['step_ms']:>9.1f}{r['timer_us_per_step']:>15.1f}"
                f"{r['timer_us_per_step_mean']:>9.1f}{r['timer_calls_per_step']:>12.1f}"
                f"{100 * r['share']:>8.3f}%{100 * r['share_mean']:>8.3f}%"
                f"{'' if gpu is None else format(100 * gpu, '.3f') + '%':>15}",
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
