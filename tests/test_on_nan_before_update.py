"""``alert.on_nan: raise`` and ``exit`` act before the NaN step's update lands (issue 22, point 3).

When the error reaches the caller, every parameter and the optimizer state (Adam's moments and step count)
are bitwise what they were before the NaN step, so a checkpoint saved in ``except`` holds the last good
state; the gradients are handed back; the step's records and alerts are on disk. DeepSpeed and Megatron:
tests/test_skip_deepspeed.py and tests/test_skip_megatron.py."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

import trainmon
from trainmon.anomaly.alerts import TrainingNaNError
from trainmon.run.anomaly_table import read_anomalies

NAN_STEP = 2


class Poison(nn.Module):
    """Identity, except that it writes a NaN when ``armed``: every gradient before it goes NaN too."""

    armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed:
            x = x.clone()
            x[0, 0] = float("nan")
        return x


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.poison, self.fc2 = nn.Linear(6, 8), Poison(), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.poison(torch.tanh(self.fc1(x))))


def state_of(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Parameters and optimizer state, deep-copied (bit patterns compared with torch.equal on int views)."""
    return {"params": copy.deepcopy(model.state_dict()), "optim": copy.deepcopy(optimizer.state_dict())}


def bitwise_equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        same_kind = a.dtype == b.dtype and a.shape == b.shape
        bits = (t.detach().reshape(-1).contiguous().view(torch.uint8) for t in (a, b))
        return same_kind and torch.equal(*bits)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(bitwise_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(bitwise_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def train_until_stopped(run, action: str, exit_code: int = 3):
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = {"xy_distribution": True, "all_xy": True, "wg_distribution": True,
              "alert": {"on_nan": action, "exit_code": exit_code, "rate_limit_s": 0}}  # fmt: skip
    mon = trainmon.attach(model, optimizer, config=config, logdir=run)
    before = None
    try:
        for step in range(NAN_STEP + 2):
            model.poison.armed = step == NAN_STEP
            if step == NAN_STEP:
                before = state_of(model, optimizer)
            optimizer.zero_grad()
            model(torch.randn(4, 6, generator=torch.Generator().manual_seed(step))).pow(2).mean().backward()
            grads = [p.grad.clone() for p in model.parameters()]
            optimizer.step()
    except (TrainingNaNError, SystemExit) as stopped:
        return stopped, step, before, state_of(model, optimizer), grads, model, mon
    finally:
        mon.close()
    raise AssertionError("training was not stopped")


@pytest.mark.parametrize("action", ["raise", "exit"])
def test_the_error_reaches_the_caller_with_the_state_before_the_nan_step(tmp_path, action, caplog):
    with caplog.at_level(logging.ERROR, "trainmon"):
        stopped, step, before, after, grads, model, _ = train_until_stopped(tmp_path / "run", action)
    assert step == NAN_STEP
    assert bitwise_equal(after, before)  # parameters, exp_avg, exp_avg_sq and step count: as before
    assert after["optim"]["state"][0]["step"] == NAN_STEP  # the step counter did not move either
    # the gradients are handed back (NaN: they were made from the NaN activation)
    assert all(bitwise_equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
    assert any(torch.isnan(g).any() for g in grads)
    message = (
        "nan in actv poison.output (nans=1) at step 2 on rank 0; the update of step 2 was not applied "
        f"(parameters and optimizer state are as before it); anomalies in {tmp_path / 'run'}"
    )
    if action == "raise":
        assert isinstance(stopped, TrainingNaNError) and str(stopped) == message
    else:
        assert isinstance(stopped, SystemExit) and stopped.code == 3
        assert f"trainmon: {message}; exiting with code 3 (alert.on_nan: exit)" in caplog.messages
    # the step's records are on disk: the NaN with its origin, and that its update did not land
    anomalies = [a for a in read_anomalies(tmp_path / "run", 0) if a.step == NAN_STEP]
    assert [a.name for a in anomalies if a.origin] == ["poison.output"]
    assert [a.message for a in anomalies if a.rule == "step_skipped"] == [
        f"update skipped (alert.on_nan: {action}): nan in actv poison.output"
    ]
