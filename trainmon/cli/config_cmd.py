"""``trainmon config check FILE`` and ``trainmon config init``: validate or create a monitor config."""

from __future__ import annotations

import argparse
import contextlib
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
from trainmon.config.keys import Declared, Section, plain
from trainmon.config.load import load, read_config_file
from trainmon.config.schema import MonitorConfig

# Exit codes: 0 ok, 1 refused (file exists), 2 bad config or bad arguments.
EXIT_REFUSED = 1
EXIT_BAD_CONFIG = 2

# The schema the command reads: its declarations give the templates, their comments and the checks.
SCHEMA: type[MonitorConfig] = MonitorConfig

# What each preset sets; every other key of a template is written with its default (or its example).
_FULL = {
    "xy_distribution": True,
    "wg_distribution": True,
    "mv_distribution": True,
    "ur_distribution": True,
    "param_distribution": True,
}
_SCHEDULE_KEYS = ("start_step", "step_interval", "collect_times", "module_ranks")
# What an msprobe user already has: a targets dict (values are ignored), a format string.
_MSPROBE_EXAMPLE = {
    "targets": ["decoder.layers.0", "decoder.layers.1"],
    "xy_distribution": True,
    "wg_distribution": True,
    "mv_distribution": True,
    "ops": ["min", "max", "norm", "zeros", "nans"],
    "ndigits": 6,
    "format": "csv",
}


def presets(schema: type[MonitorConfig] | None = None) -> dict[str, dict[str, Any]]:
    """The templates of ``config init``, as plain data: ``full`` (every key, the collection switched on),
    ``light`` (gradients and Adam moments only: no module hooks, so forward and backward are untouched) and
    ``msprobe`` (every msprobe key, in msprobe's spelling)."""
    schema = schema or SCHEMA
    return {
        "full": {**_examples(schema), **_FULL},
        "light": {
            "wg_distribution": True,
            "mv_distribution": True,
            "format": ["tensorboard", "csv"],
            **{k: v for k, v in _examples(schema).items() if k in _SCHEDULE_KEYS},
        },
        "msprobe": load(schema, _MSPROBE_EXAMPLE, {}).msprobe_dict(),
    }


def _examples(section: type[Section]) -> dict[str, Any]:
    """Every key of ``section`` with its default (or the example its declaration gives), sections expanded."""
    out = {}
    for d in section.declared():
        value = d.example
        out[d.name] = _examples(type(value)) if isinstance(value, Section) else plain(value)
    return out


def _comments(section: type[Section], prefix: str = "") -> dict[str, str]:
    """The comment above each key of a template ("section.key" for a section's keys): its help line."""
    out = {}
    for d in section.declared():
        out[prefix + d.name] = _help(d)
        if isinstance(d.default, Section):
            out.update(_comments(type(d.default), f"{prefix}{d.name}."))
    return out


def _help(d: Declared) -> str:
    return d.key.help + ("" if d.key.live else " (read at attach: an edit applies to the next run)")


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
        "--preset", choices=sorted(presets()), default="full", help="what to collect (default: full)"
    )
    init.add_argument(
        "--format",
        choices=("yaml", "json"),
        help="file format (default: from the output extension; json for --preset msprobe, else yaml)",
    )
    init.add_argument("--force", action="store_true", help="overwrite an existing file")
    init.set_defaults(func=_init)


def _anomaly_summary(config: MonitorConfig) -> str:
    alert = config.alert
    rules = ", ".join(rule.rule for rule in alert.evaluated_rules)  # the rules the run will evaluate
    return f"anomalies: rules {rules}; on NaN: {alert.on_nan}; {plural(len(alert.webhooks), 'webhook')}" + (
        "; dumps on anomaly" if alert.dump else ""
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
            config = load(SCHEMA, args.file, {})
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
        print(
            f"  note: {path}: ${name} is not set here; checked with a placeholder. Set it where the job "
            "runs (the job stops at attach without it); --require-env makes this an error"
        )
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


def render_template(preset: str, fmt: str, schema: type[MonitorConfig] | None = None) -> str:
    """The text of a template config; ``load_config`` reads it back to ``load_config(presets()[preset])``."""
    schema = schema or SCHEMA
    data = presets(schema)[preset]
    if fmt == "json":
        return json.dumps(data, indent=4) + "\n"
    comments = _comments(schema)
    lines = [f"# trainmon monitor config (preset: {preset}). Reference: docs/config.md", ""]
    for key, value in data.items():
        if key in comments:
            lines.append(f"# {comments[key]}")
        if isinstance(value, Mapping) and value and f"{key}.{next(iter(value))}" in comments:
            lines.append(f"{key}:")
            for sub, sub_value in value.items():
                if f"{key}.{sub}" in comments:
                    lines.append(f"  # {comments[f'{key}.{sub}']}")
                lines.append(f"  {sub}: {_yaml_flow(sub_value)}")
        else:
            lines.append(f"{key}: {_yaml_flow(value)}")
    return "\n".join(lines) + "\n"


def _yaml_flow(value: Any) -> str:
    # One line per key keeps the comments next to their values; "..." ends a bare scalar document.
    text = yaml.safe_dump(value, default_flow_style=True, width=1000).strip()
    return text.removesuffix("...").strip()
