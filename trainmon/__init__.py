"""trainmon: a training monitor for large-model training.

``mon = trainmon.attach(model, optimizer, config="mon.yaml")`` hooks the model and optimizer;
statistics of every collected step go to TensorBoard and CSV under ``mon.run_dir``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainmon.adapters.megatron import MegatronHandle
    from trainmon.anomaly.alerts import Alert, TrainingNaNError
    from trainmon.config import ConfigError, MonitorConfig, load_config
    from trainmon.monitor import Monitor
    from trainmon.step.stepstats import StepStats

# Public names are imported on first use, so that readers of the files (the TensorBoard plugin, the
# CLI's readers) can import ``trainmon.run.records`` without importing torch.
_LAZY = {
    "Alert": "trainmon.anomaly.alerts",
    "TrainingNaNError": "trainmon.anomaly.alerts",
    "ConfigError": "trainmon.config",
    "MonitorConfig": "trainmon.config",
    "load_config": "trainmon.config",
    "Monitor": "trainmon.monitor",
    "StepStats": "trainmon.step.stepstats",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'trainmon' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__version__ = "0.1.0"
__all__ = [
    "Alert",
    "ConfigError",
    "Monitor",
    "MonitorConfig",
    "StepStats",
    "TrainingNaNError",
    "attach",
    "enable_megatron",
    "load_config",
    "__version__",
]


def attach(
    model: Any,
    optimizer: Any = None,
    *,
    config: Any = None,
    logdir: str | Path | None = None,
    grad_acc_steps: int | None = None,
    start_iteration: int | None = None,
    grad_scaler: Any = None,
    on_alert: Callable[[Alert], Any] | None = None,
    **overrides: Any,
) -> Monitor:
    """Start monitoring ``model`` (an ``nn.Module`` or a list of model chunks) trained by ``optimizer``.

    ``config`` is a path (JSON/YAML, msprobe monitor configs accepted), a dict or a MonitorConfig;
    keyword ``overrides`` replace single keys. ``logdir`` is the run directory (default
    ``runs/<date>-<time>``, under ``$MONITOR_OUTPUT_DIR`` when set; the same folder on every rank of a job,
    see docs/distributed.md). Steps are numbered from
    ``start_iteration``; ``grad_acc_steps`` is the number of micro-batches per optimizer step (both
    default to what the framework knows, e.g. a DeepSpeed engine's, else 0 and 1).
    When ``config`` is a file, edits to it apply from the next step (with ``DYNAMIC_MONITOR=true``,
    msprobe's dynamic mode: monitoring starts off and the file's ``dynamic_on`` switches it).
    With a ``torch.amp.GradScaler`` as ``grad_scaler``, steps it skips (loss-scale overflow) still end
    and are reported as such, not as NaN alarms. ``on_alert(alert)`` is called (from a background thread)
    for every alert, besides the log and the configured webhooks.
    """
    from trainmon.adapters import resolve
    from trainmon.config import load_config
    from trainmon.monitor import Monitor
    from trainmon.rundir import job_run_dir

    _check_keywords(overrides)
    parsed = load_config(config, **overrides)
    resolved = resolve(model, optimizer)
    run_dir = Path(logdir) if logdir is not None else job_run_dir()
    # a config file is watched for edits, applied from the next step, with the same overrides
    watched = config if isinstance(config, (str, os.PathLike)) else None
    monitor = Monitor(
        resolved,
        parsed,
        run_dir,
        grad_acc_steps=_first_given(grad_acc_steps, resolved.grad_acc_steps, 1),
        start_iteration=_first_given(start_iteration, resolved.start_iteration, 0),
        config_path=watched,
        overrides=overrides,
        on_alert=on_alert,
    )
    if grad_scaler is not None:
        monitor.watch_grad_scaler(grad_scaler)
    return monitor


def _check_keywords(overrides: dict[str, Any]) -> None:
    """A keyword that is no config key but resembles one of attach's own arguments (``logdri=``,
    ``grad_acc=``) is that argument misspelt: say so, instead of the config loader's list of config keys."""
    import difflib
    import inspect

    from trainmon.config import ConfigError, MonitorConfig

    config_keys = set(MonitorConfig.all_keys())
    # read from the signature, so an argument added to attach is suggested without touching this list
    own = [n for n, p in inspect.signature(attach).parameters.items() if p.kind is p.KEYWORD_ONLY]

    def closest(key: str, names: list[str]) -> tuple[float, str]:
        # difflib's similarity; below its usual cutoff (0.6) a name is no suggestion
        return max(((difflib.SequenceMatcher(None, key, n).ratio(), n) for n in names), default=(0.0, ""))

    for key in overrides:
        if key in config_keys:
            continue
        (score, arg), (config_score, config_key) = closest(key, own), closest(key, sorted(config_keys))
        # a tie names both: start_iter is as close to start_iteration as to the config key start_step
        if score >= 0.6 and score >= config_score:
            also = f" (or the config key {config_key!r})" if config_score == score else ""
            raise ConfigError(
                f"unknown keyword argument {key!r}; did you mean attach's argument {arg!r}{also}? "
                f"(attach's arguments: {', '.join(own)}; any other keyword is a config key)",
                key=key,
            )


def _first_given(*values: int | None) -> int:
    return next(int(v) for v in values if v is not None)


def enable_megatron(config: Any = None, **attach_kwargs: Any) -> MegatronHandle:
    """The one line before ``pretrain(...)`` in a Megatron-LM script.

    Wraps ``megatron.training.training.setup_model_and_optimizer`` (``pretrain`` calls it as a module
    global), and attaches a monitor to the model chunks and the optimizer it returns, with
    ``grad_acc_steps`` and ``start_iteration`` (``args.iteration``, set by checkpoint loading) read from
    Megatron's ``get_args()``. Keyword arguments go to :func:`attach` and win over those.
    """
    from trainmon.adapters.megatron import wrap_setup

    return wrap_setup(attach, config, attach_kwargs)
