"""Editing the config file during training: applied from the step after it has settled, bad edits ignored,
msprobe's DYNAMIC_MONITOR switch."""

from __future__ import annotations

import json
import logging
import os
import time

import pandas as pd
import torch
import torch.nn.functional as F

import trainmon
from tests.test_monitor import make_toy
from trainmon.config.watch import SETTLE_S


def write_config(path, config: dict, bump: int) -> None:
    # the steps each version collected are read from the CSV: asked for (not a default since issue 33)
    path.write_text(json.dumps({"format": ["tensorboard", "csv"], **config}))
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + bump * 1_000_000_000))  # a new mtime, no sleep


def run_steps(mon, model, optimizer, n: int) -> None:
    for _ in range(n):
        loss = F.mse_loss(model(torch.randn(4, 4)), torch.randn(4, 2))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def settle(mon, model, optimizer) -> None:
    """One step, whose end is the watcher's first look at the edited file, then the settle time: the next
    step end reads the file, and the edit applies from the step after that."""
    run_steps(mon, model, optimizer, 1)
    time.sleep(SETTLE_S * 1.5)


def steps_in(path) -> set[int]:
    return set(pd.read_csv(path)["step"]) if path.exists() else set()


def test_edit_applies_from_the_step_after_it_is_seen(tmp_path, monkeypatch):
    monkeypatch.delenv("DYNAMIC_MONITOR", raising=False)
    config, run = tmp_path / "mon.json", tmp_path / "run"
    write_config(config, {"wg_distribution": True}, bump=0)
    model, optimizer = make_toy()
    with trainmon.attach(model, optimizer, config=str(config), logdir=run) as mon:
        run_steps(mon, model, optimizer, 3)  # steps 0-2
        write_config(config, {"wg_distribution": True, "xy_distribution": True}, bump=1)
        settle(mon, model, optimizer)  # the end of step 3 sees the edit
        run_steps(mon, model, optimizer, 3)  # the end of step 4 reads it; steps 5 and 6 collect it
    assert steps_in(run / "rank_0" / "actv.csv") == {5, 6}
    assert steps_in(run / "rank_0" / "grad_reduced.csv") == set(range(7))


def test_bad_edit_keeps_the_old_config(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("DYNAMIC_MONITOR", raising=False)
    config, run = tmp_path / "mon.json", tmp_path / "run"
    write_config(config, {"wg_distribution": True}, bump=0)
    model, optimizer = make_toy()
    with caplog.at_level(logging.WARNING, "trainmon"), trainmon.attach(
        model, optimizer, config=str(config), logdir=run
    ) as mon:
        run_steps(mon, model, optimizer, 2)
        write_config(config, {"wg_distribution": True, "xy_distrbution": True}, bump=1)
        settle(mon, model, optimizer)
        run_steps(mon, model, optimizer, 3)
    assert "xy_distrbution" in caplog.text and "did you mean 'xy_distribution'" in caplog.text
    assert caplog.text.count("xy_distrbution: unknown key") == 1  # reported once, not every step
    assert steps_in(run / "rank_0" / "grad_reduced.csv") == set(range(6))
    assert not (run / "rank_0" / "actv.csv").exists()


def test_dynamic_monitor_switch(tmp_path, monkeypatch):
    monkeypatch.setenv("DYNAMIC_MONITOR", "true")
    config, run = tmp_path / "mon.json", tmp_path / "run"
    write_config(config, {"wg_distribution": True, "dynamic_on": False}, bump=0)
    model, optimizer = make_toy()
    with trainmon.attach(model, optimizer, config=str(config), logdir=run) as mon:
        run_steps(mon, model, optimizer, 3)  # off: dynamic mode starts off and the file says so
        write_config(config, {"wg_distribution": True, "dynamic_on": True}, bump=1)
        settle(mon, model, optimizer)  # step 3 sees it
        run_steps(mon, model, optimizer, 3)  # read at the end of step 4: on from step 5
        write_config(config, {"wg_distribution": True, "dynamic_on": False}, bump=2)
        settle(mon, model, optimizer)  # step 7 sees it
        run_steps(mon, model, optimizer, 3)  # read at the end of step 8: off from step 9
    assert steps_in(run / "rank_0" / "grad_reduced.csv") == {5, 6, 7, 8}


def test_an_edited_interval_keeps_the_grid_of_start_step(tmp_path, monkeypatch):
    """An edit to step_interval 5 that lands at the end of step 12 collects 15, 20, 25 (the grid of
    start_step 0), not 13, 18, 23 (a grid anchored at the step the edit lands)."""
    monkeypatch.delenv("DYNAMIC_MONITOR", raising=False)
    config, run = tmp_path / "mon.json", tmp_path / "run"
    write_config(config, {"wg_distribution": True}, bump=0)
    model, optimizer = make_toy()
    with trainmon.attach(model, optimizer, config=str(config), logdir=run) as mon:
        run_steps(mon, model, optimizer, 11)  # steps 0-10
        write_config(config, {"wg_distribution": True, "step_interval": 5}, bump=1)
        settle(mon, model, optimizer)  # step 11 sees it
        run_steps(mon, model, optimizer, 16)  # read at the end of step 12; steps 13-27 on the new grid
    assert steps_in(run / "rank_0" / "grad_reduced.csv") == set(range(13)) | {15, 20, 25}
