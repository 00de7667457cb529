"""One host read per collected step, whatever the model size: counted at the dispatcher."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import trainmon
from tests.conftest import FULL_COVERAGE
from trainmon import stats
from trainmon.step import buffer as buffer_module

FULL = FULL_COVERAGE


class HostReadCounter(TorchDispatchMode):
    """Counts ops that read device values on the host: scalar reads (.item(), float(), bool(), .tolist())
    and copies from another device to the CPU. A CPU-to-CPU dtype conversion is not a host read."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__
        if name.startswith("_local_scalar_dense"):
            self.reads.append(name)
        elif name.startswith(("_to_copy", "copy_")):
            source = args[0] if name.startswith("_to_copy") else args[1]
            target = kwargs.get("device", source.device) if name.startswith("_to_copy") else args[0].device
            if torch.device(target).type == "cpu" and source.device.type != "cpu":
                self.reads.append(name)
        return func(*args, **kwargs)


def mlp(layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(layers)])


def host_reads_per_step(layers: int, tmp_path, steps: int = 3, config=FULL) -> list[tuple[int, int]]:
    """(host reads at the dispatcher, step-end copies of the statistics buffer) for each step."""
    model = mlp(layers)
    optimizer = torch.optim.AdamW(model.parameters())
    counts = []
    copies = []
    original = buffer_module.copy_to_host

    def counting_copy(t):
        copies.append(t.shape)
        return original(t)

    buffer_module.copy_to_host = counting_copy
    try:
        with trainmon.attach(model, optimizer, config=config, logdir=tmp_path / f"run{layers}") as mon:
            for _ in range(steps):
                copies.clear()
                x = torch.randn(4, 16)
                with HostReadCounter() as counter:
                    loss = F.mse_loss(model(x), torch.zeros(4, 16))
                    mon.track("loss", loss)
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
                counts.append((len(counter.reads), len(copies)))
    finally:
        buffer_module.copy_to_host = original
    return counts


@pytest.fixture(params=["auto", "torch"])
def backend(request):
    """The native CPU kernel and the portable torch path (what GPUs/NPUs run) must both hold the rule."""
    stats.set_backend(request.param)
    yield request.param
    stats.set_backend("auto")


def reads_added_by_monitor(layers: int, tmp_path, steps: int = 3, config=FULL) -> list[tuple[int, int]]:
    # torch's own AdamW reads its step counters (.item()) once per parameter: that is the training loop's,
    # measured with the monitor attached but never collecting (this rank is not in module_ranks).
    baseline = host_reads_per_step(layers, tmp_path, steps, config={**config, "module_ranks": [99]})
    monitored = host_reads_per_step(layers, tmp_path, steps, config=config)
    return [(m[0] - b[0], m[1]) for m, b in zip(monitored, baseline, strict=True)]


def test_one_host_copy_per_step_for_4_and_40_layers(tmp_path, backend):
    # no value is read on the host while the step runs; the statistics leave the device in one copy at its end
    assert reads_added_by_monitor(4, tmp_path) == [(0, 1)] * 3
    assert reads_added_by_monitor(40, tmp_path) == [(0, 1)] * 3


def test_off_steps_read_nothing(tmp_path, backend):
    assert reads_added_by_monitor(8, tmp_path, steps=4, config={**FULL, "step_interval": 2}) == [
        (0, 1),
        (0, 0),
        (0, 1),
        (0, 0),
    ]


def test_counter_sees_a_per_tensor_item(tmp_path, monkeypatch):
    """The counter would catch a monitor that reads each statistic on the host."""
    from trainmon.stats.direct import DirectReducer

    original = DirectReducer.row

    def syncing(self, t, out, row, eps, shareable=False, site=None):
        original(self, t, out, row, eps, shareable, site)
        float(out[row, 0])

    monkeypatch.setattr(DirectReducer, "row", syncing)
    four, forty = reads_added_by_monitor(4, tmp_path, steps=1), reads_added_by_monitor(40, tmp_path, steps=1)
    assert four[0][0] > 0 and forty[0][0] > 5 * four[0][0]
