"""The MindSpore partials equal a numpy reference, and the monitor's records equal the tensors' own."""

from __future__ import annotations

import sys

import mindspore as ms
import numpy as np
import pytest
from conftest import train

from trainmon.mindspore.stats import DeviceRows, partials_row
from trainmon.records import MAX, MIN, NANS, NUMEL, SUM, ZEROS


def reference(a: np.ndarray, eps: float) -> np.ndarray:
    """numel, nans, infs, zeros (|x| <= eps in float64), then min/max/sum/sumsq of the finite elements."""
    x = np.asarray(a, dtype=np.float64).ravel()
    f = x[np.isfinite(x)]
    return np.array(
        [
            x.size,
            np.isnan(x).sum(),
            np.isinf(x).sum(),
            (np.abs(x) <= eps).sum(),
            f.min() if f.size else np.inf,
            f.max() if f.size else -np.inf,
            f.sum(),
            (f * f).sum(),
        ]
    )


def assert_partials(got: np.ndarray, want: np.ndarray) -> None:
    np.testing.assert_array_equal(got[: MIN + 2], want[: MIN + 2])  # counts, min, max: exact
    np.testing.assert_allclose(got[SUM:], want[SUM:], rtol=2e-6, atol=1e-6)  # float32 reductions


def mixed(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    a = rng.standard_normal(n).astype(np.float32) * 3
    a[::7] = 0.0
    a[1::11] = np.nan
    a[2::13] = np.inf
    a[3::17] = -np.inf
    if n > 6:
        a[4] = np.float32(0.1)  # float32(0.1) > 0.1: not a zero at eps=0.1, as the torch kernel decides
        a[5] = -np.float32(9e-9)  # below eps=1e-8: a zero
    return a


@pytest.mark.parametrize("shape", [(1000,), (3, 5, 7), (1,)])
def test_float32_partials_equal_numpy(shape):
    a = mixed(int(np.prod(shape)) if shape != (1,) else 1, seed=len(shape)).reshape(shape)
    got = partials_row(ms.Tensor(a), eps=1e-8).asnumpy()
    assert_partials(got, reference(a, 1e-8))


def test_eps_and_float16_and_int32():
    a = mixed(500, seed=3)
    assert_partials(partials_row(ms.Tensor(a), eps=0.5).asnumpy(), reference(a, 0.5))
    assert reference(a, 0.1)[ZEROS] == reference(a, 0.0999)[ZEROS]  # the float32 0.1 is above eps=0.1
    assert_partials(partials_row(ms.Tensor(a), eps=0.1).asnumpy(), reference(a, 0.1))
    h = mixed(300, seed=4).astype(np.float16)
    assert_partials(partials_row(ms.Tensor(h), eps=1e-3).asnumpy(), reference(h, 1e-3))
    i = np.arange(-50, 50, dtype=np.int32)
    assert_partials(partials_row(ms.Tensor(i), eps=1e-8).asnumpy(), reference(i, 1e-8))


def test_no_finite_element_and_empty():
    a = np.array([np.nan, np.inf, -np.inf], dtype=np.float32)
    got = partials_row(ms.Tensor(a)).asnumpy()
    np.testing.assert_array_equal(got, [3, 1, 2, 0, np.inf, -np.inf, 0, 0])
    empty = partials_row(ms.Tensor(np.zeros((0, 4), np.float32))).asnumpy()
    np.testing.assert_array_equal(empty, [0, 0, 0, 0, np.inf, -np.inf, 0, 0])


def test_rows_are_read_in_one_host_copy():
    rows = DeviceRows()
    arrays = [mixed(64, seed=s) for s in range(5)]
    for a in arrays:
        rows.add(ms.Tensor(a), 1e-8)
    host = rows.to_host()
    assert host.shape == (5, 8) and host.dtype == np.float64 and len(rows) == 0
    for got, a in zip(host, arrays, strict=True):
        assert_partials(got, reference(a, 1e-8))


def test_records_hold_the_statistics_of_the_network_tensors(tmp_path):
    records, net, opt = train(tmp_path / "run", steps=3)
    assert [r.step for r in records] == [0, 1, 2]
    last = records[-1]
    by_key = {(r.kind, r.name): p for r, p in zip(last.rows, last.partials, strict=True)}
    for param, m1, m2 in zip(opt.parameters, opt.moments1, opt.moments2, strict=True):
        assert_partials(by_key["param_updated", param.name], reference(param.asnumpy(), 1e-8))
        assert_partials(by_key["exp_avg", param.name], reference(m1.asnumpy(), 1e-8))
        assert_partials(by_key["exp_avg_sq", param.name], reference(m2.asnumpy(), 1e-8))
    kinds = {r.kind for r in last.rows}
    assert kinds == {
        "actv",
        "actv_grad",
        "scalar",
        "grad_reduced",
        "param_origin",
        "param_updated",
        "exp_avg",
        "exp_avg_sq",
    }
    names = [r.name for r in last.rows if r.kind == "actv"]
    assert names[:4] == ["fc1.input", "fc1.output", "act.input", "act.output"]
    grad = by_key["actv_grad", "fc2.output_grad"]
    assert grad[NUMEL] == 6 and grad[NANS] == 0 and grad[ZEROS] <= grad[NUMEL] and grad[MAX] >= grad[MIN]
    assert "torch" not in sys.modules  # the MindSpore path never imports torch
