"""How every append-only file of a run is written (event files, CSV, dump index, requests, gradient
fingerprints; the columnar tables, :mod:`trainmon.run.columnar`, follow the same rules with their own
streams): whole records (lines or fixed-width rows) with one ``os.write`` on an ``O_APPEND`` descriptor, so
concurrent readers see complete records or none of the new ones.

A failed or short append is rolled back before anything else is written: the file is cut back to the size it
had before the append (a disk that filled up mid-record, a signal), so the file always ends with a whole
record and the next append, once there is room again, continues it cleanly. A file deleted while it is open
(the run folder removed under a running job) is noticed at the next append, said once in the log, and
created again (with its header).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

__all__ = ["AppendFile", "append_once", "claim_deleted", "naming", "say_deleted"]

logger = logging.getLogger("trainmon")

# folders (or files) already said to be deleted and recreated: one warning for a whole removed run folder
_recreated: set[Path] = set()
_recreated_lock = threading.Lock()


class AppendFile:
    """One append-only file: :meth:`append` adds whole records, or nothing.

    ``header`` (bytes, or a callable giving them) is written first whenever the file is created empty: at
    open, and when the file is created again after it was deleted (a statistics store re-lists its names).
    Not thread-safe: one writer thread per instance (the anomaly log adds its own lock).
    """

    def __init__(self, path: str | os.PathLike[str], header: bytes | Callable[[], bytes] = b"") -> None:
        self.path = Path(path)
        self._header = header
        self._cut_to: int | None = None  # a rollback that failed: cut back to this size before appending
        self._closed = False
        self._fd: int | None = self._open()  # None (not closed): to be opened again at the next append

    def _open(self) -> int:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as e:
            raise naming(e, self.path) from e
        try:
            header = self._header() if callable(self._header) else self._header
            if header and os.fstat(fd).st_size == 0:
                self._write(fd, header, 0)
        except OSError as e:
            os.close(fd)
            raise naming(e, self.path) from e
        except BaseException:
            os.close(fd)
            raise
        return fd

    def append(self, data: bytes | bytearray | memoryview) -> int:
        """Append ``data`` (complete records); returns the offset it starts at. Raises ``OSError`` (naming the
        file) with the file as it was before when the data could not all be written."""
        try:
            return self._append(data)
        except OSError as e:
            if e.filename is not None:
                raise
            raise naming(e, self.path) from e

    def _append(self, data: bytes | bytearray | memoryview) -> int:
        if self._closed:
            raise ValueError(f"append to a closed file ({self.path})")
        fd = self._fd
        if fd is None:  # creating it again failed last time (a full disk)
            fd = self._fd = self._open()
        st = os.fstat(fd)
        if st.st_nlink == 0:  # deleted while open: what we write would be gone at close
            fd = self._recreate(fd)
            st = os.fstat(fd)
        size = st.st_size
        if self._cut_to is not None:  # never append after a torn record
            os.ftruncate(fd, self._cut_to)
            size, self._cut_to = self._cut_to, None
        self._write(fd, data, size)
        return size

    def revive(self) -> None:
        """Create the file again (with its header) if it was deleted, though there is nothing to append: a
        file whose records refer to this one's (a statistics store's names) needs it back. One ``fstat``."""
        self.append(b"")

    def _write(self, fd: int, data: bytes | bytearray | memoryview, size: int) -> None:
        view = memoryview(data).cast("B")
        done = 0
        try:
            while done < len(view):  # one write for regular files; loop only on a short write
                done += os.write(fd, view[done:])
        except BaseException:
            if done:
                self._roll_back(fd, size, done)
            raise

    def _roll_back(self, fd: int, size: int, written: int) -> None:
        try:
            if os.fstat(fd).st_size != size + written:
                # another process appended after our partial record (a shared file such as requests.jsonl):
                # cutting would take its records too; readers skip the one malformed line instead
                logger.warning("trainmon: %s: a partial record stays (appended to since)", self.path)
                return
            os.ftruncate(fd, size)
        except OSError:
            self._cut_to = size

    def _recreate(self, old: int) -> int:
        say_deleted(self.path)
        self._fd, self._cut_to = None, None
        os.close(old)
        self._fd = self._open()
        return self._fd

    def close(self) -> None:
        self._closed = True
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    @property
    def closed(self) -> bool:
        return self._closed

    def fileno(self) -> int:
        if self._fd is None:
            raise ValueError(f"closed file ({self.path})")
        return self._fd


def say_deleted(path: str | os.PathLike[str]) -> None:
    """Say once, at WARNING, that the highest missing folder above ``path`` (or ``path`` itself, a file whose
    folder is there) was deleted under the job: one warning for a whole removed run folder, whichever of its
    files or tables notices first. Called before the file or folder is created again."""
    missing = Path(path)
    while not missing.parent.exists() and missing.parent != missing.parent.parent:
        missing = missing.parent
    key = Path(os.path.abspath(missing))  # the writer process names it by its absolute path
    with _recreated_lock:
        said = any(p == key or p in key.parents for p in _recreated)
        _recreated.add(key)
    if not said:
        logger.warning(
            "trainmon: %s was deleted while this job was writing to it; writing there again from now on "
            "(what it held is gone)",
            missing,
            extra={"trainmon_deleted": str(key)},  # the writer process's notice names it to its parent
        )


def claim_deleted(missing: Path) -> bool:
    """For a deletion another process of the job noticed (the writer process, which found ``missing`` gone):
    True when it is not said yet, here or by it, and is now to be said; False when this process said this
    folder, one inside it or one above it (the two processes notice the same deletion at different moments,
    after the other may have created part of it again)."""
    key = Path(os.path.abspath(missing))
    with _recreated_lock:
        said = any(p == key or p in key.parents or key in p.parents for p in _recreated)
        _recreated.add(key)
    return not said


def naming(error: OSError, path: str | os.PathLike[str]) -> OSError:
    """``error`` naming the file (os.write's errors name none), of the same type and errno."""
    if error.filename is not None:
        return error
    return type(error)(error.errno, error.strerror or str(error), str(path))


def append_once(path: str | os.PathLike[str], data: bytes) -> None:
    """Open ``path``, append ``data`` (whole records, rolled back on failure) and close it."""
    f = AppendFile(path)
    try:
        f.append(data)
    finally:
        f.close()
