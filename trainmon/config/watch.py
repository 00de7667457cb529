"""Changing the monitor config while training runs.

:class:`ConfigWatcher` watches one config file. The monitor calls :meth:`ConfigWatcher.check` at every
step boundary; it costs one ``os.stat`` when nothing changed. When the file changed and still loads, it
returns a :class:`ConfigChange`, which the monitor applies from the next step. An edit that does not load is
ignored with one warning and the current config stays in force.

Two modes:

- plain hot reload (the default): every valid edit is applied, ``ConfigChange.enabled`` is always true.
- msprobe's dynamic mode (``DYNAMIC_MONITOR=true`` in the environment, or ``dynamic=True``): monitoring
  starts off, and the file's ``dynamic_on`` key switches it on and off; ``ConfigChange.enabled`` is that
  value. As in msprobe, the file is read at the first check even if it was not edited, so a file that
  already says ``dynamic_on: true`` turns monitoring on from the next step.

trainmon never writes the user's config file (msprobe rewrites ``dynamic_on: false`` into it after
``collect_times`` writes; trainmon does not). See ``docs/config.md``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from trainmon.config import ConfigError, MonitorConfig, load_config

__all__ = ["DYNAMIC_ENV", "ConfigChange", "ConfigWatcher", "dynamic_from_env"]

logger = logging.getLogger("trainmon")

DYNAMIC_ENV = "DYNAMIC_MONITOR"
_TRUE = ("true", "1", "yes")

# What identifies one version of the file without reading it: (st_mtime_ns, st_size).
_Signature = tuple[int, int]


def dynamic_from_env(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``DYNAMIC_MONITOR`` asks for msprobe's dynamic mode: ``true``, ``1`` or ``yes``, any case."""
    env = os.environ if environ is None else environ
    return env.get(DYNAMIC_ENV, "").strip().lower() in _TRUE


@dataclass(frozen=True)
class ConfigChange:
    """A new config to apply from the next step. ``enabled`` says whether monitoring should run at all:
    always true in plain mode, the file's ``dynamic_on`` in dynamic mode."""

    config: MonitorConfig
    enabled: bool


def _describe_error(e: Exception) -> str:
    if isinstance(e, ConfigError):
        # The file is named by the warning itself.
        return f"{e.key}: {e.reason}" if e.key else e.reason
    if isinstance(e, OSError):
        return e.strerror or str(e)
    return str(e)


class ConfigWatcher:
    """Watches a config file for edits during training.

    ``current`` is the config in force (normally the one loaded from ``path`` at start). ``dynamic`` picks
    the mode; None reads ``DYNAMIC_MONITOR`` from the environment once, here. ``min_interval`` (seconds of
    ``clock``, default 0) skips the ``stat`` when the last one was more recent than that, for loops whose
    steps are very short.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        current: MonitorConfig,
        *,
        dynamic: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
        min_interval: float = 0.0,
        overrides: Mapping[str, Any] | None = None,
    ) -> None:
        self.path = os.path.expanduser(os.fspath(path))
        self._overrides = dict(overrides or {})  # keyword overrides given to attach() apply to every version
        self.current = current
        self.dynamic = dynamic_from_env() if dynamic is None else bool(dynamic)
        # Monitoring state as last reported: dynamic mode starts off until the file says dynamic_on.
        self.enabled = not self.dynamic
        self._clock = clock
        self._min_interval = float(min_interval)
        self._last_stat: float | None = None
        self._stat_error: str | None = None  # the stat error already warned about
        self._missing = False  # the file was missing at the last check
        # The version of the file last read (good or bad). Dynamic mode reads the file at the first check,
        # as msprobe does, so it starts with no version.
        self._seen: _Signature | None = None
        if not self.dynamic:
            try:
                self._seen = self._stat()
            except OSError:
                self._seen = None

    def _stat(self) -> _Signature:
        st = os.stat(self.path)
        return (st.st_mtime_ns, st.st_size)

    def check(self) -> ConfigChange | None:
        """Call at a step boundary. Returns the change to apply from the next step, or None."""
        if self._min_interval > 0:
            now = self._clock()
            if self._last_stat is not None and now - self._last_stat < self._min_interval:
                return None
            self._last_stat = now
        try:
            sig = self._stat()
        except FileNotFoundError as e:
            # Editors that save by writing a temporary file and renaming it leave a short gap; only a
            # file still missing at the next check is worth a warning.
            if self._missing:
                self._warn_stat(e)
            self._missing = True
            return None
        except OSError as e:
            self._warn_stat(e)
            return None
        self._missing = False
        self._stat_error = None
        if sig == self._seen:
            return None
        self._seen = sig
        try:
            new = load_config(self.path, **self._overrides)
        except (ConfigError, OSError) as e:
            logger.warning(
                "trainmon: ignoring the edit to config file %s, keeping the current config: %s",
                self.path,
                _describe_error(e),
            )
            return None
        enabled = new.dynamic_on if self.dynamic else True
        if new == self.current and enabled == self.enabled:
            return None
        self.current = new
        self.enabled = enabled
        return ConfigChange(config=new, enabled=enabled)

    def _warn_stat(self, e: OSError) -> None:
        detail = _describe_error(e)
        if detail != self._stat_error:
            self._stat_error = detail
            logger.warning(
                "trainmon: cannot read config file %s, keeping the current config: %s", self.path, detail
            )
