"""Cost of trainmon.mindspore on the MindSpore example (integrations/mindspore/train.py), PyNative, CPU.

Run in the MindSpore venv: ``.venv-ms/bin/python bench/mindspore_overhead.py [--steps 20]``. Prints the
median step time without the monitor, with it attached on every step, and the time of one partials row
(the MindSpore-ops stats of one tensor), as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mindspore as ms
import numpy as np
from mindspore import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integrations" / "mindspore"))
import train as example  # noqa: E402 - the example's model and config

import trainmon.mindspore  # noqa: E402
from trainmon.mindspore.stats import partials_row  # noqa: E402


def step_times(steps: int, monitored: bool, logdir: str) -> list[float]:
    ms.set_seed(0)
    net = example.Model()
    opt = nn.AdamWeightDecay(net.trainable_params(), learning_rate=1e-3)
    mon = (
        trainmon.mindspore.attach(net, opt, config=example.MONITOR_CONFIG, logdir=logdir)
        if monitored
        else None
    )
    loss_fn = nn.MSELoss()
    grad_fn = ms.value_and_grad(lambda a, b: loss_fn(net(a), b), None, opt.parameters)
    x = ms.Tensor(np.random.default_rng(0).standard_normal((32, 16)).astype(np.float32))
    y = ms.Tensor(np.zeros((32, 4), np.float32))
    times = []
    for _ in range(steps + 3):  # 3 warm-up steps
        t = time.perf_counter()
        loss, grads = grad_fn(x, y)
        opt(grads)
        loss.asnumpy()  # the step is done
        times.append(time.perf_counter() - t)
    if mon is not None:
        mon.close()
    return times[3:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    x = ms.Tensor(np.random.default_rng(1).standard_normal(2048).astype(np.float32))
    partials_row(x).asnumpy()
    t = time.perf_counter()
    for _ in range(50):
        row = partials_row(x)
    row.asnumpy()
    per_row = (time.perf_counter() - t) / 50
    with tempfile.TemporaryDirectory() as tmp:
        off = statistics.median(step_times(args.steps, False, tmp))
        on = statistics.median(step_times(args.steps, True, tmp))
    print(json.dumps({"step_ms_off": off * 1e3, "step_ms_on": on * 1e3, "partials_row_ms": per_row * 1e3}))


if __name__ == "__main__":
    main()
