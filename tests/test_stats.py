"""Golden tests of the stats kernel (trainmon/stats.py) against a float64 numpy reference, for both the
native CPU kernel ("auto") and the portable torch path ("torch")."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.conftest import assert_matches, reference_partials
from trainmon import stats
from trainmon.run.records import MAX, MIN, N_PARTIALS, SUM, SUMSQ, merge

INF = float("inf")
NAN = float("nan")


# ---------------------------------------------------------------------------------------------------------
# reference


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """Exact float64/int64 values of a tensor (bf16/f16 upcast exactly)."""
    t = t.detach()
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.float()
    if t.dtype == torch.bool:
        t = t.to(torch.int64)
    return t.numpy()


def check(t: torch.Tensor, eps: float = 1e-8, rtol: float = 1e-6) -> torch.Tensor:
    got = stats.partials(t, eps)
    assert got.dtype == torch.float64 and got.shape == (N_PARTIALS,)
    a = to_numpy(t)
    assert_matches(got, reference_partials(a, eps), a, rtol)
    return got


@pytest.fixture(params=["auto", "torch", "triton"])
def backend(request):
    """The native CPU kernel, the portable torch backend (NPUs) and the Triton kernels (GPUs; run here by
    Triton's interpreter) must all give the reference values."""
    previous = stats.get_backend()
    if request.param == "triton":
        request.getfixturevalue("triton_tiling")
    stats.set_backend(request.param)
    yield request.param
    stats.set_backend(previous)


def with_specials(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    flat = x.view(-1)
    n = flat.numel()
    for i, v in zip((3, 17, 18, 100, n // 2, n - 1), (NAN, INF, -INF, NAN, 0.0, -INF), strict=True):
        if i < n:
            flat[i] = v
    return x


# ---------------------------------------------------------------------------------------------------------
# build / backend selection


def test_native_extension_is_built():
    assert stats.native_available(), "trainmon.stats._statskernel did not import: run `pip install -e .`"
    assert stats.native_isa() in ("avx512", "avx2", "baseline")


def test_backend_env_var_and_setter():
    code = "from trainmon import stats; print(stats.get_backend())"
    env = dict(os.environ, TRAINMON_STATS_BACKEND="torch")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "torch"
    with pytest.raises(ValueError):
        stats.set_backend("cuda")


# ---------------------------------------------------------------------------------------------------------
# golden values


def test_float32_normal_1m(backend):
    torch.manual_seed(0)
    x = torch.randn(1 << 20)
    got = check(x)
    assert got[0] == 1 << 20 and got[1] == 0 and got[2] == 0


def test_float32_offset_sizes(backend):
    """Odd sizes exercise the vector tails; a mean offset makes sum relative errors meaningful."""
    torch.manual_seed(1)
    for n in (1, 2, 15, 16, 17, 31, 33, 63, 64, 65, 511, 512, 513, 1000, 4099, 100_003):
        check(torch.randn(n) * 3 + 1.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_nan_inf_mixes(backend, dtype):
    torch.manual_seed(2)
    for n in (5, 40, 1000, 70_001):
        check(with_specials(torch.randn(n).to(dtype)))
    check(torch.tensor([NAN, INF, -INF, 1.0, -2.0, 0.0], dtype=dtype))
    check(torch.tensor([INF, INF, -INF], dtype=dtype))  # no finite element


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_all_nan_all_zero(backend, dtype):
    for n in (1, 7, 64, 1001):
        got = check(torch.full((n,), NAN, dtype=dtype))
        assert got.tolist() == [n, n, 0, 0, INF, -INF, 0.0, 0.0]
        got = check(torch.zeros(n, dtype=dtype))
        assert got.tolist() == [n, 0, 0, n, 0.0, 0.0, 0.0, 0.0]
        got = check(-torch.zeros(n, dtype=dtype))  # -0.0 is a zero too
        assert got[3] == n


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int64, torch.bool])
def test_empty_and_scalar(backend, dtype):
    got = check(torch.empty(0, 3, dtype=dtype))
    assert got.tolist() == [0, 0, 0, 0, INF, -INF, 0.0, 0.0]
    got = check(torch.tensor(1, dtype=dtype))
    assert got[0] == 1 and got[MIN] == 1 and got[MAX] == 1


def test_scalar_values(backend):
    assert check(torch.tensor(-2.5)).tolist() == [1, 0, 0, 0, -2.5, -2.5, -2.5, 6.25]
    assert check(torch.tensor(NAN)).tolist() == [1, 1, 0, 0, INF, -INF, 0.0, 0.0]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_all_bit_patterns(backend, dtype):
    """Every float16 / bfloat16 value (subnormals, +-0, +-Inf, NaNs): exact conversion and counts."""
    bits = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    x = bits.view(dtype)
    for eps in (1e-8, 0.0, 1e-7, 6e-8, 1e-3, 0.5):
        got, a = stats.partials(x, eps), to_numpy(x)
        np.testing.assert_array_equal(got[:SUM].numpy(), reference_partials(a, eps)[:SUM])
    # sums accumulate in fp32: keep bf16 magnitudes where squares fit (the kernel's documented range)
    x = x[~(x.float().abs() > 1e18)]  # NaNs stay
    check(x)
    check(x[1:-2])  # unaligned start and odd length


def test_half_normal(backend):
    torch.manual_seed(3)
    for dtype in (torch.float16, torch.bfloat16):
        check(with_specials(torch.randn(1 << 20).to(dtype) * 4))


def test_float64(backend):
    torch.manual_seed(4)
    check(with_specials(torch.randn(300_001, dtype=torch.float64) * 1e100), rtol=1e-12)
    check(torch.tensor([1e-300, -1e150, 5e-324], dtype=torch.float64), eps=0.0, rtol=1e-12)


@pytest.mark.parametrize(
    "dtype", [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool]
)
def test_integers_exact(backend, dtype):
    torch.manual_seed(5)
    if dtype == torch.bool:
        x = torch.rand(10_007) < 0.3
    else:
        info = torch.iinfo(dtype)
        lo, hi = max(info.min, -30_000), min(info.max, 30_000)
        x = torch.randint(lo, hi + 1, (10_007,), dtype=torch.int64).to(dtype)
        x[0], x[1] = info.min if dtype != torch.int64 else lo, info.max if dtype != torch.int64 else hi
    for eps in (1e-8, 0.0, 1.0, 2.5, -1.0):
        got, ref = stats.partials(x, eps).numpy(), reference_partials(to_numpy(x), eps)
        np.testing.assert_array_equal(got[:SUMSQ], ref[:SUMSQ])  # int64 sums: exact
        # sumsq is exact while squares fit in 53 bits (int16 and narrower); float64 above
        np.testing.assert_allclose(got[SUMSQ], ref[SUMSQ], rtol=0 if dtype.itemsize <= 2 else 1e-12)


@pytest.mark.filterwarnings("ignore::UserWarning")  # quantized tensors are deprecated
def test_quantized_and_sparse(backend):
    q = torch.quantize_per_tensor(torch.tensor([1.0, -2.0, 0.0]), 0.1, 0, torch.qint8)
    assert stats.partials(q).tolist() == [3, 0, 0, 1, -2.0, 1.0, -1.0, 5.0]
    with pytest.raises(TypeError):
        stats.partials(torch.eye(3).to_sparse())
    with pytest.raises(TypeError):
        stats.partials_many_into(
            [torch.eye(3).to_sparse()], torch.zeros(1, N_PARTIALS, dtype=torch.float64), 0
        )


def test_complex_is_summarised_by_magnitude(backend):
    z = torch.tensor([3 + 4j, 0j, complex(NAN, 1)], dtype=torch.complex64)
    got = stats.partials(z)
    assert got.tolist() == [3, 1, 0, 1, 0.0, 5.0, 5.0, 25.0]


# ---------------------------------------------------------------------------------------------------------
# layout, eps, autograd


def test_non_contiguous(backend):
    torch.manual_seed(6)
    x = with_specials(torch.randn(300, 257))
    for v in (
        x.t(),
        x[:, 1:200],
        x[::3],
        x[:, ::2],
        x.view(3, 100, 257).permute(2, 0, 1),
        x[5],
        x[:, 7],
        x[:1].expand(4, 257),
        x.view(1, 300, 257, 1).to(memory_format=torch.channels_last),
    ):
        assert_matches(stats.partials(v), reference_partials(v.numpy()), v.numpy())
    h = x.to(torch.bfloat16)
    v = h.t()[3:]
    assert_matches(stats.partials(v), reference_partials(to_numpy(v)), to_numpy(v))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_eps_boundaries(backend, dtype):
    """|x| <= eps decided exactly as in float64, although eps is not representable in the dtype."""
    for eps in (1e-8, 1e-6, 1e-3, 0.1, 0.0):
        e = torch.tensor(eps, dtype=torch.float64).to(dtype)  # nearest value, may be above or below eps
        up = torch.nextafter(e, torch.tensor(INF, dtype=dtype))
        down = torch.nextafter(e, torch.tensor(-INF, dtype=dtype))
        x = torch.stack([e, up, down, -e, -up, -down, e * 0, -(e * 0)]).repeat(9)  # 72 elements
        # counts, min, max (squares of subnormals underflow in fp32 accumulation: sums not checked)
        np.testing.assert_array_equal(
            stats.partials(x, eps)[:SUM].numpy(), reference_partials(to_numpy(x), eps)[:SUM]
        )
    check(torch.tensor([NAN, INF, 0.0], dtype=dtype), eps=INF)  # inf <= inf is a zero, NaN never
    check(torch.tensor([0.0, 1.0], dtype=dtype), eps=-1.0)  # negative eps: nothing is a zero


def test_requires_grad_creates_no_graph(backend):
    w = torch.randn(64, 33, requires_grad=True)
    y = w * 2  # non-leaf with a grad_fn
    for t in (w, y, y.t()):
        got = stats.partials(t)
        assert got.grad_fn is None and not got.requires_grad
        out = torch.zeros(3, N_PARTIALS, dtype=torch.float64)
        stats.partials_many_into([t, w], out, 1)
        assert out.grad_fn is None and not out.requires_grad
    m, v = torch.randn(10, requires_grad=True), torch.rand(10, requires_grad=True)
    out = torch.zeros(2, N_PARTIALS, dtype=torch.float64)
    stats.adam_update_ratio_into(m, v, 0.9, 0.99, 1e-8, out, 0, 1)
    assert out.grad_fn is None
    assert w.grad is None
    assert_matches(stats.partials(y), reference_partials(y.detach().numpy()), y.detach().numpy())


def test_out_validation(backend):
    x = torch.randn(10)
    with pytest.raises(ValueError):
        stats.partials_into(x, torch.zeros(2, N_PARTIALS, dtype=torch.float32), 0)
    with pytest.raises(ValueError):
        stats.partials_into(x, torch.zeros(2, 7, dtype=torch.float64), 0)
    with pytest.raises(IndexError):
        stats.partials_into(x, torch.zeros(2, N_PARTIALS, dtype=torch.float64), 2)
    with pytest.raises(IndexError):
        stats.partials_many_into([x, x], torch.zeros(2, N_PARTIALS, dtype=torch.float64), 1)
    out = torch.zeros(4, N_PARTIALS, dtype=torch.float64)
    stats.partials_into(x, out, 3)
    assert out[:3].abs().sum() == 0 and out[3, 0] == 10


# ---------------------------------------------------------------------------------------------------------
# batched, threads, merge


def _mixed_tensors() -> list[torch.Tensor]:
    torch.manual_seed(7)
    big = torch.randn(700, 1000)
    return [
        with_specials(torch.randn(1000)),
        torch.randn(33, 17).to(torch.bfloat16),
        torch.empty(0),
        big,
        big.t()[1:],  # non-dense view: copied
        torch.randn(5).to(torch.float16),
        torch.randint(-9, 9, (77,), dtype=torch.int32),
        torch.tensor(3.0, dtype=torch.float64),
        torch.rand(40) > 0.5,
        torch.tensor([1 + 1j, 2j], dtype=torch.complex64),  # not native: torch path inside the batch
        with_specials(torch.randn(300_007)),
    ]


def test_batched_equals_per_tensor(backend):
    ts = _mixed_tensors()
    out = torch.full((len(ts) + 3, N_PARTIALS), -7.0, dtype=torch.float64)
    stats.partials_many_into(ts, out, 2)
    assert (out[:2] == -7).all() and (out[-1] == -7).all()
    for i, t in enumerate(ts):
        one = stats.partials(t)  # may be split across threads differently: sums agree to rounding
        a = to_numpy(t) if not t.is_complex() else np.abs(t.numpy())
        assert_matches(out[2 + i], one.numpy(), a)
        assert_matches(out[2 + i], reference_partials(a), a)


@pytest.fixture
def low_thread_threshold():
    """Make the native kernel split even small calls across threads (boundaries, merge of pieces)."""
    if not stats.native_available():
        pytest.skip("native kernel not built")
    from trainmon.stats import _statskernel, native

    old_py, old_c = native.THREAD_MIN_NUMEL, _statskernel.set_thread_min(1)
    native.THREAD_MIN_NUMEL = 1
    old_threads = torch.get_num_threads()
    torch.set_num_threads(3)  # more threads than cores is fine and exercises 3-way splits
    yield
    torch.set_num_threads(old_threads)
    native.THREAD_MIN_NUMEL = old_py
    _statskernel.set_thread_min(old_c)


def test_threaded_native_matches_reference(low_thread_threshold):
    from trainmon.stats import _statskernel

    if "OpenMP" in torch.__config__.parallel_info():  # the kernel runs on torch's OpenMP pool
        assert _statskernel.threading_runtime() is not None
    stats.set_backend("auto")
    torch.manual_seed(8)
    for n in (1, 5, 64, 65, 1000, 77_777):
        for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int16):
            x = torch.randn(n) * 100
            x = with_specials(x).to(dtype) if dtype.is_floating_point else x.to(dtype)
            a = to_numpy(x)
            assert_matches(stats.partials(x), reference_partials(a), a)
    ts = _mixed_tensors()
    out = torch.zeros(len(ts), N_PARTIALS, dtype=torch.float64)
    stats.partials_many_into(ts, out, 0)
    for i, t in enumerate(ts):
        a = to_numpy(t) if not t.is_complex() else np.abs(t.numpy())
        assert_matches(out[i], reference_partials(a), a)
    m, v = torch.randn(10_001), torch.rand(10_001) + 0.01
    _check_adam(m, v, 0.5, 0.7, 1e-8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_merge_of_chunks_equals_whole(backend, dtype):
    torch.manual_seed(9)
    x = with_specials(torch.randn(100_003) * 5).to(dtype)
    bounds = [0, 1, 17, 4096, 50_000, 50_001, 99_999, 100_003]
    pieces = [x[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)] + [x[:0]]
    out = torch.zeros(len(pieces), N_PARTIALS, dtype=torch.float64)
    stats.partials_many_into(pieces, out, 0)
    merged = merge(out.numpy())
    whole = stats.partials(x).numpy()
    np.testing.assert_array_equal(merged[:SUM], whole[:SUM])
    a = to_numpy(x)
    scale = np.abs(a[np.isfinite(a)]).astype(np.float64).sum()
    np.testing.assert_allclose(merged[SUM:], whole[SUM:], rtol=1e-6, atol=1e-6 * scale)
    assert_matches(merged, reference_partials(a), a)


# ---------------------------------------------------------------------------------------------------------
# Adam update / ratio


def _check_adam(m, v, c1, c2, eps, stats_eps=1e-8, rtol=2e-6):
    out = torch.zeros(3, N_PARTIALS, dtype=torch.float64)
    stats.adam_update_ratio_into(m, v, c1, c2, eps, out, 2, 0, stats_eps)
    md, vd = to_numpy(m).astype(np.float64).ravel(), to_numpy(v).astype(np.float64).ravel()
    c1f, c2f = float(c1), float(c2)
    with np.errstate(divide="ignore", invalid="ignore"):
        den = np.sqrt(vd / c2f)
        # where m == 0 the ratio's root gets 1 added: 0/0 is 0 (a never-updated parameter), m/0 stays inf
        update, ratio = (md / c1f) / (den + eps), (md / c1f) / (den + (md == 0))
    for row, ref_vals in ((2, update), (0, ratio)):
        ref = reference_partials(ref_vals, stats_eps)
        got = out[row].numpy()
        np.testing.assert_array_equal(got[:MIN], ref[:MIN])  # counts exact
        np.testing.assert_allclose(got[MIN : MAX + 1], ref[MIN : MAX + 1], rtol=rtol)  # fp32 arithmetic
        scale = np.abs(ref_vals[np.isfinite(ref_vals)]).sum()
        assert abs(got[SUM] - ref[SUM]) <= rtol * scale
        assert abs(got[SUMSQ] - ref[SUMSQ]) <= 2 * rtol * ref[SUMSQ]
    assert out[1].abs().sum() == 0  # untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_adam_update_ratio(backend, dtype):
    torch.manual_seed(10)
    for n in (1, 31, 1000, 262_147):
        m = (torch.randn(n) * 1e-3).to(dtype)
        v = (torch.rand(n) * 1e-5 + 1e-8).to(dtype)
        _check_adam(m, v, 1 - 0.9**3, 1 - 0.999**3, 1e-8)
        _check_adam(m, v, torch.tensor(0.1), torch.tensor(0.01), 1e-6)  # 0-d tensor bias corrections
    m = torch.tensor([0.0, 1.0, -1.0, 0.0, 2.0], dtype=dtype)
    v = torch.tensor([0.0, 0.0, 4.0, 1.0, NAN], dtype=dtype)  # ratio: 0/0 -> 0 (never updated), 1/0 -> inf
    _check_adam(m, v, 1.0, 1.0, 1e-8)


def test_adam_non_contiguous(backend):
    torch.manual_seed(11)
    m, v = torch.randn(64, 30).t(), (torch.rand(64, 30) + 0.1).t()
    _check_adam(m, v, 0.5, 0.25, 1e-8)


# ---------------------------------------------------------------------------------------------------------
# the torch path never reads device values on the host


class _RecordOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_torch_path_has_no_host_reads():
    previous = stats.get_backend()
    stats.set_backend("torch")
    try:
        torch.manual_seed(12)
        ts = [
            with_specials(torch.randn(1000)),
            torch.randn(50).to(torch.bfloat16),
            torch.randint(0, 5, (20,)),
            torch.rand(9) > 0.5,
            torch.empty(0),
            torch.tensor(2.0),
            torch.randn(4, dtype=torch.complex64),
        ]
        out = torch.zeros(len(ts) + 2, N_PARTIALS, dtype=torch.float64)
        with _RecordOps() as rec:
            for i, t in enumerate(ts):
                stats.partials_into(t, out, i, eps=1e-3)
                stats.partials(t)
            stats.partials_many_into(ts, out, 0)
            stats.adam_update_ratio_into(ts[0].abs(), ts[0] ** 2, torch.tensor(0.9), 0.99, 1e-8, out, 7, 8)
        assert rec.ops, "dispatch mode recorded nothing"
        assert not [op for op in rec.ops if "_local_scalar_dense" in op], rec.ops
    finally:
        stats.set_backend(previous)


def test_device_tensors_take_the_torch_path_without_host_reads(backend):
    """Meta tensors stand in for accelerator tensors: any host read or native call on them would fail."""
    out = torch.zeros(6, N_PARTIALS, dtype=torch.float64, device="meta")
    ts = [
        torch.empty(10, device="meta"),
        torch.empty(3, 4, device="meta", dtype=torch.bfloat16).t(),
        torch.empty(0, device="meta"),
        torch.empty(5, dtype=torch.int32, device="meta"),
        torch.empty(5, dtype=torch.bool, device="meta"),
    ]
    for i, t in enumerate(ts):
        stats.partials_into(t, out, i)
    stats.partials_many_into(ts, out, 0)
    stats.adam_update_ratio_into(ts[0], ts[0], 0.9, torch.tensor(0.9, device="meta"), 1e-8, out, 4, 5)
    assert stats.partials(ts[1]).device.type == "meta"
    with pytest.raises(ValueError):  # out must live on the tensor's device
        stats.partials_into(ts[0], torch.zeros(1, N_PARTIALS, dtype=torch.float64), 0)


# ---------------------------------------------------------------------------------------------------------
# every instruction set of the native kernel


def test_every_isa_matches_reference():
    if not stats.native_available():
        pytest.skip("native kernel not built")
    from trainmon.stats import _statskernel

    previous_backend = stats.get_backend()
    stats.set_backend("auto")
    best = _statskernel.ISA
    torch.manual_seed(13)
    cases = [with_specials(torch.randn(n) * 7).to(dt) for n in (3, 100, 4099) for dt in stats._FLOAT_TYPES]
    bits = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    bf16 = bits.view(torch.bfloat16)
    cases += [bits.view(torch.float16), bf16[~(bf16.float().abs() > 1e18)]]
    try:
        for isa in ("baseline", "avx2", "avx512"):
            chosen = _statskernel.set_isa(isa)
            for x in cases:
                a = to_numpy(x)
                assert_matches(stats.partials(x), reference_partials(a), a)
                assert_matches(stats.partials(x, 1e-3), reference_partials(a, 1e-3), a)
            m, v = torch.randn(1027), torch.rand(1027) + 0.01
            _check_adam(m, v, 0.3, 0.6, 1e-8)
            _check_adam(m.to(torch.float16), v.to(torch.float16), 0.3, 0.6, 1e-8)
            assert chosen in ("baseline", "avx2", "avx512")
    finally:
        _statskernel.set_isa(best)
        stats.set_backend(previous_backend)


def test_adam_ratio_of_a_never_updated_parameter_is_zero_not_nan(backend):
    """m = v = 0 (a gradient that was always exactly zero, like an attention key bias): ratio 0, update 0."""
    m, v = torch.zeros(1000), torch.zeros(1000)
    m[:10], v[:10] = 1e-3, 1e-6
    out = torch.zeros(2, N_PARTIALS, dtype=torch.float64)
    stats.adam_update_ratio_into(m, v, 0.1, 0.001, 1e-8, out, 0, 1)
    upd, ratio = out.tolist()
    assert upd[1] == ratio[1] == 0  # no NaN
    assert ratio[0] == 1000 and ratio[3] == 990  # 990 elements are exactly zero
    assert ratio[5] == pytest.approx(1e-3 / 0.1 / math.sqrt(1e-6 / 0.001), rel=1e-6)
