"""``trainmon config check FILE`` and ``trainmon config init``: validate or create a monitor config."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

from trainmon.cli.config_errors import every_error
from trainmon.cli.words import plural
from trainmon.config.check import ConfigError
from trainmon.config.load import load_config, read_config_file
from trainmon.config.schema import AlertConfig, MonitorConfig

# Exit codes: 0 ok, 1 refused (file exists), 2 bad config or bad arguments.
EXIT_REFUSED = 1
EXIT_BAD_CONFIG = 2

# Keys of the templates, in the order they are written; values are the schema's defaults (MonitorConfig).
_TEMPLATE_KEYS = (
    "targets",
    "all_xy",
    "xy_distribution",
    "forward_only",
    "backward_only",
    "wg_distribution",
    "monitor_mbs_grad",
    "mv_distribution",
    "ur_distribution",
    "param_distribution",
    "squash_name",
    "ops",
    "eps",
    "ndigits",
    "format",
    "start_step",
    "step_interval",
    "collect_times",
    "module_ranks",
    "sync_timeout_s",
    "tensorboard_ranks",
    "csv_ranks",
    "alert",
    "grad_probe",
)
_SCHEDULE_KEYS = ("start_step", "step_interval", "collect_times", "module_ranks")


def _defaults(*keys: str) -> dict[str, Any]:
    """``keys`` with the schema's default values, sections (``alert``, ``grad_probe``) with all their keys."""
    config = MonitorConfig()
    out = config.to_dict()
    out["alert"] = {
        f.name: getattr(config.alert, f.name) for f in dataclasses.fields(AlertConfig) if f.name != "given"
    }
    # the default rule set spelled out, so the template shows where rules go
    out["alert"]["rules"] = [{"rule": "nan"}]
    out["alert"] = {k: _plain(v) for k, v in out["alert"].items()}
    return {k: out[k] for k in keys}


def _plain(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v


PRESETS: dict[str, dict[str, Any]] = {
    # Everything trainmon collects: activations, gradients, optimizer state, parameters; every key shown.
    "full": {
        **_defaults(*_TEMPLATE_KEYS),
        "xy_distribution": True,
        "wg_distribution": True,
        "mv_distribution": True,
        "ur_distribution": True,
        "param_distribution": True,
    },
    # Gradients and Adam moments only: no module hooks, so the forward/backward pass is untouched.
    "light": {
        "wg_distribution": True,
        "mv_distribution": True,
        "format": ["tensorboard", "csv"],
        **_defaults(*_SCHEDULE_KEYS),
    },
    # What an msprobe user already has: a targets dict (values are ignored), a format string.
    "msprobe": {
        "targets": {"decoder.layers.0": {}, "decoder.layers.1": {}},
        "xy_distribution": True,
        "forward_only": False,
        "backward_only": False,
        "all_xy": False,
        "wg_distribution": True,
        "mv_distribution": True,
        "param_distribution": False,
        "ops": ["min", "max", "norm", "zeros", "nans"],
        "eps": 1e-8,
        "ndigits": 6,
        "format": "csv",
        **_defaults(*_SCHEDULE_KEYS),
    },
}

# One-line explanations written above each key of a YAML template ("section.key" for a section's keys).
_COMMENTS = {
    "targets": "module / parameter names; globs (*?[) and 're:' regexes allowed; [] = everything",
    "all_xy": "hook every module for activations, whatever targets says",
    "xy_distribution": "activations: module inputs/outputs (actv) and their gradients (actv_grad)",
    "forward_only": "activations: forward only",
    "backward_only": "activations: backward only",
    "wg_distribution": "weight gradients before (grad_unreduced) and after (grad_reduced) the reduction",
    "monitor_mbs_grad": "unreduced gradients per micro-batch",
    "mv_distribution": "Adam moments exp_avg / exp_avg_sq, after the optimizer step",
    "ur_distribution": "Adam update m/(sqrt(v)+eps) and ratio m/sqrt(v)",
    "param_distribution": "parameters before (param_origin) and after (param_updated) the optimizer step",
    "squash_name": "shorten long Megatron names to the part from 'layers.' / 'embedding.' / ... on",
    "ops": "statistics written: min, max, mean, norm, zeros, nans, infs",
    "eps": "|x| <= eps counts as zero",
    "ndigits": "CSV floats: null = every digit of the float32; N = rounded to N decimal places (msprobe)",
    "format": "outputs: tensorboard, csv, api (in memory only)",
    "start_step": "first step collected",
    "step_interval": "collect every N steps",
    "collect_times": "stop after this many collected steps",
    "module_ranks": "ranks that collect; [] = all",
    "sync_timeout_s": "process group: seconds a rank waits when the ranks agree on a config edit or a skip",
    "tensorboard_ranks": "ranks with TensorBoard events: auto | all | [ranks] (-1 = last); + all_ranks run",
    "csv_ranks": "ranks with CSV files: auto (above 16 ranks: those with events) | all | [ranks]",
    "alert": "anomaly rules, where alerts go and what happens on a NaN (docs/alerts.md)",
    "alert.rules": "rules: nan, turbulence, zscore, max_ratio, threshold (docs/anomalies.md); nan = NaN/Inf",
    "alert.dump": "dump the module where a NaN started and the flagged tensors (docs/dumps.md)",
    "alert.on_nan": "continue | raise | exit | skip (keep the NaN step's update from landing)",
    "alert.exit_code": "process exit code of on_nan: exit",
    "alert.max_per_step": "anomaly records a step; the rest are counted in one 'suppressed' record",
    "alert.saturation": "also flag values at the largest finite value of their dtype",
    "alert.capture": "default | exact (check and dump the step's own tensors before the update)",
    "alert.max_skips": "on_nan: skip skips at most this many steps, then raises",
    "alert.webhooks": "[{url or url_env, kind: generic|slack|dingtalk|feishu, secret(_env), timeout_s}]",
    "alert.rate_limit_s": "one alert line per (rule, kind, tensor) per this many seconds; 0 = no limit",
    "alert.max_queue": "alerts waiting for delivery; more are dropped and counted",
    "alert.max_lines": "lines in one alert before a '+N more alert lines' line",
    "grad_probe": "gradient fingerprints for trainmon compare (docs/grad_probe.md)",
    "grad_probe.enable": "write fingerprints of every parameter's gradient at collected steps",
    "grad_probe.grad_level": "L0: statistics; L1: + direction sketch (sampled values); L2: + bins",
    "grad_probe.param_list": "parameter names or globs; [] = every parameter the optimizer updates",
    "grad_probe.bounds": "histogram bin edges of L2",
    "grad_probe.sample_size": "sampled elements per parameter (L1, L2)",
    "grad_probe.sign_bitmap": "also every element's sign, 1 bit each (L1, L2)",
    "grad_probe.sample_seed": "name | shape: what the sample positions are seeded by",
}


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "config",
        help="check or create a monitor config file",
        description="Validate a monitor config (trainmon or msprobe format) or write a template.",
    )
    actions = parser.add_subparsers(dest="config_action", required=True, metavar="ACTION")

    check = actions.add_parser(
        "check",
        help="validate a config file and summarise what it collects",
        description="Validate a config file and summarise what it collects. Webhook URLs and secrets "
        "read from environment variables (url_env, secret_env) that are not set where you check are "
        "checked with a placeholder and reported; the job itself needs them set.",
    )
    check.add_argument("file", metavar="FILE", help="JSON or YAML config file (an empty file: all defaults)")
    check.add_argument(
        "--require-env",
        action="store_true",
        help="fail, as the job would, when a url_env/secret_env variable is not set here",
    )
    check.set_defaults(func=_check)

    init = actions.add_parser("init", help="write a template config file")
    init.add_argument(
        "-o", "--output", metavar="FILE", help="output file, '-' for stdout (default: trainmon.yaml)"
    )
    init.add_argument(
        "--preset", choices=sorted(PRESETS), default="full", help="what to collect (default: full)"
    )
    init.add_argument(
        "--format",
        choices=("yaml", "json"),
        help="file format (default: from the output extension; json for --preset msprobe, else yaml)",
    )
    init.add_argument("--force", action="store_true", help="overwrite an existing file")
    init.set_defaults(func=_init)


def _anomaly_summary(config: MonitorConfig) -> str:
    from trainmon.anomaly.rules import RULES, rules_for_alert  # the rules the run will evaluate

    alert = config.alert
    names = {cls: name for name, cls in RULES.items()}
    rules = ", ".join(names[type(rule)] for rule in rules_for_alert(alert))
    return (
        f"anomalies: rules {rules}; on NaN: {alert.on_nan}; "
        f"{plural(len(alert.webhooks), 'webhook')}" + ("; dumps on anomaly" if alert.dump else "")
    )


# --- check ---


# What an unset url_env/secret_env variable stands for while checking: a URL WebhookSink accepts and that
# can never be reached (.invalid is reserved), should it ever be used.
_PLACEHOLDER = {"url_env": "https://placeholder.invalid/trainmon-config-check", "secret_env": "placeholder"}


def _unset_env(file: str) -> list[tuple[str, str, str]]:
    """``(key path, variable, env key)`` of each webhook variable the file names that is not set here."""
    try:
        raw = read_config_file(file)
    except ConfigError:
        return []  # load_config reports it
    alert = raw.get("alert")
    hooks = alert.get("webhooks") if isinstance(alert, Mapping) else None
    if not isinstance(hooks, list):
        return []
    out = []
    for i, hook in enumerate(hooks):
        if not isinstance(hook, Mapping):
            continue
        for key in ("url_env", "secret_env"):
            name = hook.get(key)
            if isinstance(name, str) and name and not os.environ.get(name):
                out.append((f"alert.webhooks[{i}].{key}", name, key))
    return out


@contextlib.contextmanager
def _placeholders(unset: list[tuple[str, str, str]]) -> Iterator[None]:
    """Set each unset variable to a placeholder for the duration of the check."""
    names = {name: _PLACEHOLDER[key] for _, name, key in unset}
    os.environ.update(names)
    try:
        yield
    finally:
        for name in names:
            os.environ.pop(name, None)


def _check(args: argparse.Namespace) -> int:
    unset = [] if args.require_env else _unset_env(args.file)
    try:
        with _placeholders(unset):
            config = load_config(args.file)
    except ConfigError as e:
        with _placeholders(unset):  # every error of the file, not only the first (config_errors.py)
            errors = every_error(args.file, e)
        for error in errors:
            print(f"error: {error}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    print(f"OK: {args.file}")
    for line in summarize(config):
        print(f"  {line}")
    for path, name, _ in unset:
        print(f"  note: {path}: ${name} is not set here; checked with a placeholder. Set it where the job "
              "runs (the job stops at attach without it); --require-env makes this an error")
    return 0


def summarize(config: MonitorConfig) -> list[str]:
    """A few human lines on what ``config`` will collect, when and where."""
    lines = [
        f"collect: {', '.join(config.kinds)}"
        if config.kinds
        else "collect: nothing (no *_distribution key is on)"
    ]
    if config.xy_enabled:
        scope = "all modules" if config.monitor_all_modules else f"modules matching {_targets(config)}"
        direction = "forward only" if config.forward_only else "backward only" if config.backward_only else ""
        lines.append(f"activations: {scope}" + (f", {direction}" if direction else ""))
    if any(
        (config.wg_distribution, config.mv_distribution, config.ur_distribution, config.param_distribution)
    ):
        scope = f"parameters matching {_targets(config)}" if config.targets else "all parameters"
        per_micro = ", per micro-batch" if config.wg_distribution and config.monitor_mbs_grad else ""
        lines.append(f"parameters: {scope}{per_micro}")
    lines.append(f"ops: {', '.join(config.ops)} (eps {config.eps:g})")
    schedule = f"schedule: from step {config.start_step}, every {plural(config.step_interval, 'step')}"
    if config.collect_times < 100_000_000:
        schedule += f", at most {plural(config.collect_times, 'collection')}"
    ranks = ", ".join(map(str, config.module_ranks)) if config.module_ranks else "all"
    lines.append(f"{schedule}; ranks: {ranks}")
    lines.append(f"output: {', '.join(config.format)}" + (", names squashed" if config.squash_name else ""))
    lines.append(_anomaly_summary(config))
    if config.pending_active:
        lines.append(f"not implemented yet (ignored): {', '.join(config.pending_active)}")
    lines += [f"note: {note}" for note in config.advice]
    return lines


def _targets(config: MonitorConfig) -> str:
    shown = ", ".join(config.targets[:5])
    more = f" (+{len(config.targets) - 5} more)" if len(config.targets) > 5 else ""
    return f"{shown}{more}"


# --- init ---


def _init(args: argparse.Namespace) -> int:
    output = args.output or None
    ext_format = _format_from_extension(output)
    fmt = args.format or ext_format or ("json" if args.preset == "msprobe" else "yaml")
    if ext_format and fmt != ext_format:
        print(f"error: --format {fmt} does not match the file name {output}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    if output is None:
        output = f"trainmon.{fmt}"
    text = render_template(args.preset, fmt)
    if output == "-":
        sys.stdout.write(text)
        return 0
    path = Path(output)
    if path.exists() and not args.force:
        print(f"error: {output} exists; use --force to overwrite it", file=sys.stderr)
        return EXIT_REFUSED
    path.write_text(text, encoding="utf-8")
    print(f"wrote {output} (preset {args.preset}); check it with: trainmon config check {output}")
    return 0


def _format_from_extension(output: str | None) -> str | None:
    if not output or output == "-":
        return None
    suffix = Path(output).suffix.lower()
    return {".json": "json", ".yaml": "yaml", ".yml": "yaml"}.get(suffix)


def render_template(preset: str, fmt: str) -> str:
    """The text of a template config; ``load_config`` reads it back to ``load_config(PRESETS[preset])``."""
    data = PRESETS[preset]
    if fmt == "json":
        return json.dumps(data, indent=4) + "\n"
    lines = [f"# trainmon monitor config (preset: {preset}). Reference: docs/config.md", ""]
    for key, value in data.items():
        if key in _COMMENTS:
            lines.append(f"# {_COMMENTS[key]}")
        if isinstance(value, Mapping) and value and key in ("alert", "grad_probe"):
            lines.append(f"{key}:")
            for sub, sub_value in value.items():
                if f"{key}.{sub}" in _COMMENTS:
                    lines.append(f"  # {_COMMENTS[f'{key}.{sub}']}")
                lines.append(f"  {sub}: {_yaml_flow(sub_value)}")
        else:
            lines.append(f"{key}: {_yaml_flow(value)}")
    return "\n".join(lines) + "\n"


def _yaml_flow(value: Any) -> str:
    # One line per key keeps the comments next to their values; "..." ends a bare scalar document.
    text = yaml.safe_dump(value, default_flow_style=True, width=1000).strip()
    return text.removesuffix("...").strip()
