"""An optimizer that holds others, as torchtitan's ``OptimizersContainer`` does (one optimizer per model
part in ``.optimizers``; the container is itself an ``Optimizer`` made over every parameter with no
hyper-parameters, and its ``step`` runs theirs): Adam's moments and update are read from the inner optimizer
that updates each parameter. (torchtitan 0.3.0's own container was checked the same way by hand.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import trainmon

CONFIG = {"wg_distribution": True, "mv_distribution": True, "ur_distribution": True, "format": ["api"]}


class Container(torch.optim.Optimizer):
    def __init__(self, parts: list[nn.Module]) -> None:
        self.optimizers = [torch.optim.AdamW(part.parameters(), lr=1e-2) for part in parts]
        torch.optim.Optimizer.__init__(self, [p for part in parts for p in part.parameters()], {})

    def step(self, closure=None) -> None:
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)


def test_moments_and_update_of_an_optimizer_that_holds_others(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 1))
    optimizer = Container([model[0], model[2]])
    monitor = trainmon.attach(model, optimizer, config=CONFIG, logdir=str(tmp_path))
    for _ in range(3):
        loss = model(torch.randn(5, 4)).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    latest = monitor.latest()
    monitor.close()
    for name, param in model.named_parameters():
        inner = optimizer.optimizers[0 if name.startswith("0.") else 1]
        state = inner.state[param]
        for kind in ("exp_avg", "exp_avg_sq"):
            expected = float(np.linalg.norm(state[kind].numpy().astype(np.float64)))
            assert latest[f"{kind}/{name}"]["norm"] == pytest.approx(expected, rel=1e-6)
        # Adam's update with the inner optimizer's betas and eps (the container's group has none)
        c1, c2 = 1 - 0.9**3, 1 - 0.999**3
        update = (state["exp_avg"] / c1) / ((state["exp_avg_sq"] / c2).sqrt() + 1e-8)
        expected = float(np.linalg.norm(update.numpy().astype(np.float64)))
        assert latest[f"update/{name}"]["norm"] == pytest.approx(expected, rel=1e-5)
