"""Cell hooks are in place on collected steps only: not collected steps run without them (MindSpore's
autograd is slower with backward hooks), and collected steps after idle ones are recorded in full."""

from __future__ import annotations

import mindspore as ms
import numpy as np
from conftest import CONFIG, Net
from mindspore import nn

import trainmon.mindspore


def test_hooks_follow_the_schedule(tmp_path):
    ms.set_seed(0)
    net = Net()
    opt = nn.SGD(net.trainable_params(), learning_rate=1e-2)
    config = dict(CONFIG, start_step=1, step_interval=2, alert={})
    mon = trainmon.mindspore.attach(net, opt, config=config, logdir=tmp_path / "run")
    grad_fn = ms.value_and_grad(lambda x: (net(x) ** 2).sum(), None, opt.parameters)
    installed, recorded = [], []
    for _ in range(5):
        installed.append(bool(net.fc1._forward_hook) and bool(net.fc1._backward_hook))
        _, grads = grad_fn(ms.Tensor(np.ones((3, 4), np.float32)))
        opt(grads)
        record = mon.latest_record()
        recorded.append(record.step if record is not None else None)
    mon.close()
    assert installed == [False, True, False, True, False]
    assert recorded == [None, 1, 1, 3, 3]
    full = {(r.kind, r.name) for r in mon.latest_record().rows}
    assert {("actv", "fc1.output"), ("actv_grad", "fc1.output_grad"), ("grad_reduced", "fc1.weight")} <= full
    assert not net.fc1._forward_hook and not net.fc1._backward_hook  # close() removes them


def test_module_ranks_leave_out_the_other_ranks(tmp_path):
    """One process is rank 0: ``module_ranks: [1]`` collects nothing on it (no Cell hooks, no record), and
    ``[0]`` collects as without the key."""
    got = {}
    for ranks in ([1], [0]):
        ms.set_seed(0)
        net = Net()
        opt = nn.SGD(net.trainable_params(), learning_rate=1e-2)
        config = dict(CONFIG, module_ranks=ranks, alert={})
        mon = trainmon.mindspore.attach(net, opt, config=config, logdir=tmp_path / f"run{ranks[0]}")
        grad_fn = ms.value_and_grad(lambda x, net=net: (net(x) ** 2).sum(), None, opt.parameters)
        hooked = []
        for _ in range(2):
            hooked.append(bool(net.fc1._forward_hook))
            _, grads = grad_fn(ms.Tensor(np.ones((3, 4), np.float32)))
            opt(grads)
        record = mon.latest_record()
        mon.close()
        got[ranks[0]] = (hooked, None if record is None else record.step)
    assert got == {1: ([False, False], None), 0: ([True, True], 1)}
