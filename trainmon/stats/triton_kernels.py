"""The Triton kernels of the accelerator backend (imported only where Triton is installed).

Stage 1 reads each tensor once, in chunks of ``CHUNK`` elements (``BLOCK`` at a time): one program per
(tensor, chunk) writes a *partial row* of 7 float64 values, ``nans, infs, zeros, min, max, sum, sumsq`` over
its chunk (fp32 accumulation inside the chunk, int32 counts; elements past the end load as NaN and are taken
out of the NaN count by the chunk's known length, so they fall out of every statistic without a branch).
Stage 2 (:func:`finalize`) reduces each tensor's partial rows in order, in float64, into its row of the
step buffer, so equal input gives bit-equal output.

Tensor tables (``*_table`` kernels) let one launch cover every tensor of one dtype: an int64 table holds
the tensors' addresses, element counts and first block, and for each block (program) its tensor.

The batch kernel (``stats_batch``) also reads float64, int64 and int32 tensors, widened to float64 and
accumulated in float64 (exact for integers below 2**53 in magnitude).

bfloat16 tensors are read as their int16 bits and widened by a shift (``BF16``): exact for every value,
subnormals included, in the compiled kernels and in Triton's interpreter alike (whose own bfloat16
conversion flushes subnormals to zero).

Written for every Triton from 3.2 (torch 2.6) to 3.9, compiled and interpreted alike
(``bench/triton_versions.sh``). A loop whose bound is loaded from memory is a ``while``, not a ``range``:
the interpreters before 3.7 turn a range bound into a Python int with ``int()`` of a one-element array,
which numpy 2.4 refuses; compiled, both spellings give the same instructions (``bench/triton_aot.py
--dump``) and the same results.
"""

from __future__ import annotations

import triton
import triton.language as tl

# The host side (triton_path) sizes its buffers with these. The kernels spell them as literals (a row is
# ``part_ptr + row * 8``, a descriptor ``desc_ptr + d * 4``): module-level constexprs are not read the same
# way by every Triton version these kernels support.
PARTIAL_WIDTH = 8  # a partial row: nans, infs, zeros, min, max, sum, sumsq, (unused)
DESC_WIDTH = 4  # a descriptor: first partial row, partial rows, output row, numel


@triton.jit
def _load_f32(ptr, idx, mask, other, BF16: tl.constexpr):
    """Elements ``idx`` as float32 (``other`` where ``mask`` is off); ``ptr`` points at int16 bits when
    ``BF16``."""
    if BF16:
        bits = tl.load(ptr + idx, mask=mask, other=0).to(tl.int32)
        x = (bits << 16).to(tl.float32, bitcast=True)
        return tl.where(mask, x, other)
    else:
        return tl.load(ptr + idx, mask=mask, other=other).to(tl.float32)


@triton.jit
def _accumulate(x, zero_hi, n_fin, n_inf, n_zero, s, q, mn, mx):
    a = tl.abs(x)
    fin = a < float("inf")  # false for NaN and +-inf
    n_fin += fin.to(tl.int32)
    n_inf += (a == float("inf")).to(tl.int32)
    n_zero += (a <= zero_hi).to(tl.int32)
    xf = tl.where(fin, x, 0.0)
    s += xf
    q += xf * xf
    mn = tl.minimum(mn, tl.where(fin, x, float("inf")))
    mx = tl.maximum(mx, tl.where(fin, x, float("-inf")))
    return n_fin, n_inf, n_zero, s, q, mn, mx


@triton.jit
def _store_partial(ptr, length, n_fin, n_inf, n_zero, s, q, mn, mx):
    fin = tl.sum(n_fin, axis=0).to(tl.int64)
    inf = tl.sum(n_inf, axis=0).to(tl.int64)
    tl.store(ptr + 0, (length - fin - inf).to(tl.float64))
    tl.store(ptr + 1, inf.to(tl.float64))
    tl.store(ptr + 2, tl.sum(n_zero, axis=0).to(tl.float64))
    tl.store(ptr + 3, tl.min(mn, axis=0).to(tl.float64))
    tl.store(ptr + 4, tl.max(mx, axis=0).to(tl.float64))
    tl.store(ptr + 5, tl.sum(s, axis=0).to(tl.float64))
    tl.store(ptr + 6, tl.sum(q, axis=0).to(tl.float64))


@triton.jit
def _chunk(
    base,
    start,
    n,
    zero_hi,
    part_row,
    BF16: tl.constexpr,
    WIDE: tl.constexpr,
    BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Partial row of elements ``[start, min(start + CHUNK, n))`` of the tensor at ``base``. ``WIDE``: a
    float64, int64 or int32 tensor (``base`` typed as it), widened to float64 and accumulated in float64
    (exact for integers below 2**53 in magnitude); else fp32 accumulation."""
    offs = tl.arange(0, BLOCK)
    n_fin = tl.zeros([BLOCK], dtype=tl.int32)
    n_inf = tl.zeros([BLOCK], dtype=tl.int32)
    n_zero = tl.zeros([BLOCK], dtype=tl.int32)
    if WIDE:
        s = tl.zeros([BLOCK], dtype=tl.float64)
        q = tl.zeros([BLOCK], dtype=tl.float64)
        mn = tl.full([BLOCK], float("inf"), dtype=tl.float64)
        mx = tl.full([BLOCK], float("-inf"), dtype=tl.float64)
    else:
        s = tl.zeros([BLOCK], dtype=tl.float32)
        q = tl.zeros([BLOCK], dtype=tl.float32)
        mn = tl.full([BLOCK], float("inf"), dtype=tl.float32)
        mx = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    for i in range(0, CHUNK, BLOCK):
        idx = start + i + offs
        if WIDE:
            inside = idx < n
            x = tl.where(inside, tl.load(base + idx, mask=inside, other=0).to(tl.float64), float("nan"))
        else:
            x = _load_f32(base, idx, idx < n, float("nan"), BF16)
        n_fin, n_inf, n_zero, s, q, mn, mx = _accumulate(x, zero_hi, n_fin, n_inf, n_zero, s, q, mn, mx)
    length = tl.maximum(tl.minimum(n - start, CHUNK), 0)
    _store_partial(part_row, length, n_fin, n_inf, n_zero, s, q, mn, mx)


@triton.jit(do_not_specialize=["n", "first_row"])
def stats_one(
    x_ptr, n, part_ptr, first_row, zero_hi, BF16: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr
):
    """One tensor: program ``c`` writes the partial row ``first_row + c`` for chunk ``c``."""
    c = tl.program_id(0).to(tl.int64)
    _chunk(x_ptr, c * CHUNK, n, zero_hi, part_ptr + (first_row + c) * 8, BF16, False, BLOCK, CHUNK)


@triton.jit(do_not_specialize=["ntensors", "first_row"])
def stats_table(
    tab_ptr,
    ntensors,
    part_ptr,
    first_row,
    zero_hi,
    DTYPE: tl.constexpr,
    BF16: tl.constexpr,
    BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Many tensors of one dtype. ``tab``: addresses[T], numels[T], first blocks[T], tensor of each block[B];
    program ``p`` writes the partial row ``first_row + p``."""
    p = tl.program_id(0).to(tl.int64)
    t = tl.load(tab_ptr + 3 * ntensors + p)
    base = tl.load(tab_ptr + t).to(tl.pointer_type(DTYPE))
    n = tl.load(tab_ptr + ntensors + t)
    c = p - tl.load(tab_ptr + 2 * ntensors + t)
    _chunk(base, c * CHUNK, n, zero_hi, part_ptr + (first_row + p) * 8, BF16, False, BLOCK, CHUNK)


@triton.jit(do_not_specialize=["ntensors", "first_row"])
def stats_batch(
    tab_ptr,
    ntensors,
    part_ptr,
    first_row,
    zero_f32,
    zero_f16,
    zero_bf16,
    BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Many tensors of mixed dtypes, each tagged with its own (0 float32, 1 float16, 2 bfloat16, 3 float64,
    4 int64, 5 int32): the batches of tensors taken in hooks, where autocast mixes float32 and bfloat16 and a
    model's first module takes integer token ids. ``tab``: addresses[T], numels[T], first blocks[T], dtype
    tags[T], the float64 zero threshold's bits, tensor of each block[B]; program ``p`` writes the partial
    row ``first_row + p``. The branch is on one value per program, the same for all its elements."""
    p = tl.program_id(0).to(tl.int64)
    t = tl.load(tab_ptr + 4 * ntensors + 1 + p)
    address = tl.load(tab_ptr + t)
    n = tl.load(tab_ptr + ntensors + t)
    c = p - tl.load(tab_ptr + 2 * ntensors + t)
    code = tl.load(tab_ptr + 3 * ntensors + t)
    row = part_ptr + (first_row + p) * 8
    start = c * CHUNK
    if code == 2:
        _chunk(address.to(tl.pointer_type(tl.int16)), start, n, zero_bf16, row, True, False, BLOCK, CHUNK)
    elif code == 1:
        _chunk(address.to(tl.pointer_type(tl.float16)), start, n, zero_f16, row, False, False, BLOCK, CHUNK)
    elif code == 0:
        _chunk(address.to(tl.pointer_type(tl.float32)), start, n, zero_f32, row, False, False, BLOCK, CHUNK)
    else:
        z64 = tl.load(tab_ptr + 4 * ntensors).to(tl.float64, bitcast=True)  # the float64 zero threshold
        if code == 3:
            _chunk(address.to(tl.pointer_type(tl.float64)), start, n, z64, row, False, True, BLOCK, CHUNK)
        elif code == 4:
            _chunk(address.to(tl.pointer_type(tl.int64)), start, n, z64, row, False, True, BLOCK, CHUNK)
        else:
            _chunk(address.to(tl.pointer_type(tl.int32)), start, n, z64, row, False, True, BLOCK, CHUNK)


@triton.jit(do_not_specialize=["ntensors", "nblocks", "first_row"])
def adam_table(
    tab_ptr,
    ftab_ptr,
    ntensors,
    nblocks,
    part_ptr,
    first_row,
    zero_hi,
    DTYPE: tl.constexpr,
    BF16: tl.constexpr,
    BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Adam's ``update = (m*ic1) / (sqrt(v*ic2) + eps)`` and ``ratio = (m*ic1) / sqrt(v*ic2)`` (ratio 0 where
    m == 0), in fp32 with IEEE division and square root as the native kernel, never materialised.
    ``tab``: m addresses[T], v addresses[T], numels[T], first blocks[T], tensor of each block[B];
    ``ftab`` (float32): ic1[T], ic2[T], eps[T]. Block ``p`` writes the update's partial row
    ``first_row + p`` and the ratio's ``first_row + nblocks + p``."""
    p = tl.program_id(0).to(tl.int64)
    t = tl.load(tab_ptr + 4 * ntensors + p)
    m_base = tl.load(tab_ptr + t).to(tl.pointer_type(DTYPE))
    v_base = tl.load(tab_ptr + ntensors + t).to(tl.pointer_type(DTYPE))
    n = tl.load(tab_ptr + 2 * ntensors + t)
    start = (p - tl.load(tab_ptr + 3 * ntensors + t)) * CHUNK
    ic1 = tl.load(ftab_ptr + t)
    ic2 = tl.load(ftab_ptr + ntensors + t)
    adam_eps = tl.load(ftab_ptr + 2 * ntensors + t)
    _adam_chunk(
        m_base, v_base, start, n, ic1, ic2, adam_eps, zero_hi,
        part_ptr + (first_row + p) * 8, part_ptr + (first_row + nblocks + p) * 8, BF16, BLOCK, CHUNK,
    )  # fmt: skip


@triton.jit
def _adam_chunk(
    m_base, v_base, start, n, ic1, ic2, adam_eps, zero_hi, u_row, r_row,
    BF16: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """adam_table's work for one chunk: the update's partial row at ``u_row``, the ratio's at ``r_row``."""
    offs = tl.arange(0, BLOCK)
    u_fin = tl.zeros([BLOCK], dtype=tl.int32)
    u_inf = tl.zeros([BLOCK], dtype=tl.int32)
    u_zero = tl.zeros([BLOCK], dtype=tl.int32)
    u_s = tl.zeros([BLOCK], dtype=tl.float32)
    u_q = tl.zeros([BLOCK], dtype=tl.float32)
    u_mn = tl.full([BLOCK], float("inf"), dtype=tl.float32)
    u_mx = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    r_fin = tl.zeros([BLOCK], dtype=tl.int32)
    r_inf = tl.zeros([BLOCK], dtype=tl.int32)
    r_zero = tl.zeros([BLOCK], dtype=tl.int32)
    r_s = tl.zeros([BLOCK], dtype=tl.float32)
    r_q = tl.zeros([BLOCK], dtype=tl.float32)
    r_mn = tl.full([BLOCK], float("inf"), dtype=tl.float32)
    r_mx = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    for i in range(0, CHUNK, BLOCK):
        idx = start + i + offs
        inside = idx < n
        m = _load_f32(m_base, idx, inside, float("nan"), BF16)
        v = _load_f32(v_base, idx, inside, 0.0, BF16)
        update, ratio = _adam_values(m, v, ic1, ic2, adam_eps)
        u_fin, u_inf, u_zero, u_s, u_q, u_mn, u_mx = _accumulate(
            update, zero_hi, u_fin, u_inf, u_zero, u_s, u_q, u_mn, u_mx
        )
        r_fin, r_inf, r_zero, r_s, r_q, r_mn, r_mx = _accumulate(
            ratio, zero_hi, r_fin, r_inf, r_zero, r_s, r_q, r_mn, r_mx
        )
    length = tl.maximum(tl.minimum(n - start, CHUNK), 0)
    _store_partial(u_row, length, u_fin, u_inf, u_zero, u_s, u_q, u_mn, u_mx)
    _store_partial(r_row, length, r_fin, r_inf, r_zero, r_s, r_q, r_mn, r_mx)


@triton.jit
def _adam_values(m, v, ic1, ic2, adam_eps):
    """Adam's update and ratio of moments ``m``, ``v`` (IEEE division and square root, as the native
    kernel)."""
    mh = m * ic1
    den = tl.sqrt_rn(v * ic2)
    update = tl.div_rn(mh, den + adam_eps)
    ratio = tl.div_rn(mh, den + (mh == 0.0).to(tl.float32))
    return update, ratio


@triton.jit
def finalize(desc_ptr, part_ptr, out_ptr, ROWS: tl.constexpr):
    """Stage 2: program ``d`` reduces the partial rows of descriptor ``d`` (first, count, output row,
    numel) in order, in float64, and writes the 8 partials of the output row."""
    d = tl.program_id(0).to(tl.int64)
    first = tl.load(desc_ptr + d * 4)
    count = tl.load(desc_ptr + d * 4 + 1)
    out_row = tl.load(desc_ptr + d * 4 + 2)
    numel = tl.load(desc_ptr + d * 4 + 3)
    offs = tl.arange(0, ROWS)
    nans = tl.zeros([ROWS], dtype=tl.float64)
    infs = tl.zeros([ROWS], dtype=tl.float64)
    zeros = tl.zeros([ROWS], dtype=tl.float64)
    s = tl.zeros([ROWS], dtype=tl.float64)
    q = tl.zeros([ROWS], dtype=tl.float64)
    mn = tl.full([ROWS], float("inf"), dtype=tl.float64)
    mx = tl.full([ROWS], float("-inf"), dtype=tl.float64)
    i = count * 0  # an int64 counter: a `while`, as the bound is loaded (see the module docstring)
    while i < count:
        inside = i + offs < count
        row = part_ptr + (first + i + offs) * 8
        nans += tl.load(row + 0, mask=inside, other=0.0)
        infs += tl.load(row + 1, mask=inside, other=0.0)
        zeros += tl.load(row + 2, mask=inside, other=0.0)
        mn = tl.minimum(mn, tl.load(row + 3, mask=inside, other=float("inf")))
        mx = tl.maximum(mx, tl.load(row + 4, mask=inside, other=float("-inf")))
        s += tl.load(row + 5, mask=inside, other=0.0)
        q += tl.load(row + 6, mask=inside, other=0.0)
        i += ROWS
    out = out_ptr + out_row * 8
    tl.store(out + 0, numel.to(tl.float64))
    tl.store(out + 1, tl.sum(nans, axis=0))
    tl.store(out + 2, tl.sum(infs, axis=0))
    tl.store(out + 3, tl.sum(zeros, axis=0))
    tl.store(out + 4, tl.min(mn, axis=0))
    tl.store(out + 5, tl.max(mx, axis=0))
    tl.store(out + 6, tl.sum(s, axis=0))
    tl.store(out + 7, tl.sum(q, axis=0))


# ---------------------------------------------------------------------------------------------------------
# The fast variants (Tiling(kernel="fast"), judged by bench/gpu_kernel_sweep.py): the same partial rows, bit
# for bit, with fewer instructions and more bytes in flight per element. A chunk's whole blocks are read
# without masks, ``UNROLL`` blocks' loads issued before their sums, from addresses the host guarantees
# 16-byte aligned (so the loads are vectorised: the hint goes on the pointer, after the cast from the
# table's integer, where Triton's alignment analysis keeps it), and summed as if every value were finite: a
# sum, a sum of squares, min, max and the zero count, no NaN/Inf bookkeeping. Every lane adds its values in
# the order the base kernel does, so where they are all finite each lane's sums are the base kernel's. A
# NaN or an Inf leaves its lane's sum or sum of squares non-finite (as does an overflow, which the base
# kernel makes too): the chunk is then read again by the base kernel's code, whose partial row it stores.


@triton.jit
def _load_whole(ptr, BF16: tl.constexpr):
    """A whole block at ``ptr`` as float32, no mask (int16 bits when ``BF16``)."""
    if BF16:
        return (tl.load(ptr).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptr).to(tl.float32)


@triton.jit
def _accumulate_finite(x, zero_hi, n_zero, s, q, mn, mx):
    """:func:`_accumulate` for values taken as finite (checked at the chunk's end)."""
    n_zero += (tl.abs(x) <= zero_hi).to(tl.int32)
    s += x
    q += x * x
    mn = tl.minimum(mn, x)
    mx = tl.maximum(mx, x)
    return n_zero, s, q, mn, mx


@triton.jit
def _all_finite(s, q):
    """Whether every lane's sum and sum of squares is finite (a NaN compares false)."""
    bad = (~(tl.abs(s) < float("inf"))).to(tl.int32) + (~(tl.abs(q) < float("inf"))).to(tl.int32)
    return tl.sum(bad, axis=0) == 0


@triton.jit
def _chunk_fast(
    base,
    start,
    n,
    zero_hi,
    part_row,
    BF16: tl.constexpr,
    BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
    UNROLL: tl.constexpr,
):
    """:func:`_chunk`'s partial row (floating-point tensors), bit for bit, the fast way (see above)."""
    offs = tl.arange(0, BLOCK)
    length = tl.maximum(tl.minimum(n - start, CHUNK), 0)
    whole = length // BLOCK * BLOCK  # elements in whole blocks
    n_zero = tl.zeros([BLOCK], dtype=tl.int32)
    s = tl.zeros([BLOCK], dtype=tl.float32)
    q = tl.zeros([BLOCK], dtype=tl.float32)
    mn = tl.full([BLOCK], float("inf"), dtype=tl.float32)
    mx = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    i = length * 0  # an int64 counter: a `while`, as the bound is loaded (see the module docstring)
    while i + UNROLL * BLOCK <= whole:
        ptr = base + tl.max_contiguous(tl.multiple_of(start + i + offs, BLOCK), BLOCK)
        x0 = _load_whole(ptr, BF16)
        if UNROLL >= 2:
            x1 = _load_whole(ptr + BLOCK, BF16)
        if UNROLL >= 4:
            x2 = _load_whole(ptr + 2 * BLOCK, BF16)
            x3 = _load_whole(ptr + 3 * BLOCK, BF16)
        n_zero, s, q, mn, mx = _accumulate_finite(x0, zero_hi, n_zero, s, q, mn, mx)
        if UNROLL >= 2:
            n_zero, s, q, mn, mx = _accumulate_finite(x1, zero_hi, n_zero, s, q, mn, mx)
        if UNROLL >= 4:
            n_zero, s, q, mn, mx = _accumulate_finite(x2, zero_hi, n_zero, s, q, mn, mx)
            n_zero, s, q, mn, mx = _accumulate_finite(x3, zero_hi, n_zero, s, q, mn, mx)
        i += UNROLL * BLOCK
    if UNROLL > 1:  # the whole blocks left over, one at a time
        while i < whole:
            ptr = base + tl.max_contiguous(tl.multiple_of(start + i + offs, BLOCK), BLOCK)
            n_zero, s, q, mn, mx = _accumulate_finite(_load_whole(ptr, BF16), zero_hi, n_zero, s, q, mn, mx)
            i += BLOCK
    # the last, partial block, masked and with every value checked, as the base kernel reads it
    idx = start + i + offs
    x = _load_f32(base, idx, idx < start + length, float("nan"), BF16)
    t_fin = tl.zeros([BLOCK], dtype=tl.int32)
    t_inf = tl.zeros([BLOCK], dtype=tl.int32)
    t_fin, t_inf, n_zero, s, q, mn, mx = _accumulate(x, zero_hi, t_fin, t_inf, n_zero, s, q, mn, mx)
    if _all_finite(s, q):
        n_fin = t_fin + (whole // BLOCK).to(tl.int32)  # every value of the whole blocks was finite
        _store_partial(part_row, length, n_fin, t_inf, n_zero, s, q, mn, mx)
    else:
        _chunk(base, start, n, zero_hi, part_row, BF16, False, BLOCK, CHUNK)


@triton.jit(do_not_specialize=["n", "first_row"])
def stats_one_fast(
    x_ptr,
    n,
    part_ptr,
    first_row,
    zero_hi,
    BF16: tl.constexpr,
    BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
    UNROLL: tl.constexpr,
):
    """:func:`stats_one`, the fast way."""
    c = tl.program_id(0).to(tl.int64)
    row = part_ptr + (first_row + c) * 8
    _chunk_fast(x_ptr, c * CHUNK, n, zero_hi, row, BF16, BLOCK, CHUNK, UNROLL)


@triton.jit(do_not_specialize=["ntensors", "first_row"])
def stats_table_fast(
    tab_ptr,
    ntensors,
    part_ptr,
    first_row,
    zero_hi,
    DTYPE: tl.constexpr,
    BF16: tl.constexpr,
    BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
    UNROLL: tl.constexpr,
):
    """:func:`stats_table`, the fast way: every address in the table 16-byte aligned."""
    p = tl.program_id(0).to(tl.int64)
    t = tl.load(tab_ptr + 3 * ntensors + p)
    base = tl.multiple_of(tl.load(tab_ptr + t).to(tl.pointer_type(DTYPE)), 16)
    n = tl.load(tab_ptr + ntensors + t)
    c = p - tl.load(tab_ptr + 2 * ntensors + t)
    row = part_ptr + (first_row + p) * 8
    _chunk_fast(base, c * CHUNK, n, zero_hi, row, BF16, BLOCK, CHUNK, UNROLL)


@triton.jit(do_not_specialize=["ntensors", "first_row"])
def stats_batch_fast(
    tab_ptr,
    ntensors,
    part_ptr,
    first_row,
    zero_f32,
    zero_f16,
    zero_bf16,
    BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
    UNROLL: tl.constexpr,
):
    """:func:`stats_batch`, the fast way for its floating-point tensors: every address 16-byte aligned."""
    p = tl.program_id(0).to(tl.int64)
    t = tl.load(tab_ptr + 4 * ntensors + 1 + p)
    address = tl.load(tab_ptr + t)
    n = tl.load(tab_ptr + ntensors + t)
    c = p - tl.load(tab_ptr + 2 * ntensors + t)
    code = tl.load(tab_ptr + 3 * ntensors + t)
    row = part_ptr + (first_row + p) * 8
    start = c * CHUNK
    if code == 2:
        bf16 = tl.multiple_of(address.to(tl.pointer_type(tl.int16)), 16)
        _chunk_fast(bf16, start, n, zero_bf16, row, True, BLOCK, CHUNK, UNROLL)
    elif code == 1:
        f16 = tl.multiple_of(address.to(tl.pointer_type(tl.float16)), 16)
        _chunk_fast(f16, start, n, zero_f16, row, False, BLOCK, CHUNK, UNROLL)
    elif code == 0:
        f32 = tl.multiple_of(address.to(tl.pointer_type(tl.float32)), 16)
        _chunk_fast(f32, start, n, zero_f32, row, False, BLOCK, CHUNK, UNROLL)
    else:
        z64 = tl.load(tab_ptr + 4 * ntensors).to(tl.float64, bitcast=True)  # the float64 zero threshold
        if code == 3:
            _chunk(address.to(tl.pointer_type(tl.float64)), start, n, z64, row, False, True, BLOCK, CHUNK)
        elif code == 4:
            _chunk(address.to(tl.pointer_type(tl.int64)), start, n, z64, row, False, True, BLOCK, CHUNK)
        else:
            _chunk(address.to(tl.pointer_type(tl.int32)), start, n, z64, row, False, True, BLOCK, CHUNK)


@triton.jit(do_not_specialize=["ntensors", "nblocks", "first_row"])
def adam_table_fast(
    tab_ptr,
    ftab_ptr,
    ntensors,
    nblocks,
    part_ptr,
    first_row,
    zero_hi,
    DTYPE: tl.constexpr,
    BF16: tl.constexpr,
    BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
    UNROLL: tl.constexpr,
):
    """:func:`adam_table`, the fast way: every address 16-byte aligned."""
    p = tl.program_id(0).to(tl.int64)
    t = tl.load(tab_ptr + 4 * ntensors + p)
    m_base = tl.multiple_of(tl.load(tab_ptr + t).to(tl.pointer_type(DTYPE)), 16)
    v_base = tl.multiple_of(tl.load(tab_ptr + ntensors + t).to(tl.pointer_type(DTYPE)), 16)
    n = tl.load(tab_ptr + 2 * ntensors + t)
    start = (p - tl.load(tab_ptr + 3 * ntensors + t)) * CHUNK
    ic1 = tl.load(ftab_ptr + t)
    ic2 = tl.load(ftab_ptr + ntensors + t)
    adam_eps = tl.load(ftab_ptr + 2 * ntensors + t)
    u_row = part_ptr + (first_row + p) * 8
    r_row = part_ptr + (first_row + nblocks + p) * 8
    offs = tl.arange(0, BLOCK)
    length = tl.maximum(tl.minimum(n - start, CHUNK), 0)
    whole = length // BLOCK * BLOCK
    u_zero = tl.zeros([BLOCK], dtype=tl.int32)
    u_s = tl.zeros([BLOCK], dtype=tl.float32)
    u_q = tl.zeros([BLOCK], dtype=tl.float32)
    u_mn = tl.full([BLOCK], float("inf"), dtype=tl.float32)
    u_mx = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    r_zero = tl.zeros([BLOCK], dtype=tl.int32)
    r_s = tl.zeros([BLOCK], dtype=tl.float32)
    r_q = tl.zeros([BLOCK], dtype=tl.float32)
    r_mn = tl.full([BLOCK], float("inf"), dtype=tl.float32)
    r_mx = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    i = length * 0  # an int64 counter: a `while`, as the bound is loaded (see the module docstring)
    while i + UNROLL * BLOCK <= whole:
        at = tl.max_contiguous(tl.multiple_of(start + i + offs, BLOCK), BLOCK)
        m0 = _load_whole(m_base + at, BF16)
        v0 = _load_whole(v_base + at, BF16)
        if UNROLL >= 2:
            m1 = _load_whole(m_base + at + BLOCK, BF16)
            v1 = _load_whole(v_base + at + BLOCK, BF16)
        if UNROLL >= 4:
            m2 = _load_whole(m_base + at + 2 * BLOCK, BF16)
            v2 = _load_whole(v_base + at + 2 * BLOCK, BF16)
            m3 = _load_whole(m_base + at + 3 * BLOCK, BF16)
            v3 = _load_whole(v_base + at + 3 * BLOCK, BF16)
        update, ratio = _adam_values(m0, v0, ic1, ic2, adam_eps)
        u_zero, u_s, u_q, u_mn, u_mx = _accumulate_finite(update, zero_hi, u_zero, u_s, u_q, u_mn, u_mx)
        r_zero, r_s, r_q, r_mn, r_mx = _accumulate_finite(ratio, zero_hi, r_zero, r_s, r_q, r_mn, r_mx)
        if UNROLL >= 2:
            update, ratio = _adam_values(m1, v1, ic1, ic2, adam_eps)
            u_zero, u_s, u_q, u_mn, u_mx = _accumulate_finite(update, zero_hi, u_zero, u_s, u_q, u_mn, u_mx)
            r_zero, r_s, r_q, r_mn, r_mx = _accumulate_finite(ratio, zero_hi, r_zero, r_s, r_q, r_mn, r_mx)
        if UNROLL >= 4:
            update, ratio = _adam_values(m2, v2, ic1, ic2, adam_eps)
            u_zero, u_s, u_q, u_mn, u_mx = _accumulate_finite(update, zero_hi, u_zero, u_s, u_q, u_mn, u_mx)
            r_zero, r_s, r_q, r_mn, r_mx = _accumulate_finite(ratio, zero_hi, r_zero, r_s, r_q, r_mn, r_mx)
            update, ratio = _adam_values(m3, v3, ic1, ic2, adam_eps)
            u_zero, u_s, u_q, u_mn, u_mx = _accumulate_finite(update, zero_hi, u_zero, u_s, u_q, u_mn, u_mx)
            r_zero, r_s, r_q, r_mn, r_mx = _accumulate_finite(ratio, zero_hi, r_zero, r_s, r_q, r_mn, r_mx)
        i += UNROLL * BLOCK
    if UNROLL > 1:
        while i < whole:
            at = tl.max_contiguous(tl.multiple_of(start + i + offs, BLOCK), BLOCK)
            update, ratio = _adam_values(
                _load_whole(m_base + at, BF16), _load_whole(v_base + at, BF16), ic1, ic2, adam_eps
            )
            u_zero, u_s, u_q, u_mn, u_mx = _accumulate_finite(update, zero_hi, u_zero, u_s, u_q, u_mn, u_mx)
            r_zero, r_s, r_q, r_mn, r_mx = _accumulate_finite(ratio, zero_hi, r_zero, r_s, r_q, r_mn, r_mx)
            i += BLOCK
    idx = start + i + offs
    inside = idx < start + length
    update, ratio = _adam_values(
        _load_f32(m_base, idx, inside, float("nan"), BF16),
        _load_f32(v_base, idx, inside, 0.0, BF16),
        ic1,
        ic2,
        adam_eps,
    )
    u_fin = tl.zeros([BLOCK], dtype=tl.int32)
    u_inf = tl.zeros([BLOCK], dtype=tl.int32)
    r_fin = tl.zeros([BLOCK], dtype=tl.int32)
    r_inf = tl.zeros([BLOCK], dtype=tl.int32)
    u_fin, u_inf, u_zero, u_s, u_q, u_mn, u_mx = _accumulate(
        update, zero_hi, u_fin, u_inf, u_zero, u_s, u_q, u_mn, u_mx
    )
    r_fin, r_inf, r_zero, r_s, r_q, r_mn, r_mx = _accumulate(
        ratio, zero_hi, r_fin, r_inf, r_zero, r_s, r_q, r_mn, r_mx
    )
    if _all_finite(u_s, u_q) & _all_finite(r_s, r_q):
        blocks = (whole // BLOCK).to(tl.int32)
        _store_partial(u_row, length, u_fin + blocks, u_inf, u_zero, u_s, u_q, u_mn, u_mx)
        _store_partial(r_row, length, r_fin + blocks, r_inf, r_zero, r_s, r_q, r_mn, r_mx)
    else:
        _adam_chunk(m_base, v_base, start, n, ic1, ic2, adam_eps, zero_hi, u_row, r_row, BF16, BLOCK, CHUNK)


# ---------------------------------------------------------------------------------------------------------
# grad_probe fingerprints


@triton.jit(do_not_specialize=["ntensors", "first_row"])
def bins_table(
    tab_ptr,
    ntensors,
    bounds_ptr,
    part_ptr,
    first_row,
    NB: tl.constexpr,
    NBP: tl.constexpr,
    DTYPE: tl.constexpr,
    BF16: tl.constexpr,
    BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Per block, elements ``<= bound[j]`` for each of the ``NB`` bounds (already rounded to the tensor's
    dtype), then elements ``== 0``: ``NB + 1`` float64 counts at row ``first_row + p`` (width NB + 1).
    ``NBP``: a power of two > NB; padded bounds are NaN, which no element is <= to."""
    p = tl.program_id(0).to(tl.int64)
    t = tl.load(tab_ptr + 3 * ntensors + p)
    base = tl.load(tab_ptr + t).to(tl.pointer_type(DTYPE))
    n = tl.load(tab_ptr + ntensors + t)
    start = (p - tl.load(tab_ptr + 2 * ntensors + t)) * CHUNK
    j = tl.arange(0, NBP)
    bounds = tl.load(bounds_ptr + j, mask=j < NB, other=float("nan"))
    offs = tl.arange(0, BLOCK)
    below = tl.zeros([NBP, BLOCK], dtype=tl.int32)
    zeros = tl.zeros([BLOCK], dtype=tl.int32)
    for i in range(0, CHUNK, BLOCK):
        idx = start + i + offs
        x = _load_f32(base, idx, idx < n, float("nan"), BF16)
        below += (x[None, :] <= bounds[:, None]).to(tl.int32)
        zeros += (x == 0.0).to(tl.int32)
    row = part_ptr + (first_row + p) * (NB + 1)
    tl.store(row + j, tl.sum(below, axis=1).to(tl.float64), mask=j < NB)
    tl.store(row + NB, tl.sum(zeros, axis=0).to(tl.float64))


@triton.jit(do_not_specialize=["ntensors"])
def gather_table(
    tab_ptr, ntensors, pos_ptr, out_ptr, DTYPE: tl.constexpr, BF16: tl.constexpr, BLOCK: tl.constexpr
):
    """Program ``t`` copies tensor ``t`` at its sample positions into float32 output.
    ``tab``: addresses[T], sample counts[T], first position[T] (in ``pos``), first output element[T]."""
    t = tl.program_id(0).to(tl.int64)
    base = tl.load(tab_ptr + t).to(tl.pointer_type(DTYPE))
    k = tl.load(tab_ptr + ntensors + t)
    first_pos = tl.load(tab_ptr + 2 * ntensors + t)
    first_out = tl.load(tab_ptr + 3 * ntensors + t)
    offs = tl.arange(0, BLOCK)
    i = k * 0  # an int64 counter: a `while`, as the bound is loaded (see the module docstring)
    while i < k:
        inside = i + offs < k
        pos = tl.load(pos_ptr + first_pos + i + offs, mask=inside, other=0)
        x = _load_f32(base, pos, inside, 0.0, BF16)
        tl.store(out_ptr + first_out + i + offs, x, mask=inside)
        i += BLOCK


@triton.jit(do_not_specialize=["ntensors"])
def signs_table(tab_ptr, ntensors, out_ptr, DTYPE: tl.constexpr, BF16: tl.constexpr, BYTES: tl.constexpr):
    """Bit ``i`` (most significant first, numpy.packbits order) of a tensor's bitmap is ``x[i] > 0``.
    ``tab``: addresses[T], numels[T], first blocks[T], first output byte[T], tensor of each block[B];
    a block packs ``8 * BYTES`` elements."""
    p = tl.program_id(0).to(tl.int64)
    t = tl.load(tab_ptr + 4 * ntensors + p)
    base = tl.load(tab_ptr + t).to(tl.pointer_type(DTYPE))
    n = tl.load(tab_ptr + ntensors + t)
    first_byte = (p - tl.load(tab_ptr + 2 * ntensors + t)) * BYTES
    out = out_ptr + tl.load(tab_ptr + 3 * ntensors + t)
    byte = first_byte + tl.arange(0, BYTES)
    bit = tl.arange(0, 8)
    idx = byte[:, None] * 8 + bit[None, :]
    x = _load_f32(base, idx, idx < n, 0.0, BF16)
    weight = (128 >> bit).to(tl.int32)
    packed = tl.sum((x > 0.0).to(tl.int32) * weight[None, :], axis=1)
    tl.store(out + byte, packed.to(tl.uint8), mask=byte * 8 < n)


__all__ = [
    "DESC_WIDTH",
    "PARTIAL_WIDTH",
    "adam_table",
    "adam_table_fast",
    "bins_table",
    "finalize",
    "gather_table",
    "signs_table",
    "stats_batch_fast",
    "stats_one",
    "stats_one_fast",
    "stats_table",
    "stats_table_fast",
    "triton",
]
