"""Tensor dumps: on-demand requests, one safetensors file per dumped tensor, and a per-rank index.

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
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from safetensors import safe_open

if TYPE_CHECKING:  # torch is imported where tensors are written or loaded: readers of the index need none
    import torch

from trainmon.records import kind_name

__all__ = [
    "DUMPS_DIR",
    "REQUESTS_FILE",
    "DumpEntry",
    "DumpError",
    "DumpRequest",
    "DumpWriter",
    "RequestPoller",
    "append_request",
    "dump_file_name",
    "dumps_dir",
    "list_dumps",
    "load_dump",
    "requests_file",
]

logger = logging.getLogger("trainmon")

PLUGIN_DIR = Path("plugins", "trainmon")
DUMPS_DIR = PLUGIN_DIR / "dumps"
REQUESTS_FILE = PLUGIN_DIR / "requests.jsonl"

MiB = 1 << 20
GiB = 1 << 30
DEFAULT_MAX_BYTES_PER_STEP = 256 * MiB
DEFAULT_MAX_BYTES_PER_RUN = 4 * GiB

# Longest sanitised tensor name kept in a file name; longer ones are cut and get a hash suffix.
_MAX_NAME_CHARS = 120
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+|\.{2,}")
_RANK_INDEX = re.compile(r"^rank_(\d+)\.jsonl$")


class DumpError(ValueError):
    """A file is not a readable trainmon dump (not safetensors, corrupt, or holding no tensor)."""


def dumps_dir(run_dir: str | os.PathLike[str]) -> Path:
    """The directory holding the dumps of the run ``run_dir``."""
    return Path(run_dir) / DUMPS_DIR


def step_dumps_dir(run_dir: str | os.PathLike[str], step: int, rank: int) -> Path:
    """The directory holding one rank's dumps of one step."""
    return dumps_dir(run_dir) / f"step_{step}" / f"rank_{rank}"


def requests_file(run_dir: str | os.PathLike[str]) -> Path:
    """The dump request file of the run ``run_dir``."""
    return Path(run_dir) / REQUESTS_FILE


def _append(path: Path, data: bytes, fd: int | None = None) -> None:
    """Append ``data`` (complete lines) with one ``os.write`` on an ``O_APPEND`` descriptor (looping only
    on a short write). Opens and closes ``path`` unless an open ``fd`` is given."""
    own = fd is None
    if own:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
    finally:
        if own:
            os.close(fd)


def _json_line(d: dict[str, Any]) -> bytes:
    return (json.dumps(d, separators=(",", ":"), allow_nan=False, ensure_ascii=False) + "\n").encode("utf-8")


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
        """A request with a fresh unique id and the current time."""
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
    _append(requests_file(run_dir), _json_line(request.to_dict()))


class RequestPoller:
    """Reads the requests appended to a run's request file since the last :meth:`poll`.

    The first poll returns every request already in the file. A poll with nothing new costs one ``stat``.
    A partial last line (a writer mid-append) is left for the next poll. If the file is replaced or
    truncated, reading starts again from its beginning.
    """

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.path = requests_file(run_dir)
        self._offset = 0
        self._ino: int | None = None

    def poll(self) -> list[DumpRequest]:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            self._offset, self._ino = 0, None
            return []
        except OSError as e:
            logger.warning("trainmon: cannot stat %s: %s", self.path, e)
            return []
        if self._ino is not None and (st.st_ino != self._ino or st.st_size < self._offset):
            self._offset = 0  # replaced or truncated
        self._ino = st.st_ino
        if st.st_size <= self._offset:
            return []
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read(st.st_size - self._offset)
        except OSError as e:
            logger.warning("trainmon: cannot read %s: %s", self.path, e)
            return []
        end = data.rfind(b"\n") + 1  # complete lines only
        out: list[DumpRequest] = []
        for raw in data[:end].splitlines():
            if not raw.strip():
                continue
            try:
                out.append(DumpRequest.from_dict(json.loads(raw)))
            except (ValueError, TypeError) as e:  # JSONDecodeError, UnicodeDecodeError are ValueErrors
                logger.warning("trainmon: %s: malformed dump request skipped: %s", self.path, e)
        self._offset += end
        return out


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


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class DumpWriter:
    """Writes the dumps of one rank of a run. Not for the training thread: call it from a writer thread.

    Caps count tensor data bytes (``numel * element_size``; the safetensors header, a few hundred bytes, is
    not counted): a tensor that would take the bytes dumped at its step above ``max_bytes_per_step``, or the
    bytes dumped by this writer above ``max_bytes_per_run``, is skipped (a warning once per step).
    I/O and serialisation errors are logged on the ``trainmon`` logger and give ``None``; they never raise.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        rank: int,
        *,
        max_bytes_per_step: int = DEFAULT_MAX_BYTES_PER_STEP,
        max_bytes_per_run: int = DEFAULT_MAX_BYTES_PER_RUN,
    ) -> None:
        if max_bytes_per_step < 0 or max_bytes_per_run < 0:
            raise ValueError("dump byte caps must be >= 0")
        self.run_dir = Path(run_dir)
        self.rank = int(rank)
        self.max_bytes_per_step = int(max_bytes_per_step)
        self.max_bytes_per_run = int(max_bytes_per_run)
        self.index_path = dumps_dir(run_dir) / f"rank_{self.rank}.jsonl"
        self.run_bytes = 0
        self._step_bytes: dict[int, int] = {}
        self._warned_steps: set[int] = set()
        self._lock = threading.Lock()
        self._fd: int | None = None  # index file, opened on first write

    def _warn_once(self, step: int, msg: str, *args: Any) -> None:
        if step not in self._warned_steps:
            self._warned_steps.add(step)
            logger.warning(msg + " (further skips at this step are not logged)", *args)

    def _forget_old_steps(self, step: int) -> None:
        # Steps arrive in order; keep a few recent ones so late micro-batches are still counted.
        for s in [s for s in self._step_bytes if s < step - 8]:
            del self._step_bytes[s]
        self._warned_steps = {s for s in self._warned_steps if s >= step - 8}

    def write(
        self,
        step: int,
        micro_step: int,
        kind: str,
        name: str,
        tensor: torch.Tensor | np.ndarray,
        reason: str,
        note: str = "",
    ) -> DumpEntry | None:
        """Save one tensor and index it; the entry, or None when skipped by a cap or on an error."""
        step, micro_step, kind = int(step), int(micro_step), kind_name(kind)
        with self._lock:
            self._forget_old_steps(step)
            try:
                # numpy arrays come from the MindSpore monitor (host copies), torch tensors from the torch one
                if isinstance(tensor, np.ndarray):
                    nbytes = tensor.nbytes
                else:
                    nbytes = tensor.numel() * tensor.element_size()
            except Exception as e:  # noqa: BLE001 - never raise into the monitor
                logger.warning("trainmon: dump of %s %r at step %d skipped: %s", kind, name, step, e)
                return None
            used = self._step_bytes.get(step, 0)
            if used + nbytes > self.max_bytes_per_step:
                self._warn_once(
                    step,
                    "trainmon: dump of %s %r (%d bytes) at step %d skipped: the step cap "
                    "of %d bytes would be exceeded",
                    kind,
                    name,
                    nbytes,
                    step,
                    self.max_bytes_per_step,
                )
                return None
            if self.run_bytes + nbytes > self.max_bytes_per_run:
                self._warn_once(
                    step,
                    "trainmon: dump of %s %r (%d bytes) at step %d skipped: the run cap "
                    "of %d bytes would be exceeded",
                    kind,
                    name,
                    nbytes,
                    step,
                    self.max_bytes_per_run,
                )
                return None
            try:
                entry = self._save(step, micro_step, kind, name, tensor, reason, note)
            except Exception as e:  # noqa: BLE001 - I/O, unsupported dtype, ...: log, never raise
                logger.warning(
                    "trainmon: dump of %s %r at step %d on rank %d failed: %s", kind, name, step, self.rank, e
                )
                return None
            self._step_bytes[step] = used + nbytes
            self.run_bytes += nbytes
            return entry

    def _save(
        self,
        step: int,
        micro_step: int,
        kind: str,
        name: str,
        tensor: torch.Tensor | np.ndarray,
        reason: str,
        note: str = "",
    ) -> DumpEntry:
        if isinstance(tensor, np.ndarray):
            t = np.ascontiguousarray(tensor)
            dtype = str(t.dtype)
        else:
            t = tensor.detach()
            if t.device.type != "cpu":
                t = t.cpu()
            t = t.contiguous()
            dtype = _dtype_name(t.dtype)
        shape = tuple(int(s) for s in t.shape)
        metadata = {
            "step": str(step),
            "rank": str(self.rank),
            "name": name,
            "kind": kind,
            "micro_step": str(micro_step),
            "reason": str(reason),
            "dtype": dtype,
            "shape": json.dumps(list(shape)),
        }
        if note:
            metadata["note"] = str(note)
        directory = step_dumps_dir(self.run_dir, step, self.rank)
        directory.mkdir(parents=True, exist_ok=True)
        file_name = dump_file_name(kind, name, micro_step)
        target = directory / file_name
        n = 1
        while target.exists():  # the same tensor dumped twice at one step, or two names sanitised alike
            target = directory / file_name.replace(".safetensors", f"__{n}.safetensors")
            n += 1
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        try:
            if isinstance(t, np.ndarray):
                from safetensors.numpy import save_file
            else:
                from safetensors.torch import save_file

            save_file({"tensor": t}, str(tmp), metadata=metadata)
            os.replace(tmp, target)  # readers never see a half-written dump
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        entry = DumpEntry(
            path=target.relative_to(self.run_dir).as_posix(),
            bytes=target.stat().st_size,
            shape=shape,
            dtype=dtype,
            step=step,
            rank=self.rank,
            kind=kind,
            name=name,
            micro_step=micro_step,
            reason=str(reason),
            wall_time=time.time(),
            note=str(note),
        )
        try:
            if self._fd is None:
                self._fd = os.open(self.index_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            _append(self.index_path, _json_line(entry.to_dict()), self._fd)
        except BaseException:
            target.unlink(missing_ok=True)  # an unindexed dump would never be found
            raise
        return entry

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                fd, self._fd = self._fd, None
                os.close(fd)

    def __enter__(self) -> DumpWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def iter_dumps(path: str | os.PathLike[str]) -> Iterator[DumpEntry]:
    """Stream the entries of one rank index file; a malformed complete line is skipped with a warning."""
    for lineno, raw in _iter_lines(Path(path)):
        try:
            yield DumpEntry.from_dict(json.loads(raw))
        except (ValueError, TypeError) as e:
            logger.warning("trainmon: %s:%d: malformed dump entry skipped: %s", path, lineno, e)


def list_dumps(run_dir: str | os.PathLike[str]) -> list[DumpEntry]:
    """Every dump of a run: all rank index files merged, ordered by (step, rank), then as written."""
    directory = dumps_dir(run_dir)
    if not directory.is_dir():
        return []
    files = []
    for p in directory.iterdir():
        m = _RANK_INDEX.match(p.name)
        if m and p.is_file():
            files.append((int(m.group(1)), p))
    entries: list[DumpEntry] = []
    for _, p in sorted(files):
        entries.extend(iter_dumps(p))
    entries.sort(key=lambda e: (e.step, e.rank))
    return entries


def load_dump(path: str | os.PathLike[str]) -> tuple[torch.Tensor, dict[str, str]]:
    """The tensor of a dump file and its string metadata. Read with safetensors only (no code runs); a file
    that is not a readable safetensors file holding a tensor raises :class:`DumpError` naming it."""
    try:
        from safetensors.torch import load_file

        tensors = load_file(str(path))
        with safe_open(str(path), framework="pt") as f:
            metadata = dict(f.metadata() or {})
    except Exception as e:  # noqa: BLE001 - SafetensorError, OSError, ...
        raise DumpError(f"{path}: not a readable safetensors dump: {e}") from e
    if not tensors:
        raise DumpError(f"{path}: the file holds no tensor")
    tensor = tensors["tensor"] if "tensor" in tensors else next(iter(tensors.values()))
    return tensor, metadata
