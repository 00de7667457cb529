"""Damaged files: what a reader does with a file of a run it cannot read.

A sealed Parquet segment cut short by a disk error or a bad copy, an Arrow stream whose bytes were
overwritten in the middle, a summary or manifest that is no longer JSON, a dump index with broken lines: the
reader that meets one (every reader of :mod:`trainmon.run`) calls :func:`read_or_note` (or :func:`note`),
which records ``damaged: path, why`` here and hands back what the reader reads instead (nothing, or the part
before the damage), so the rest of the run is read as usual.

Whoever shows a run says so once per file: ``trainmon analyze``, ``trainmon compare`` and ``trainmon dump
ls`` print one warning line for each file :func:`damaged` lists under the run, the TensorBoard tab a notice
naming each one (and TensorBoard's log a line). A file is listed while it is as it was when it was found
damaged (same size and modification time): one repaired, replaced or removed drops out, and is noted again
if a reader finds it damaged again.

What is **not** damage: a torn last record (a writer killed mid-append, or appending right now), which every
reader skips by design; a file that is gone (a stream sealed meanwhile: the readers list the folder again).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

__all__ = ["DAMAGE_ERRORS", "Damaged", "damaged", "forget", "note", "read_or_note", "reason"]

logger = logging.getLogger("trainmon")

T = TypeVar("T")

# What reading a damaged file raises: pyarrow's ArrowInvalid is a ValueError and ArrowIOError an OSError, JSON
# and UTF-8 errors are ValueErrors; the rest are what a decoder meeting garbage raises.
DAMAGE_ERRORS: tuple[type[BaseException], ...] = (
    OSError, ValueError, TypeError, KeyError, IndexError, EOFError, NotImplementedError, OverflowError,
)  # fmt: skip
# Damaged files remembered at most (a logdir of many broken runs must not grow a reader's memory forever).
MAX_NOTED = 10_000


@dataclass(frozen=True)
class Damaged:
    """A file a reader could not read (or read only in part), and why."""

    path: Path
    why: str

    def relative_to(self, folder: str | os.PathLike[str]) -> str:
        """The path relative to ``folder`` (with ``/``), as the tab shows it."""
        return Path(os.path.relpath(self.path, folder)).as_posix()


_lock = threading.Lock()
_noted: dict[str, tuple[Damaged, tuple[int, int] | None]] = {}  # absolute path -> (record, its stamp)


def _stamp(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_size, st.st_mtime_ns)


def reason(error: BaseException) -> str:
    """What an error says of a file, on one line (its path left out where the error adds it)."""
    text = str(error).strip() or type(error).__name__
    if isinstance(error, OSError) and error.strerror:  # not "[Errno 13] Permission denied: 'path'"
        text = error.strerror
    return " ".join(text.split())[:300]


def note(path: str | os.PathLike[str], why: str | BaseException) -> None:
    """Record that ``path`` is damaged (said once per file on the ``trainmon`` logger at DEBUG: whoever shows
    the run says it, see the module's doc)."""
    key = os.path.abspath(path)
    text = reason(why) if isinstance(why, BaseException) else why
    stamp = _stamp(key)
    with _lock:
        old = _noted.get(key)
        if old is not None and old == (Damaged(Path(key), text), stamp):
            return
        if old is None and len(_noted) >= MAX_NOTED:
            _noted.pop(next(iter(_noted)))
        _noted[key] = (Damaged(Path(key), text), stamp)
    logger.debug("trainmon: damaged file %s (%s): read without it", key, text)


def read_or_note(path: str | os.PathLike[str], read: Callable[[], T], instead: Callable[[], T]) -> T:
    """``read()``; when it raises one of :data:`DAMAGE_ERRORS` (``FileNotFoundError`` aside: a file gone is
    not damaged), ``path`` is noted damaged and ``instead()`` is returned."""
    try:
        return read()
    except FileNotFoundError:
        raise
    except DAMAGE_ERRORS as e:
        note(path, e)
        return instead()


def damaged(under: str | os.PathLike[str] | None = None) -> list[Damaged]:
    """The damaged files noted under the folder ``under`` (every one when None), by path; those changed or
    removed since they were noted are dropped."""
    prefix = None if under is None else os.path.join(os.path.abspath(under), "")
    with _lock:
        found = [(k, v) for k, v in _noted.items() if prefix is None or k.startswith(prefix)]
    out = []
    for key, (record, stamp) in found:
        if _stamp(key) != stamp:  # repaired, replaced, or gone
            with _lock:
                if _noted.get(key) == (record, stamp):
                    del _noted[key]
            continue
        out.append(record)
    return sorted(out, key=lambda d: str(d.path))


def forget(under: str | os.PathLike[str] | None = None) -> None:
    """Drop the files noted under ``under`` (every one when None)."""
    prefix = None if under is None else os.path.join(os.path.abspath(under), "")
    with _lock:
        for key in [k for k in _noted if prefix is None or k.startswith(prefix)]:
            del _noted[key]
