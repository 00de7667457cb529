"""The ``trainmon config`` CLI: ``config check`` (its summary of a config, its errors, and what the docs show:
the quickstart's YAML blocks pass as written, also where the webhook's environment variable is not set; an
empty file means defaults) and ``config init`` (presets, formats, where it writes)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
from pathlib import Path

import pytest
import yaml
from test_config import MSPROBE_CONFIG, _write

from trainmon.cli import main
from trainmon.config import AlertConfig, GradProbe, MonitorConfig, load_config
from trainmon.run.records import STATS

QUICKSTART = Path(__file__).resolve().parents[1] / "docs" / "quickstart.md"


@pytest.fixture
def cli(monkeypatch):
    import trainmon.cli as cli_module

    # Sibling subcommands may still be missing while the package grows; test ours alone then.
    missing = [m for m in cli_module._SUBCOMMANDS if importlib.util.find_spec(f"trainmon.cli.{m}") is None]
    if missing:
        monkeypatch.setattr(cli_module, "_SUBCOMMANDS", ("config_cmd",))
    return cli_module.main


def test_cli_check_ok(cli, tmp_path, capsys):
    path = _write(tmp_path, "monitor.json", json.dumps(MSPROBE_CONFIG))
    assert cli(["config", "check", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"OK: {path}\n")
    assert "collect: actv, actv_grad, grad_unreduced, grad_reduced" in out
    assert "ops: min, max, norm, zeros, nans, mean" in out
    assert "schedule: from step 0, every 1 step; ranks: 0, 1, 2, 3" in out
    assert "output: csv, names squashed" in out
    assert "not implemented yet (ignored): l2_targets" in out


def test_cli_check_summary_of_a_small_config(cli, tmp_path, capsys):
    path = _write(
        tmp_path, "c.yaml", "wg_distribution: true\nstart_step: 5\nstep_interval: 10\ncollect_times: 3\n"
    )
    assert cli(["config", "check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "collect: grad_unreduced, grad_reduced" in out
    assert "parameters: all parameters" in out
    assert "from step 5, every 10 steps, at most 3 collections; ranks: all" in out
    assert "anomalies: rules nan, straggler; on NaN: continue; 0 webhooks" in out
    assert "not implemented" not in out


def test_cli_check_summarises_the_alert_section(cli, tmp_path, capsys):
    text = "alert:\n  rules: [{rule: nan}, {rule_name: AnomalyTurbulence, args: {threshold: 0.5}}]\n"
    path = _write(
        tmp_path,
        "c.yaml",
        text + "  on_nan: exit\n  dump: true\n  webhooks: [{url: 'http://127.0.0.1:9/'}]\n",
    )
    assert cli(["config", "check", str(path)]) == 0
    assert (
        "anomalies: rules nan, turbulence; on NaN: exit; 1 webhook; dumps on anomaly"
        in capsys.readouterr().out
    )


def test_cli_check_error_exits_2(cli, tmp_path, capsys):
    path = _write(tmp_path, "c.json", '{"ops": ["nrom"]}')
    assert cli(["config", "check", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"error: {path}: ops[0]: unknown op 'nrom'; did you mean 'norm'?")


def test_cli_check_missing_file(cli, tmp_path, capsys):
    assert cli(["config", "check", str(tmp_path / "x.yaml")]) == 2
    assert "config file not found" in capsys.readouterr().err


def test_cli_init_default_writes_trainmon_yaml(cli, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli(["config", "init"]) == 0
    written = tmp_path / "trainmon.yaml"
    assert written.exists()
    assert "wrote trainmon.yaml" in capsys.readouterr().out
    c = load_config(written)
    assert c.kinds == (
        "actv", "actv_grad", "grad_unreduced", "grad_reduced", "param_origin", "param_updated",
        "exp_avg", "exp_avg_sq", "update", "ratio",
    )  # fmt: skip
    assert c.ops == STATS
    assert written.read_text().startswith("# trainmon monitor config")


def test_cli_init_full_template_has_the_alert_and_grad_probe_sections_with_their_defaults(cli, capsys):
    assert cli(["config", "init", "-o", "-"]) == 0
    text = capsys.readouterr().out
    data = yaml.safe_load(text)
    assert list(data["alert"]) == list(AlertConfig.key_names())
    assert data["alert"]["on_nan"] == "continue" and data["alert"]["max_skips"] == 10
    assert data["alert"]["rate_limit_s"] == 300 and data["alert"]["webhooks"] == []
    assert data["grad_probe"]["grad_level"] == "L2" and data["grad_probe"]["sample_size"] == 1024
    config = load_config(data)
    assert config.alert == AlertConfig(rules=({"rule": "nan"}, {"rule": "straggler"}))
    assert config.grad_probe == GradProbe()
    # each key of a section is explained above it
    assert "  # continue | raise | exit | skip" in text and "\n  on_nan: continue\n" in text


def test_cli_init_refuses_to_overwrite(cli, tmp_path, capsys):
    path = _write(tmp_path, "mine.yaml", "keep: me\n")
    assert cli(["config", "init", "-o", str(path)]) == 1
    assert "use --force" in capsys.readouterr().err
    assert path.read_text() == "keep: me\n"
    assert cli(["config", "init", "-o", str(path), "--force", "--preset", "light"]) == 0
    assert load_config(path).kinds == ("grad_unreduced", "grad_reduced", "exp_avg", "exp_avg_sq")


@pytest.mark.parametrize("preset", ["full", "light", "msprobe"])
@pytest.mark.parametrize("fmt", ["yaml", "json"])
def test_cli_init_round_trips(cli, tmp_path, capsys, preset, fmt):
    from trainmon.cli.config_cmd import presets

    path = tmp_path / f"out.{fmt}"
    assert cli(["config", "init", "-o", str(path), "--preset", preset, "--format", fmt]) == 0
    assert load_config(path) == load_config(presets()[preset])
    assert cli(["config", "check", str(path)]) == 0
    assert "not implemented" not in capsys.readouterr().out


def test_cli_init_msprobe_preset_is_msprobe_style_json(cli, capsys):
    assert cli(["config", "init", "--preset", "msprobe", "-o", "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert isinstance(data["targets"], dict) and data["targets"]
    assert all(v == {} for v in data["targets"].values())
    assert data["format"] == "csv"


def test_cli_init_stdout_yaml(cli, capsys):
    assert cli(["config", "init", "-o", "-", "--preset", "light"]) == 0
    out = capsys.readouterr().out
    assert load_config(yaml.safe_load(out)).kinds == (
        "grad_unreduced",
        "grad_reduced",
        "exp_avg",
        "exp_avg_sq",
    )


def test_cli_init_format_from_extension_and_mismatch(cli, tmp_path, capsys):
    path = tmp_path / "c.json"
    assert cli(["config", "init", "-o", str(path)]) == 0
    json.loads(path.read_text())  # JSON because of the extension
    assert cli(["config", "init", "-o", str(tmp_path / "d.json"), "--format", "yaml"]) == 2
    assert "does not match" in capsys.readouterr().err


def test_cli_config_requires_an_action(cli):
    with pytest.raises(SystemExit) as e:
        cli(["config"])
    assert e.value.code == 2


# --- config check on what the docs show ---


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


def test_check_reports_every_error_of_a_file_at_once(tmp_path, capsys):
    """Not only the first (issue 32): each error as the loader says it, in the order it finds them, once."""
    path = tmp_path / "bad.yaml"
    path.write_text("ops: [min, mx]\neps: -1\nalert:\n  on_nan: explode\n  max_per_step: -3\n")
    assert main(["config", "check", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert [line.split(": ")[2] for line in lines] == ["ops[1]", "eps", "alert.on_nan", "alert.max_per_step"]
    assert all(line.startswith(f"error: {path}: ") for line in lines)
    assert "'mx'; did you mean 'max'?" in lines[0] and "-1" in lines[1]
    assert "'explode'" in lines[2] and "-3" in lines[3]
    path.write_text("ops: [min, max]\n")  # one error, or none: as before
    assert main(["config", "check", str(path)]) == 0
    path.write_text("{not yaml: [\n")  # a file that is no config has its one error
    assert main(["config", "check", str(path)]) == 2
    assert len(capsys.readouterr().err.splitlines()) == 1
