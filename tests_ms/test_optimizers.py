"""Adam moments and Adam's update/ratio (``ur_distribution``) of MindSpore optimizers equal numpy
references computed from the optimizer's own state; optimizers without moments are skipped with a warning."""

from __future__ import annotations

import logging

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn
from test_stats import assert_partials, reference

import trainmon.mindspore

CONFIG = {"mv_distribution": True, "ur_distribution": True, "format": ["csv"]}


def train_dense(optimizer_cls, logdir, steps: int = 3):
    ms.set_seed(0)
    net = nn.Dense(4, 3)
    opt = optimizer_cls(net.trainable_params(), learning_rate=1e-2)
    mon = trainmon.mindspore.attach(net, opt, config=CONFIG, logdir=logdir)
    grad_fn = ms.value_and_grad(lambda x: (net(x) ** 2).sum(), None, opt.parameters)
    rng = np.random.default_rng(1)
    for _ in range(steps):
        _, grads = grad_fn(ms.Tensor(rng.standard_normal((2, 4)).astype(np.float32)))
        opt(grads)
    record = mon.latest_record()
    mon.close()
    return opt, {(r.kind, r.name): p for r, p in zip(record.rows, record.partials, strict=True)}


@pytest.mark.parametrize(
    "optimizer_cls, first, second",
    [(nn.Adam, "moment1", "moment2"), (nn.AdamWeightDecay, "moments1", "moments2")],
)
def test_moments_update_and_ratio_equal_numpy(tmp_path, optimizer_cls, first, second):
    opt, rows = train_dense(optimizer_cls, tmp_path / "run")
    eps = float(np.asarray(opt.eps.asnumpy()).reshape(-1)[0])
    if optimizer_cls is nn.Adam:  # bias correction from beta^t, held by the optimizer
        c1 = 1.0 - float(opt.beta1_power.asnumpy().reshape(-1)[0])
        c2 = 1.0 - float(opt.beta2_power.asnumpy().reshape(-1)[0])
        assert 0 < c1 < 1 and 0 < c2 < 1
    else:  # AdamWeightDecay corrects nothing
        c1 = c2 = 1.0
    for param, m, v in zip(opt.parameters, getattr(opt, first), getattr(opt, second), strict=True):
        m_np, v_np = m.asnumpy(), v.asnumpy()
        assert_partials(rows["exp_avg", param.name], reference(m_np, 1e-8))
        assert_partials(rows["exp_avg_sq", param.name], reference(v_np, 1e-8))
        m_hat = m_np.astype(np.float32) / np.float32(c1)
        root = np.sqrt(v_np.astype(np.float32) / np.float32(c2))
        want_update = reference(m_hat / (root + np.float32(eps)), 1e-8)
        want_ratio = reference(m_hat / root, 1e-8)
        for got, want in ((rows["update", param.name], want_update), (rows["ratio", param.name], want_ratio)):
            np.testing.assert_array_equal(got[:4], want[:4])
            np.testing.assert_allclose(got[4:], want[4:], rtol=1e-5, atol=1e-7)


def test_optimizer_without_moments_is_skipped_with_one_warning(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        _, rows = train_dense(nn.SGD, tmp_path / "run")
    assert not {k for k, _ in rows} & {"exp_avg", "exp_avg_sq", "update", "ratio"}
    warnings = [r.getMessage() for r in caplog.records if "keeps no Adam moments" in r.getMessage()]
    assert warnings == ["trainmon: SGD keeps no Adam moments; mv/ur statistics are skipped"]
