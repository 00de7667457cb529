"""Every config key is declared once (``trainmon.config.keys``): a key added in one declaration reaches the
loader and its messages, ``trainmon config init`` (the template and its comments), ``trainmon config check``,
the msprobe export, the key tables of docs/config.md and the watcher's note on edits that wait for the next
run. Configs load as they did before the declarations (a golden file of what the previous code read), and
the ``alert`` section is parsed once: the anomaly engines take its typed rules as they are."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest
import yaml

from trainmon.cli import config_cmd, main
from trainmon.config import AlertConfig, ConfigError, MonitorConfig, Webhook, load_config
from trainmon.config.keys import Section, key, not_live
from trainmon.config.load import load
from trainmon.config.reference import tables, update_docs
from trainmon.config.rules import NanRule, Rule, ThresholdRule
from trainmon.config.watch import ConfigWatcher

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "config.md"
GOLDEN = Path(__file__).resolve().parent / "data" / "configs_before_one_declaration.json"


@dataclass(frozen=True, kw_only=True)
class Extra(MonitorConfig):
    """The schema with two keys more, each declared once, here."""

    extra_limit: int = key(3, "an extra limit for the test", lo=1, group="schedule", msprobe=True)
    extra_mode: Literal["fast", "exact"] = key(
        "fast", "fast | exact: an extra mode", group="output", live=False
    )


# --- one declaration reaches every reader ---


def test_an_added_key_is_loaded_validated_and_written_back():
    c = load(Extra, {"extra_limit": 5, "wg_distribution": True}, {})
    assert (c.extra_limit, c.extra_mode, c.wg_distribution) == (5, "fast", True)
    assert load(Extra, None, {}).extra_limit == 3  # its default
    assert load(Extra, c.to_dict(), {}) == c and c.to_dict()["extra_limit"] == 5
    for raw, message in (
        ({"extra_limit": 0}, "extra_limit: must be >= 1, got 0"),
        ({"extra_limit": "2"}, "extra_limit: expected an integer, got string '2'"),
        ({"extra_mode": "slow"}, "extra_mode: unknown extra_mode 'slow' (allowed: fast, exact)"),
        ({"extra_limt": 1}, "extra_limt: unknown key 'extra_limt'; did you mean 'extra_limit'?"),
    ):
        with pytest.raises(ConfigError) as e:
            load(Extra, raw, {})
        assert str(e.value).startswith(message), str(e.value)
    with pytest.raises(ConfigError, match="unknown key 'extra_limit'"):
        load_config({"extra_limit": 5})  # the schema without the declaration does not know it


def test_an_added_key_is_in_config_init_and_config_check(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(config_cmd, "SCHEMA", Extra)
    assert main(["config", "init", "-o", "-"]) == 0
    text = capsys.readouterr().out
    assert "\n# an extra limit for the test\nextra_limit: 3\n" in text
    # an edit that waits for the next attach says so where it is explained
    assert "\n# fast | exact: an extra mode (read at attach: an edit applies to the next run)\n" in text
    assert load(Extra, yaml.safe_load(text), {}) == load(Extra, config_cmd.presets(Extra)["full"], {})
    assert main(["config", "init", "--preset", "msprobe", "-o", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["extra_limit"] == 3  # declared msprobe=True
    bad, good = tmp_path / "bad.yaml", tmp_path / "good.yaml"
    bad.write_text("extra_limit: 0\n")
    good.write_text("extra_limit: 4\nextra_mode: exact\n")
    assert main(["config", "check", str(bad)]) == 2
    assert capsys.readouterr().err == f"error: {bad}: extra_limit: must be >= 1, got 0\n"
    assert main(["config", "check", str(good)]) == 0
    assert capsys.readouterr().out.startswith(f"OK: {good}\n")


def test_an_added_key_is_in_the_docs_key_table():
    text = DOCS.read_text(encoding="utf-8")
    rows = tables(Extra)
    assert "| `extra_limit` | int >= 1 | `3` | An extra limit for the test. |" in rows["schedule"]
    assert (
        "| `extra_mode` | `fast`, `exact` | `fast` | Fast \\| exact: an extra mode. Read at attach: an edit "
        "of it applies to the next run. |"
    ) in rows["output"]
    with_extra = update_docs(text, Extra)
    assert with_extra != text and "`extra_limit`" in with_extra and "`extra_limit`" not in text


def test_the_docs_key_tables_are_the_declarations():
    text = DOCS.read_text(encoding="utf-8")
    assert update_docs(text) == text, "run: python -m trainmon.config.reference docs/config.md"
    own_tables = tables()
    for name in MonitorConfig.all_keys():  # a row each; a section has a table of its own
        assert f"| `{name}` |" in text or f"<!-- keys: {name} -->" in text and name in own_tables, name
    for section in (AlertConfig, Webhook):
        for name in section.key_names():
            assert f"| `{name}` |" in text, name


def test_a_key_without_a_docs_table_is_refused():
    @dataclass(frozen=True, kw_only=True)
    class Homeless(MonitorConfig):
        nowhere: bool = key(False, "a key in no table")

    with pytest.raises(ValueError, match="nowhere: declare the docs table"):
        tables(Homeless)


def test_an_edit_of_a_key_read_at_attach_only_is_reported(tmp_path, caplog):
    assert not_live(MonitorConfig(), MonitorConfig(sync_timeout_s=5, step_interval=3)) == ["sync_timeout_s"]
    assert not_live(load(Extra, None, {}), load(Extra, {"extra_mode": "exact"}, {})) == ["extra_mode"]
    path = tmp_path / "monitor.json"
    path.write_text('{"wg_distribution": true}')
    watcher = ConfigWatcher(path, load_config(path), dynamic=False, settle_s=0)
    path.write_text('{"wg_distribution": true, "step_interval": 2}')
    os.utime(path, ns=(1, 1))
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        assert watcher.check().config.step_interval == 2
        assert not [r for r in caplog.records if "next run" in r.getMessage()]
        path.write_text('{"wg_distribution": true, "step_interval": 2, "sync_timeout_s": 5}')
        os.utime(path, ns=(2, 2))
        assert watcher.check().config.sync_timeout_s == 5
    (note,) = [r.getMessage() for r in caplog.records if "next run" in r.getMessage()]
    assert note == (
        f"trainmon: config file {path}: sync_timeout_s is read at attach only; the edit of it applies to the "
        "next run"
    )


def test_a_subclass_changes_a_default_and_keeps_the_declaration():
    @dataclass(frozen=True, kw_only=True)
    class Section2(Section):
        count: int = key(1, "a count", lo=1)

    @dataclass(frozen=True, kw_only=True)
    class Section3(Section2):
        count: int = 5

    assert Section3().count == 5
    with pytest.raises(ConfigError, match="count: must be >= 1"):
        Section3.parse({"count": 0}, None)
    (d,) = Section3.declared()
    assert (d.key.help, d.default) == ("a count", 5)


# --- configs load as before ---


def test_every_config_loads_as_before(monkeypatch):
    """What the previous code (before the declarations) loaded each config to: the docs' configs, the
    msprobe config with every V1 key, the presets of ``config init``, edge forms of every key."""
    for var in ("SLACK_HOOK", "FEISHU_HOOK", "DINGTALK_HOOK"):
        monkeypatch.setenv(var, f"https://example.invalid/{var.lower()}")
    for var in ("FEISHU_SECRET", "DINGTALK_SECRET"):
        monkeypatch.setenv(var, "s3cret")
    cases = json.loads(GOLDEN.read_text(encoding="utf-8"))
    assert len(cases) >= 18
    for case in cases:
        config = load_config(case["config"])
        expected = dict(case["to_dict"])
        # issue 33 changed two defaults on purpose, and only those: no CSV unless a config asks for it, and
        # TensorBoard shows the summary (the new key); a config that names its formats loads as before
        expected["tensorboard_tensors"] = "summary"
        if case["config"].get("format") in (None, [], ""):
            assert expected["format"] == ["tensorboard", "csv"], case["source"]
            expected["format"] = ["tensorboard"]
        assert config.to_dict() == expected, case["source"]
        assert load_config(expected) == config, case["source"]


# --- the alert section is typed once ---


def test_the_alert_section_holds_typed_rules_and_webhooks_that_the_engines_take_as_they_are(tmp_path):
    from trainmon.anomaly.sink import AnomalySink

    alert = load_config(
        {
            "alert": {
                "rules": [
                    {"rule_name": "AnomalyNan", "args": {"threshold": 1e10}},
                    {"rule": "threshold", "above": 2},
                ],
                "webhooks": [{"url": "http://127.0.0.1:9/x", "kind": "slack"}],
            }
        }
    ).alert
    assert all(isinstance(r, Rule) for r in alert.rules) and isinstance(alert.webhooks[0], Webhook)
    assert alert.rules == (NanRule(threshold=1e10), ThresholdRule(above=2.0))
    sink = AnomalySink(alert, 0, "run", tmp_path)
    try:
        assert all(a is b for a, b in zip(sink._engine.rules, alert.rules, strict=True))  # not parsed again
    finally:
        sink.close()
