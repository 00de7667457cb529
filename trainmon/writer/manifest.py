"""Keeping a run's manifest current from the writer thread (the document: :mod:`trainmon.run.manifest`).
Several ranks' writers are serialised with an advisory lock and merge their names into what is on disk.

The lock is never waited for long: a process that holds it and hangs (or a lock server that does not answer)
must not hold up attach, the writer thread (whose queue would fill and drop steps) or close. A save waits
at most ``LOCK_WAIT_S`` for it, then writes without it (the write itself replaces the file atomically, so
it is never torn; a concurrent writer's new names may be missing until its own next save) and says so once;
while the lock stays taken, later saves only try it once."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from trainmon.run import records
from trainmon.run.layout import manifest_lock_path, manifest_path
from trainmon.run.manifest import read_manifest, write_manifest
from trainmon.run.records import Derived, StepRecord, chunk_name, kind_name
from trainmon.writer.layouts import LayoutCache

try:
    import fcntl
except ImportError:  # pragma: no cover - non-POSIX
    fcntl = None  # type: ignore[assignment]

__all__ = ["LOCK_WAIT_S", "Manifest", "ManifestSink"]

logger = logging.getLogger("trainmon")

LOCK_WAIT_S = 0.5  # a save holds the lock for milliseconds; longer means its holder is stuck


def _try_lock(fd: int, wait_s: float) -> bool:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)


@contextlib.contextmanager
def _locked(run_dir: Path, wait_s: float = LOCK_WAIT_S) -> Iterator[bool]:
    """Holds the run's manifest lock, waiting at most ``wait_s`` for it; yields whether it got it."""
    lock = manifest_lock_path(run_dir)
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as f:
        held = fcntl is None or _try_lock(f.fileno(), wait_s)
        try:
            yield held
        finally:
            if held and fcntl is not None:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)


class Manifest:
    """Keeps ``manifest.json`` of a run up to date; rewrites it only when something changed.

    ``names`` is ``{kind: [name, ...]}`` in order of first appearance; ``kinds`` lists the kinds in the
    same order. Names are as they appear in TensorBoard tags (``"{vpp_stage}:{name}"`` with several
    model chunks).
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        payload: Mapping[str, Any] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.payload: dict[str, Any] = dict(payload or {})
        self.payload.setdefault("created", clock())
        self._names: dict[str, dict[str, None]] = {}
        self.writes = 0
        self._lock_taken = False  # the last save found the lock held by another process
        self._save()

    @property
    def names(self) -> dict[str, list[str]]:
        return {kind: list(names) for kind, names in self._names.items()}

    def update(self, **fields: Any) -> None:
        """Set top-level fields and rewrite."""
        self.payload.update(fields)
        self._save()

    def update_names(self, names: Mapping[str, Iterable[str]]) -> bool:
        """Add ``{kind: names}``; rewrites the file (and returns True) only if something was new."""
        changed = False
        for kind, seq in names.items():
            known = self._names.get(kind)
            if known is None:
                known = self._names[kind] = {}
                changed = True
            for name in seq:
                if name not in known:
                    known[name] = None
                    changed = True
        if changed:
            self._save()
        return changed

    def _save(self) -> None:
        with _locked(self.run_dir, 0.0 if self._lock_taken else LOCK_WAIT_S) as held:
            if not held and not self._lock_taken:
                logger.warning(
                    "trainmon: %s is held by another process (for more than %gs); writing the manifest "
                    "without it while that lasts (names another writer adds may be missing until its next "
                    "save)",
                    manifest_lock_path(self.run_dir),
                    LOCK_WAIT_S,
                )
            self._lock_taken = not held
            on_disk = read_manifest(self.run_dir) or {}
            merged: dict[str, dict[str, None]] = {}
            if on_disk.get("schema_version") == records.SCHEMA_VERSION:
                for kind, seq in (on_disk.get("names") or {}).items():
                    if isinstance(seq, list):
                        merged[kind] = dict.fromkeys(str(n) for n in seq)
            for kind, seq in self._names.items():
                merged.setdefault(kind, {}).update(seq)
            doc = {**self.payload, "kinds": list(merged), "names": {k: list(v) for k, v in merged.items()}}
            created = on_disk.get("created")
            if isinstance(created, (int, float)) and created < doc["created"]:
                doc["created"] = created  # a resumed (or second) writer keeps the run's first time
            write_manifest(self.run_dir, doc)
            self.writes += 1


class ManifestSink:
    """Writer-thread sink keeping the manifest's names current; costs nothing while the layout of
    the records does not change. On close it records ``closed`` (Unix time) and ``last_step``, so that
    readers (``trainmon dump request``) know no job is serving the run any more; a job that attaches to
    the run again writes a manifest without them."""

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        payload: Mapping[str, Any] | None = None,
        multi_chunk: bool | None = None,
        clock: Callable[[], float] = time.time,
        last_step: int | None = None,
    ) -> None:
        """``clock`` gives the times the manifest records (created, closed): the writer process is given the
        training process's. ``last_step``: the last step written before this sink took over (the writer
        thread's, after the writer process ended)."""
        payload = dict(payload or {})
        if multi_chunk is None:
            multi_chunk = int(payload.get("chunks", 1) or 1) > 1
        self.multi_chunk = bool(multi_chunk)
        self._clock = clock
        self.manifest = Manifest(run_dir, payload, clock)
        self._path = manifest_path(run_dir)
        self._seen = LayoutCache(self._names_of)
        self._last_step: int | None = last_step
        self._closed = False

    def _names_of(self, rows) -> dict[str, list[str]]:
        names: dict[str, dict[str, None]] = {}
        for r in rows:
            names.setdefault(kind_name(r.kind), {})[chunk_name(r.vpp_stage, r.name, self.multi_chunk)] = None
        out = {k: list(v) for k, v in names.items()}
        self.manifest.update_names(out)
        return out

    def write(self, record: StepRecord, derived: Derived | None = None) -> None:
        self._seen.get(tuple(record.rows))
        self._last_step = int(record.step)
        if not os.path.exists(self._path):  # the run folder was deleted under the job
            # its files are created again as they are written (trainmon.run.append); say from which step
            self.manifest.update(recreated_at_step=self._last_step)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.manifest.update(closed=self._clock(), last_step=self._last_step)
