"""Tensor dumps on disk: the request format, file names and the per-rank index (the files are written by
:mod:`trainmon.writer.dumps`, read by :mod:`trainmon.read.dump_contents`).

On disk (see ``docs/dumps.md``)::

    RUN/plugins/trainmon/requests.jsonl                 dump requests (CLI, plugin), one JSON object a line
    RUN/plugins/trainmon/dumps/rank_<r>.jsonl           index of rank r's dumps, one DumpEntry a line
    RUN/plugins/trainmon/dumps/step_<s>/rank_<r>/<kind>__<name>__m<micro>.safetensors

Each rank appends to its own index file: appends from many processes to one shared file are not safe on
network file systems, so :func:`list_dumps` merges the rank files instead. Every JSONL append is one
``os.write`` of complete lines on an ``O_APPEND`` descriptor; readers skip a partial last line.
Dumps are safetensors only: they are read with ``safetensors`` and never with a loader that can run code.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import json
import logging
import os
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainmon.run.append import append_once
from trainmon.run.damage import note
from trainmon.run.layout import dumps_dir, rank_files, requests_file
from trainmon.run.records import kind_name

__all__ = [
    "DumpEntry",
    "DumpError",
    "DumpRequest",
    "append_request",
    "dump_file_name",
    "iter_dumps",
    "json_line",
    "list_dumps",
]

logger = logging.getLogger("trainmon")

# Longest sanitised tensor name kept in a file name; longer ones are cut and get a hash suffix.
_MAX_NAME_CHARS = 120
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+|\.{2,}")


class DumpError(ValueError):
    """A file is not a readable trainmon dump (not safetensors, corrupt, or holding no tensor)."""


def json_line(d: dict[str, Any]) -> bytes:
    text = json.dumps(d, separators=(",", ":"), allow_nan=False, ensure_ascii=False) + "\n"
    return text.encode("utf-8", "backslashreplace")  # names are encoded already; never fail on a stray one


def _iter_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """Complete, non-blank lines of a file, streaming; a partial last line is skipped."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.endswith(b"\n"):
                logger.debug("trainmon: %s:%d: partial last line skipped", path, lineno)
                return
            if raw.strip():
                yield lineno, raw


# --------------------------------------------------------------------------------------------- requests


def _opt_int(name: str, x: Any) -> int | None:
    if x is None:
        return None
    if isinstance(x, bool) or not isinstance(x, int):
        raise ValueError(f"field {name!r}: expected an integer or null, got {x!r}")
    if x < 0:
        raise ValueError(f"field {name!r}: expected >= 0, got {x!r}")
    return x


@dataclass(frozen=True)
class DumpRequest:
    """A request to dump the tensors whose names match the glob ``name`` (``fnmatch`` syntax, case
    sensitive) at step ``step`` (None: the next collected step), on rank ``rank`` (None: all ranks), of
    record kind ``kind`` (None: all kinds)."""

    name: str
    step: int | None = None
    rank: int | None = None
    kind: str | None = None
    id: str = ""
    created: float = 0.0

    @classmethod
    def new(
        cls, name: str, step: int | None = None, rank: int | None = None, kind: str | None = None
    ) -> DumpRequest:
        """A request with a fresh unique id and the current time; ``ValueError`` for an empty ``name`` (a glob
        that matches no tensor, which no job would ever serve)."""
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"the name glob of a dump request must not be empty, got {name!r}")
        return cls(
            name=name,
            step=step,
            rank=rank,
            kind=None if kind is None else kind_name(kind),
            id=uuid.uuid4().hex,
            created=time.time(),
        )

    def matches(self, step: int, rank: int, kind: str, name: str) -> bool:
        """Whether a tensor is covered (a request for the "next" step matches any step)."""
        return (
            (self.step is None or self.step == step)
            and (self.rank is None or self.rank == rank)
            and (self.kind is None or self.kind == kind_name(kind))
            and fnmatch.fnmatchcase(name, self.name)
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> DumpRequest:
        if not isinstance(d, dict):
            raise ValueError(f"expected a JSON object, got {type(d).__name__}")
        name, rid, kind, created = d.get("name"), d.get("id"), d.get("kind"), d.get("created", 0.0)
        if not isinstance(name, str) or not name:
            raise ValueError(f"field 'name': expected a non-empty string, got {name!r}")
        if not isinstance(rid, str) or not rid:
            raise ValueError(f"field 'id': expected a non-empty string, got {rid!r}")
        if kind is not None and not isinstance(kind, str):
            raise ValueError(f"field 'kind': expected a string or null, got {kind!r}")
        if isinstance(created, bool) or not isinstance(created, (int, float)):
            raise ValueError(f"field 'created': expected a number, got {created!r}")
        return cls(
            name=name,
            step=_opt_int("step", d.get("step")),
            rank=_opt_int("rank", d.get("rank")),
            kind=kind,
            id=rid,
            created=float(created),
        )


def append_request(run_dir: str | os.PathLike[str], request: DumpRequest) -> None:
    """Append one request line to ``RUN/plugins/trainmon/requests.jsonl`` (one ``O_APPEND`` write)."""
    append_once(requests_file(run_dir), json_line(request.to_dict()))


# ------------------------------------------------------------------------------------------------ dumps


@dataclass(frozen=True)
class DumpEntry:
    """One dumped tensor, as recorded in ``dumps/rank_<r>.jsonl``. ``path`` is relative to the run
    directory (``/``-separated); ``bytes`` is the size of the file on disk."""

    path: str
    bytes: int
    shape: tuple[int, ...]
    dtype: str
    step: int
    rank: int
    kind: str
    name: str
    micro_step: int
    reason: str
    wall_time: float
    # what a reader must know about the values, e.g. that the tensor changed in place after its hook
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["shape"] = list(self.shape)
        return d

    @classmethod
    def from_dict(cls, d: Any) -> DumpEntry:
        if not isinstance(d, dict):
            raise ValueError(f"expected a JSON object, got {type(d).__name__}")
        kw: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name not in d:
                if f.default is not dataclasses.MISSING:  # added after the first index format
                    continue
                raise ValueError(f"missing key {f.name!r}")
            x = d[f.name]
            if f.name == "shape":
                if not isinstance(x, list) or not all(type(i) is int for i in x):
                    raise ValueError(f"field 'shape': expected a list of integers, got {x!r}")
                x = tuple(x)
            elif f.name in ("bytes", "step", "rank", "micro_step"):
                if isinstance(x, bool) or not isinstance(x, int):
                    raise ValueError(f"field {f.name!r}: expected an integer, got {x!r}")
            elif f.name == "wall_time":
                if isinstance(x, bool) or not isinstance(x, (int, float)):
                    raise ValueError(f"field 'wall_time': expected a number, got {x!r}")
                x = float(x)
            elif not isinstance(x, str):
                raise ValueError(f"field {f.name!r}: expected a string, got {x!r}")
            kw[f.name] = x
        return cls(**kw)


def _sanitise(text: str) -> str:
    safe = _UNSAFE.sub("_", text).strip(".") or "_"
    if len(safe) > _MAX_NAME_CHARS:
        safe = f"{safe[:_MAX_NAME_CHARS]}-{hashlib.sha1(text.encode('utf-8')).hexdigest()[:8]}"
    return safe


def dump_file_name(kind: str, name: str, micro_step: int) -> str:
    """``<kind>__<sanitised name>__m<micro>.safetensors``: characters other than letters, digits, ``.``,
    ``_`` and ``-`` become ``_``; names longer than 120 characters are cut and get a hash suffix."""
    return f"{_sanitise(kind_name(kind))}__{_sanitise(name)}__m{int(micro_step)}.safetensors"


def iter_dumps(path: str | os.PathLike[str]) -> Iterator[DumpEntry]:
    """Stream the entries of one rank index file; malformed complete lines are skipped, and the file noted
    damaged (:mod:`trainmon.run.damage`: its first bad line, and how many)."""
    bad: list[tuple[int, str]] = []
    try:
        for lineno, raw in _iter_lines(Path(path)):
            try:
                yield DumpEntry.from_dict(json.loads(raw))
            except (ValueError, TypeError) as e:
                bad.append((lineno, str(e)))
    finally:
        if bad:
            more = f" ({len(bad)} malformed lines skipped)" if len(bad) > 1 else " (skipped)"
            note(path, f"line {bad[0][0]}: malformed dump entry: {bad[0][1]}{more}")


def list_dumps(run_dir: str | os.PathLike[str]) -> list[DumpEntry]:
    """Every dump of a run: all rank index files merged, ordered by (step, rank), then as written."""
    entries: list[DumpEntry] = []
    for _, p in rank_files(dumps_dir(run_dir)):
        entries.extend(iter_dumps(p))
    entries.sort(key=lambda e: (e.step, e.rank))
    return entries
