"""Cost of trainmon.mindspore on MindSpore PyNative training (CPU here), as ratios of paired runs.

Run in the MindSpore venv: ``.venv-ms/bin/python bench/mindspore_overhead.py [--steps 30] [--repeats 3]``.
Two workloads: the example's MLP (``integrations/mindspore/train.py``: 16-64-4, batch 32, 44 rows a step)
and a wider one (``--width 512 --depth 4``, batch 256). Modes, each run in turn within one process, repeated:
``off`` (no monitor), ``idle`` (attached, no step collected), ``on`` (every step: activations and their
gradients, weight gradients, parameters, moments), ``on+probe`` (also grad_probe L2 fingerprints). Prints
the median step time of each mode and the median of the per-repeat ratios to ``off``, as JSON.
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

MODES = {
    "off": None,
    "idle": dict(example.MONITOR_CONFIG, start_step=10**9),
    "on": example.MONITOR_CONFIG,
    "on+probe": dict(example.MONITOR_CONFIG, grad_probe={"enable": True, "grad_level": "L2"}),
}


class Wide(nn.Cell):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.layers = nn.SequentialCell(
            [nn.SequentialCell([nn.Dense(width, width), nn.GELU()]) for _ in range(depth)]
        )
        self.head = nn.Dense(width, 4)

    def construct(self, x: ms.Tensor) -> ms.Tensor:
        return self.head(self.layers(x))


def step_times(workload: tuple[int, int], steps: int, config: dict | None, logdir: str) -> list[float]:
    width, depth = workload
    ms.set_seed(0)
    net = example.MLP() if width == 0 else Wide(width, depth)
    opt = nn.AdamWeightDecay(net.trainable_params(), learning_rate=1e-3)
    mon = trainmon.mindspore.attach(net, opt, config=config, logdir=logdir) if config is not None else None
    loss_fn = nn.MSELoss()
    grad_fn = ms.value_and_grad(lambda a, b: loss_fn(net(a), b), None, opt.parameters)
    batch, features = (32, 16) if width == 0 else (256, width)
    x = ms.Tensor(np.random.default_rng(0).standard_normal((batch, features)).astype(np.float32))
    y = ms.Tensor(np.zeros((batch, 4), np.float32))
    times = []
    for _ in range(steps + 3):  # 3 warm-up steps (graph compiles)
        t = time.perf_counter()
        loss, grads = grad_fn(x, y)
        opt(grads)
        loss.asnumpy()  # the step is done
        times.append(time.perf_counter() - t)
    if mon is not None:
        mon.close()
    return times[3:]


def measure(workload: tuple[int, int], steps: int, repeats: int, tmp: str) -> dict:
    medians: dict[str, list[float]] = {mode: [] for mode in MODES}
    for rep in range(repeats):
        for mode, config in MODES.items():
            logdir = f"{tmp}/{workload}-{rep}-{mode}"
            medians[mode].append(statistics.median(step_times(workload, steps, config, logdir)))
    out: dict = {"step_ms": {m: round(statistics.median(v) * 1e3, 2) for m, v in medians.items()}}
    out["ratio_to_off"] = {
        m: round(statistics.median(a / b for a, b in zip(v, medians["off"], strict=True)), 3)
        for m, v in medians.items()
        if m != "off"
    }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=4)
    args = parser.parse_args()
    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    with tempfile.TemporaryDirectory() as tmp:
        wide = (args.width, args.depth)
        result = {
            "example_mlp": measure((0, 0), args.steps, args.repeats, tmp),
            f"wide_{args.width}x{args.depth}": measure(wide, args.steps, args.repeats, tmp),
        }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
