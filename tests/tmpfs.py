"""A real tmpfs for the disk-full tests: mounted on a folder of the test, filled with a ballast file, and
emptied again. Mounting needs root (CAP_SYS_ADMIN): where that is not permitted the tests skip, saying so."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def tmpfs(path: Path, size: str = "4m") -> Iterator[Path]:
    """``path`` as a fresh tmpfs of ``size`` bytes, unmounted afterwards."""
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(
            f"mounting a tmpfs is not permitted here ({done.stderr.strip() or done.returncode}); the "
            "disk-full tests need one (run them as root)"
        )
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(directory: Path) -> Path:
    """Fill the file system holding ``directory`` to the last byte with a ballast file; returns its path.
    Files with room left in their last page can still take a few bytes: writes there come out short, the
    case a torn record comes from."""
    ballast = directory / "ballast"
    fd = os.open(ballast, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        for size in (1 << 20, 1 << 16, 1 << 12, 1 << 8, 1):
            chunk = b"\0" * size
            while True:
                try:
                    os.write(fd, chunk)
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    break
    finally:
        os.close(fd)
    return ballast
