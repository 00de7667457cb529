"""How fast the statistics kernels read memory on a GPU, for several tilings: the sweep a GPU session runs to
pick the kernels' tiling (``trainmon.stats.triton_path.Tiling``).

On the H200, wg + mv's kernels took 1.4 ms to read ~3.2 GB (gradients and both Adam moments of the
yardstick's ~270M parameters): ~2.3 TB/s, half of what the memory gives. Likely too few bytes are in flight
to hide the memory's latency (2,048 elements a program at a time, two programs an SM, which the registers
allow no more of); a tiling with more in flight per SM may read faster. This times, for each tiling, the
parameter side's path as a collected step runs it (``TritonReducer.rows``: one ``stats_table`` launch, then
stage 2), on tensors of the yardstick's parameter sizes (float32, like gradients and moments) and, apart,
one ``stats_batch`` launch over bf16 tensors of its activation sizes; against ``torch.sum`` of the same
bytes in one tensor (a read of everything at the memory's pace). It also checks that every tiling gives the
same statistics as the first (counts, min and max exactly; sums within 1e-6 of what rounding allows): a
tiling changes the order of float32 sums, never what is counted.

    python bench/gpu_kernel_sweep.py                                   # on a GPU, the default tilings
    python bench/gpu_kernel_sweep.py --tilings 2048,65536,8 4096,65536,8 --repeat 20
    TRITON_INTERPRET=1 python bench/gpu_kernel_sweep.py --device cpu --scale 0.0001 --repeat 1   # dry run
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

# block, chunk, warps: the current tiling first, then more elements in flight per program or per SM
DEFAULT_TILINGS = (
    (2048, 1 << 16, 8),
    (4096, 1 << 16, 8),
    (4096, 1 << 16, 16),
    (1024, 1 << 16, 4),
    (2048, 1 << 15, 8),
    (2048, 1 << 17, 8),
)


def yardstick_numels(scale: float) -> tuple[list[int], list[int]]:
    """Element counts of the GPU yardstick's parameters (``gpt_cuda.GPT()``, built on the meta device) and of
    one layer's activations (8 x 1024 tokens), times ``scale`` (at least one element each)."""
    import torch
    from gpt_cuda import GPT

    with torch.device("meta"):
        model = GPT()
    d, tokens = model.ln.normalized_shape[0], 8 * 1024
    params = [p.numel() for p in model.parameters()]
    activations = [tokens * d] * 6 + [tokens * 3 * d, tokens * 4 * d, tokens * 4 * d]
    return [max(1, int(n * scale)) for n in params], [max(1, int(n * scale)) for n in activations]


def run(args: argparse.Namespace) -> dict:
    import torch

    from trainmon import stats
    from trainmon.run.records import INFS, MAX, MIN, NANS, NUMEL, SUM, SUMSQ, ZEROS
    from trainmon.stats import triton_path

    device = torch.device(args.device)
    stats.set_backend("triton")
    if not triton_path.supports(device):
        raise SystemExit(f"the Triton kernels cannot run on {device} (on a CPU: TRITON_INTERPRET=1)")
    cuda = device.type == "cuda"
    params, activations = yardstick_numels(args.scale)
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

    read = sum(t.numel() * t.element_size() for t in grads)
    batch_read = sum(t.numel() * t.element_size() for t in acts)
    reference = elapsed(lambda: flat.sum())
    rows = []
    first = None
    for block, chunk, warps in args.tilings:
        triton_path.set_tiling(triton_path.Tiling(chunk=chunk, block=block, warps=warps))
        reducer = triton_path.TritonReducer(device)
        out = torch.zeros((len(grads) + len(acts), 8), dtype=torch.float64, device=device)

        def table(reducer=reducer, out=out) -> None:
            reducer.rows(grads, out, 0, 1e-8)
            reducer.complete(out)
            reducer.reset()

        def batch(reducer=reducer, out=out) -> None:
            for i, t in enumerate(acts):
                reducer.row(t, out, len(grads) + i, 1e-8, shareable=True, site=i)
            reducer.complete(out)
            reducer.reset()

        batch()  # the learning step reads each at its hook; batches from the next one on
        seconds, batch_seconds = elapsed(table), elapsed(batch)
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
        rows.append(
            {
                "block": block,
                "chunk": chunk,
                "warps": warps,
                "table_ms": seconds * 1e3,
                "table_gb_s": read / seconds / 1e9,
                "batch_ms": batch_seconds * 1e3,
                "batch_gb_s": batch_read / batch_seconds / 1e9,
                "same_statistics": same,
            }
        )
    return {
        "device": torch.cuda.get_device_name(device) if cuda else str(device),
        "read_bytes": read,
        "batch_bytes": batch_read,
        "sum_ms": reference * 1e3,
        "sum_gb_s": read / reference / 1e9,
        "tilings": rows,
    }


def table_of(result: dict) -> str:
    lines = [
        f"{result['device']}: {result['read_bytes'] / 1e9:.2f} GB of float32 parameters (stats_table), "
        f"{result['batch_bytes'] / 1e9:.2f} GB of bf16 activations (stats_batch); torch.sum of the former: "
        f"{result['sum_ms']:.3f} ms, {result['sum_gb_s']:.0f} GB/s",
        "",
        "| block | chunk | warps | stats_table ms | GB/s | vs sum | stats_batch ms | GB/s | same stats |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["tilings"]:
        lines.append(
            f"| {r['block']} | {r['chunk']} | {r['warps']} | {r['table_ms']:.3f} | {r['table_gb_s']:.0f} | "
            f"{r['table_gb_s'] / result['sum_gb_s']:.2f} | {r['batch_ms']:.3f} | {r['batch_gb_s']:.0f} | "
            f"{'yes' if r['same_statistics'] else 'NO'} |"
        )
    return "\n".join(lines)


def tiling(text: str) -> tuple[int, int, int]:
    block, chunk, warps = (int(part) for part in text.split(","))
    if chunk % block:
        raise argparse.ArgumentTypeError(f"{text}: the chunk must be a multiple of the block")
    return block, chunk, warps


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tilings", nargs="+", type=tiling, default=list(DEFAULT_TILINGS), metavar="B,C,W")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--scale", type=float, default=1.0, help="tensor sizes times this (a CPU dry run)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = run(args)
    print(table_of(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
