"""Changing the monitor config while training runs.

:class:`ConfigWatcher` watches one config file. The monitor calls :meth:`ConfigWatcher.check` at every
step boundary; it costs one ``os.stat`` when nothing changed. A changed file is read once it has kept one
version (modification time, size, inode) for ``settle_s`` seconds (two looks at least that far apart), so a
file caught half-written by an editor that truncates it and then writes it is not applied; an empty file is
never read as "all defaults" (an edit in progress, or a mistake): the current config stays. When the settled
file loads, :meth:`check` returns a :class:`ConfigChange`, which the monitor applies from the next step. An
edit that does not load is ignored with one warning and the current config stays in force.

:class:`ConfigReloads` is what the monitor uses: in a single process the watcher's changes as they come; in
a process group only rank 0 reads the file, and its reading travels to every rank with a small collective
(:class:`trainmon.step.agree.RankAgreement`) at exchange steps the ranks agree on, so that every rank
applies an edit at the same step (see its docstring for the cost).

Two modes:

- plain hot reload (the default): every valid edit is applied, ``ConfigChange.enabled`` is always true.
- msprobe's dynamic mode (``DYNAMIC_MONITOR=true`` in the environment, or ``dynamic=True``): monitoring
  starts off, and the file's ``dynamic_on`` key switches it on and off; ``ConfigChange.enabled`` is that
  value. As in msprobe, the file is read at the first check even if it was not edited (once it has settled),
  so a file that already says ``dynamic_on: true`` turns monitoring on from the next step.

trainmon never writes the user's config file (msprobe rewrites ``dynamic_on: false`` into it after
``collect_times`` writes; trainmon does not). See ``docs/config.md``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from trainmon.config import ConfigError, MonitorConfig, load_config
from trainmon.config.keys import not_live
from trainmon.config.load import parse_config_text
from trainmon.joblog import job_wide, rank_note

if TYPE_CHECKING:
    from trainmon.step.agree import RankAgreement

__all__ = [
    "EditedConfig",
    "DYNAMIC_ENV",
    "SETTLE_S",
    "ConfigChange",
    "ConfigReloads",
    "ConfigWatcher",
    "dynamic_from_env",
]

logger = logging.getLogger("trainmon")

DYNAMIC_ENV = "DYNAMIC_MONITOR"
_TRUE = ("true", "1", "yes")
# A changed file is read once two looks at least this far apart found the same version. Editors write a
# config in one system call after truncating it; 20 ms is far longer than that window.
SETTLE_S = 0.02

# What identifies one version of the file without reading it: (st_mtime_ns, st_size, st_ino). The inode
# tells a file renamed over the config from the one before it, whatever their sizes and times.
_Signature = tuple[int, int, int]


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
    steps are very short. ``settle_s`` (seconds of ``clock``) is how long a changed file must keep one
    version before it is read (None: ``SETTLE_S``); 0 reads it at the first look.
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
        settle_s: float | None = None,
    ) -> None:
        self.path = os.path.expanduser(os.fspath(path))
        self._overrides = dict(overrides or {})  # keyword overrides given to attach() apply to every version
        self.current = current
        self.dynamic = dynamic_from_env() if dynamic is None else bool(dynamic)
        # Monitoring state as last reported: dynamic mode starts off until the file says dynamic_on.
        self.enabled = not self.dynamic
        self._clock = clock
        self._min_interval = float(min_interval)
        self._settle_s = float(SETTLE_S if settle_s is None else settle_s)
        self._last_stat: float | None = None
        self._stat_error: str | None = None  # the stat error already warned about
        self._missing = False  # the file was missing at the last check
        # The version of the file last read (good or bad). Dynamic mode reads the file at the first check,
        # as msprobe does, so it starts with no version.
        self._seen: _Signature | None = None
        # A version not read yet, and when it was first seen: read once it has settled.
        self._pending: tuple[_Signature, float] | None = None
        try:
            sig = self._stat()
        except OSError:
            sig = None
        if not self.dynamic:
            self._seen = sig
        elif sig is not None:
            self._pending = (sig, clock())  # the version attach loaded: settled from there

    def _stat(self) -> _Signature:
        st = os.stat(self.path)
        return (st.st_mtime_ns, st.st_size, st.st_ino)

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
            self._pending = None
            return None
        now = self._clock()
        if self._pending is None or self._pending[0] != sig:
            self._pending = (sig, now)
            if self._settle_s > 0:
                return None  # a version seen for the first time: it may still be being written
        elif now - self._pending[1] < self._settle_s:
            return None
        return self._read(sig)

    def _read(self, sig: _Signature) -> ConfigChange | None:
        try:
            with open(self.path, "rb") as f:
                data = f.read()
            after = self._stat()
        except OSError as e:
            self._warn_stat(e)
            return None
        if after != sig:  # written to while we read: look again once it settles
            self._pending = (after, self._clock())
            return None
        self._pending = None
        self._seen = sig
        if not data.strip():
            # a save in progress (truncated, not written yet) or a file emptied by mistake: never "all
            # defaults", which would silently switch every statistic off
            logger.warning(
                "trainmon: config file %s is empty; keeping the current config (an empty file is taken "
                "as an edit in progress, never as all defaults)",
                self.path,
            )
            return None
        try:
            new = load_config(parse_config_text(data, self.path), **self._overrides)
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
        waiting = not_live(self.current, new)
        if waiting:
            logger.warning(
                "trainmon: config file %s: %s %s read at attach only; the edit of it applies to the next run",
                self.path,
                ", ".join(waiting),
                "is" if len(waiting) == 1 else "are",
            )
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


# In a process group the ranks exchange about every _EXCHANGE_S seconds of steps, but at least every
# _MAX_GAP steps: an edit lands within 10 steps of rank 0 seeing it settle; a job of 0.1-1 s steps pays one
# small collective a second or so, not one per step (steps under 0.1 s: one per 10 steps).
_MAX_GAP = 10
_EXCHANGE_S = 1.0


class ConfigReloads:
    """Edits of a watched config file, applied by every rank at the same step.

    Alone (no process group, or one rank), :meth:`at_step_end` returns the watcher's changes as they come:
    an edit applies from the step after it has settled. In a process group only rank 0 reads the file;
    the others never do, so no two ranks can read different versions into different schedules. At an
    *exchange step* (chosen by rank 0 at the exchange before, the same on every rank) every rank joins one
    broadcast of 24 bytes from rank 0: the number of the newest version rank 0 has read, the size of its
    description, the step of the next exchange. When that number is new, a second broadcast carries the
    config (as JSON) and a third collective checks that every rank could load it; then every rank applies
    it from the next step, or, if one could not, none does. At attach the first exchange hands rank 0's
    config to every rank (ranks attaching while the file changes may have read different versions).

    The cost, and why: a store round trip at every step would put one request per rank per step on one
    server (too slow at 1000 ranks), and a collective at every step would synchronise the ranks' host
    threads at every step. An exchange is a gloo broadcast of CPU tensors (no accelerator is touched, see
    trainmon.step.agree), at most one per step, about one per second for steps of 0.1-1 s, one per 10
    steps for shorter ones; the price is latency: an edit lands at most 10 steps after rank 0 has seen it
    settle. Steps between exchanges cost rank 0 one ``os.stat`` and the others nothing.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        current: MonitorConfig,
        agreement: RankAgreement,
        *,
        overrides: Mapping[str, Any] | None = None,
        dynamic: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
        settle_s: float | None = None,
    ) -> None:
        self.watcher = ConfigWatcher(
            path, current, dynamic=dynamic, overrides=overrides, clock=clock, settle_s=settle_s
        )
        self.path = self.watcher.path
        self._agreement = agreement
        self._clock = clock
        self.current, self.enabled = current, self.watcher.enabled
        self._staged: ConfigChange | None = None  # rank 0: the newest version read, not yet exchanged
        self._version = 0  # rank 0: versions read so far
        self._agreed = -1  # the version every rank applies; -1: none yet (the first exchange sends one)
        self._next: int | None = None  # the step at whose end the ranks exchange next; None: the next end
        self._since: tuple[int, float] | None = None  # rank 0: (step, time) of the last exchange
        self._stopped = False

    def at_attach(self) -> ConfigChange | None:
        """In a process group, every rank takes rank 0's config now (every rank calls this at attach)."""
        if not self._agreement.shared or not self._agreement.ready("the config at attach"):
            return None
        return self._exchange(None)

    def at_step_end(self, step: int) -> ConfigChange | None:
        """At the end of ``step``: the change every rank applies from ``step + 1``, or None."""
        agreement = self._agreement
        if not agreement.shared:
            if agreement.broken is None:
                return self._take(self.watcher.check())  # alone: as the watcher sees it
            if not self._stopped:
                self._stopped = True
                logger.warning(
                    "trainmon: %sedits of config file %s are no longer applied on this rank: the ranks could "
                    "not agree on them (%s); the config in force stays",
                    rank_note(),
                    self.path,
                    agreement.broken,
                )
            return None
        if agreement.leader:
            change = self.watcher.check()
            if change is not None:
                self._staged, self._version = change, self._version + 1
        if self._next is not None and step < self._next:
            return None
        return self._exchange(step)

    def _take(self, change: ConfigChange | None) -> ConfigChange | None:
        if change is not None:
            self.current, self.enabled = change.config, change.enabled
        return change

    def _gap(self, step: int) -> int:
        """Rank 0: steps to the next exchange, about _EXCHANGE_S seconds of steps, 1 to _MAX_GAP."""
        now, since, self._since = self._clock(), self._since, (step, self._clock())
        if since is None or step <= since[0]:
            return 1
        per_step = (now - since[1]) / (step - since[0])
        return max(1, min(_MAX_GAP, math.ceil(_EXCHANGE_S / per_step) if per_step > 0 else _MAX_GAP))

    def _exchange(self, step: int | None) -> ConfigChange | None:
        import torch  # only a process group gets here

        agreement, leader = self._agreement, self._agreement.leader
        what = "an edit of the config file" if step is not None else "the config at attach"
        header = torch.zeros(3, dtype=torch.int64)
        payload = b""
        if leader:
            if self._version != self._agreed:
                offer = self._staged or ConfigChange(self.current, self.enabled)
                payload = json.dumps({"config": offer.config.to_dict(), "enabled": offer.enabled}).encode()
            header[0], header[1] = self._version, len(payload)
            header[2] = self._gap(step) if step is not None else 1
        if not agreement.broadcast(header, what):
            return None
        version, size, gap = (int(v) for v in header)
        self._next = None if step is None else step + gap
        if version == self._agreed:
            return None
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if leader and size else None
        if data is None:
            data = torch.empty(size, dtype=torch.uint8)
        if size and not agreement.broadcast(data, what):
            return None
        change, problem = self._offered(payload if leader else data.numpy().tobytes())
        failed = agreement.max(1 if problem else 0, what)
        if failed is None:
            return None
        self._agreed = version
        if leader:
            self._staged = None
        if failed:
            logger.warning(
                "trainmon: %signoring the edit to config file %s, keeping the current config: %s",
                rank_note(),
                self.path,
                problem or "another rank could not load it (its log says why)",
            )
            return None
        return self._take(change if change != ConfigChange(self.current, self.enabled) else None)

    def _offered(self, payload: bytes) -> tuple[ConfigChange | None, str]:
        """The config rank 0 sent, as this rank loads it, or the reason it cannot."""
        try:
            sent = json.loads(payload.decode("utf-8"))
            return ConfigChange(load_config(sent["config"]), bool(sent["enabled"])), ""
        except (ConfigError, ValueError, KeyError, TypeError) as e:
            return None, _describe_error(e)


class EditedConfig:
    """A monitor's config: the one given, or, given a file, the file's (every rank of a process group takes
    rank 0's at attach) with its edits applied as they land at step ends (:class:`ConfigReloads`)."""

    def __init__(
        self,
        config: MonitorConfig,
        path: str | os.PathLike[str] | None,
        agreement: RankAgreement,
        overrides: Mapping[str, Any] | None = None,
    ) -> None:
        self.reloads = None if path is None else ConfigReloads(path, config, agreement, overrides=overrides)
        agreed = self.reloads.at_attach() if self.reloads is not None else None
        self.first = agreed.config if agreed is not None else config  # the config in force at attach
        self.enabled = self.reloads is None or self.reloads.enabled  # msprobe's dynamic_on

    def at_step_end(self, step: int) -> ConfigChange | None:
        """The change every rank applies from ``step + 1``, or None."""
        change = self.reloads.at_step_end(step) if self.reloads is not None else None
        if change is not None:
            self.enabled = change.enabled
        return change

    def say_applied(self, step: int) -> None:
        """Once the change of ``step``'s end is applied."""
        assert self.reloads is not None
        job_wide(logger).warning(
            "trainmon: config %s reloaded; monitoring is %s from step %d",
            self.reloads.path,
            "on" if self.enabled else "off",
            step + 1,
        )
