"""``trainmon config check`` on what the docs show (issue 15, point 15): the quickstart's YAML blocks pass as
written, also where the webhook's environment variable is not set; an empty file means defaults."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from trainmon.cli import main
from trainmon.config import MonitorConfig, load_config

QUICKSTART = Path(__file__).resolve().parents[1] / "docs" / "quickstart.md"


def _yaml_blocks() -> list[str]:
    return re.findall(r"```yaml\n(.*?)```", QUICKSTART.read_text(encoding="utf-8"), flags=re.S)


def _alert_block() -> str:
    (block,) = [b for b in _yaml_blocks() if b.startswith("alert:")]
    return block


def test_quickstart_yaml_blocks_pass_as_written(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("SLACK_HOOK", raising=False)
    blocks = _yaml_blocks()
    assert len(blocks) >= 2
    for i, block in enumerate(blocks):
        path = tmp_path / f"block{i}.yaml"
        path.write_text(block)
        assert main(["config", "check", str(path)]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "anomalies: rules nan, turbulence; on NaN: raise; 1 webhook; dumps on anomaly" in out
    assert ("  note: alert.webhooks[0].url_env: $SLACK_HOOK is not set here; checked with a placeholder. Set "
            "it where the job runs (the job stops at attach without it); --require-env makes this an error"
            ) in out.splitlines()
    assert "SLACK_HOOK" not in os.environ  # the placeholder does not outlive the check


def test_require_env_fails_as_the_job_would(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("SLACK_HOOK", raising=False)
    path = tmp_path / "alert.yaml"
    path.write_text(_alert_block())
    assert main(["config", "check", "--require-env", str(path)]) == 2
    assert capsys.readouterr().err == (
        f"error: {path}: alert.webhooks[0].url_env: environment variable 'SLACK_HOOK' is not set\n")
    monkeypatch.setenv("SLACK_HOOK", "https://hooks.slack.com/services/T/B/x")
    assert main(["config", "check", "--require-env", str(path)]) == 0
    assert "note:" not in capsys.readouterr().out
    assert main(["config", "check", str(path)]) == 0  # set here: nothing to note
    assert "note:" not in capsys.readouterr().out


def test_placeholder_does_not_hide_other_errors(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("SLACK_HOOK", raising=False)
    path = tmp_path / "bad.yaml"
    path.write_text("alert:\n  webhooks: [{url_env: SLACK_HOOK, kind: slak}]\n")
    assert main(["config", "check", str(path)]) == 2
    assert "alert.webhooks[0].kind: unknown kind 'slak'" in capsys.readouterr().err


@pytest.mark.parametrize("name, text", [("empty.yaml", ""), ("blank.json", "\n  \n"),
                                        ("comments.yaml", "# nothing set yet\n"), ("noext", "")])
def test_empty_config_file_means_defaults(tmp_path, capsys, name, text):
    path = tmp_path / name
    path.write_text(text)
    assert load_config(path) == MonitorConfig()
    assert main(["config", "check", str(path)]) == 0
    assert capsys.readouterr().out.startswith(f"OK: {path}\n")
