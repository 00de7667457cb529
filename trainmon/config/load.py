"""The one config loader: a file (JSON or YAML), a mapping or a :class:`MonitorConfig`, plus keyword
overrides, to a validated :class:`MonitorConfig`. msprobe monitor config files load unchanged."""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from trainmon.config.check import ConfigError, check_keys, describe
from trainmon.config.schema import MonitorConfig
from trainmon.joblog import job_wide

__all__ = ["load", "load_config", "parse_config_text", "read_config_file"]

logger = logging.getLogger("trainmon")


class _YamlLoader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e-8`` as a float (YAML 1.1 requires a dot, so PyYAML returns the
    string "1e-8"); configs copied from JSON then mean the same in YAML."""


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def _parse_json(text: str, file: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}", file=file) from None


def _parse_yaml(text: str, file: str) -> Any:
    try:
        return yaml.load(text, Loader=_YamlLoader)  # a SafeLoader subclass: no object construction
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"invalid YAML{where}: {problem}", file=file) from None


def read_config_file(file: str) -> Mapping[str, Any]:
    """The raw mapping of a config file, unvalidated. An empty file (or one of comments only) means all
    defaults, as no config does. Raises :class:`ConfigError`."""
    try:
        data = Path(file).read_bytes()
    except FileNotFoundError:
        raise ConfigError("config file not found", file=file) from None
    except OSError as e:
        raise ConfigError(f"cannot read config file: {e.strerror or e}", file=file) from None
    return parse_config_text(data, file)


def parse_config_text(data: bytes, file: str) -> Mapping[str, Any]:
    """The raw mapping of the contents ``data`` of config file ``file`` (its name picks JSON or YAML), as
    :func:`read_config_file` reads it."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError("config file is not UTF-8 text", file=file) from None
    if not text.strip():
        return {}
    ext = Path(file).suffix.lower()
    if ext == ".json":
        parsed = _parse_json(text, file)
    elif ext in (".yaml", ".yml"):
        parsed = _parse_yaml(text, file)
    else:
        try:
            parsed = _parse_json(text, file)
        except ConfigError:
            parsed = _parse_yaml(text, file)
    if parsed is None:  # YAML of comments only
        return {}
    if not isinstance(parsed, Mapping):
        got = describe(parsed)
        raise ConfigError(f"the top level must be a mapping of config keys, got {got}", file=file)
    return parsed


def _build(schema: type[MonitorConfig], raw: Mapping[Any, Any]) -> MonitorConfig:
    check_keys(raw, schema.all_keys(), None)
    known = set(schema.key_names())
    return schema(
        **{k: v for k, v in raw.items() if k in known},
        pending={k: v for k, v in raw.items() if k not in known},
    )


def load_config(source: Any = None, /, **overrides: Any) -> MonitorConfig:
    """Load and validate a monitor config.

    ``source`` is None (all defaults), a path to a ``.json`` / ``.yaml`` / ``.yml`` file (other
    extensions: JSON, then YAML), a mapping, or a :class:`MonitorConfig`. ``overrides`` are config keys
    applied on top and validated the same way. ``None`` for any key means its default.
    Raises :class:`ConfigError`.
    """
    return load(MonitorConfig, source, overrides)


def load(schema: type[MonitorConfig], source: Any, overrides: Mapping[str, Any]) -> MonitorConfig:
    """:func:`load_config` for the keys ``schema`` declares (``MonitorConfig`` or a subclass of it)."""
    file: str | None = None
    if source is None:
        raw: dict[Any, Any] = {}
    elif isinstance(source, MonitorConfig):
        if not overrides:
            return source
        raw = source.to_dict()
    elif isinstance(source, Mapping):
        raw = dict(source)
    elif isinstance(source, (str, os.PathLike)):
        file = os.path.expanduser(os.fspath(source))
        raw = dict(read_config_file(file))
    else:
        raise ConfigError(f"a config source is a path, a mapping or a MonitorConfig, got {describe(source)}")
    raw.update(overrides)
    try:
        config = _build(schema, raw)
    except ConfigError as e:
        if file is None:
            raise
        # Point at the file unless the bad value came from an override.
        top = re.split(r"[.\[/]", e.key or "", maxsplit=1)[0]
        raise ConfigError(e.reason, key=e.key, file=None if top in overrides else file) from None
    if config.pending_active:
        job_wide(logger).warning(
            "trainmon: config keys accepted but not implemented yet: %s", ", ".join(config.pending_active)
        )
    for note in config.advice:
        job_wide(logger).warning("trainmon: %s", note)
    return config
