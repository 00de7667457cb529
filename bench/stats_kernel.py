"""Micro-benchmark of the stats kernel (trainmon/stats.py); not a test.

For float32 and bfloat16 tensors of 1K, 64K, 1M and 4M elements it times, per call:

* native   - the C kernel through ``partials_into`` with ``torch.get_num_threads()`` threads
* native1  - the same, one thread
* torch    - the portable torch path (what CUDA/NPU tensors run), on the CPU
* sum      - ``t.sum()``: the floor, one torch reduction reading every element once
* naive7   - 7 separate torch ops (min, max, mean, norm, zeros, nans, infs), as naive monitors do

and the per-call overhead of ``partials_into`` on a 100-element tensor. ``--workload`` also measures the
kernel alone on the project's reference workload (../shared/bench/tinygpt.py): every tensor a fully
monitoring run reads per step (module inputs/outputs, their grads, weight grads, params, Adam moments:
~640 tensors, ~122M elements), compared with the floor (one ``sum`` per tensor), as median step-time
ratios to an unmonitored run and as the time spent inside the hooks per step.

    python bench/stats_kernel.py [--threads 2] [--workload] [--rounds 3]
    TRAINMON_STATS_ISA=avx2 python bench/stats_kernel.py     # cap the native instruction set
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORKLOAD = REPO.parent / "shared" / "bench"


def timeit(fn, min_time: float = 0.2, repeats: int = 5) -> float:
    """Best-of-``repeats`` mean seconds per call, each repeat running for about ``min_time``."""
    fn()
    t0 = time.perf_counter()
    fn()
    once = max(time.perf_counter() - t0, 1e-7)
    n = max(1, int(min_time / repeats / once))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return best


def micro(threads: int) -> None:
    import torch

    from trainmon import stats

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    print(
        f"torch {torch.__version__}, {threads} threads; native kernel: {stats.native_available()}, "
        f"ISA {stats.native_isa()}"
    )
    if stats.native_available():
        from trainmon.stats import _statskernel

        print(f"threads run on: {_statskernel.threading_runtime()}")
    out = torch.zeros(4, 8, dtype=torch.float64)

    def naive7(t):
        f = t.float()
        return [f.min(), f.max(), f.mean(), f.norm(), (f == 0).sum(), f.isnan().sum(), f.isinf().sum()]

    def native(t, nthreads):
        def run():
            torch.set_num_threads(nthreads)
            stats.partials_into(t, out, 0)

        return run

    def torch_path(t):
        def run():
            stats.set_backend("torch")
            try:
                stats.partials_into(t, out, 1)
            finally:
                stats.set_backend("auto")

        return run

    cols = ("native", "native1", "torch", "sum", "naive7")
    header = f"{'dtype':9s} {'numel':>8s} | " + " ".join(f"{c:>9s}" for c in cols) + " |"
    header += f" {'GB/s':>6s} {'nat/sum':>7s} {'torch/sum':>9s} {'naive/sum':>9s}"
    print(header)
    print("-" * len(header))
    for dtype in (torch.float32, torch.bfloat16):
        for n in (1 << 10, 1 << 16, 1 << 20, 1 << 22):
            t = torch.randn(n).to(dtype)
            a = timeit(native(t, threads))
            a1 = timeit(native(t, 1))
            torch.set_num_threads(threads)
            b = timeit(torch_path(t))
            c = timeit(lambda t=t: t.sum())
            d = timeit(lambda t=t: naive7(t))
            gbs = n * t.element_size() / a / 1e9
            name = str(dtype).replace("torch.", "")
            print(
                f"{name:9s} {n:8d} | {a * 1e6:7.1f}us {a1 * 1e6:7.1f}us {b * 1e6:7.1f}us {c * 1e6:7.1f}us "
                f"{d * 1e6:7.1f}us | {gbs:6.1f} {a / c:7.2f} {b / c:9.2f} {d / c:9.2f}"
            )
    torch.set_num_threads(threads)
    small = torch.randn(100)
    per_call = timeit(lambda: stats.partials_into(small, out, 2), min_time=0.5)
    floor = timeit(lambda: small.sum(), min_time=0.5)
    ptr, pout = small.data_ptr(), out.data_ptr()
    raw = None
    if stats.native_available():
        from trainmon.stats import _statskernel

        raw = timeit(lambda: _statskernel.partials(ptr, 100, 0, 1e-8, pout, 1), min_time=0.5)
    print(
        f"\nper-call overhead, 100 elements: partials_into {per_call * 1e9:.0f} ns, "
        f"t.sum() {floor * 1e9:.0f} ns" + (f", raw C call {raw * 1e9:.0f} ns" if raw is not None else "")
    )


# ---------------------------------------------------------------------------------------------------------
# reference workload


def workload_child(mode: str, steps: int) -> None:
    """Train tinygpt with hooks that read every monitored tensor with ``mode``; print the median step."""
    sys.path.insert(0, str(WORKLOAD))
    import torch
    from tinygpt import batches, make, train

    from trainmon import stats

    torch.set_num_threads(2)
    model, opt = make()
    data = batches(steps)
    cap = 4096
    buf = torch.zeros(cap, 8, dtype=torch.float64)
    row = [0]
    sink: list[torch.Tensor] = []

    if mode == "floor":

        def read(t):
            sink.append(t.detach().sum())

        def read_many(ts):
            for t in ts:
                read(t)
    elif mode in ("native", "torch"):
        if mode == "torch":
            stats.set_backend("torch")

        def read(t):
            stats.partials_into(t, buf, row[0] % cap)
            row[0] += 1

        def read_many(ts):
            stats.partials_many_into(ts, buf, 0)
    else:
        read = read_many = None

    spent = [0.0]
    steps_spent: list[float] = []
    if read is not None:
        raw_read, raw_many = read, read_many

        def read(t):
            t0 = time.perf_counter()
            raw_read(t)
            spent[0] += time.perf_counter() - t0

        def read_many(ts):
            t0 = time.perf_counter()
            raw_many(ts)
            spent[0] += time.perf_counter() - t0

        def fwd(mod, inp, out):
            for t in list(inp) + ([out] if torch.is_tensor(out) else list(out)):
                if torch.is_tensor(t) and t.is_floating_point():
                    read(t)

        def bwd(mod, gin, gout):
            for t in list(gin) + list(gout):
                if t is not None:
                    read(t)

        for name, mod in model.named_modules():
            if name:
                mod.register_forward_hook(fwd)
                mod.register_full_backward_hook(bwd)
        params = list(model.parameters())

        def pre(o, a, k):
            read_many([p.grad for p in params] + params)

        def post(o, a, k):
            read_many(
                [opt.state[p]["exp_avg"] for p in params] + [opt.state[p]["exp_avg_sq"] for p in params]
            )
            sink.clear()
            row[0] = 0
            steps_spent.append(spent[0])
            spent[0] = 0.0

        opt.register_step_pre_hook(pre)
        opt.register_step_post_hook(post)
    times, _ = train(model, opt, data)
    in_hooks = statistics.median(steps_spent[3:]) if steps_spent else 0.0
    print(statistics.median(times[3:]), in_hooks)


def workload(rounds: int, steps: int) -> None:
    modes = ("none", "floor", "native", "torch")
    ratios: dict[str, list[float]] = {m: [] for m in modes[1:]}
    hooks: dict[str, list[float]] = {m: [] for m in modes[1:]}
    env = dict(os.environ, PYTHONPATH=str(REPO))
    print(
        f"\nreference workload ({WORKLOAD / 'tinygpt.py'}), {rounds} rounds x {steps} steps, "
        "step-time ratios:"
    )
    for r in range(rounds):
        step: dict[str, float] = {}
        for mode in modes:
            cmd = [sys.executable, __file__, "--child", mode, "--steps", str(steps)]
            res = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
            step_s, hook_s = res.stdout.strip().splitlines()[-1].split()
            step[mode] = float(step_s)
            if mode != "none":
                hooks[mode].append(float(hook_s))
        for mode in modes[1:]:
            ratios[mode].append(step[mode] / step["none"])
        print(
            f"  round {r}: none {step['none'] * 1e3:.1f} ms/step; "
            + ", ".join(f"{m} {step[m] / step['none']:.3f}" for m in modes[1:])
        )
    print("  median ratio: " + ", ".join(f"{m} {statistics.median(v):.3f}" for m, v in ratios.items()))
    print(
        "  median time inside the hooks per step: "
        + ", ".join(f"{m} {statistics.median(v) * 1e3:.1f} ms" for m, v in hooks.items())
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--workload", action="store_true", help="also run the tinygpt workload comparison")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        workload_child(args.child, args.steps)
        return
    micro(args.threads)
    if args.workload:
        workload(args.rounds, args.steps)


if __name__ == "__main__":
    main()
