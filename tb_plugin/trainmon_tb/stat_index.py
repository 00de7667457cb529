"""The statistics store of a run (``plugins/trainmon/stats/rank=<r>/``, through
:mod:`trainmon.run.statstore`) for the heatmap and the line chart. A rank's step and tensor columns are kept
in memory and read again when its files changed; a statistic's column is read on first use."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainmon.run.statstore import read_rows, stat_ranks, store_signature, tensor_columns
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
    flags: np.ndarray  # uint8, same shape
    agg: str


class _RankStore:
    """One rank's store: names by id, and the step/id/statistic columns."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        self.run_dir, self.rank = run_dir, rank
        self.by_id: dict[int, tuple[str, str]] = {}
        self.kind_names: dict[str, Interner] = {}  # kind -> its names in order of first appearance
        self.kind_ids: dict[str, list[int]] = {}  # kind -> id of each interned name
        self.count = 0
        self.signature: tuple = ()
        self.steps = np.empty(0, dtype=np.int64)
        self.ids = np.empty(0, dtype=np.int32)
        self.stats: dict[str, np.ndarray] = {}

    def refresh(self) -> bool:
        signature = store_signature(self.run_dir, self.rank)
        if signature == self.signature:
            return False
        table = read_rows(self.run_dir, self.rank, ["step", "kind", "name"])
        ids, tensors = tensor_columns(table)
        self.__init__(self.run_dir, self.rank)
        self.signature = signature
        for i, (kind, name) in enumerate(tensors):
            self.by_id[i] = (kind, name)
            interner = self.kind_names.setdefault(kind, Interner())
            if name not in interner.ids:
                interner(name)
                self.kind_ids.setdefault(kind, []).append(i)
        self.steps = np.asarray(table.column("step").to_numpy(), dtype=np.int64)
        self.ids = ids.astype(np.int32)
        self.count = len(self.steps)
        return True

    def column(self, stat: str) -> np.ndarray:
        col = self.stats.get(stat)
        if col is None:  # rows are only ever appended: the first ``count`` are those of the step column
            values = read_rows(self.run_dir, self.rank, [stat]).column(stat)[: self.count]
            col = self.stats[stat] = np.asarray(values.to_numpy(), dtype=np.float32)
        return col


class StatIndex:
    """The statistics store of one run, every rank. Thread-safe."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self._ranks: dict[int, _RankStore] = {}
        self._lock = threading.RLock()

    def refresh(self) -> bool:
        with self._lock:
            changed = False
            for rank in stat_ranks(self.run_dir):
                if rank not in self._ranks:
                    self._ranks[rank] = _RankStore(self.run_dir, rank)
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
                nan = np.isnan(v)
                inf = np.isinf(v)
                np.bitwise_or.at(flags, key[nan], HAS_NAN)
                np.bitwise_or.at(flags, key[inf], HAS_INF)
                finite = ~(nan | inf)
                reduce = np.fmin if agg == "min" else np.fmax
                reduce.at(values, key[finite], v[finite])
            return Heatmap(
                names=names,
                step_lo=step_lo,
                step_hi=step_hi,
                bins=bins,
                edges=edges,
                values=values.reshape(n, bins),
                flags=flags.reshape(n, bins),
                agg=agg,
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
