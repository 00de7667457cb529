"""A small MLP trained with MindSpore (PyNative mode, CPU) and monitored by trainmon: one line after the
optimizer is built. Runs in the MindSpore venv (``scripts/setup_mindspore.sh`` creates ``.venv-ms``):

    .venv-ms/bin/python integrations/mindspore/train.py --steps 50 --nan-step 40 --logdir runs/ms

Then ``tensorboard --logdir runs`` and ``trainmon analyze runs/ms`` (names ``mlp.poison.output``, where the
NaN was injected, as the origin; ``.venv-ms/bin/python -m trainmon`` in the MindSpore venv) and
``trainmon dump ls runs/ms``.
"""

from __future__ import annotations

import argparse

import mindspore as ms
import numpy as np
from mindspore import nn

import trainmon.mindspore

# What trainmon records (msprobe monitor keys; a JSON/YAML file path works as well): activations and their
# gradients of every Cell, weight gradients at the optimizer, parameters, AdamWeightDecay's moments.
MONITOR_CONFIG = {
    "xy_distribution": True,
    "wg_distribution": True,
    "param_distribution": True,
    "mv_distribution": True,
    "format": ["tensorboard", "csv"],
    # a NaN/Inf is an anomaly; the Cell where it started is dumped at its next occurrence
    "alert": {"rules": [{"rule": "nan"}], "dump": True},
}


class Poison(nn.Cell):
    """Identity, except at the step chosen by --nan-step: then one element becomes NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.active = False

    def construct(self, x: ms.Tensor) -> ms.Tensor:
        if not self.active:
            return x
        mask = np.zeros(x.shape, dtype=np.float32)
        mask.flat[0] = np.nan
        return x + ms.Tensor(mask)


class MLP(nn.Cell):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.fc1 = nn.Dense(16, width)
        self.act = nn.GELU()
        self.poison = Poison()
        self.fc2 = nn.Dense(width, 4)

    def construct(self, x: ms.Tensor) -> ms.Tensor:
        return self.fc2(self.poison(self.act(self.fc1(x))))


class Model(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = MLP()

    def construct(self, x: ms.Tensor) -> ms.Tensor:
        return self.mlp(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--nan-step", type=int, default=None, help="inject a NaN in mlp.poison at this step")
    parser.add_argument("--logdir", default=None, help="run directory (default runs/<date>-<time>)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    ms.set_seed(args.seed)
    net = Model()
    optimizer = nn.AdamWeightDecay(net.trainable_params(), learning_rate=1e-3, weight_decay=0.01)
    monitor = trainmon.mindspore.attach(net, optimizer, config=MONITOR_CONFIG, logdir=args.logdir)

    loss_fn = nn.MSELoss()
    grad_fn = ms.value_and_grad(lambda x, y: loss_fn(net(x), y), None, optimizer.parameters)
    rng = np.random.default_rng(args.seed)
    target = rng.standard_normal((16, 4)).astype(np.float32)
    for step in range(args.steps):
        net.mlp.poison.active = step == args.nan_step
        x = rng.standard_normal((32, 16)).astype(np.float32)
        loss, grads = grad_fn(ms.Tensor(x), ms.Tensor(np.tanh(x @ target)))
        monitor.track("loss", loss)  # before the optimizer call, which ends the step
        optimizer(grads)
    monitor.close()
    print(f"trainmon: {args.steps} steps recorded in {monitor.run_dir}")


if __name__ == "__main__":
    main()
