"""CLI output: a closed stdout is not an error for any command, `analyze --rule` knows its rules, counts and
plurals read right, `trainmon --version`."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainmon import __version__
from trainmon.anomaly.log import AnomalyLog
from trainmon.cli import main
from trainmon.run.records import RECORDED_RULES, Anomaly


def _anomaly(name: str, rank: int = 0, **kw) -> Anomaly:
    base = dict(step=5, rank=rank, kind="actv", name=name, stat="max", value=math.nan, rule="nan")
    base.update(kw)
    return Anomaly(**base)


def _run_with_one_rank(run: Path) -> None:
    with AnomalyLog(run, 0) as log:
        log.write_step(5, [_anomaly("fc1", stat="nans", value=12345678.0, origin=True),
                           _anomaly("fc2", rule="zscore", stat="norm", value=12.5, baseline=1.0)])


def _closed_pipe_run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """``trainmon ARGS`` with stdout a pipe whose reader has gone (``trainmon ... | head -0``), made
    deterministic: the read end is closed before the command starts."""
    r, w = os.pipe()
    os.close(r)
    try:
        return subprocess.run([sys.executable, "-m", "trainmon", *args], stdout=w, stderr=subprocess.PIPE,
                              cwd=cwd, timeout=120, text=True)
    finally:
        os.close(w)


def test_every_command_takes_a_closed_stdout_quietly(tmp_path):
    run = tmp_path / "run"
    _run_with_one_rank(run)
    cfg = tmp_path / "c.json"
    cfg.write_text("{}")
    commands = [
        ["dump", "ls", str(run)],
        ["dump", "ls", str(run), "--json"],
        ["dump", "request", str(run), "--name", "layers.*", "--step", "next"],
        ["analyze", str(run)],
        ["config", "check", str(cfg)],
        ["config", "init", "-o", "-"],
        ["--version"],
        ["--help"],
    ]
    for args in commands:
        done = _closed_pipe_run(args, tmp_path)
        assert (args, done.returncode, done.stderr) == (args, 0, "")


def test_analyze_unknown_rule_is_an_error_listing_the_rules(tmp_path, capsys):
    _run_with_one_rank(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(["analyze", str(tmp_path), "--rule", "nan,nna"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert ("argument --rule: unknown rule 'nna'; rules: nan, inf, turbulence, zscore, max_ratio, threshold, "
            "loss_scale_overflow, step_skipped") in err
    assert set(RECORDED_RULES) >= {"nan", "inf", "zscore", "step_skipped", "loss_scale_overflow"}


def test_analyze_rule_filter_and_integer_counts(tmp_path, capsys):
    _run_with_one_rank(tmp_path)
    assert main(["analyze", str(tmp_path), "--rule", "zscore", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [a["name"] for a in doc["top"]] == ["fc2"]
    assert main(["analyze", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"{tmp_path}: 2 anomalies on 1 rank"
    assert lines[3] == "  step 5, rank 0: actv fc1 nans = 12345678 [nan]"  # a count, not 1.23457e+07
    assert "    value        12345678" in lines


def test_one_anomaly_is_singular(tmp_path, capsys):
    for r in (0, 1):
        with AnomalyLog(tmp_path, r) as log:
            log.write_step(5, [_anomaly("fc1", rank=r)] if r == 0 else [])
    assert main(["analyze", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines()[0] == f"{tmp_path}: 1 anomaly on 2 ranks"


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"trainmon {__version__}\n"


def test_on_nan_raise_message_prints_the_count_as_an_integer(tmp_path):
    import torch

    import trainmon
    from trainmon.anomaly.alerts import TrainingNaNError

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    config = {"xy_distribution": True, "all_xy": True, "alert": {"on_nan": "raise"}}
    with pytest.raises(TrainingNaNError) as e, trainmon.attach(model, opt, config=config,
                                                               logdir=tmp_path / "run"):
        for step in range(3):
            if step == 1:
                with torch.no_grad():
                    model[0].weight[0, 0] = float("nan")
            loss = model(torch.ones(4, 4)).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert "(nans=4) at step 1 on rank 0" in str(e.value)  # one NaN column over a batch of 4
