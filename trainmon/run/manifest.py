"""The run manifest, ``RUN/plugins/trainmon/manifest.json``.

A small JSON document describing the run for readers (the TensorBoard plugin, the CLI): the schema
version of the records, what the job passed in (world size, config, ...), and which names each kind
has. It is always replaced atomically (temporary file + ``os.replace``), so a reader sees the old or
the new document, never a partial one. Concurrent writers (several ranks) are serialised with an
advisory lock and merge their names into what is on disk instead of overwriting each other.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from enum import Enum
from pathlib import Path
from typing import Any

import numpy as np

from trainmon.run import records
from trainmon.run.damage import note, read_or_note
from trainmon.run.layout import manifest_path

__all__ = ["jsonable", "read_manifest", "write_manifest"]


def read_manifest(run_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The manifest of ``run_dir``, or None when there is none, or it is damaged (then it is noted,
    :mod:`trainmon.run.damage`)."""
    path = manifest_path(run_dir)
    try:
        data = read_or_note(path, lambda: json.loads(path.read_bytes()), lambda: None)
    except FileNotFoundError:
        return None
    if data is not None and not isinstance(data, dict):
        note(path, f"not a manifest: a JSON {type(data).__name__}, not an object")
        return None
    return data


def jsonable(obj: Any) -> Any:
    """Plain JSON data (strict: no NaN/Infinity tokens, which browsers' JSON.parse rejects)."""
    if isinstance(obj, (np.generic, np.ndarray)):
        obj = obj.tolist()
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if np.isfinite(obj) else repr(obj)
    if isinstance(obj, Mapping):
        return {str(k.value if isinstance(k, Enum) else k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, Enum):
        return jsonable(obj.value)
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    return str(obj)


def write_manifest(run_dir: str | os.PathLike[str], payload: Mapping[str, Any]) -> Path:
    """Write ``payload`` (plus ``schema_version``) as the run's manifest, atomically."""
    path = manifest_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = dict(payload)
    doc["schema_version"] = records.SCHEMA_VERSION
    text = json.dumps(jsonable(doc), indent=1, allow_nan=False) + "\n"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk leaves no stray temporary file
        raise
    return path
