"""The same small model trained in PyTorch and in MindSpore, for ``trainmon compare``.

Both runs start from the same weights (a seeded numpy ``.npz``, created when absent), see the same seeded
numpy batches and use plain SGD, so they agree up to float32 rounding. Each framework runs in its own
virtual environment (MindSpore needs numpy<2 and must not share the torch venv). Two modes:

``--mode stats`` (the statistics store, the monitor at full coverage: activations, their gradients, weight
gradients, parameters)::

    .venv/bin/python    integrations/mindspore/compare_frameworks.py --framework torch --mode stats \
        --out runs/pt
    .venv-ms/bin/python integrations/mindspore/compare_frameworks.py --framework mindspore --mode stats \
        --out runs/ms
    .venv/bin/python -m trainmon compare runs/pt runs/ms        # no divergence; no map needed

``--mode probe`` (the default: grad_probe fingerprints of the weight gradients)::

    .venv/bin/python    integrations/mindspore/compare_frameworks.py --framework torch --out runs/pt
    .venv-ms/bin/python integrations/mindspore/compare_frameworks.py --framework mindspore --out runs/ms
    .venv/bin/python -m trainmon compare runs/pt runs/ms --map integrations/mindspore/torch_to_mindspore.yaml

Injected changes, in the run that gets them only: ``--inject-step S`` (or ``--inject wgrad --inject-step S``)
adds seeded noise to ``fc2.weight``'s gradient from step S on, after backward (one weight gradient, nothing
else); ``--inject forward --inject-step S`` makes the ``act`` module's output 0.1% larger from step S on
(one module's forward). ``trainmon compare`` names step S, the tensor and the phase: the weight gradient of
``fc2`` (weight-gradient), the output of ``act`` (forward).

The LayerNorm's parameters are ``norm.weight``/``norm.bias`` in PyTorch and ``norm.gamma``/``norm.beta`` in
MindSpore, hence the name map; ``sample_seed: shape`` makes both runs sample the same positions of a
renamed parameter (the default seed includes the name, and ``trainmon compare`` leaves the sign and cosine
of pairs sampled at different positions out).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import numpy as np

IN, HIDDEN, OUT = 16, 64, 8
BATCH = 32
LR = 0.1
LN_EPS = 1e-5  # MindSpore's LayerNorm defaults to 1e-7, PyTorch's to 1e-5
INJECT_PARAM = "fc2.weight"
DATA_SEED, NOISE_SEED, WEIGHT_SEED = 1, 2, 0
# PyTorch name -> MindSpore name (the shipped torch_to_mindspore.yaml says the same)
MS_NAMES = {"norm.weight": "norm.gamma", "norm.bias": "norm.beta"}

FORWARD_CHANGE = 1e-3  # --inject forward: act's output this much larger
STATS_CONFIG = {
    "format": ["tensorboard"],
    "tensorboard_ranks": [],
    "xy_distribution": True,
    "wg_distribution": True,
    "param_distribution": True,
}
MONITOR_CONFIG = {
    "format": ["csv"],
    "grad_probe": {
        "enable": True,
        "grad_level": "L2",
        "sample_size": 256,  # fc1.weight (1024 elements) and fc2.weight (512) are sampled, not copied
        "sample_seed": "shape",  # norm.weight and norm.gamma sampled at the same positions
    },
}


def initial_weights(path: Path) -> dict[str, np.ndarray]:
    """The initial weights, by PyTorch name (Linear and Dense both store weight as (out, in)); the file
    is created from a fixed seed when absent (atomically: concurrent runs may create it at once)."""
    if not path.exists():
        rng = np.random.default_rng(WEIGHT_SEED)

        def uniform(shape: tuple[int, ...], fan_in: int) -> np.ndarray:
            bound = 1.0 / np.sqrt(fan_in)
            return rng.uniform(-bound, bound, shape).astype(np.float32)

        weights = {
            "fc1.weight": uniform((HIDDEN, IN), IN),
            "fc1.bias": uniform((HIDDEN,), IN),
            "norm.weight": (1.0 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32),
            "norm.bias": (0.1 * rng.standard_normal(HIDDEN)).astype(np.float32),
            "fc2.weight": uniform((OUT, HIDDEN), HIDDEN),
            "fc2.bias": uniform((OUT,), HIDDEN),
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".npz", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **weights)
        os.replace(tmp, path)
    with np.load(path) as data:
        return {k: data[k].astype(np.float32) for k in data.files}


def batches(steps: int):
    """The same (x, y) every run: y = tanh(x @ T) for a fixed T."""
    rng = np.random.default_rng(DATA_SEED)
    target = rng.standard_normal((IN, OUT)).astype(np.float32)
    for _ in range(steps):
        x = rng.standard_normal((BATCH, IN)).astype(np.float32)
        yield x, np.tanh(x @ target).astype(np.float32)


def noise_for(step: int, grad: np.ndarray) -> np.ndarray:
    """What --inject-step adds to the gradient: seeded noise of half the gradient's spread."""
    rng = np.random.default_rng([NOISE_SEED, step])
    return (0.5 * float(grad.std()) * rng.standard_normal(grad.shape)).astype(np.float32)


def train_torch(
    weights: dict[str, np.ndarray], out: Path, steps: int, inject: int | None, what: str, config: dict
) -> list[float]:
    import torch
    from torch import nn

    import trainmon

    class Act(nn.Tanh):
        changed = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = super().forward(x)
            return y * (1.0 + FORWARD_CHANGE) if self.changed else y

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = nn.Linear(IN, HIDDEN)
            self.norm = nn.LayerNorm(HIDDEN, eps=LN_EPS)
            self.act = Act()
            self.fc2 = nn.Linear(HIDDEN, OUT)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc2(self.act(self.norm(self.fc1(x))))

    torch.use_deterministic_algorithms(True)
    net = Net()
    net.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()})
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    params = dict(net.named_parameters())
    losses = []
    with trainmon.attach(net, opt, config=config, logdir=out):
        for step, (x, y) in enumerate(batches(steps)):
            net.act.changed = what == "forward" and inject is not None and step >= inject
            opt.zero_grad()
            loss = nn.functional.mse_loss(net(torch.from_numpy(x)), torch.from_numpy(y))
            loss.backward()
            if what == "wgrad" and inject is not None and step >= inject:
                g = params[INJECT_PARAM].grad
                g += torch.from_numpy(noise_for(step, g.numpy()))
            opt.step()
            losses.append(loss.item())
    return losses


def train_mindspore(
    weights: dict[str, np.ndarray], out: Path, steps: int, inject: int | None, what: str, config: dict
) -> list[float]:
    import mindspore as ms
    from mindspore import nn

    import trainmon.mindspore

    class Act(nn.Tanh):
        changed = False

        def construct(self, x: ms.Tensor) -> ms.Tensor:
            y = super().construct(x)
            return y * (1.0 + FORWARD_CHANGE) if self.changed else y

    class Net(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = nn.Dense(IN, HIDDEN)
            self.norm = nn.LayerNorm((HIDDEN,), epsilon=LN_EPS)
            self.act = Act()
            self.fc2 = nn.Dense(HIDDEN, OUT)

        def construct(self, x: ms.Tensor) -> ms.Tensor:
            return self.fc2(self.act(self.norm(self.fc1(x))))

    ms.set_context(mode=ms.PYNATIVE_MODE)
    net = Net()
    by_name = {p.name: p for p in net.trainable_params()}
    for name, value in weights.items():
        by_name[MS_NAMES.get(name, name)].set_data(ms.Tensor(value))
    opt = nn.SGD(net.trainable_params(), learning_rate=LR)
    loss_fn = nn.MSELoss()
    grad_fn = ms.value_and_grad(lambda x, y: loss_fn(net(x), y), None, opt.parameters)
    inject_at = [p.name for p in opt.parameters].index(INJECT_PARAM)
    losses = []
    monitor = trainmon.mindspore.attach(net, opt, config=config, logdir=out)
    try:
        for step, (x, y) in enumerate(batches(steps)):
            net.act.changed = what == "forward" and inject is not None and step >= inject
            loss, grads = grad_fn(ms.Tensor(x), ms.Tensor(y))
            if what == "wgrad" and inject is not None and step >= inject:
                grads = list(grads)
                g = grads[inject_at]
                grads[inject_at] = g + ms.Tensor(noise_for(step, g.asnumpy()))
                grads = tuple(grads)
            opt(grads)
            losses.append(float(loss.asnumpy()))
    finally:
        monitor.close()
    return losses


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--framework", choices=("torch", "mindspore"), required=True)
    parser.add_argument("--out", required=True, help="run directory")
    parser.add_argument(
        "--weights",
        default="runs/compare_frameworks_weights.npz",
        help="initial weights (.npz by PyTorch name), created from a fixed seed when absent",
    )
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument(
        "--mode",
        choices=("probe", "stats"),
        default="probe",
        help="probe: grad_probe fingerprints (default); stats: the statistics store at full coverage",
    )
    parser.add_argument(
        "--inject",
        choices=("wgrad", "forward"),
        default="wgrad",
        help=f"what --inject-step changes: {INJECT_PARAM}'s gradient (wgrad) or act's output (forward)",
    )
    parser.add_argument("--inject-step", type=int, default=None, help="inject the change from this step on")
    args = parser.parse_args(argv)
    weights = initial_weights(Path(args.weights))
    train = train_torch if args.framework == "torch" else train_mindspore
    config = STATS_CONFIG if args.mode == "stats" else MONITOR_CONFIG
    losses = train(weights, Path(args.out), args.steps, args.inject_step, args.inject, config)
    print(
        f"trainmon: {args.steps} {args.framework} steps in {args.out}: "
        f"loss {losses[0]:.6f} -> {losses[-1]:.6f}"
    )


if __name__ == "__main__":
    main()
