"""The run manifest, ``RUN/plugins/trainmon/manifest.json``.

A small JSON document describing the run for readers (the TensorBoard plugin, the CLI): the schema
version of the records, what the job passed in (world size, config, ...), and which names each kind
has. It is always replaced atomically (temporary file + ``os.replace``), so a reader sees the old or
the new document, never a partial one. Concurrent writers (several ranks) are serialised with an
advisory lock and merge their names into what is on disk instead of overwriting each other.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterable, Mapping
from enum import Enum
from pathlib import Path
from typing import Any

import numpy as np

from trainmon import records
from trainmon.records import StepRecord, chunk_name, kind_name
from trainmon.writer.tensorboard import LayoutCache

try:
    import fcntl
except ImportError:  # pragma: no cover - non-POSIX
    fcntl = None  # type: ignore[assignment]

__all__ = ["Manifest", "ManifestSink", "manifest_path", "read_manifest", "write_manifest"]

MANIFEST_NAME = "manifest.json"


def manifest_path(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / "plugins" / "trainmon" / MANIFEST_NAME


def read_manifest(run_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The manifest of ``run_dir``, or None when there is none (or it is unreadable)."""
    try:
        with open(manifest_path(run_dir), encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _jsonable(obj: Any) -> Any:
    """Plain JSON data (strict: no NaN/Infinity tokens, which browsers' JSON.parse rejects)."""
    if isinstance(obj, (np.generic, np.ndarray)):
        obj = obj.tolist()
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if np.isfinite(obj) else repr(obj)
    if isinstance(obj, Mapping):
        return {str(k.value if isinstance(k, Enum) else k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, Enum):
        return _jsonable(obj.value)
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    return str(obj)


def write_manifest(run_dir: str | os.PathLike[str], payload: Mapping[str, Any]) -> Path:
    """Write ``payload`` (plus ``schema_version``) as the run's manifest, atomically."""
    path = manifest_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = dict(payload)
    doc["schema_version"] = records.SCHEMA_VERSION
    text = json.dumps(_jsonable(doc), indent=1, allow_nan=False) + "\n"
    tmp = path.with_name(f".{MANIFEST_NAME}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


@contextlib.contextmanager
def _locked(run_dir: Path):
    lock = manifest_path(run_dir).with_name("manifest.lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as f:
        if fcntl is not None:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)


class Manifest:
    """Keeps ``manifest.json`` of a run up to date; rewrites it only when something changed.

    ``names`` is ``{kind: [name, ...]}`` in order of first appearance; ``kinds`` lists the kinds in the
    same order. Names are as they appear in TensorBoard tags (``"{vpp_stage}:{name}"`` with several
    model chunks).
    """

    def __init__(self, run_dir: str | os.PathLike[str], payload: Mapping[str, Any] | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.payload: dict[str, Any] = dict(payload or {})
        self.payload.setdefault("created", time.time())
        self._names: dict[str, dict[str, None]] = {}
        self.writes = 0
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
        with _locked(self.run_dir):
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
    ) -> None:
        payload = dict(payload or {})
        if multi_chunk is None:
            multi_chunk = int(payload.get("chunks", 1) or 1) > 1
        self.multi_chunk = bool(multi_chunk)
        self.manifest = Manifest(run_dir, payload)
        self._seen = LayoutCache(self._names_of)
        self._last_step: int | None = None
        self._closed = False

    def _names_of(self, rows) -> dict[str, list[str]]:
        names: dict[str, dict[str, None]] = {}
        for r in rows:
            names.setdefault(kind_name(r.kind), {})[chunk_name(r.vpp_stage, r.name, self.multi_chunk)] = None
        out = {k: list(v) for k, v in names.items()}
        self.manifest.update_names(out)
        return out

    def write(self, record: StepRecord, derived: Mapping[str, np.ndarray] | None = None) -> None:
        self._seen.get(tuple(record.rows))
        self._last_step = int(record.step)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.manifest.update(closed=time.time(), last_step=self._last_step)
