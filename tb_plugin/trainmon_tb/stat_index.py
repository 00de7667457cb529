"""The statistics store of a run (``plugins/trainmon/stats/rank_<r>.{names.jsonl,bin}``) for the heatmap
and the line chart. Columns are kept in memory and extended with what was appended since the last refresh; a
statistic's column is read on first use."""

from __future__ import annotations

import dataclasses
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainmon.run.layout import RANK_BIN, stats_dir, stats_names_file, stats_records_file
from trainmon.run.records import STATS
from trainmon.run.statstore import STAT_RECORD, read_names, read_records
from trainmon_tb.anomaly_index import Interner, bin_edges, glob_ids, step_bins

MAX_SERIES_POINTS = 4000
HAS_DATA, HAS_NAN, HAS_INF = 1, 2, 4


@dataclass
class Heatmap:
    names: list[str]
    step_lo: int
    step_hi: int
    bins: int
    edges: list[int]
    values: np.ndarray  # float32 (len(names), bins), NaN where the bin has no finite value
    flags: np.ndarray  # uint8, same shape: HAS_DATA, and HAS_NAN/HAS_INF when the tensor held any
    agg: str
    # the cells (flat index row * bins + bin) whose tensor held NaN or Inf elements, in order, with the most
    # NaN and Inf elements it held at one step of the bin
    bad_cells: np.ndarray = dataclasses.field(default_factory=lambda: np.empty(0, dtype=np.int64))
    bad_nans: np.ndarray = dataclasses.field(default_factory=lambda: np.empty(0))
    bad_infs: np.ndarray = dataclasses.field(default_factory=lambda: np.empty(0))


class _RankStore:
    """One rank's store: names by id, and the step/id/statistic columns."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        self.run_dir, self.rank = run_dir, rank
        self.names_path = stats_names_file(run_dir, rank)
        self.bin_path = stats_records_file(run_dir, rank)
        self.by_id: dict[int, tuple[str, str]] = {}
        self.kind_names: dict[str, Interner] = {}  # kind -> its names in order of first appearance
        self.kind_ids: dict[str, list[int]] = {}  # kind -> store id of each interned name
        self._names_offset = 0
        self.count = 0
        self.inode = -1
        self.steps = np.empty(0, dtype=np.int64)
        self.ids = np.empty(0, dtype=np.int32)
        self.stats: dict[str, np.ndarray] = {}

    def refresh(self) -> bool:
        try:
            st = os.stat(self.bin_path)
        except OSError:
            return False
        if st.st_ino != self.inode or st.st_size < self.count * STAT_RECORD.itemsize:
            self.__init__(self.run_dir, self.rank)  # replaced or truncated: read it again
            self.inode = st.st_ino
        new = read_records(self.bin_path, self.count)  # records first: their names are already on disk
        lines, self._names_offset = read_names(self.names_path, self._names_offset)
        for i, kind, name in lines:
            self.by_id[i] = (kind, name)
            interner = self.kind_names.setdefault(kind, Interner())
            if name not in interner.ids:
                interner(name)
                self.kind_ids.setdefault(kind, []).append(i)
        if not len(new):
            return bool(lines)
        self.steps = np.concatenate([self.steps, np.asarray(new["step"])])
        self.ids = np.concatenate([self.ids, np.asarray(new["id"])])
        for j, stat in enumerate(STATS):
            if stat in self.stats:
                self.stats[stat] = np.concatenate([self.stats[stat], np.asarray(new["stats"][:, j])])
        self.count += len(new)
        return True

    def column(self, stat: str) -> np.ndarray:
        col = self.stats.get(stat)
        if col is None:
            recs = read_records(self.bin_path, 0)[: self.count]
            col = self.stats[stat] = np.ascontiguousarray(recs["stats"][:, STATS.index(stat)])
        return col


class StatIndex:
    """The statistics store of one run, every rank. Thread-safe."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self._ranks: dict[int, _RankStore] = {}
        self._lock = threading.RLock()

    def refresh(self) -> bool:
        with self._lock:
            try:
                entries = list(os.scandir(stats_dir(self.run_dir)))
            except OSError:
                entries = []
            changed = False
            for e in entries:
                m = RANK_BIN.match(e.name)
                if m and int(m.group(1)) not in self._ranks:
                    self._ranks[int(m.group(1))] = _RankStore(self.run_dir, int(m.group(1)))
            for store in self._ranks.values():
                changed |= store.refresh()
            return changed

    def summary(self) -> dict:
        with self._lock:
            kinds: dict[str, None] = {}
            lo, hi = None, None
            for store in self._ranks.values():
                kinds.update(dict.fromkeys(store.kind_names))
                if len(store.steps):
                    s_lo, s_hi = int(store.steps.min()), int(store.steps.max())
                    lo = s_lo if lo is None else min(lo, s_lo)
                    hi = s_hi if hi is None else max(hi, s_hi)
            return {
                "ranks": sorted(self._ranks),
                "stat_kinds": list(kinds),
                "steps": None if lo is None else [lo, hi],
            }

    def _store(self, rank: int | None) -> _RankStore | None:
        if rank is None:
            return self._ranks[min(self._ranks)] if self._ranks else None
        return self._ranks.get(rank)

    def heatmap(
        self,
        rank: int | None,
        kind: str,
        stat: str,
        step_lo: int | None,
        step_hi: int | None,
        bins: int,
        name: str | None = None,
    ) -> Heatmap | None:
        """None when the rank has no store; a heatmap with no names when the kind has none."""
        with self._lock:
            store = self._store(rank)
            if store is None:
                return None
            interner = store.kind_names.get(kind, Interner())
            wanted = glob_ids(interner, name)
            rows = np.arange(len(interner.values)) if wanted is None else wanted
            ids = np.asarray(store.kind_ids.get(kind, []), dtype=np.int64)[rows]
            names = [interner.values[i] for i in rows]
            if step_lo is None or step_hi is None:
                lo = int(store.steps.min()) if len(store.steps) else 0
                hi = int(store.steps.max()) if len(store.steps) else 0
                step_lo = lo if step_lo is None else step_lo
                step_hi = hi if step_hi is None else step_hi
            bins, edges = bin_edges(step_lo, step_hi, bins)
            n = len(names)
            values = np.full(n * bins, np.nan, dtype=np.float32)
            flags = np.zeros(n * bins, dtype=np.uint8)
            agg = "min" if stat == "min" else "max"
            if n and len(store.steps):
                # ids of records whose name line was damaged are unknown: they map to no row
                size = max(max(store.by_id, default=0), int(store.ids.max())) + 1
                row_of_id = np.full(size, -1, dtype=np.int64)
                row_of_id[ids] = np.arange(n)
                sel = np.flatnonzero((store.steps >= step_lo) & (store.steps <= step_hi))
                row = row_of_id[store.ids[sel]]
                keep = row >= 0
                sel, row = sel[keep], row[keep]
                key = row * bins + step_bins(store.steps[sel], step_lo, step_hi, bins)
                v = store.column(stat)[sel]
                flags[key] = HAS_DATA
                # a cell is marked when its tensor held any NaN/Inf element, whatever statistic is shown: a
                # gradient with most elements NaN has finite min/max/mean/norm over the rest
                nans, infs = store.column("nans")[sel], store.column("infs")[sel]
                np.bitwise_or.at(flags, key[(nans > 0) | np.isnan(v)], HAS_NAN)
                np.bitwise_or.at(flags, key[(infs > 0) | np.isinf(v)], HAS_INF)
                finite = np.isfinite(v)
                reduce = np.fmin if agg == "min" else np.fmax
                reduce.at(values, key[finite], v[finite])
                most_nans = np.zeros(n * bins)
                most_infs = np.zeros(n * bins)
                np.fmax.at(most_nans, key, nans)
                np.fmax.at(most_infs, key, infs)
                bad_cells = np.flatnonzero(flags & (HAS_NAN | HAS_INF))
                bad_nans, bad_infs = most_nans[bad_cells], most_infs[bad_cells]
            else:
                bad_cells, bad_nans, bad_infs = np.empty(0, dtype=np.int64), np.empty(0), np.empty(0)
            return Heatmap(
                names=names,
                step_lo=step_lo,
                step_hi=step_hi,
                bins=bins,
                edges=edges,
                values=values.reshape(n, bins),
                flags=flags.reshape(n, bins),
                agg=agg,
                bad_cells=bad_cells,
                bad_nans=bad_nans,
                bad_infs=bad_infs,
            )

    def series(
        self, rank: int | None, kind: str, name: str, stat: str
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """(steps, values) of one tensor's statistic, by step; None when unknown."""
        with self._lock:
            store = self._store(rank)
            if store is None:
                return None
            interner = store.kind_names.get(kind)
            if interner is None or name not in interner.ids:
                return None
            store_id = store.kind_ids[kind][interner.ids[name]]
            sel = np.flatnonzero(store.ids == store_id)
            steps, values = store.steps[sel], store.column(stat)[sel]
            order = np.argsort(steps, kind="stable")
            steps, values = steps[order], values[order]
            if len(steps) > MAX_SERIES_POINTS:
                steps, values = _min_max_decimate(steps, values, MAX_SERIES_POINTS // 2)
            return steps, values


def _min_max_decimate(steps: np.ndarray, values: np.ndarray, bins: int) -> tuple[np.ndarray, np.ndarray]:
    """Per bin of consecutive points, keep the lowest and the highest (non-finite points always kept)."""
    n = len(steps)
    edges = np.linspace(0, n, bins + 1).astype(np.int64)
    keep = np.zeros(n, dtype=bool)
    finite = np.isfinite(values)
    keep[~finite] = True
    filled_lo = np.where(finite, values, np.inf)
    filled_hi = np.where(finite, values, -np.inf)
    for a, b in zip(edges[:-1], edges[1:], strict=False):
        if b > a:
            keep[a + int(np.argmin(filled_lo[a:b]))] = True
            keep[a + int(np.argmax(filled_hi[a:b]))] = True
    return steps[keep], values[keep]
