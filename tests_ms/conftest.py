"""Shared pieces of the MindSpore tests (run in .venv-ms: ``.venv-ms/bin/python -m pytest tests_ms``)."""

from __future__ import annotations

from pathlib import Path

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn

ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")

NAN_STEP = 2
STEPS = 4


class Poison(nn.Cell):
    """Identity until ``poisoned``: then one element of the output becomes NaN (PyNative runs Python)."""

    def __init__(self) -> None:
        super().__init__()
        self.poisoned = False

    def construct(self, x: ms.Tensor) -> ms.Tensor:
        if self.poisoned:
            mask = np.zeros(x.shape, dtype=np.float32)
            mask.flat[0] = np.nan
            return x + ms.Tensor(mask)
        return x


class Net(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Dense(4, 8)
        self.act = nn.ReLU()
        self.bad = Poison()
        self.fc2 = nn.Dense(8, 2)

    def construct(self, x: ms.Tensor) -> ms.Tensor:
        return self.fc2(self.bad(self.act(self.fc1(x))))


CONFIG = {
    "xy_distribution": True,
    "wg_distribution": True,
    "param_distribution": True,
    "mv_distribution": True,
    "format": ["tensorboard", "csv"],
    "alert": {"rules": [{"rule": "nan"}], "dump": True},
}


def train(logdir: Path, steps: int = STEPS, nan_step: int | None = None):
    """Train ``Net`` with AdamWeightDecay under the monitor; the records of every step and the final net."""
    import trainmon.mindspore

    ms.set_seed(0)
    net = Net()
    opt = nn.AdamWeightDecay(net.trainable_params(), learning_rate=1e-2)
    mon = trainmon.mindspore.attach(net, opt, config=CONFIG, logdir=logdir)
    loss_fn = nn.MSELoss()
    grad_fn = ms.value_and_grad(lambda x, y: loss_fn(net(x), y), None, opt.parameters)
    rng = np.random.default_rng(0)
    records = []
    for step in range(steps):
        net.bad.poisoned = step == nan_step
        x = ms.Tensor(rng.standard_normal((3, 4)).astype(np.float32))
        y = ms.Tensor(rng.standard_normal((3, 2)).astype(np.float32))
        loss, grads = grad_fn(x, y)
        mon.track("loss", loss)
        opt(grads)
        mon.flush()  # the step's anomalies are found (and their dumps requested) before the next step
        records.append(mon.latest_record())
    mon.close()
    return records, net, opt


@pytest.fixture(scope="session")
def nan_run(tmp_path_factory) -> tuple[Path, list]:
    run = tmp_path_factory.mktemp("ms") / "nanrun"
    records, _, _ = train(run, nan_step=NAN_STEP)
    return run, records
