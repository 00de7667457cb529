"""How fast the statistics kernels read memory on a GPU, for several kernel variants and tilings: the sweep a
GPU session runs to pick the kernels' tiling (``trainmon.stats.triton_path.Tiling``) per device.

On the H200 (issue 44), ``torch.sum`` over the yardstick's 1.08 GB of float32 parameters read at 4,021 GB/s,
``stats_table`` at 1,614 GB/s and ``stats_batch`` on bf16 activations at 603 GB/s. The base kernels load
one element per instruction (their table addresses carry no alignment Triton can see), count NaN, Inf and
finite values of every element, and keep one block's loads in flight. The ``fast`` variants
(``Tiling(kernel="fast", unroll=U)``, trainmon/stats/triton_kernels.py) read whole blocks unmasked with
16-byte vector loads, ``U`` blocks' loads issued before their sums, and sum as if every value were finite
(a chunk whose sums turn non-finite is read again the base way): the same partial rows bit for bit.

For each tiling (kernel, block, chunk, warps, unroll) this times, as a collected step runs them:
``stats_table`` (``TritonReducer.rows``, then stage 2) on tensors of the yardstick's parameter sizes
(float32, like gradients and moments); ``stats_batch`` over bf16 tensors of one layer's activation sizes;
``adam_table`` (``TritonReducer.adam_rows``) over float32 moments of the parameter sizes (two tensors read
per parameter); each against ``torch.sum`` of the parameters' bytes in one tensor (a read at the memory's
pace). It checks that every tiling gives the same statistics as the first (counts, min and max exactly;
sums within 1e-6 of what rounding allows: a tiling changes the order of float32 sums, never what is
counted; the fast variants of one block and chunk give the base one's bits) and records the choice for
this device: the tiling with the least time for the three together among those giving the same statistics.
The default tiling is not changed from here: the recorded choice, with its device, is the evidence to do it.

    python bench/gpu_kernel_sweep.py                                   # on a GPU, the default tilings
    python bench/gpu_kernel_sweep.py --tilings 2048,65536,8 2048,65536,8,fast4 --repeat 20
    TRITON_INTERPRET=1 python bench/gpu_kernel_sweep.py --device cpu --scale 0.0001 --repeat 1   # dry run

A tiling is ``BLOCK,CHUNK,WARPS`` (the base kernels) or ``BLOCK,CHUNK,WARPS,fastU`` (the fast variants with
``U`` in 1, 2, 4 blocks' loads in flight).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))  # this tree's trainmon
sys.path.insert(0, str(BENCH))  # the yardstick's model (gpt_cuda)

# kernel, block, chunk, warps, unroll: the tiling in use first, then more elements in flight per program or
# per SM, then the fast variants (vector loads, no NaN/Inf bookkeeping, 1 to 4 blocks' loads in flight)
DEFAULT_TILINGS = (
    ("base", 2048, 1 << 16, 8, 1),
    ("base", 4096, 1 << 16, 8, 1),
    ("base", 1024, 1 << 16, 4, 1),
    ("fast", 2048, 1 << 16, 8, 1),
    ("fast", 2048, 1 << 16, 8, 2),
    ("fast", 2048, 1 << 16, 8, 4),
    ("fast", 1024, 1 << 16, 4, 4),
    ("fast", 4096, 1 << 16, 8, 2),
)


def yardstick_numels(scale: float, layers: int = 16) -> tuple[list[int], list[int]]:
    """Element counts of the GPU yardstick's parameters (``gpt_cuda.GPT()``, built on the meta device; with
    ``layers`` blocks) and of one layer's activations (8 x 1024 tokens), times ``scale`` (at least one element
    each)."""
    import torch
    from gpt_cuda import GPT

    with torch.device("meta"):
        model = GPT(layers=layers)
    d, tokens = model.ln.normalized_shape[0], 8 * 1024
    params = [p.numel() for p in model.parameters()]
    activations = [tokens * d] * 6 + [tokens * 3 * d, tokens * 4 * d, tokens * 4 * d]
    return [max(1, int(n * scale)) for n in params], [max(1, int(n * scale)) for n in activations]


def run(args: argparse.Namespace) -> dict:
    import torch

    from trainmon import stats
    from trainmon.run.records import INFS, MAX, MIN, NANS, NUMEL, SUM, SUMSQ, ZEROS
    from trainmon.stats import triton_path
    from trainmon.stats.direct import AdamItem

    device = torch.device(args.device)
    stats.set_backend("triton")
    if not triton_path.supports(device):
        raise SystemExit(f"the Triton kernels cannot run on {device} (on a CPU: TRITON_INTERPRET=1)")
    cuda = device.type == "cuda"
    params, activations = yardstick_numels(args.scale, args.layers)
    generator = torch.Generator(device=device).manual_seed(0)
    grads = [torch.randn(n, generator=generator, device=device) for n in params]
    acts = [torch.randn(n, generator=generator, device=device).to(torch.bfloat16) for n in activations]
    flat = torch.randn(sum(params), generator=generator, device=device)

    def elapsed(work) -> float:
        """Seconds a call of ``work`` takes, the median of ``--repeat`` after one unmeasured call."""
        work()
        times = []
        for _ in range(args.repeat):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                work()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                begin = time.perf_counter()
                work()
                times.append(time.perf_counter() - begin)
        return sorted(times)[len(times) // 2]

    # Adam's moments of every parameter (exp_avg_sq >= 0), read in pairs by adam_table
    moments = [(g * 1e-3, g * g * 1e-6) for g in grads]
    items = [
        AdamItem(m, v, 0.1, 0.001, 1e-8, len(grads) + len(acts) + 2 * i, len(grads) + len(acts) + 2 * i + 1)
        for i, (m, v) in enumerate(moments)
    ]
    read = sum(t.numel() * t.element_size() for t in grads)
    batch_read = sum(t.numel() * t.element_size() for t in acts)
    reference = elapsed(lambda: flat.sum())
    rows = []
    first = None
    skipped = []
    began = time.monotonic()
    for kernel, block, chunk, warps, unroll in args.tilings:
        if rows and time.monotonic() - began > args.time_budget:
            skipped.append(label((kernel, block, chunk, warps, unroll)))
            continue
        tiling = triton_path.Tiling(chunk=chunk, block=block, warps=warps, kernel=kernel, unroll=unroll)
        triton_path.set_tiling(tiling)
        reducer = triton_path.TritonReducer(device)
        out = torch.zeros((len(grads) + len(acts) + 2 * len(items), 8), dtype=torch.float64, device=device)

        def table(reducer=reducer, out=out) -> None:
            reducer.rows(grads, out, 0, 1e-8)
            reducer.complete(out)
            reducer.reset()

        def batch(reducer=reducer, out=out) -> None:
            for i, t in enumerate(acts):
                reducer.row(t, out, len(grads) + i, 1e-8, shareable=True, site=i)
            reducer.complete(out)
            reducer.reset()

        def adam(reducer=reducer, out=out) -> None:
            reducer.adam_rows(items, out, 1e-8)
            reducer.complete(out)
            reducer.reset()

        batch()  # the learning step reads each at its hook; batches from the next one on
        seconds, batch_seconds, adam_seconds = elapsed(table), elapsed(batch), elapsed(adam)
        got = out.cpu()
        if first is None:
            first = got
        exact = [NUMEL, NANS, INFS, ZEROS, MIN, MAX]
        # float32 sums in another order: within 1e-6 of sum(|x|) (at most sqrt(n * sumsq)); sumsq relative
        scale = (first[:, NUMEL] * first[:, SUMSQ]).sqrt()
        same = bool(
            torch.equal(got[:, exact], first[:, exact])
            and ((got[:, SUM] - first[:, SUM]).abs() <= 1e-6 * scale + 1e-12).all()
            and ((got[:, SUMSQ] - first[:, SUMSQ]).abs() <= 1e-6 * first[:, SUMSQ] + 1e-12).all()
        )
        if triton_path.unavailable():  # a kernel failed: the torch ops stood in, not a figure of the kernels
            raise SystemExit(f"error: {triton_path.unavailable()} (tiling {label(rows_key(tiling))})")
        rows.append(
            {
                "kernel": kernel,
                "block": block,
                "chunk": chunk,
                "warps": warps,
                "unroll": unroll,
                "table_ms": seconds * 1e3,
                "table_gb_s": read / seconds / 1e9,
                "batch_ms": batch_seconds * 1e3,
                "batch_gb_s": batch_read / batch_seconds / 1e9,
                "adam_ms": adam_seconds * 1e3,
                "adam_gb_s": 2 * read / adam_seconds / 1e9,
                "same_statistics": same,
            }
        )
    result = {
        "device": torch.cuda.get_device_name(device) if cuda else str(device),
        "torch": torch.__version__,
        "triton": _triton_version(),
        "read_bytes": read,
        "batch_bytes": batch_read,
        "adam_bytes": 2 * read,
        "sum_ms": reference * 1e3,
        "sum_gb_s": read / reference / 1e9,
        "tilings": rows,
        "not_timed": skipped,
    }
    result["choice"] = choice(result)
    return result


def _triton_version() -> str:
    import triton

    return triton.__version__


def rows_key(tiling) -> tuple:
    return (tiling.kernel, tiling.block, tiling.chunk, tiling.warps, tiling.unroll)


def label(key: tuple) -> str:
    """A tiling as the command line spells it: ``block,chunk,warps`` or ``block,chunk,warps,fastU``."""
    kernel, block, chunk, warps, unroll = key
    return f"{block},{chunk},{warps}" + (f",fast{unroll}" if kernel == "fast" else "")


def choice(result: dict) -> dict | None:
    """This device's pick: the tiling whose three kernels take the least time together, among those that
    give the first tiling's statistics; with each kernel's read speed as a fraction of ``torch.sum``'s."""
    same = [r for r in result["tilings"] if r["same_statistics"]]
    if not same:
        return None
    best = min(same, key=lambda r: r["table_ms"] + r["batch_ms"] + r["adam_ms"])
    key = (best["kernel"], best["block"], best["chunk"], best["warps"], best["unroll"])
    return {
        "device": result["device"],
        "tiling": label(key),
        "Tiling": {"kernel": key[0], "block": key[1], "chunk": key[2], "warps": key[3], "unroll": key[4]},
        "step_ms": best["table_ms"] + best["batch_ms"] + best["adam_ms"],
        "in_use_ms": sum(result["tilings"][0][k] for k in ("table_ms", "batch_ms", "adam_ms")),
        "of_sum": {name: best[f"{name}_gb_s"] / result["sum_gb_s"] for name in ("table", "batch", "adam")},
    }


def table_of(result: dict) -> str:
    lines = [
        f"{result['device']}: {result['read_bytes'] / 1e9:.2f} GB of float32 parameters (stats_table; "
        f"adam_table reads their two moments), {result['batch_bytes'] / 1e9:.2f} GB of bf16 activations "
        f"(stats_batch); torch.sum of the parameters: {result['sum_ms']:.3f} ms, "
        f"{result['sum_gb_s']:.0f} GB/s",
        "",
        "| kernel | block | chunk | warps | unroll | stats_table ms | GB/s | vs sum | stats_batch ms | GB/s "
        "| vs sum | adam_table ms | GB/s | vs sum | same stats |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    total = result["sum_gb_s"]
    for r in result["tilings"]:
        lines.append(
            f"| {r['kernel']} | {r['block']} | {r['chunk']} | {r['warps']} | {r['unroll']} | "
            f"{r['table_ms']:.3f} | {r['table_gb_s']:.0f} | {r['table_gb_s'] / total:.2f} | "
            f"{r['batch_ms']:.3f} | {r['batch_gb_s']:.0f} | {r['batch_gb_s'] / total:.2f} | "
            f"{r['adam_ms']:.3f} | {r['adam_gb_s']:.0f} | {r['adam_gb_s'] / total:.2f} | "
            f"{'yes' if r['same_statistics'] else 'NO'} |"
        )
    pick = result.get("choice")
    if pick:
        lines += [
            "",
            f"choice for {pick['device']}: {pick['tiling']} ({pick['step_ms']:.3f} ms for the three kernels; "
            f"the tiling in use {pick['in_use_ms']:.3f} ms); of torch.sum's read speed: "
            + ", ".join(f"{name} {share:.2f}" for name, share in pick["of_sum"].items()),
        ]
    if result.get("not_timed"):
        lines.append(f"not timed (past --time-budget): {' '.join(result['not_timed'])}")
    return "\n".join(lines)


def tiling(text: str) -> tuple[str, int, int, int, int]:
    parts = text.split(",")
    kernel, unroll = "base", 1
    if len(parts) == 4:
        if not parts[3].startswith("fast") or parts[3][4:] not in ("1", "2", "4"):
            raise argparse.ArgumentTypeError(f"{text}: the fourth part is fast1, fast2 or fast4")
        kernel, unroll = "fast", int(parts[3][4:])
    elif len(parts) != 3:
        raise argparse.ArgumentTypeError(f"{text}: block,chunk,warps or block,chunk,warps,fastU")
    block, chunk, warps = (int(part) for part in parts[:3])
    if chunk % block:
        raise argparse.ArgumentTypeError(f"{text}: the chunk must be a multiple of the block")
    return kernel, block, chunk, warps, unroll


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--tilings", nargs="+", type=tiling, default=list(DEFAULT_TILINGS), metavar="B,C,W[,fastU]"
    )
    parser.add_argument(
        "--time-budget", type=float, default=1e9, help="seconds; no tiling starts past them (one always runs)"
    )
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--scale", type=float, default=1.0, help="tensor sizes times this (a CPU dry run)")
    parser.add_argument(
        "--layers", type=int, default=16, help="the yardstick's blocks (fewer tensors: a CPU dry run)"
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = run(args)
    print(table_of(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
