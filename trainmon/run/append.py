"""How every append-only file of a run is written: whole records (lines or fixed-width rows) with one
``os.write`` on an ``O_APPEND`` descriptor, so concurrent readers see complete records or none of the new
ones; a short write (disk full, a signal) is continued until the data is written or an error is raised."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["append_records", "open_append"]


def open_append(path: Path) -> int:
    """An ``O_APPEND`` descriptor of ``path`` (created 0644 with its folder)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)


def append_records(fd: int, data: bytes) -> None:
    """Append ``data`` (complete records) to ``fd``."""
    view = memoryview(data)
    while view:  # one write for regular files; loop only on a short write
        view = view[os.write(fd, view) :]
