"""Forward hooks registered after ``attach`` (issue 22, point 8): the monitor's own forward hook of a module
runs after them, so it records the output they hand on; the skip line and the alert then name the same
tensor, the module whose call (hooks included) made the NaN."""

from __future__ import annotations

import logging

import torch
from torch import nn

import trainmon
from trainmon.run.anomaly_table import read_anomalies


def test_a_hook_registered_after_attach_is_part_of_its_modules_call(tmp_path, caplog):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    alerts: list = []
    config = {"xy_distribution": True, "all_xy": True, "alert": {"on_nan": "skip", "rate_limit_s": 0}}
    poisoned_at = {1, 3}

    def poison(module, args, output):  # a hook of the user's, e.g. an activation clamp gone wrong
        if step in poisoned_at:
            output = output.clone()
            output[0, 0] = float("nan")
        return output

    with (
        caplog.at_level(logging.WARNING, "trainmon"),
        trainmon.attach(model, optimizer, config=config, logdir=tmp_path / "run", on_alert=alerts.append),
    ):
        model[1].register_forward_hook(poison)  # after attach: registered after the monitor's hook
        for step in range(4):
            if step == 2:  # one more, registered mid-run on another module
                model[0].register_forward_hook(poison)
            model(torch.randn(3, 4)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    skips = [r.getMessage() for r in caplog.records if "the update is skipped" in r.getMessage()]
    # step 1: 1's hook makes the NaN; step 3: 0's hook (registered at step 2) makes it first
    assert [m.split(";")[0] for m in skips] == ["trainmon: step 1: nan in actv 1.output",
                                                "trainmon: step 3: nan in actv 0.output"]  # fmt: skip
    lines = [a.lines[0] for a in alerts]
    assert lines == [
        "NaN at step 1 rank 0: actv 1.output (origin, forward), 1 NaN; +2 more tensors",
        "NaN at step 3 rank 0: actv 0.output (origin, forward), 1 NaN; +6 more tensors",
    ]
    origins = [(a.step, a.name) for a in read_anomalies(tmp_path / "run", 0) if a.origin]
    assert origins == [(1, "1.output"), (3, "0.output")]
