"""The fast variants of the stage-1 kernels (``Tiling(kernel="fast")``: whole blocks read unmasked, ``unroll``
blocks' loads in flight, values summed as finite and the chunk read again by the base kernel's code where a
lane's sum turns non-finite) give the base kernels' partial rows bit for bit, on every entry point
(stats_one, stats_table, stats_batch, adam_table), for tails, NaN and Inf inside whole blocks and in tails,
sums of squares that overflow float32, bfloat16 subnormals and signed zeros; and the float64 golden values.
The launches are counted, so a fast variant that silently fell back to the base kernel would fail here.

Under Triton's interpreter without a GPU (tests/conftest.py sets TRITON_INTERPRET=1), on CUDA with one.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.conftest import assert_matches, reference_partials
from tests.test_stats_triton import CountingKernels, to_numpy
from trainmon import stats
from trainmon.run.records import N_PARTIALS
from trainmon.stats import triton_path
from trainmon.stats.direct import AdamItem

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INF, NAN = float("inf"), float("nan")
# small enough for the interpreter: 4 blocks of 256 a chunk, so unroll 2 and 4 meet whole groups, leftover
# whole blocks and tails
CHUNK, BLOCK = 1024, 256
STAGE_1 = ("stats_one", "stats_table", "stats_batch", "adam_table")


def adversarial(dtype: torch.dtype) -> list[torch.Tensor]:
    """Tensors whose chunks hit every path of the fast kernels."""
    g = torch.Generator().manual_seed(7)

    def randn(n: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(n, generator=g) * scale

    sizes = [1, 5, BLOCK - 1, BLOCK, BLOCK + 3, 3 * BLOCK + 1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 517]
    out = [randn(n, 3.0) + 0.25 for n in sizes]
    whole_nan = randn(2 * CHUNK)
    whole_nan[CHUNK + 300] = NAN  # inside a whole block of the second chunk
    whole_inf = randn(CHUNK + 40)
    whole_inf[[5, 700]] = torch.tensor([INF, -INF])  # both in whole blocks of the first chunk
    tail_nan = randn(CHUNK + BLOCK + 10)
    tail_nan[CHUNK + BLOCK + 4] = NAN  # in the partial block only
    zeros = torch.zeros(CHUNK + 7)
    zeros[::3] = -0.0
    out += [whole_nan, whole_inf, tail_nan, zeros]
    if dtype == torch.float32:
        out.append(randn(2 * CHUNK, 1e25))  # squares overflow float32 in whole blocks
    if dtype == torch.bfloat16:
        tiny = torch.full((CHUNK + 9,), 1e-39)  # bfloat16 subnormals
        tiny[1::2] = -3e-40
        out.append(tiny)
    return [t.to(dtype).to(DEVICE) for t in out]


def reduce_all(tiling: triton_path.Tiling, tensors: list[torch.Tensor], adam: list[AdamItem]):
    """Every entry point's rows under ``tiling``: (table rows, one-tensor rows, batch rows, Adam rows), and
    the launches per kernel."""
    counting = CountingKernels(triton_path.kernels())
    previous_kernels, previous_tiling = triton_path._kernels, triton_path.get_tiling()
    triton_path._kernels = counting
    triton_path.set_tiling(tiling)
    try:
        n = len(tensors)
        out = torch.full((4 * n + 2 * len(adam), N_PARTIALS), -7.0, dtype=torch.float64, device=DEVICE)
        reducer = stats.reducer_for(DEVICE)
        reducer.rows(tensors, out, 0, 1e-8)  # stats_table
        for i, t in enumerate(tensors):
            reducer.row(t, out, n + i, 1e-8)  # stats_one
        reducer.complete(out)
        reducer.reset()
        for _step in range(2):  # the first step reads each at its hook (learning), the next one batches
            for i, t in enumerate(tensors):
                reducer.row(t, out, 2 * n + i, 1e-8, shareable=True, site=i)
            reducer.complete(out)
            reducer.reset()
        reducer.adam_rows(adam, out, 1e-8)
        reducer.complete(out)
        reducer.reset()
    finally:
        triton_path._kernels = previous_kernels
        triton_path.set_tiling(previous_tiling)
    assert triton_path.unavailable() is None, triton_path.unavailable()
    return out.cpu(), dict(counting.launches)


def adam_items(dtype: torch.dtype, first_row: int) -> list[AdamItem]:
    g = torch.Generator().manual_seed(11)
    items = []
    for i, n in enumerate([3, CHUNK + 7, 2 * CHUNK + BLOCK + 1]):
        m = torch.randn(n, generator=g) * 1e-3
        v = torch.rand(n, generator=g) * 1e-5
        if n > BLOCK:
            m[[0, 1, BLOCK + 2]] = torch.tensor([0.0, 1e-3, 2e-3])
            v[[0, 1, BLOCK + 2]] = torch.tensor([0.0, 0.0, NAN])  # ratio inf / NaN inside a whole block
        m, v = m.to(dtype).to(DEVICE), v.to(dtype).to(DEVICE)
        rows = (first_row + 2 * i, first_row + 2 * i + 1)
        items.append(AdamItem(m, v, 1 - 0.9 ** (i + 1), 1 - 0.999 ** (i + 2), 1e-8, *rows))
    return items


@pytest.fixture
def triton_on():
    previous = stats.get_backend()
    stats.set_backend("triton")
    yield
    stats.set_backend(previous)


@pytest.mark.parametrize(
    ("dtype", "unroll"), [(torch.float32, 4), (torch.bfloat16, 4), (torch.float16, 1)], ids=str
)
def test_fast_kernels_give_the_base_kernels_rows_bit_for_bit(triton_on, dtype, unroll):
    tensors = adversarial(dtype)
    adam = adam_items(dtype, 4 * len(tensors))
    base_tiling = triton_path.Tiling(chunk=CHUNK, block=BLOCK, warps=4, rows=4, sign_bytes=64)
    fast_tiling = triton_path.Tiling(
        chunk=CHUNK, block=BLOCK, warps=4, rows=4, sign_bytes=64, kernel="fast", unroll=unroll
    )
    base, base_launches = reduce_all(base_tiling, tensors, adam)
    fast, fast_launches = reduce_all(fast_tiling, tensors, adam)
    # the fast variants ran, as often as the base ones did, and nothing else changed
    assert fast_launches == {(k + "_fast" if k in STAGE_1 else k): v for k, v in base_launches.items()}
    assert base_launches["stats_table"] == 1 and base_launches["adam_table"] == 1
    assert base_launches["stats_batch"] == 1
    # bit for bit, NaN payloads aside (a NaN row is compared as NaN)
    assert torch.equal(base.nan_to_num(nan=12345.0), fast.nan_to_num(nan=12345.0))
    # and the float64 golden values of every tensor, from each entry point (but those whose squares
    # overflow or underflow the float32 sum of squares, in the base kernel as in the fast one: compared
    # bitwise above)
    n = len(tensors)
    for i, t in enumerate(tensors):
        a = to_numpy(t)
        magnitudes = np.abs(a[np.isfinite(a) & (a != 0)])
        if magnitudes.size and (magnitudes.max() > 1e19 or magnitudes.min() < 1e-30):
            continue
        ref = reference_partials(a)
        for row in (i, n + i, 2 * n + i):
            assert_matches(fast[row], ref, a)


def test_a_misaligned_table_takes_the_base_kernel(triton_on):
    """The fast variants' vector loads need 16-byte aligned addresses: a table holding one that is not
    (a view at an odd offset, as a flat buffer's parameter can be) runs the base kernel, same rows."""
    storage = torch.randn(3 * CHUNK, device=DEVICE)
    tensors = [storage[1 : 1 + CHUNK + 5], storage[2 * CHUNK : 3 * CHUNK]]  # the first 4 bytes off
    assert tensors[0].data_ptr() % 16 and not tensors[1].data_ptr() % 16
    fast_tiling = triton_path.Tiling(chunk=CHUNK, block=BLOCK, warps=4, rows=4, sign_bytes=64, kernel="fast")
    base_tiling = triton_path.Tiling(chunk=CHUNK, block=BLOCK, warps=4, rows=4, sign_bytes=64)
    fast, launches = reduce_all(fast_tiling, tensors, [])
    base, _ = reduce_all(base_tiling, tensors, [])
    assert launches["stats_table"] == 1 and "stats_table_fast" not in launches
    assert launches["stats_batch"] == 1 and "stats_batch_fast" not in launches
    # two rows read alone, two read at their hooks in the batch's learning step: Triton specialises a
    # pointer argument on its alignment itself
    assert launches["stats_one_fast"] == 4
    assert torch.equal(base, fast)
    for i, t in enumerate(tensors):
        a = to_numpy(t)
        assert_matches(fast[i], reference_partials(a), a)
    assert np.isfinite(fast[: 2 * len(tensors)].numpy()).all()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_interpreter_digest_of_the_fast_variants_is_the_base_kernels_one():
    """bench/triton_digest.py (every kernel through the host side on fixed inputs with NaN, Inf, zeros and
    sizes across chunks; the batch with every dtype) prints the digest bench/triton_checked.json records for
    the venv's Triton with the base kernels; with the fast variants it prints the same."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    import triton

    repo = Path(__file__).resolve().parents[1]
    record = json.loads((repo / "bench" / "triton_checked.json").read_text())
    if record["reference"] != triton.__version__:
        pytest.skip(f"the recorded digest is Triton {record['reference']}'s, this is {triton.__version__}")
    want = record["versions"][record["reference"]]["digest"]
    argv = [sys.executable, str(repo / "bench" / "triton_digest.py"), "--fast", "4"]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=280, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == f"digest {want}"
