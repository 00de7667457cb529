"""A digest of what every Triton kernel of trainmon computes on fixed inputs, under Triton's interpreter.

Runs each kernel through the host side (trainmon.stats.triton_path and triton_fingerprints) on seeded CPU
tensors: single tensors, tables and a batch of float32, bfloat16 and float16 (the batch also float64, int64
and int32) with NaN, +-Inf, zeros and sizes across several chunks, merged rows, Adam's update and ratio, and
grad_probe's bin counts, samples and sign bitmaps; prints the SHA-256 of the output bytes. Two Triton versions
(or two revisions of the kernels) that print the same digest computed the same bits. bench/triton_versions.sh
compares each version's digest with the one of the Triton in the venv.

    TRITON_INTERPRET=1 python bench/triton_digest.py
    TRITON_INTERPRET=1 python bench/triton_digest.py --fast 4   # the fast variants: the same digest
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from trainmon import stats  # noqa: E402
from trainmon.gradprobe.sampling import sample_positions  # noqa: E402
from trainmon.run.gradprobe import ParamLayout  # noqa: E402
from trainmon.run.records import N_PARTIALS  # noqa: E402
from trainmon.stats import triton_path  # noqa: E402
from trainmon.stats.direct import AdamItem  # noqa: E402

# small tiles, as the tests use: tensors of a few thousand elements span several chunks and stage-2 passes
TILING = triton_path.Tiling(chunk=1 << 12, block=1 << 10, rows=4, sign_bytes=32)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SIZES = (0, 1, 7, 4095, 4096, 4097, 3 * 4096 + 17)


def tensors(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for dtype in DTYPES:
        for n in SIZES:
            x = torch.randn(n, generator=g) * 3 + 0.25
            if n > 20:
                x[[2, 9, 11, 13, 14]] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, 1e-40])
            out.append(x.to(dtype))
    return out


def wide_tensors(seed: int) -> list[torch.Tensor]:
    """float64, int64 and int32 tensors, which only the batch kernel reads (widened to float64)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in SIZES:
        x = torch.randn(n, generator=g, dtype=torch.float64) * 3 + 0.25
        if n > 20:
            special = [float("nan"), float("inf"), -float("inf"), 0.0, 1e-300]
            x[[2, 9, 11, 13, 14]] = torch.tensor(special, dtype=x.dtype)
        out.append(x)
        out.append(torch.randint(-(2**40), 2**40, (n,), generator=g))
        out.append(torch.randint(-(2**31), 2**31 - 1, (n,), generator=g, dtype=torch.int32))
    return out


def statistics() -> bytes:
    xs = tensors(0)
    out = torch.zeros((2 * len(xs) + 2 + 2 * 4, N_PARTIALS), dtype=torch.float64)
    reducer = stats.reducer_for("cpu")
    assert isinstance(reducer, triton_path.TritonReducer), "the Triton backend does not run here"
    for i, x in enumerate(xs):
        reducer.row(x, out, i, 1e-8)  # stats_one
    reducer.rows(xs, out, len(xs), 1e-8)  # stats_table, one launch per dtype
    reducer.merged_row(xs[: len(SIZES)], out, 2 * len(xs), 1e-8)
    g = torch.Generator().manual_seed(1)
    items = []
    for j, (n, dtype) in enumerate(((1, torch.float32), (4096 + 7, torch.bfloat16), (40, torch.float16))):
        m = (torch.randn(n, generator=g) * 1e-3).to(dtype)
        v = (torch.rand(n, generator=g) * 1e-5).to(dtype)
        if n > 20:
            m[:3], v[:3] = 0.0, torch.tensor([0.0, 1e-6, float("nan")]).to(dtype)
        row = 2 * len(xs) + 2 + 2 * j
        items.append(AdamItem(m, v, 1 - 0.9 ** (j + 1), 1 - 0.999 ** (j + 2), 1e-8, row, row + 1))
    reducer.adam_rows(items, out, 1e-8)
    reducer.complete(out)  # finalize
    reducer.reset()
    # tensors taken in hooks: a step that reads each at its hook (stats_one; the torch ops for the wide ones),
    # then one of a batch of every dtype (stats_batch)
    hooked = xs + wide_tensors(3)
    batched = torch.zeros((len(hooked), N_PARTIALS), dtype=torch.float64)
    for _ in range(2):
        for i, x in enumerate(hooked):
            reducer.row(x, batched, i, 1e-8, shareable=True, site=i)
        reducer.complete(batched)
        reducer.reset()
    return out.numpy().tobytes() + batched.numpy().tobytes()


def fingerprints() -> bytes:
    from trainmon.stats.triton_fingerprints import TritonFingerprinter

    grads = [x for x in tensors(2) if x.numel()]
    bounds = (-0.5, 0.0, 0.75)
    layouts, positions = [], []
    for i, g in enumerate(grads):
        positions.append(sample_positions(g.numel(), 50, i))
        k = len(positions[-1])
        layouts.append(
            ParamLayout(f"p{i}", 0, tuple(g.shape), str(g.dtype), "L2", bounds, i, "name", k, True)
        )
    buffer, assemble = TritonFingerprinter(torch.device("cpu")).take(grads, layouts, positions, 1e-8)
    return np.asarray(assemble(buffer.numpy())).tobytes()


def main() -> None:
    import argparse
    import dataclasses

    import triton

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--fast",
        type=int,
        choices=(1, 2, 4),
        help="the fast kernel variants, this many blocks' loads in flight",
    )
    args = parser.parse_args()
    tiling = TILING if args.fast is None else dataclasses.replace(TILING, kernel="fast", unroll=args.fast)
    triton_path.set_tiling(tiling)
    stats.set_backend("triton")
    digest = hashlib.sha256(statistics() + fingerprints()).hexdigest()
    if triton_path.unavailable():  # a kernel failed and the torch ops stood in: not the kernels' bits
        raise SystemExit(f"error: {triton_path.unavailable()}")
    print(f"triton {triton.__version__} numpy {np.__version__} torch {torch.__version__}")
    print("digest", digest)


if __name__ == "__main__":
    main()
