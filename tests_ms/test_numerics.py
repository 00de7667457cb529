"""The monitor never changes training numerics: losses and final weights are bitwise those of a run
without it, on every step collected or not, whether the step's tensors are held or reduced at once."""

from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from conftest import CONFIG, Net
from mindspore import nn

import trainmon.mindspore
from trainmon.mindspore import monitor as ms_monitor


def run(logdir, monitored: bool, steps: int = 5):
    ms.set_seed(0)
    net = Net()
    opt = nn.AdamWeightDecay(net.trainable_params(), learning_rate=1e-2)
    config = dict(CONFIG, step_interval=2, grad_probe={"enable": True, "grad_level": "L2"})
    mon = trainmon.mindspore.attach(net, opt, config=config, logdir=logdir) if monitored else None
    loss_fn = nn.MSELoss()
    grad_fn = ms.value_and_grad(lambda x, y: loss_fn(net(x), y), None, opt.parameters)
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(steps):
        x = ms.Tensor(rng.standard_normal((3, 4)).astype(np.float32))
        y = ms.Tensor(rng.standard_normal((3, 2)).astype(np.float32))
        loss, grads = grad_fn(x, y)
        if mon is not None:
            mon.track("loss", loss)
        opt(grads)
        losses.append(loss.asnumpy().tobytes())
    if mon is not None:
        mon.close()
    return losses, [p.asnumpy().tobytes() for p in opt.parameters]


@pytest.mark.parametrize("hold_bytes", [0, ms_monitor.CPU_HOLD_BYTES])
def test_losses_and_weights_are_bitwise_those_without_the_monitor(tmp_path, monkeypatch, hold_bytes):
    monkeypatch.setattr(ms_monitor, "CPU_HOLD_BYTES", hold_bytes)
    off = run(None, monitored=False)
    on = run(tmp_path / "run", monitored=True)
    assert on == off
    assert (tmp_path / "run" / "rank_0").is_dir()
