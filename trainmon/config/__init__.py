"""The monitor configuration: the typed schema (``schema``), its loader (``load``), the validators every
section uses (``check``), target patterns (``targets``) and the watcher that applies edits (``watch``).

The public names are importable from here; they are loaded on first use, so that the modules that validate
sections of the config (the anomaly rules, the alert delivery) can import ``trainmon.config.check`` while
the schema imports them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainmon.config.check import ConfigError
    from trainmon.config.load import load_config, read_config_file
    from trainmon.config.schema import (
        ALLOWED_FORMATS,
        ALLOWED_OPS,
        PENDING_KEYS,
        AlertConfig,
        CcDistribution,
        GradProbe,
        MonitorConfig,
    )

_PUBLIC = {
    "ConfigError": "trainmon.config.check",
    "load_config": "trainmon.config.load",
    "read_config_file": "trainmon.config.load",
    "ALLOWED_FORMATS": "trainmon.config.schema",
    "ALLOWED_OPS": "trainmon.config.schema",
    "PENDING_KEYS": "trainmon.config.schema",
    "AlertConfig": "trainmon.config.schema",
    "CcDistribution": "trainmon.config.schema",
    "GradProbe": "trainmon.config.schema",
    "MonitorConfig": "trainmon.config.schema",
}
__all__ = [
    "ALLOWED_FORMATS",
    "ALLOWED_OPS",
    "PENDING_KEYS",
    "AlertConfig",
    "CcDistribution",
    "ConfigError",
    "GradProbe",
    "MonitorConfig",
    "load_config",
    "read_config_file",
]


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'trainmon.config' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
