"""A step that a GradScaler skips (loss-scale overflow) ends like any other and is reported as such."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

import trainmon
from tests.test_monitor import make_toy
from trainmon.run.anomaly_table import read_anomalies
from trainmon.run.statstore import read_rows


def test_skipped_step_is_a_loss_scale_overflow_not_an_alarm(tmp_path, caplog):
    model, optimizer = make_toy()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    run = tmp_path / "run"
    config = {"wg_distribution": True, "param_distribution": True, "alert": {"on_nan": "raise"}}
    with caplog.at_level(logging.WARNING, "trainmon"), trainmon.attach(
        model, optimizer, config=config, logdir=run, grad_scaler=scaler
    ) as mon:
        for step in range(5):
            loss = F.mse_loss(model(torch.randn(4, 4)), torch.randn(4, 2))
            if step == 2:
                loss = loss * 1e38  # the scaled gradients overflow: the scaler skips optimizer.step()
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            mon.track("loss_scale", torch.tensor(scaler.get_scale()))
        assert mon.step == 5  # the skipped step still ended; numbering follows the training loop
    assert scaler.get_scale() == 2.0**15  # it really did skip once
    anomalies = list(read_anomalies(run, 0))
    assert anomalies and {(a.step, a.rule) for a in anomalies} == {(2, "loss_scale_overflow")}
    assert {a.kind for a in anomalies} == {"grad_unreduced"}  # the optimizer never ran: no grad_reduced
    assert "NaN at step" not in caplog.text and "Inf at step" not in caplog.text  # no alert, no raise
    # the parameters did not move across the skipped step, which has no optimizer rows
    # (the statistics store: no CSV by default since issue 33)
    rows = read_rows(run, 0, ["step", "kind", "name", "norm"]).to_pandas()
    rows["kind"], rows["name"] = rows["kind"].astype(str), rows["name"].astype(str)
    origin = rows[rows["kind"] == "param_origin"].set_index(["step", "name"])["norm"]
    updated = rows[rows["kind"] == "param_updated"].set_index(["step", "name"])["norm"]
    assert len(origin) == len(updated) == 4 * 4  # 4 optimizer steps of 4 parameters
    assert 2 not in origin.index.get_level_values("step")
    assert (origin.loc[3] == updated.loc[1]).all()
    assert not hasattr(scaler.step, "__wrapped__") and "step" not in vars(scaler)  # close() restored it
