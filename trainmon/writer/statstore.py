"""The statistics store: every step-level statistic of a rank as fixed-width binary records, for the
TensorBoard plugin's heatmaps (and any script with numpy).

On disk, per rank::

    RUN/plugins/trainmon/stats/rank_<r>.names.jsonl   {"id": 0, "kind": "actv", "name": "layers.0.output"}
    RUN/plugins/trainmon/stats/rank_<r>.bin           records of STAT_RECORD: step, id, 7 float32 stats

A name line is always written before the first record that uses its id, so a reader that reads the names
after the records never meets an unknown id. Each step is one ``os.write`` of whole records on an
``O_APPEND`` descriptor; a reader ignores a trailing partial record. Values are those TensorBoard shows
(micro-steps merged, float32), for all seven statistics whatever ``ops`` says.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from trainmon import records
from trainmon.records import STATS, StepGroups, StepRecord, chunk_name, kind_name
from trainmon.writer.tensorboard import LayoutCache

__all__ = [
    "STATS_DIR",
    "STAT_RECORD",
    "StatStoreSink",
    "names_file",
    "read_names",
    "read_records",
    "records_file",
]

STATS_DIR = Path("plugins", "trainmon", "stats")
STAT_RECORD = np.dtype([("step", "<i8"), ("id", "<i4"), ("stats", "<f4", (len(STATS),))])


def names_file(run_dir: str | os.PathLike[str], rank: int) -> Path:
    return Path(run_dir) / STATS_DIR / f"rank_{int(rank)}.names.jsonl"


def records_file(run_dir: str | os.PathLike[str], rank: int) -> Path:
    return Path(run_dir) / STATS_DIR / f"rank_{int(rank)}.bin"


def read_names(path: str | os.PathLike[str], start_byte: int = 0) -> tuple[list[tuple[int, str, str]], int]:
    """(id, kind, name) of the complete lines from ``start_byte`` on, and the byte offset after them."""
    out: list[tuple[int, str, str]] = []
    try:
        with open(path, "rb") as f:
            f.seek(start_byte)
            data = f.read()
    except FileNotFoundError:
        return out, start_byte
    end = data.rfind(b"\n") + 1  # a partial last line waits for the next read
    for raw in data[:end].splitlines():
        if not raw.strip():
            continue
        try:
            d = json.loads(raw)
            out.append((int(d["id"]), str(d["kind"]), str(d["name"])))
        except (ValueError, KeyError, TypeError):
            continue  # a damaged line costs its name, never the store
    return out, start_byte + end


def read_records(path: str | os.PathLike[str], start: int = 0) -> np.ndarray:
    """The complete records from record index ``start`` on (a memory map; empty when there are none)."""
    try:
        size = os.path.getsize(path)
    except OSError:
        return np.empty(0, dtype=STAT_RECORD)
    count = size // STAT_RECORD.itemsize - start
    if count <= 0:
        return np.empty(0, dtype=STAT_RECORD)
    return np.memmap(path, dtype=STAT_RECORD, mode="r", offset=start * STAT_RECORD.itemsize, shape=(count,))


def _append(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:  # one write for regular files; loop only on a short write
        view = view[os.write(fd, view) :]


class _Layout:
    """What a layout of rows needs: its step groups and each group's id in the store."""

    __slots__ = ("groups", "ids", "merge")

    def __init__(self, groups: StepGroups, ids: np.ndarray, n_rows: int) -> None:
        self.groups = groups
        self.ids = ids
        self.merge = len(groups.keys) != n_rows


class StatStoreSink:
    """Writer-thread sink appending each step's statistics to the rank's store."""

    def __init__(self, run_dir: str | os.PathLike[str], rank: int, multi_chunk: bool = False) -> None:
        self.multi_chunk = bool(multi_chunk)
        names_path, self.path = names_file(run_dir, rank), records_file(run_dir, rank)
        names_path.parent.mkdir(parents=True, exist_ok=True)
        # a resumed job continues the ids already on disk
        self._ids = {(kind, name): i for i, kind, name in read_names(names_path)[0]}
        self._next_id = max(self._ids.values(), default=-1) + 1
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT
        self._names_fd: int | None = os.open(names_path, flags, 0o644)
        self._fd: int | None = os.open(self.path, flags, 0o644)
        self._layouts = LayoutCache(self._layout_of)

    def _layout_of(self, rows: tuple) -> _Layout:
        groups = StepGroups(rows)
        new: list[bytes] = []
        ids = np.empty(len(groups.keys), dtype="<i4")
        for j, (kind, vpp_stage, name) in enumerate(groups.keys):
            key = (kind_name(kind), chunk_name(vpp_stage, name, self.multi_chunk))
            i = self._ids.get(key)
            if i is None:
                i = self._ids[key] = self._next_id
                self._next_id += 1
                line = {"id": i, "kind": key[0], "name": key[1]}
                new.append(json.dumps(line, ensure_ascii=False, separators=(",", ":")).encode() + b"\n")
            ids[j] = i
        if new and self._names_fd is not None:
            _append(self._names_fd, b"".join(new))
        return _Layout(groups, ids, len(rows))

    def write(self, record: StepRecord, derived: Mapping[str, np.ndarray] | None = None) -> None:
        if self._fd is None or not record.rows:
            return
        layout = self._layouts.get(tuple(record.rows))
        if layout.merge or derived is None:
            derived = records.derive(layout.groups.merge(record.partials))
        out = np.empty(len(layout.ids), dtype=STAT_RECORD)
        out["step"] = record.step
        out["id"] = layout.ids
        with np.errstate(over="ignore"):  # beyond float32 is +-inf, as in TensorBoard
            for j, stat in enumerate(STATS):
                out["stats"][:, j] = derived[stat]
        _append(self._fd, out.tobytes())

    def flush(self) -> None:
        pass

    def close(self) -> None:
        for attr in ("_fd", "_names_fd"):
            fd = getattr(self, attr)
            if fd is not None:
                setattr(self, attr, None)
                os.close(fd)
