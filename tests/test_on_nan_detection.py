"""NaN/Inf detection stays on while ``alert.on_nan`` acts on NaN: a rule list without ``nan`` must not turn it
off (a run went through a NaN with exit code 0 and no alert), narrow ``nan`` rules give way to a full NaN/Inf
rule (keeping their threshold part), and ``trainmon config check`` lists the ``nan`` rule that ``on_nan``
keeps on."""

from __future__ import annotations

import logging

import pytest

from tests.test_anomaly_e2e import XY, train
from trainmon.anomaly.alerts import TrainingNaNError
from trainmon.cli import main
from trainmon.config.alert import AlertConfig
from trainmon.config.rules import NanRule, StragglerRule, TurbulenceRule
from trainmon.run.anomaly_table import read_anomalies

TURBULENCE = {"rule": "turbulence", "threshold": 1e9}  # never fires: only NaN detection can stop the run


def test_on_nan_adds_a_full_nan_rule_to_a_list_without_one():
    rules = [{"rule": "turbulence"}]
    assert AlertConfig(rules=rules, on_nan="continue").evaluated_rules == (TurbulenceRule(),)
    assert AlertConfig(rules=rules).evaluated_rules == (TurbulenceRule(),)
    for action in ("raise", "exit", "skip"):
        assert AlertConfig(rules=rules, on_nan=action).evaluated_rules == (
            NanRule(stats=("nans", "infs")),
            TurbulenceRule(),
        )


def test_narrow_nan_rules_keep_their_threshold_part_and_report_nothing_twice():
    narrow = [
        {"rule": "nan", "kinds": ["grad_reduced"]},  # NaN/Inf of one kind only: the full rule covers it
        {"rule": "nan", "names": ["layers.*"], "stats": ["nans", "max"], "threshold": 1e4},
        {"rule": "nan", "warmup": 3, "stats": ["infs"]},  # would miss the first steps
    ]
    assert AlertConfig(rules=narrow, on_nan="raise").evaluated_rules == (
        NanRule(stats=("nans", "infs")),
        NanRule(names=("layers.*",), stats=("max",), threshold=1e4),
    )
    full = [{"rule": "nan", "stats": ["infs", "nans", "norm"], "threshold": 5.0}, {"rule": "zscore"}]
    assert AlertConfig(rules=full, on_nan="exit").evaluated_rules == AlertConfig(rules=full).evaluated_rules
    # the default already counts NaN/Inf (and names stragglers)
    assert AlertConfig(on_nan="raise").evaluated_rules == (NanRule(), StragglerRule())


def test_on_nan_raise_stops_at_the_nan_step_with_a_turbulence_only_rule_list(tmp_path, caplog):
    run = tmp_path / "run"
    config = {**XY, "alert": {"rules": [TURBULENCE], "on_nan": "raise", "rate_limit_s": 0}}
    with (
        caplog.at_level(logging.WARNING, "trainmon"),
        pytest.raises(TrainingNaNError, match="at step 3 on rank 0"),
    ):
        train(run, 6, config, poison_step=3)
    anomalies = list(read_anomalies(run, 0))
    assert {a.step for a in anomalies} == {3}
    assert {a.rule for a in anomalies} <= {"nan", "inf", "suppressed", "step_skipped"}
    # raise keeps the NaN step's update from landing before it raises, and records that
    (held,) = [a for a in anomalies if a.rule == "step_skipped"]
    assert held.message == "update skipped (alert.on_nan: raise): nan in actv layers.1.mlp.fc2.output"
    origins = [(a.kind, a.name) for a in anomalies if a.origin]
    assert origins == [("actv", "layers.1.mlp.fc2.output")]
    assert any("NaN at step 3" in r.getMessage() for r in caplog.records)  # the alert went out


def test_on_nan_continue_with_a_turbulence_only_rule_list_still_reports_no_nan(tmp_path):
    run = tmp_path / "run"
    train(run, 5, {**XY, "alert": {"rules": [TURBULENCE]}}, poison_step=3)
    assert list(read_anomalies(run, 0)) == []  # the user chose: no action, no NaN rule


def test_config_check_lists_the_nan_rule_that_on_nan_keeps_on(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("alert:\n  rules: [{rule: turbulence}]\n  on_nan: raise\n")
    assert main(["config", "check", str(path)]) == 0
    assert "anomalies: rules nan, turbulence; on NaN: raise; 0 webhooks" in capsys.readouterr().out
