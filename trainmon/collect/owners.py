"""One monitor per model and optimizer: a second attach would hook everything twice (each statistic recorded
twice, each step ended twice). Each hooked object maps to its open monitor, weakly on both sides, so the
registry keeps neither a model nor a monitor alive."""

from __future__ import annotations

import contextlib
import logging
import weakref
from pathlib import Path
from typing import Any, Protocol

from trainmon.adapters import Resolved
from trainmon.joblog import job_wide

logger = logging.getLogger("trainmon")

__all__ = ["claim", "close_previous", "release"]


class Owner(Protocol):
    """A monitor, as the registry sees it."""

    run_dir: Path

    @property
    def closed(self) -> bool: ...

    def close(self) -> None: ...


_OWNERS: weakref.WeakKeyDictionary[Any, weakref.ref[Any]] = weakref.WeakKeyDictionary()


def _hooked_objects(resolved: Resolved) -> list[Any]:
    """Every module of the model chunks, and the optimizer (or DeepSpeed engine) whose step is hooked."""
    objects: list[Any] = [module for chunk in resolved.chunks for module in chunk.modules()]
    if resolved.optimizer is not None:
        objects.extend(resolved.optimizer.hooked_objects())
    return objects


def close_previous(resolved: Resolved) -> None:
    """Close, with a warning, the open monitors of any object the new monitor is about to hook."""
    previous: dict[int, Owner] = {}
    for obj in _hooked_objects(resolved):
        try:
            ref = _OWNERS.get(obj)
        except TypeError:  # not weakly referenceable: never registered
            continue
        monitor = ref() if ref is not None else None
        if monitor is not None and not monitor.closed:
            previous[id(monitor)] = monitor
    for monitor in previous.values():
        job_wide(logger).warning(
            "trainmon: this model or optimizer already has a monitor (run %s); closing it and attaching the "
            "new one. Call monitor.close() before attaching another.",
            monitor.run_dir,
        )
        monitor.close()


def claim(monitor: Owner, resolved: Resolved) -> None:
    ref = weakref.ref(monitor)
    for obj in _hooked_objects(resolved):
        with contextlib.suppress(TypeError):  # not weakly referenceable: no check for it
            _OWNERS[obj] = ref


def release(monitor: Owner) -> None:
    for obj, ref in list(_OWNERS.items()):
        if ref() is monitor:
            _OWNERS.pop(obj, None)
