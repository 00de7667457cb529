"""Every rank's time of a run (``plugins/trainmon/rank_times/``, else each rank's ``timing/rank=<r>/``: read
through :mod:`trainmon.run.timetable`; what the times mean: :mod:`trainmon.run.timing`) for the time heat map,
read **on demand**: one time (``step``, ``forward``, ``wait``, ...) of every rank is read when a heat map asks
for it, never at startup nor for the tab's first view, and kept in a small least-recently-used cache
(:data:`CACHE_ENTRIES` times, at most :data:`CACHE_BYTES`). A cached time is brought up to date when it is
asked for again: only the steps written since are read.

A time is kept as ``(groups, steps, g)`` float32: the ranks in the groups of the timeline's rank rows
(:mod:`trainmon_tb.rank_rows`: ``g`` consecutive ranks a group, ``g`` = 1 up to 200 ranks), the steps on a
regular grid (the collected steps: a step missing from it is NaN). A heat map cell is a group's (or, under an
expanded group, one rank's) values over a bin of steps; every bin of a heat map holds the same number of
grid steps (the last one fewer), so the values of the cells of a row lie one after another in memory and a
1,024-rank x 20,000-step heat map is one copy and one sort of small rows: each cell's median, maximum and the
rank of the maximum come from its sorted values, exactly."""

from __future__ import annotations

import math
import mmap
import os
import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from trainmon.run.columnar import column_numpy, read_segment, segments, signature
from trainmon.run.layout import rank_partitions, rank_times_dir, timing_dir
from trainmon.run.timetable import RANK_TIMES_SCHEMA, TIMING_COLUMNS, read_timing
from trainmon.run.timing import TIMES
from trainmon_tb.rank_rows import MAX_RANK_ROWS, group_size, rank_rows

CACHE_ENTRIES = 4  # times kept (a 1,024-rank x 20,000-step time: 82 MB)
CACHE_BYTES = 512 << 20
HAS_DATA = 1  # the cell's flag (heatmap.js: bit 1, data)
# cell values laid out and sorted at once (a few rank rows of a heat map: 16 MB, in the caches' reach)
CELL_CHUNK = 4 << 20

COLUMN = dict(zip(TIMES, TIMING_COLUMNS, strict=True))  # a time's column in the tables
_READERS = min(2, os.cpu_count() or 1)  # segments decoded side by side
_WORKERS = _READERS  # rank rows of a heat map computed side by side

_Part = tuple[np.ndarray, np.ndarray]  # (steps, values: steps x ranks)


@dataclass
class TimeHeatmap:
    """Rows (rank rows: ``labels``, ``row_kinds``, ``group_size``) x bins of steps (``edges``: bin ``i`` holds
    the steps ``edges[i] .. edges[i+1] - 1``); per cell, in milliseconds, the median and the maximum of its
    values (NaN: none) and the rank of the maximum (-1: none)."""

    labels: list[str]
    row_kinds: list[str]
    group_size: int
    ranks: int
    step_lo: int
    step_hi: int
    edges: list[int]
    median: np.ndarray  # (rows, bins) float32
    max: np.ndarray  # (rows, bins) float32
    max_rank: np.ndarray  # (rows, bins) int32
    source: str  # "rank_times" or "timing" (one table a rank: a job that exchanged no times)

    @property
    def bins(self) -> int:
        return len(self.edges) - 1

    @property
    def flags(self) -> np.ndarray:
        return np.isfinite(self.max).astype(np.uint8) * HAS_DATA


@dataclass
class _Grid:
    """One time of every rank on a regular grid of steps (``first + i * stride``), in seconds."""

    name: str
    source: str
    signature: tuple
    ranks: np.ndarray  # (R,) ascending
    size: int  # ranks a group
    group_ids: np.ndarray  # (G,) rank // size of each group, ascending
    first: int
    stride: int
    count: int  # grid steps filled
    values: np.ndarray  # (G, capacity, size) float32; NaN where no value

    @property
    def nbytes(self) -> int:
        return self.values.nbytes

    @property
    def last(self) -> int:
        return self.first + (self.count - 1) * self.stride


def _stride(steps: np.ndarray) -> int:
    diffs = np.diff(steps)
    return int(np.gcd.reduce(diffs)) if len(diffs) and diffs.min() > 0 else 1


def _last_of_each_step(steps: np.ndarray) -> np.ndarray:
    """Indices of the last row of each distinct step (a resumed job writes a step again: the last counts),
    by step."""
    _, last_rev = np.unique(steps[::-1], return_index=True)
    return len(steps) - 1 - last_rev


def _list_matrix(column: pa.ChunkedArray, world: int) -> np.ndarray:
    """A column of lists of float32 as ``(rows, world)``: a list shorter than ``world`` (a step of a smaller
    job, resumed larger) padded with NaN."""
    array = column.combine_chunks() if column.num_chunks != 1 else column.chunks[0]
    n = len(array)
    lengths = np.diff(np.asarray(column_numpy(array.offsets), dtype=np.int64))  # a null list: none
    flat = np.asarray(column_numpy(array.flatten()), dtype=np.float32)
    if n and (lengths == world).all():
        return flat.reshape(n, world)
    out = np.full((n, world), np.nan, dtype=np.float32)
    rows = np.repeat(np.arange(n), lengths)
    cols = np.arange(len(flat)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    out[rows, cols] = flat
    return out


class TimeIndex:
    """The time of every rank of one run. Nothing is read until a heat map asks for a time. Thread-safe; the
    cache's lock is held only to look up and insert."""

    def __init__(self, run_dir: os.PathLike[str] | str) -> None:
        from pathlib import Path

        self.run_dir = Path(run_dir)
        self._cache: OrderedDict[str, _Grid] = OrderedDict()
        self._lock = threading.Lock()
        self._loading: dict[str, threading.Lock] = {}
        self.reads = 0  # times read from the tables (tests, benchmarks)
        # room for cells' values, kept for the next heat map (fresh memory costs page faults): one heat map
        # computed at a time
        self._scratch = np.empty(0, dtype=np.float32)
        self._compute = threading.Lock()

    def available(self) -> bool:
        """Whether the run has timing tables (two ``stat`` calls; nothing read)."""
        return rank_times_dir(self.run_dir).is_dir() or timing_dir(self.run_dir).is_dir()

    def source(self) -> str | None:
        if rank_times_dir(self.run_dir).is_dir():
            return "rank_times"
        return "timing" if timing_dir(self.run_dir).is_dir() else None

    # ------------------------------------------------------------------ reading
    def _signature(self, source: str) -> tuple:
        if source == "rank_times":
            return signature(rank_times_dir(self.run_dir))
        return tuple((rank, signature(folder)) for rank, folder in rank_partitions(timing_dir(self.run_dir)))

    def _read(self, source: str, name: str, after: int | None) -> tuple[np.ndarray, list[_Part]]:
        """(ranks, parts) of one time from step ``after + 1`` on: each part's steps and values (steps x
        ranks, float32), in the order they were written (a step written again, by a resumed job, comes in a
        later part)."""
        column = COLUMN[name]
        lo = None if after is None else after + 1
        if source == "rank_times":
            return self._read_rank_times(column, lo)
        parts = []
        for rank, _ in rank_partitions(timing_dir(self.run_dir)):
            t = read_timing(self.run_dir, rank, ["step", column], step_lo=lo)
            parts.append((rank, np.asarray(column_numpy(t.column("step")), dtype=np.int64),
                          np.asarray(column_numpy(t.column(column)), dtype=np.float32)))  # fmt: skip
        ranks = np.asarray([r for r, _, _ in parts], dtype=np.int64)
        steps = np.unique(np.concatenate([s for _, s, _ in parts])) if parts else np.empty(0, np.int64)
        values = np.full((len(steps), len(ranks)), np.nan, dtype=np.float32)
        for j, (_, s, v) in enumerate(parts):
            keep = _last_of_each_step(s)
            values[np.searchsorted(steps, s[keep]), j] = v[keep]
        return ranks, [(steps, values)]

    def _read_rank_times(self, column: str, lo: int | None) -> tuple[np.ndarray, list[_Part]]:
        """The segments of ``rank_times/`` read side by side (pyarrow decodes them without the GIL: a
        1,024-rank x 20,000-step time is 20 segments of 4 MB)."""
        from concurrent.futures import ThreadPoolExecutor

        folder = rank_times_dir(self.run_dir)
        columns = ["step", "world", column]

        def read(segment) -> pa.Table:
            return read_segment(segment, RANK_TIMES_SCHEMA, columns, lo, None, mapped=True)

        for attempt in range(3):
            found = [s for s in segments(folder) if s.overlaps(lo, None)]
            try:
                if len(found) < 2:
                    tables = [read(s) for s in found]
                else:
                    with ThreadPoolExecutor(_READERS) as pool:
                        tables = list(pool.map(read, found))
                break
            except FileNotFoundError:  # a stream sealed (or a segment replaced) meanwhile: list again
                if attempt == 2:
                    raise
        tables = [t for t in tables if t.num_rows]
        world = max((int(pc.max(t.column("world")).as_py()) for t in tables), default=0)
        parts = []
        for t in tables:
            steps = np.asarray(column_numpy(t.column("step")), dtype=np.int64)
            parts.append((steps, _list_matrix(t.column(column), world)))
        return np.arange(world, dtype=np.int64), parts

    def _load(self, name: str) -> _Grid | None:
        source = self.source()
        if source is None:
            return None
        sig = self._signature(source)
        ranks, parts = self._read(source, name, None)
        self.reads += 1
        if not len(ranks):
            return None
        every = np.concatenate([s for s, _ in parts]) if parts else np.empty(0, np.int64)
        steps = np.unique(every)
        size = group_size(ranks, MAX_RANK_ROWS)
        group_ids = np.unique(ranks // size)
        first = int(steps[0]) if len(steps) else 0
        stride = _stride(steps)
        count = int((steps[-1] - first) // stride + 1) if len(steps) else 0
        grid = _Grid(name, source, sig, ranks, size, group_ids, first, stride, 0,
                     np.empty((len(group_ids), 0, size), dtype=np.float32))  # fmt: skip
        _grow(grid, count)
        if len(parts) > 1 and len(steps) == len(every):  # no step written twice: any order, side by side
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(_READERS) as pool:
                list(pool.map(lambda part: _put(grid, *part), parts))
        else:
            for part_steps, values in parts:
                _put(grid, part_steps, values)
        _holes(grid, 0, parts)
        return grid

    def _update(self, grid: _Grid) -> _Grid | None:
        """``grid`` with the steps written since it was read (read again whole when they do not fit it)."""
        source = self.source()
        if source != grid.source:
            return self._load(grid.name)
        sig = self._signature(source)
        if sig == grid.signature:
            return grid
        ranks, parts = self._read(source, grid.name, grid.last if grid.count else None)
        self.reads += 1
        steps = np.concatenate([s for s, _ in parts]) if parts else np.empty(0, np.int64)
        fits = (
            np.array_equal(ranks, grid.ranks) or not len(steps)
        ) and bool(((steps - grid.first) % grid.stride == 0).all())
        if not fits:
            return self._load(grid.name)
        grid.signature = sig
        if len(steps):
            since = grid.count
            _grow(grid, int((steps.max() - grid.first) // grid.stride + 1))
            for part_steps, values in parts:
                _put(grid, part_steps, values)
            _holes(grid, since, parts)
        return grid

    def _current(self, name: str) -> _Grid | None:
        """The time's grid, read or brought up to date (under the time's lock: a grid changes only there)."""
        with self._lock:
            grid = self._cache.get(name)
        grid = self._load(name) if grid is None else self._update(grid)
        with self._lock:
            if grid is None:
                self._cache.pop(name, None)
                return None
            self._cache[name] = grid
            self._cache.move_to_end(name)
            while len(self._cache) > 1 and (
                len(self._cache) > CACHE_ENTRIES or sum(g.nbytes for g in self._cache.values()) > CACHE_BYTES
            ):
                self._cache.popitem(last=False)
        return grid

    def key(self, name: str) -> str | None:
        """Changes whenever the time's heat maps may change (steps written, ranks): the time brought up to
        date first (only what is new is read). None: the run has no timing table."""
        with self._lock:
            loading = self._loading.setdefault(name, threading.Lock())
        with loading:
            grid = self._current(name)
        if grid is None:
            return None
        written = zlib.crc32(repr(grid.signature).encode())
        return f"{name}.{len(grid.ranks)}.{grid.first}.{grid.stride}.{grid.count}.{written:08x}"

    def cached(self) -> list[str]:
        with self._lock:
            return list(self._cache)

    # ------------------------------------------------------------------ the heat map
    def _buffer(self, size: int) -> np.ndarray:
        """``size`` float32 of the scratch buffer (under ``_compute``)."""
        if len(self._scratch) < size:
            self._scratch = _fresh((size,))
        return self._scratch[:size]

    def heatmap(
        self,
        name: str,
        step_lo: int | None,
        step_hi: int | None,
        bins: int,
        expand: Collection[int] = (),
    ) -> TimeHeatmap | None:
        """Rank rows x bins of steps of one time (None: the run has no timing table)."""
        with self._lock:
            loading = self._loading.setdefault(name, threading.Lock())
        with loading:  # one reader of a time at a time, its grid unchanged meanwhile; other times go on
            grid = self._current(name)
            return None if grid is None else self._heatmap(grid, step_lo, step_hi, bins, expand)

    def _heatmap(
        self, grid: _Grid, step_lo: int | None, step_hi: int | None, bins: int, expand: Collection[int]
    ) -> TimeHeatmap:
        rows = rank_rows(grid.ranks.tolist(), expand, MAX_RANK_ROWS)
        lo = step_lo if step_lo is not None else grid.first if grid.count else 0
        hi = step_hi if step_hi is not None else max(lo, grid.last) if grid.count else lo
        # the grid steps inside [lo, hi], in bins of ``width`` grid steps
        g0 = max(0, -((grid.first - lo) // grid.stride))  # ceil((lo - first) / stride)
        g1 = min(grid.count, (hi - grid.first) // grid.stride + 1) if hi >= grid.first else 0
        n = max(0, g1 - g0)
        width = max(1, math.ceil(n / max(1, bins)))
        nb = max(1, math.ceil(n / width))
        edges = [lo] + [grid.first + (g0 + i * width) * grid.stride for i in range(1, nb)] + [hi + 1]
        shape = (len(rows.labels), nb)
        median = np.full(shape, np.nan, dtype=np.float32)
        top = np.full(shape, np.nan, dtype=np.float32)
        top_rank = np.full(shape, -1, dtype=np.int32)
        if n:
            block = grid.values[:, g0:g1, :]  # (G, n, g)
            first_rank = grid.group_ids * grid.size
            # each group's row (and the row of an expanded group's header)
            group_rows = rows.base[_first_present(grid)]
            with self._compute:
                med, mx, at = _cells(block, width, nb, self._buffer)
            top_rank_group = np.where(at >= 0, first_rank[:, None] + at % grid.size, -1)
            median[group_rows], top[group_rows], top_rank[group_rows] = med, mx, top_rank_group
            for gi in _opened(grid, rows):  # the ranks of an expanded group, each on its own row
                members = first_rank[gi] + np.arange(grid.size)
                present = np.isin(members, grid.ranks)
                single = np.ascontiguousarray(block[gi].T[present][:, :, None])  # (ranks, n, 1)
                with self._compute:
                    med, mx, at = _cells(single, width, nb, self._buffer)
                own = rows.member[members[present]]
                median[own], top[own] = med, mx
                top_rank[own] = np.where(at >= 0, members[present][:, None], -1)
        return TimeHeatmap(
            labels=rows.labels,
            row_kinds=rows.kinds,
            group_size=rows.group_size,
            ranks=len(grid.ranks),
            step_lo=lo,
            step_hi=hi,
            edges=edges,
            median=median * np.float32(1e3),
            max=top * np.float32(1e3),
            max_rank=top_rank,
            source=grid.source,
        )


# an anonymous map's pages handed out at once (Linux): a third cheaper than a fault a page when written
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def _fresh(shape: tuple[int, ...]) -> np.ndarray:
    """An uninitialised float32 array. A large one in an anonymous map of its own: numpy asks the kernel for
    huge pages for large arrays, and where the kernel compacts memory to find them (transparent_hugepage
    defrag: madvise, a common default) touching 80 MB the first time takes 100-200 ms instead of 30-40 on
    two cores; a time's first heat map is mostly reading and placing its values."""
    size = int(np.prod(shape)) * 4
    if size < (4 << 20):
        return np.empty(shape, dtype=np.float32)
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0) | _POPULATE
    memory = mmap.mmap(-1, size, flags=flags) if flags else mmap.mmap(-1, size)
    return np.frombuffer(memory, dtype=np.float32).reshape(shape)


def _grow(grid: _Grid, count: int) -> None:
    """Make room for ``count`` grid steps (capacity doubled: appending a step at a time stays cheap)."""
    groups, capacity, size = grid.values.shape
    if count > capacity:  # not filled: every step up to ``count`` is written by _put or _holes
        grown = _fresh((groups, max(count, 2 * capacity), size))
        grown[:, : grid.count] = grid.values[:, : grid.count]
        grid.values = grown
    grid.count = max(grid.count, count)


def _holes(grid: _Grid, since: int, parts: list[_Part]) -> None:
    """NaN at the grid steps from ``since`` on that no part wrote (steps the run did not collect)."""
    written = np.zeros(grid.count - since, dtype=bool)
    for steps, _ in parts:
        at = (steps - grid.first) // grid.stride - since
        written[at[(at >= 0) & (at < len(written))]] = True
    missing = np.flatnonzero(~written) + since
    if len(missing):
        grid.values[:, missing, :] = np.nan


def _put(grid: _Grid, steps: np.ndarray, values: np.ndarray) -> None:
    """Write ``values`` (steps x the grid's ranks) at their grid steps (within the grid's count)."""
    if not len(steps):
        return
    groups, _, size = grid.values.shape
    at = (steps - grid.first) // grid.stride
    ranks = grid.ranks
    if len(ranks) == groups * size:  # every slot of every group: one transposing copy
        block = values.reshape(len(steps), groups, size).transpose(1, 0, 2)
        if len(at) > 1 and (np.diff(at) == 1).all():
            grid.values[:, int(at[0]) : int(at[-1]) + 1, :] = block
        else:
            grid.values[:, at, :] = block
        return
    grid.values[:, at, :] = np.nan  # the slots of ranks the run lacks
    group = np.searchsorted(grid.group_ids, ranks // size)
    for j, rank in enumerate(ranks.tolist()):
        grid.values[group[j], at, rank % size] = values[:, j]


def _first_present(grid: _Grid) -> np.ndarray:
    """The first rank of each group that the run has (the group's row in the rank rows)."""
    group = grid.ranks // grid.size
    starts = np.flatnonzero(np.r_[True, group[1:] != group[:-1]])
    return grid.ranks[starts]


def _opened(grid: _Grid, rows) -> list[int]:
    """The groups shown with their ranks (each rank has a member row)."""
    if rows.group_size == 1:
        return []
    firsts = _first_present(grid)
    return [gi for gi, r in enumerate(firsts.tolist()) if rows.member[r] >= 0]


def _cells(
    block: np.ndarray, width: int, bins: int, buffer: Callable[[int], np.ndarray]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row and bin of ``width`` steps of ``block`` (rows, steps, slots): the median and the maximum of the
    cell's values (NaN: none) and the index of the maximum among them (``step * slots + slot``, -1: none).
    ``buffer(n)``: room for the cells' values of a few rows at a time (:data:`CELL_CHUNK` values a worker).
    The rows are split between :data:`_WORKERS` threads (numpy copies and sorts without the GIL)."""
    rows, _, slots = block.shape
    k = width * slots
    median = np.empty((rows, bins), dtype=np.float32)
    top = np.empty((rows, bins), dtype=np.float32)
    at = np.empty((rows, bins), dtype=np.int32)
    step = max(1, CELL_CHUNK // max(1, bins * k))
    chunks = [(r0, min(rows, r0 + step)) for r0 in range(0, rows, step)]
    workers = min(_WORKERS, len(chunks))
    room = buffer(workers * step * bins * k)

    def work(worker: int) -> None:
        own = room[worker * step * bins * k : (worker + 1) * step * bins * k]
        for r0, r1 in chunks[worker::workers]:
            cells = own[: (r1 - r0) * bins * k].reshape(r1 - r0, bins, k)
            median[r0:r1], top[r0:r1], at[r0:r1] = _reduce(block[r0:r1], width, cells)

    if workers < 2:
        work(0)
    else:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(work, range(workers)))
    return median, top, at


def _reduce(block: np.ndarray, width: int, cells: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`_cells` of a few rows, their values laid out in ``cells`` (rows, bins, width * slots)."""
    rows, bins, k = cells.shape
    n = block.shape[1]
    whole = n // width
    if whole:
        cells[:, :whole] = block[:, : whole * width].reshape(rows, whole, k)
    if whole < bins:  # the last bin, fewer steps
        rest = block[:, whole * width :].reshape(rows, -1)
        cells[:, whole, : rest.shape[1]] = rest
        cells[:, whole, rest.shape[1] :] = np.nan
    # the maximum's place first (sorting loses it); argmax stops at a NaN, so the cells holding one (a step
    # missing, a rank missing from its group, the last bin) are done again without their NaN
    at = cells.argmax(axis=-1)
    holes = np.isnan(np.take_along_axis(cells, at[..., None], -1)[..., 0])
    count = np.full((rows, bins), k, dtype=np.int64)
    r, b = np.nonzero(holes)
    if len(r):
        part = cells[r, b]
        at[r, b] = np.where(np.isnan(part), -np.inf, part).argmax(axis=-1)
        count[r, b] = (~np.isnan(part)).sum(axis=-1)
    cells.sort(axis=-1)  # NaN last
    empty = count == 0
    lo = np.maximum(count - 1, 0) // 2
    hi = np.minimum(count // 2, k - 1)
    pick = lambda i: np.take_along_axis(cells, i[..., None], -1)[..., 0]
    median = (pick(lo) + pick(hi)) * np.float32(0.5)
    top = pick(np.maximum(count - 1, 0))
    median[empty], top[empty] = np.nan, np.nan
    return median, top, np.where(empty, -1, at)
