"""The monitor configuration: every key declared once (``keys``: how; ``schema``, ``alert``, ``rules``: the
sections), its loader (``load``), the validators every section uses (``check``), target patterns
(``targets``), the key tables of the docs (``reference``) and the watcher that applies edits (``watch``)."""

from __future__ import annotations

from trainmon.config.alert import AlertConfig, Webhook
from trainmon.config.check import ConfigError
from trainmon.config.load import load_config, read_config_file
from trainmon.config.schema import (
    ALLOWED_FORMATS,
    ALLOWED_OPS,
    PENDING_KEYS,
    CcDistribution,
    GradProbe,
    MonitorConfig,
)

__all__ = [
    "ALLOWED_FORMATS",
    "ALLOWED_OPS",
    "PENDING_KEYS",
    "AlertConfig",
    "CcDistribution",
    "ConfigError",
    "GradProbe",
    "MonitorConfig",
    "Webhook",
    "load_config",
    "read_config_file",
]
