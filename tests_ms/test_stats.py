"""The MindSpore partials equal a numpy reference, and the monitor's records equal the tensors' own."""

from __future__ import annotations

import sys

import mindspore as ms
import numpy as np
import pytest
from conftest import train
from mindspore import nn

from trainmon.mindspore.stats import DeviceRows, partials_row
from trainmon.run.records import MAX, MIN, NANS, NUMEL, SUM, ZEROS


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


@pytest.mark.parametrize("hold_bytes", [0, 1 << 30])
def test_rows_are_read_in_one_host_copy(hold_bytes):
    rows = DeviceRows(1e-8, hold_bytes=hold_bytes)
    # more than one compiled call's worth (32), empty tensors between, several shapes and dtypes
    arrays = [mixed(64 + s % 3, seed=s) for s in range(40)]
    arrays[3] = np.zeros((0, 4), np.float32)
    arrays[37] = arrays[37].astype(np.float16)
    for i, a in enumerate(arrays):
        rows.add(ms.Tensor(a))
        if i % 5 == 4:
            rows.settle()
    host = rows.to_host()
    assert host.shape == (40, 8) and host.dtype == np.float64 and len(rows) == 0
    for got, a in zip(host, arrays, strict=True):
        assert_partials(got, reference(a, 1e-8))
    assert rows.to_host().shape == (0, 8)


def test_held_tensors_are_reduced_when_asked_not_when_read():
    """reduce() fixes the values: a parameter changed in place afterwards keeps its old statistics."""
    rows = DeviceRows(1e-8, hold_bytes=1 << 30)
    param = ms.Parameter(ms.Tensor(np.arange(6, dtype=np.float32)), name="w")
    rows.add(param)
    rows.settle()  # under the hold: still waiting
    rows.reduce()
    param.set_data(ms.Tensor(np.full(6, 7.0, np.float32)))
    rows.add(param)
    host = rows.to_host()
    assert_partials(host[0], reference(np.arange(6, dtype=np.float32), 1e-8))
    assert_partials(host[1], reference(np.full(6, 7.0, np.float32), 1e-8))


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
    # parameters are read before the update: step 2's origin is step 1's updated value, exactly
    before = {(r.kind, r.name): p for r, p in zip(last.rows, last.partials, strict=True)}
    after_prev = {(r.kind, r.name): p for r, p in zip(records[1].rows, records[1].partials, strict=True)}
    for param in opt.parameters:
        origin = before["param_origin", param.name]
        np.testing.assert_array_equal(origin, after_prev["param_updated", param.name])
        assert not np.array_equal(origin, before["param_updated", param.name])
    assert "torch" not in sys.modules  # the MindSpore path never imports torch


def test_latest_is_the_step_stats_mapping_of_the_torch_monitor(tmp_path):
    from conftest import CONFIG, Net

    import trainmon.mindspore

    ms.set_seed(0)
    net = Net()
    opt = nn.SGD(net.trainable_params(), learning_rate=1e-2)
    mon = trainmon.mindspore.attach(net, opt, config=CONFIG, logdir=tmp_path / "run")
    assert mon.latest() is None
    grad_fn = ms.value_and_grad(lambda x: net(x).sum(), None, opt.parameters)
    x = np.arange(12, dtype=np.float32).reshape(3, 4) / 10
    _, grads = grad_fn(ms.Tensor(x))
    opt(grads)
    stats = mon.latest()
    mon.close()
    weight = opt.parameters[0]
    got = stats[f"param_updated/{weight.name}"]
    w = weight.asnumpy().astype(np.float64)
    assert got["max"] == pytest.approx(w.max(), rel=1e-6) and got["min"] == pytest.approx(w.min(), rel=1e-6)
    assert got["norm"] == pytest.approx(np.sqrt((w * w).sum()), rel=1e-5)
    assert got["nans"] == 0
    assert stats.step == 0 and "actv/fc1.output" in stats


def test_a_tensor_added_twice_is_reduced_once_and_its_row_repeated(monkeypatch):
    from trainmon.mindspore import stats

    calls = []
    real = stats.device_partials_blocks
    def counted(xs, eps):
        calls.append(len(xs))
        return real(xs, eps)

    monkeypatch.setattr(stats, "device_partials_blocks", counted)
    rows = DeviceRows(1e-8, hold_bytes=1 << 30)
    a, b = ms.Tensor(mixed(50, seed=1)), ms.Tensor(mixed(70, seed=2))
    for x in (a, b, a, a):
        rows.add(x)
    rows.reduce()
    rows.add(a)  # after a reduce: a new row of its own
    host = rows.to_host()
    assert calls == [2, 1]
    want_a, want_b = reference(a.asnumpy(), 1e-8), reference(b.asnumpy(), 1e-8)
    for got, want in zip(host, (want_a, want_b, want_a, want_a, want_a), strict=True):
        assert_partials(got, want)
