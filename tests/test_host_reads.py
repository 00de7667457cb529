"""One host read per collected step, whatever the model size: counted at the dispatcher."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import trainmon
from trainmon import stats

FULL = {"xy_distribution": True, "all_xy": True, "wg_distribution": True, "mv_distribution": True,
        "param_distribution": True}


class HostReadCounter(TorchDispatchMode):
    """Counts ops that move a value to the host: scalar reads (.item(), bool()) and copies to the CPU."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__
        if name.startswith("_local_scalar_dense"):
            self.reads.append(name)
        elif name.startswith("_to_copy") and str(kwargs.get("device", "")) == "cpu":
            self.reads.append(name)
        return func(*args, **kwargs)


def mlp(layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(layers)])


def host_reads_per_step(layers: int, tmp_path, steps: int = 3, config=FULL) -> list[int]:
    model = mlp(layers)
    optimizer = torch.optim.AdamW(model.parameters())
    counts = []
    with trainmon.attach(model, optimizer, config=config, logdir=tmp_path / f"run{layers}") as mon:
        for _ in range(steps):
            x = torch.randn(4, 16)
            with HostReadCounter() as counter:
                loss = F.mse_loss(model(x), torch.zeros(4, 16))
                mon.track("loss", loss)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            counts.append(len(counter.reads))
    return counts


@pytest.fixture(params=["auto", "torch"])
def backend(request):
    """The native CPU kernel and the portable torch path (what GPUs/NPUs run) must both hold the rule."""
    stats.set_backend(request.param)
    yield request.param
    stats.set_backend("auto")


def reads_added_by_monitor(layers: int, tmp_path, steps: int = 3, config=FULL) -> list[int]:
    # torch's own AdamW reads its step counters (.item()) once per parameter: that is the training loop's,
    # measured with the monitor attached but never collecting (this rank is not in module_ranks).
    baseline = host_reads_per_step(layers, tmp_path, steps, config={**config, "module_ranks": [99]})
    monitored = host_reads_per_step(layers, tmp_path, steps, config=config)
    return [m - b for m, b in zip(monitored, baseline)]


def test_one_host_read_per_step_for_4_and_40_layers(tmp_path, backend):
    assert reads_added_by_monitor(4, tmp_path) == [1, 1, 1]
    assert reads_added_by_monitor(40, tmp_path) == [1, 1, 1]


def test_off_steps_read_nothing(tmp_path, backend):
    assert reads_added_by_monitor(8, tmp_path, steps=4, config={**FULL, "step_interval": 2}) == [1, 0, 1, 0]
