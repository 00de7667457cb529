"""trainmon for MindSpore (PyNative mode): ``mon = trainmon.mindspore.attach(net, optimizer, config=...)``.

Imported only when used: ``import trainmon`` never imports MindSpore. Outputs (TensorBoard, CSV, stat
store, anomalies, manifest) are the PyTorch monitor's, so the CLI and the TensorBoard plugin read both.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainmon.config.check import ConfigError
from trainmon.config.load import load_config
from trainmon.config.schema import MonitorConfig
from trainmon.mindspore.monitor import MindSporeMonitor
from trainmon.rundir import default_run_dir

__all__ = ["MindSporeMonitor", "attach"]


def attach(
    net: Any,
    optimizer: Any = None,
    *,
    config: Any = None,
    logdir: str | Path | None = None,
    start_iteration: int = 0,
    on_alert: Callable[[Any], Any] | None = None,
    **overrides: Any,
) -> MindSporeMonitor:
    """Monitor ``net`` (an ``nn.Cell``) trained by ``optimizer`` (a MindSpore optimizer Cell), PyNative mode.

    ``config`` is a path (JSON/YAML, msprobe monitor configs accepted), a dict or a MonitorConfig, with
    keyword ``overrides`` on top, exactly as for :func:`trainmon.attach`. ``logdir`` is the run directory
    (default ``runs/<date>-<time>``, under ``$MONITOR_OUTPUT_DIR`` when set). A step ends at each call of
    the optimizer; steps are numbered from ``start_iteration``.
    """
    import mindspore as ms

    if ms.get_context("mode") != ms.PYNATIVE_MODE:
        raise RuntimeError(
            "trainmon.mindspore.attach: Cell hooks need PyNative mode; call "
            "mindspore.set_context(mode=mindspore.PYNATIVE_MODE) first"
        )
    parsed = load_config(config, **overrides)
    _check_supported(parsed)
    run_dir = Path(logdir) if logdir is not None else default_run_dir()
    return MindSporeMonitor(
        net, optimizer, parsed, run_dir, start_iteration=start_iteration, on_alert=on_alert
    )


def _check_supported(config: MonitorConfig) -> None:
    """What the PyTorch monitor does and this one cannot is refused, not silently ignored."""
    if config.alert.on_nan == "skip":
        raise ConfigError(
            "'skip' is not supported by trainmon.mindspore (it sees the optimizer Cell's call through hooks, "
            "which cannot keep the update from landing); use raise, exit or continue",
            key="alert.on_nan",
        )
    if config.alert.capture == "exact":
        raise ConfigError(
            "'exact' is not supported by trainmon.mindspore; use default (alert.dump: true dumps the "
            "flagged Cells at their next call)",
            key="alert.capture",
        )
