"""The statistics store of a run (``plugins/trainmon/stats/rank=<r>/``, read through
:mod:`trainmon.run.statstore`) for the heatmap and the line chart, read **on demand**: a rank's statistic is
read when a heatmap or a series of that rank asks for it, as a steps x tensors matrix, and kept in a small
least-recently-used cache (:data:`CACHE_ENTRIES` matrices, at most :data:`CACHE_BYTES`). A cached matrix is
brought up to date when it is used again: only the steps written since are read.

Zoomed-out heatmaps come from per-block minima and maxima: with the matrix, blocks of ``2**k`` steps are
reduced once per level and kept, and a heatmap whose bins span many steps is reduced from the coarsest level
whose blocks fit in its bins (the blocks of a bin straddling an edge are taken from the finer level), so a
20,000-step heatmap costs about what a 1000-step one does."""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow.compute as pc

from trainmon.run.layout import stats_dir
from trainmon.run.manifest import read_manifest
from trainmon.run.statstore import last_step, read_stats, stat_ranks, store_signature
from trainmon_tb.anomaly_index import Interner, bin_edges, glob_ids

MAX_SERIES_POINTS = 4000
HAS_DATA, HAS_NAN, HAS_INF = 1, 2, 4
CACHE_ENTRIES = 8  # (rank, statistic) matrices kept
CACHE_BYTES = 384 << 20
READ_STEPS = 2048  # steps read at once when a rank's statistic is read
_SETTLED_NS = 2_000_000_000  # see anomaly_index: a folder time younger than this may hide a change


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


_NO_BAD = (np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0), np.empty(0))


@dataclass
class _Frame:
    """One statistic of one rank at every step: ``low``/``high`` (float32, steps x tensors; equal at the
    finest level, NaN where no finite value) and ``flags`` (HAS_DATA/HAS_NAN/HAS_INF), per level of blocks
    of ``2**level`` steps (level 0: single steps)."""

    rank: int
    stat: str
    signature: tuple
    steps: np.ndarray  # (S,) ascending
    tensors: tuple[tuple[str, str], ...]
    values: np.ndarray  # (S, T) float32
    flags: np.ndarray  # (S, T) uint8
    kinds: dict[str, Interner] = field(default_factory=dict)  # kind -> names, in tensor order
    columns: dict[str, list[int]] = field(default_factory=dict)  # kind -> tensor column of each name
    levels: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=dict)
    # the (step index, tensor column) of every value whose tensor held NaN/Inf elements, with their counts:
    # few in a healthy run, so kept sparse; the heatmap's tooltip shows them
    bad: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] = field(default_factory=lambda: _NO_BAD)

    def __post_init__(self) -> None:
        for j, (kind, name) in enumerate(self.tensors):
            interner = self.kinds.setdefault(kind, Interner())
            if name not in interner.ids:
                interner(name)
                self.columns.setdefault(kind, []).append(j)

    @property
    def nbytes(self) -> int:
        extra = sum(a.nbytes for level in self.levels.values() for a in level)
        extra += sum(a.nbytes for a in self.bad)
        return self.values.nbytes + self.flags.nbytes + self.steps.nbytes + extra

    def level(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(first step, last step, low, high, flags) of each block of ``2**k`` steps (aligned to multiples
        of ``2**k``; a block holds the steps present in it)."""
        got = self.levels.get(k)
        if got is None:
            ids = self.steps >> k
            if len(ids):
                starts = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]])
                ends = np.r_[starts[1:], len(ids)] - 1
            else:
                starts = ends = np.empty(0, np.int64)
            finite = np.isfinite(self.values)
            low = np.fmin.reduceat(np.where(finite, self.values, np.inf), starts, axis=0)
            high = np.fmax.reduceat(np.where(finite, self.values, -np.inf), starts, axis=0)
            low[np.isinf(low)] = np.nan
            high[np.isinf(high)] = np.nan
            flags = np.bitwise_or.reduceat(self.flags, starts, axis=0)
            got = self.levels[k] = (self.steps[starts], self.steps[ends], low, high, flags)
        return got


def _read_part(run_dir: Path, rank: int, stat: str, signature: tuple, step_lo: int | None,
               step_hi: int | None) -> _Frame:  # fmt: skip
    stats = tuple(dict.fromkeys((stat, "nans", "infs")))
    frame = read_stats(run_dir, rank, stats, step_lo=step_lo, step_hi=step_hi)
    values = frame.values[stat].astype(np.float32, copy=False)
    nans, infs = frame.values["nans"], frame.values["infs"]
    present = ~np.isnan(nans)  # a count is never NaN: NaN means no row
    # a cell is marked when its tensor held any NaN/Inf element, whatever statistic is shown: a gradient with
    # most elements NaN has finite min/max/mean/norm over the rest
    has_nan = present & ((nans > 0) | np.isnan(values))
    has_inf = present & ((infs > 0) | np.isinf(values))
    flags = present.astype(np.uint8) * HAS_DATA
    flags |= has_nan.astype(np.uint8) * HAS_NAN
    flags |= has_inf.astype(np.uint8) * HAS_INF
    at, col = np.nonzero(has_nan | has_inf)
    counts = np.nan_to_num(nans[at, col]), np.nan_to_num(infs[at, col])
    bad = (at.astype(np.int64), col.astype(np.int64), *counts)
    return _Frame(rank, stat, signature, frame.steps, frame.tensors, values, flags, bad=bad)


def _read_frame(run_dir: Path, rank: int, stat: str, step_lo: int | None = None) -> _Frame:
    """One statistic of one rank from ``step_lo`` on, read :data:`READ_STEPS` steps at a time (what reading
    a whole long run at once would hold on top of the matrix is a multiple of it)."""
    signature = store_signature(run_dir, rank)
    last = last_step(run_dir, rank)
    if last is None:
        return _read_part(run_dir, rank, stat, signature, step_lo, None)
    first = step_lo if step_lo is not None else _first_step(run_dir, rank)
    if first is None or last - first < READ_STEPS:
        return _read_part(run_dir, rank, stat, signature, step_lo, None)
    parts = []
    for lo in range(first, last + 1, READ_STEPS):
        hi = None if lo + READ_STEPS > last else lo + READ_STEPS - 1  # the last part: whatever came since
        part = _read_part(run_dir, rank, stat, signature, lo, hi)
        if len(part.steps):
            parts.append(part)
    if not parts:
        return _read_part(run_dir, rank, stat, signature, step_lo, None)
    tensors = max((p.tensors for p in parts), key=len)
    if any(p.tensors != tensors[: len(p.tensors)] for p in parts):  # tensors in another order: at once
        return _read_part(run_dir, rank, stat, signature, step_lo, None)
    steps = np.concatenate([p.steps for p in parts])
    values = np.full((len(steps), len(tensors)), np.nan, dtype=np.float32)
    flags = np.zeros(values.shape, dtype=np.uint8)
    row = 0
    bad: list[tuple[np.ndarray, ...]] = []
    for p in parts:
        values[row : row + len(p.steps), : len(p.tensors)] = p.values
        flags[row : row + len(p.steps), : len(p.tensors)] = p.flags
        bad.append((p.bad[0] + row, *p.bad[1:]))
        row += len(p.steps)
    joined = tuple(np.concatenate(column) for column in zip(*bad, strict=True))
    return _Frame(rank, stat, signature, steps, tensors, values, flags, bad=joined)


def _first_step(run_dir: Path, rank: int) -> int | None:
    """The first step of a rank's store: its first segment's (its name says it), else its first row's."""
    from trainmon.run.columnar import segments
    from trainmon.run.layout import stats_rank_dir

    found = segments(stats_rank_dir(run_dir, rank))
    if found:
        return min(s.lo for s in found)
    return None


class StatIndex:
    """The statistics store of one run. Ranks are listed cheaply at each refresh; a rank's statistic is read
    when asked for and cached. Thread-safe; the cache's lock is held only to look up and insert."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self._ranks: tuple[int, ...] = ()
        self._dir_time: int | None = None
        self._cache: OrderedDict[tuple[int, str], _Frame] = OrderedDict()
        self._lock = threading.Lock()
        self._loading: dict[tuple[int, str], threading.Lock] = {}
        self._kinds: tuple[tuple, list[str]] | None = None  # (signature, stat kinds) of the first rank
        self._first: tuple[int, int] | None = None  # (rank, its first step)
        self.reads = 0  # matrices read from the store (tests, benchmarks)

    # ------------------------------------------------------------------ ranks and summary
    def refresh(self) -> bool:
        """List the ranks with a store (only when the store's folder changed). True when they changed."""
        folder = stats_dir(self.run_dir)
        try:
            mtime = os.stat(folder).st_mtime_ns
        except OSError:
            mtime = -1
        if mtime == self._dir_time and (mtime < 0 or time.time_ns() - mtime > _SETTLED_NS):
            return False
        self._dir_time = mtime
        ranks = tuple(stat_ranks(self.run_dir))
        changed, self._ranks = ranks != self._ranks, ranks
        return changed

    def first_rank(self) -> int | None:
        return self._ranks[0] if self._ranks else None

    def summary(self) -> dict:
        ranks = self._ranks
        steps = None
        if ranks:
            last = last_step(self.run_dir, ranks[0])
            first = self._first_step(ranks[0])
            if last is not None and first is not None:
                steps = [first, int(last)]
        return {"ranks": list(ranks), "stat_kinds": self._stat_kinds(), "steps": steps}

    def _first_step(self, rank: int) -> int | None:
        """The first step of a rank's store (read once: steps are only appended after it)."""
        if self._first is None or self._first[0] != rank:
            first = _first_step(self.run_dir, rank)
            if first is None:  # the old store: its first record's step
                from trainmon.run.statstore import read_rows

                column = read_rows(self.run_dir, rank, ["step"]).column("step")
                if not len(column):
                    return None
                first = int(pc.min(column).as_py())
            self._first = (rank, first)
        return self._first[1]

    def _stat_kinds(self) -> list[str]:
        """The kinds with statistics: the manifest's, else those of the first rank's store."""
        manifest = read_manifest(self.run_dir) or {}
        kinds = manifest.get("kinds")
        if isinstance(kinds, list) and kinds and self._ranks:
            return [str(k) for k in kinds]
        if not self._ranks:
            return []
        rank = self._ranks[0]
        signature = store_signature(self.run_dir, rank)
        if self._kinds is None or self._kinds[0] != signature:
            from trainmon.run.statstore import read_rows

            column = read_rows(self.run_dir, rank, ["kind"]).column("kind")
            found = list(dict.fromkeys(str(k) for k in column.unique().to_pylist())) if len(column) else []
            self._kinds = (signature, found)
        return self._kinds[1]

    # ------------------------------------------------------------------ the cache
    def _frame(self, rank: int | None, stat: str) -> _Frame | None:
        if rank is None:
            if not self._ranks:
                self.refresh()
            if not self._ranks:
                return None
            rank = self._ranks[0]
        key = (rank, stat)
        with self._lock:
            loading = self._loading.setdefault(key, threading.Lock())
        with loading:  # one read per (rank, stat) at a time; other keys go on
            with self._lock:
                frame = self._cache.get(key)
                if frame is not None:
                    self._cache.move_to_end(key)
            frame = self._current(frame, rank, stat)
            if frame is None:
                return None
            with self._lock:
                self._cache[key] = frame
                self._cache.move_to_end(key)
                while len(self._cache) > 1 and (
                    len(self._cache) > CACHE_ENTRIES
                    or sum(f.nbytes for f in self._cache.values()) > CACHE_BYTES
                ):
                    self._cache.popitem(last=False)
            return frame

    def _current(self, frame: _Frame | None, rank: int, stat: str) -> _Frame | None:
        """``frame`` brought up to date (the steps written since), or read (None: the rank has no store)."""
        if frame is not None:
            signature = store_signature(self.run_dir, rank)
            if signature == frame.signature:
                return frame
            after = int(frame.steps[-1]) + 1 if len(frame.steps) else None
            new = _read_frame(self.run_dir, rank, stat, step_lo=after)
            self.reads += 1
            if not len(new.steps):
                frame.signature = signature
                return frame
            if new.tensors[: len(frame.tensors)] == frame.tensors or frame.tensors == new.tensors[:0]:
                return _extend(frame, new)
            # other tensors than before: read the whole rank again
        if rank not in self._ranks and rank not in stat_ranks(self.run_dir):
            return None
        self.reads += 1
        return _read_frame(self.run_dir, rank, stat)

    # ------------------------------------------------------------------ queries
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
        frame = self._frame(rank, stat)
        if frame is None:
            return None
        interner = frame.kinds.get(kind, Interner())
        wanted = glob_ids(interner, name)
        rows = np.arange(len(interner.values)) if wanted is None else wanted
        cols = np.asarray(frame.columns.get(kind, []), dtype=np.int64)[rows]
        names = [interner.values[i] for i in rows]
        steps = frame.steps
        if step_lo is None or step_hi is None:
            lo = int(steps[0]) if len(steps) else 0
            hi = int(steps[-1]) if len(steps) else 0
            step_lo = lo if step_lo is None else step_lo
            step_hi = hi if step_hi is None else step_hi
        bins, edges = bin_edges(step_lo, step_hi, bins)
        agg = "min" if stat == "min" else "max"
        n = len(names)
        values = np.full((bins, n), np.nan, dtype=np.float32)
        flags = np.zeros((bins, n), dtype=np.uint8)
        if n and len(steps):
            _reduce_bins(frame, cols, np.asarray(edges, dtype=np.int64), agg, values, flags)
        flags = np.ascontiguousarray(flags.T)
        bad_cells, bad_nans, bad_infs = _bad_cells(frame, cols, np.asarray(edges, dtype=np.int64), flags)
        return Heatmap(
            names=names,
            step_lo=step_lo,
            step_hi=step_hi,
            bins=bins,
            edges=edges,
            values=np.ascontiguousarray(values.T),
            flags=flags,
            agg=agg,
            bad_cells=bad_cells,
            bad_nans=bad_nans,
            bad_infs=bad_infs,
        )

    def series(
        self, rank: int | None, kind: str, name: str, stat: str
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """(steps, values) of one tensor's statistic, by step; None when unknown."""
        frame = self._frame(rank, stat)
        if frame is None:
            return None
        interner = frame.kinds.get(kind)
        if interner is None or name not in interner.ids:
            return None
        col = frame.columns[kind][interner.ids[name]]
        has = (frame.flags[:, col] & HAS_DATA) > 0
        steps, values = frame.steps[has], frame.values[has, col]
        if len(steps) > MAX_SERIES_POINTS:
            steps, values = _min_max_decimate(steps, values, MAX_SERIES_POINTS // 2)
        return steps, values

    def nonfinite_steps(
        self, rank: int | None, kind: str, name: str, stat: str
    ) -> tuple[list[int], list[int]]:
        """The steps at which one tensor held a NaN element, and those with an Inf (and no NaN), whatever
        statistic is shown: its ``norm`` there is the norm of its finite elements (0 when none is), a value
        a chart must not draw as if it were the tensor's."""
        frame = self._frame(rank, stat)
        interner = frame.kinds.get(kind) if frame is not None else None
        if interner is None or name not in interner.ids:
            return [], []
        flags = frame.flags[:, frame.columns[kind][interner.ids[name]]]
        nan = (flags & HAS_NAN) > 0
        inf = ((flags & HAS_INF) > 0) & ~nan
        return frame.steps[nan].tolist(), frame.steps[inf].tolist()

    def first_step(self, rank: int | None, stat: str, kind: str, name: str) -> int | None:
        """The first step at which one tensor has a row on the rank (None: it has none), from the matrix of
        ``stat`` (the one just shown, so read already)."""
        frame = self._frame(rank, stat)
        interner = frame.kinds.get(kind) if frame is not None else None
        if interner is None or name not in interner.ids:
            return None
        held = np.flatnonzero(frame.flags[:, frame.columns[kind][interner.ids[name]]] & HAS_DATA)
        return int(frame.steps[held[0]]) if len(held) else None

    def key(self, rank: int | None) -> str | None:
        """Changes whenever a heatmap of ``rank`` may change (its store written); None: no store."""
        rank = self.first_rank() if rank is None else rank
        if rank is None:
            return None
        return f"{rank}.{zlib.crc32(repr(store_signature(self.run_dir, rank)).encode())}"

    def cached(self) -> list[tuple[int, str]]:
        """The (rank, statistic) matrices in the cache, least recently used first."""
        with self._lock:
            return list(self._cache)


def _extend(frame: _Frame, new: _Frame) -> _Frame:
    """``frame`` with the later steps of ``new`` (whose tensors start with ``frame``'s) appended."""
    t_old, t_new = len(frame.tensors), len(new.tensors)
    values = np.full((len(frame.steps) + len(new.steps), t_new), np.nan, dtype=np.float32)
    flags = np.zeros(values.shape, dtype=np.uint8)
    values[: len(frame.steps), :t_old] = frame.values
    flags[: len(frame.steps), :t_old] = frame.flags
    values[len(frame.steps) :] = new.values
    flags[len(frame.steps) :] = new.flags
    steps = np.concatenate([frame.steps, new.steps])
    bad = tuple(
        np.concatenate([old, fresh + len(frame.steps) if i == 0 else fresh])
        for i, (old, fresh) in enumerate(zip(frame.bad, new.bad, strict=True))
    )
    return _Frame(frame.rank, frame.stat, new.signature, steps, new.tensors, values, flags, bad=bad)


def _bad_cells(
    frame: _Frame, cols: np.ndarray, edges: np.ndarray, flags: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The heatmap cells (flat index row * bins + bin of ``flags``, names x bins) whose tensor held NaN/Inf
    elements, and the most NaN and Inf elements it held at one step of the bin."""
    n, bins = flags.shape
    cells = np.flatnonzero(flags.reshape(-1) & (HAS_NAN | HAS_INF))
    if not len(cells):
        return cells.astype(np.int64), np.empty(0), np.empty(0)
    at, col, nans, infs = frame.bad
    row_of_col = np.full(len(frame.tensors), -1, dtype=np.int64)
    row_of_col[cols] = np.arange(n)
    row = row_of_col[col]
    b = np.searchsorted(edges, frame.steps[at], side="right") - 1
    ok = (row >= 0) & (b >= 0) & (b < bins)
    key = row[ok] * bins + b[ok]
    most_nans, most_infs = np.zeros(n * bins), np.zeros(n * bins)
    np.fmax.at(most_nans, key, nans[ok])
    np.fmax.at(most_infs, key, infs[ok])
    return cells.astype(np.int64), most_nans[cells], most_infs[cells]


def _reduce_bins(
    frame: _Frame, cols: np.ndarray, edges: np.ndarray, agg: str, values: np.ndarray, flags: np.ndarray
) -> None:
    """Fill ``values``/``flags`` (bins x names) with the min or max of each bin's steps, from the coarsest
    level of blocks that fits the narrowest bin (blocks straddling a bin edge come from single steps)."""
    widths = np.diff(edges)
    k = 0
    while (2 << k) <= int(widths.min()) and (2 << k) <= max(1, len(frame.steps)):
        k += 1
    starts, ends, low, high, fl = frame.level(k)
    # blocks lying wholly inside one bin; the single steps of the blocks that straddle an edge
    bin_of_start = np.searchsorted(edges, starts, side="right") - 1
    bin_of_end = np.searchsorted(edges, ends, side="right") - 1
    inside = (bin_of_start == bin_of_end) & (bin_of_start >= 0) & (bin_of_start < len(widths))
    picked = low if agg == "min" else high
    _scatter(values, flags, bin_of_start[inside], picked[inside][:, cols], fl[inside][:, cols], agg)
    if k and not inside.all():
        straddle = starts[~inside]
        block_of = frame.steps >> k
        steps_in = np.isin(block_of, straddle >> k)
        s = frame.steps[steps_in]
        b = np.searchsorted(edges, s, side="right") - 1
        ok = (b >= 0) & (b < len(widths))
        v = frame.values[steps_in][ok][:, cols]
        _scatter(values, flags, b[ok], v, frame.flags[steps_in][ok][:, cols], agg)


def _scatter(
    values: np.ndarray, flags: np.ndarray, bin_of: np.ndarray, v: np.ndarray, f: np.ndarray, agg: str
) -> None:
    """Reduce rows ``v`` (and their flags ``f``) into the bins ``bin_of`` (ascending) of ``values``,
    ``flags``."""
    if not len(bin_of):
        return
    starts = np.flatnonzero(np.r_[True, bin_of[1:] != bin_of[:-1]])
    bins = bin_of[starts]
    finite = np.isfinite(v)
    if agg == "min":
        red = np.fmin.reduceat(np.where(finite, v, np.inf), starts, axis=0)
        red[np.isinf(red)] = np.nan
        values[bins] = np.fmin(values[bins], red)
    else:
        red = np.fmax.reduceat(np.where(finite, v, -np.inf), starts, axis=0)
        red[np.isinf(red)] = np.nan
        values[bins] = np.fmax(values[bins], red)
    flags[bins] |= np.bitwise_or.reduceat(f, starts, axis=0)


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
