"""What every collector shares: arming per step, and never letting a monitor fault reach training."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

logger = logging.getLogger("trainmon")

F = TypeVar("F", bound=Callable[..., Any])


class Collector(Protocol):
    def arm(self) -> None:
        """Install the hooks needed for the step about to start."""

    def disarm(self) -> None:
        """Remove them (off steps, close)."""


def guarded(what: str) -> Callable[[F], F]:
    """Wrap a hook so an exception inside the monitor is logged (once per hook) and training goes on.

    Exceptions marked ``reaches_training`` (the NaN action the user configured) pass through."""

    def decorate(fn: F) -> F:
        failed = False

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            nonlocal failed
            try:
                return fn(*args, **kwargs)
            except Exception as error:
                if getattr(error, "reaches_training", False):  # what the user asked for (alert.on_nan: raise)
                    raise
                if not failed:
                    failed = True
                    logger.exception("trainmon: %s failed; training continues without it for this call", what)
                return None

        return wrapper  # type: ignore[return-value]

    return decorate
