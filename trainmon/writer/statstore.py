"""The writer-thread sink of the statistics store (the format: :mod:`trainmon.run.statstore`): each step's
step-level statistics appended as whole records, a name line written before the first record using its id
(an id whose name line could not be written is not used: the next step tries again)."""

from __future__ import annotations

import os

import numpy as np

from trainmon.run.append import AppendFile
from trainmon.run.layout import stats_names_file, stats_records_file
from trainmon.run.records import STATS, Derived, StepRecord, TensorGroups, chunk_name, kind_name
from trainmon.run.statstore import STAT_RECORD, encode_name, read_names
from trainmon.writer.layouts import LayoutCache

__all__ = ["StatStoreSink"]


class _Layout:
    """What a layout of rows needs: its step groups and each group's id in the store."""

    __slots__ = ("groups", "ids")

    def __init__(self, groups: TensorGroups, ids: np.ndarray) -> None:
        self.groups = groups
        self.ids = ids


class StatStoreSink:
    """Writer-thread sink appending each step's statistics to the rank's store."""

    def __init__(self, run_dir: str | os.PathLike[str], rank: int, multi_chunk: bool = False) -> None:
        self.multi_chunk = bool(multi_chunk)
        names_path, self.path = stats_names_file(run_dir, rank), stats_records_file(run_dir, rank)
        # a resumed job continues the ids already on disk
        self._ids = {(kind, name): i for i, kind, name in read_names(names_path)[0]}
        self._next_id = max(self._ids.values(), default=-1) + 1
        # a names file deleted under the job is created again with every name known so far
        self._names: AppendFile | None = AppendFile(names_path, self._all_names)
        self._records: AppendFile | None = AppendFile(self.path)
        self._layouts = LayoutCache(self._layout_of)

    def _all_names(self) -> bytes:
        return b"".join(encode_name(i, kind, name) for (kind, name), i in self._ids.items())

    def _layout_of(self, rows: tuple) -> _Layout:
        groups = TensorGroups(rows)
        new: dict[tuple[str, str], int] = {}
        ids = np.empty(len(groups.keys), dtype="<i4")
        for j, (kind, vpp_stage, name) in enumerate(groups.keys):
            key = (kind_name(kind), chunk_name(vpp_stage, name, self.multi_chunk))
            i = self._ids.get(key, new.get(key))
            if i is None:
                i = new[key] = self._next_id + len(new)
            ids[j] = i
        if new and self._names is not None:
            # raises when the names cannot be written: then no id is taken and the layout is not kept
            self._names.append(b"".join(encode_name(i, kind, name) for (kind, name), i in new.items()))
            self._ids.update(new)
            self._next_id += len(new)
        return _Layout(groups, ids)

    def write(self, record: StepRecord, derived: Derived) -> None:
        if self._records is None or not record.rows:
            return
        layout = self._layouts.get(tuple(record.rows))
        out = np.empty(len(layout.ids), dtype=STAT_RECORD)
        out["step"] = record.step
        out["id"] = layout.ids
        with np.errstate(over="ignore"):  # beyond float32 is +-inf, as in TensorBoard
            for j, stat in enumerate(STATS):
                out["stats"][:, j] = derived.tensors[stat]
        if self._names is not None:
            self._names.revive()  # deleted with the run folder: the records need their names back
        self._records.append(out.tobytes())

    def flush(self) -> None:
        pass

    def close(self) -> None:
        for attr in ("_records", "_names"):
            f = getattr(self, attr)
            if f is not None:
                setattr(self, attr, None)
                f.close()
