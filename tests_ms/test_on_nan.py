"""``alert.on_nan`` under MindSpore: raise and exit act at the end of the NaN step, from the optimizer call;
skip and ``capture: exact``, which need the PyTorch monitor's pre-update check, are refused at attach."""

from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from conftest import CONFIG, NAN_STEP, Net
from mindspore import nn

import trainmon.mindspore
from trainmon.anomaly.alerts import TrainingNaNError
from trainmon.config import ConfigError


def _train(logdir, alert: dict, steps: int = 4, done: list[int] | None = None) -> list[int]:
    """Train with a NaN at NAN_STEP; the steps whose optimizer call returned (also appended to ``done``)."""
    ms.set_seed(0)
    net = Net()
    opt = nn.AdamWeightDecay(net.trainable_params(), learning_rate=1e-2)
    config = {**CONFIG, "alert": {**CONFIG["alert"], **alert}}
    mon = trainmon.mindspore.attach(net, opt, config=config, logdir=logdir)
    loss_fn = nn.MSELoss()
    grad_fn = ms.value_and_grad(lambda x, y: loss_fn(net(x), y), None, opt.parameters)
    rng = np.random.default_rng(0)
    done = [] if done is None else done
    try:
        for step in range(steps):
            net.bad.poisoned = step == NAN_STEP
            x = ms.Tensor(rng.standard_normal((3, 4)).astype(np.float32))
            y = ms.Tensor(rng.standard_normal((3, 2)).astype(np.float32))
            _, grads = grad_fn(x, y)
            opt(grads)
            done.append(step)
    finally:
        mon.close()
    return done


def test_on_nan_raise_stops_training_at_the_nan_step(tmp_path):
    done: list[int] = []
    expected = rf"nan in actv bad.output \(nans=1\) at step {NAN_STEP} on rank 0"
    with pytest.raises(TrainingNaNError, match=expected):
        _train(tmp_path / "run", {"on_nan": "raise"}, done=done)
    assert done == list(range(NAN_STEP))  # raised from the optimizer call of the NaN step


def test_on_nan_exit_exits_with_the_configured_code(tmp_path):
    with pytest.raises(SystemExit) as stopped:
        _train(tmp_path / "run", {"on_nan": "exit", "exit_code": 7})
    assert stopped.value.code == 7


def test_on_nan_continue_trains_through(tmp_path):
    assert _train(tmp_path / "run", {"on_nan": "continue"}) == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("alert", "key"), [({"on_nan": "skip"}, "alert.on_nan"), ({"capture": "exact"}, "alert.capture")]
)
def test_what_needs_the_pre_update_check_is_refused_at_attach(tmp_path, alert, key):
    net = Net()
    opt = nn.SGD(net.trainable_params(), learning_rate=1e-2)
    with pytest.raises(ConfigError) as err:
        trainmon.mindspore.attach(net, opt, config={**CONFIG, "alert": alert}, logdir=tmp_path / "run")
    assert err.value.key == key and "not supported by trainmon.mindspore" in str(err.value)
    assert not (tmp_path / "run").exists()
