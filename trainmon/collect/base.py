"""What every collector shares: arming per step, and never letting a monitor fault reach training."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from trainmon.joblog import rank_note

logger = logging.getLogger("trainmon")

F = TypeVar("F", bound=Callable[..., Any])


class Collector(Protocol):
    def arm(self) -> None:
        """Install the hooks needed for the step about to start."""

    def disarm(self) -> None:
        """Remove them (off steps, close)."""


class Guard:
    """A hook's protection against the monitor's own faults: :meth:`failed`, called in the hook's ``except
    Exception`` clause, logs the first failure (with its traceback) and lets training go on; exceptions
    marked ``reaches_training`` (the NaN action the user configured) are raised on. The hottest hooks (one
    call per monitored tensor) catch inline with one, which saves them a wrapper's frame; the others are
    wrapped by :func:`guarded`."""

    __slots__ = ("what", "_failed")

    def __init__(self, what: str) -> None:
        self.what = what
        self._failed = False

    def failed(self, error: Exception) -> None:
        if getattr(error, "reaches_training", False):  # what the user asked for (alert.on_nan: raise)
            raise error
        if not self._failed:
            self._failed = True
            logger.exception(
                "trainmon: %s%s failed; training continues without it for this call", rank_note(), self.what
            )


def guarded(what: str) -> Callable[[F], F]:
    """Wrap a hook so an exception inside the monitor is logged (once per hook) and training goes on
    (:class:`Guard`)."""

    def decorate(fn: F) -> F:
        guard = Guard(what)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except Exception as error:
                guard.failed(error)
                return None

        return wrapper  # type: ignore[return-value]

    return decorate


class HookSlot:
    """A hook that stays the same object from one collected step to the next: registered once through torch
    (``register``, a call that returns torch's ``RemovableHandle``), taken out of its owner's hook tables by
    :meth:`disarm` and written back under the same id by :meth:`arm`, which is what registering writes.

    Hooks are installed only for collected steps, so a schedule that collects every tenth step arms and
    disarms every module's hooks each time; registering anew then made a handle, its weak references and the
    hook's closures per hook, ~8,000 objects a collected step on a 16-layer GPT, which lived across the step
    and were promoted to the oldest generation (bringing full collections on). Arming a slot again allocates
    nothing. Where a torch's handle does not say where it wrote the hook, it registers anew each time."""

    __slots__ = ("_register", "_handle", "_hook", "_marks")

    def __init__(self, register: Callable[[], Any]) -> None:
        self._register = register
        self._handle: Any = None
        self._hook: Any = None
        self._marks: tuple[tuple[Any, Any], ...] = ()  # (weak ref of a side table, the id's value there)

    def arm(self) -> None:
        handle = self._handle
        table = handle.hooks_dict_ref() if handle is not None and self._hook is not None else None
        if table is None:  # the first arm, a handle that says nothing, or an owner gone
            self._handle = handle = self._register()
            ref = getattr(handle, "hooks_dict_ref", None)
            table = ref() if ref is not None else None
            self._hook = table.get(handle.id) if table is not None else None
            # the side tables (with_kwargs, always_call) that took the id: written back with the hook
            self._marks = tuple(
                (side, tables[handle.id])
                for side in getattr(handle, "extra_dict_ref", ())
                if (tables := side()) is not None and handle.id in tables
            )
            return
        table[handle.id] = self._hook
        for side, value in self._marks:
            tables = side()
            if tables is not None:
                tables[handle.id] = value

    def disarm(self) -> None:
        if self._handle is not None:
            self._handle.remove()

    @property
    def id(self) -> int:
        """The hook's key in its owner's table (known once armed)."""
        return self._handle.id
