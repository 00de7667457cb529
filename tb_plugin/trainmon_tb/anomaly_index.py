"""An index of a run's anomaly records (``plugins/trainmon/anomalies/rank=<r>/``, read through
:mod:`trainmon.run.anomaly_table`; the old layout's ``rank_<r>.jsonl`` too) as numpy columns, kept current at
little cost while a job writes:

- **Which ranks have new records** is read from their summaries (:mod:`trainmon.run.summary`), which every
  rank rewrites by a rename at each step end, after its records: a rename changes the summary folder's
  modification time, so a refresh when no rank ended a step is one ``stat``. Otherwise the summaries that
  changed (size, time) are read, and only ranks whose record counts moved are read. Ranks without a summary
  (a run of the old layout, a job killed before its first summary) are checked by their files' signature.
- **A rank's new records** are read from the step after the last one indexed (each step's records are
  written together), a few columns only, and **merged in** collection order (step, collectives, phase,
  micro-step, pipeline stage, seq, rank): records of steps nobody had yet are placed by step; only the steps
  they share with records already indexed are ordered again. Nothing is re-sorted, nothing is searched
  record by record.
- **Queries never wait for a refresh**: a refresh reads files without any lock, then publishes the new
  columns as one immutable snapshot; queries read whichever snapshot is current.

A record's full fields are read back from its rank's table (its step only) when the event list shows it.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import logging
import math
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from trainmon.run.anomalies import anomaly_to_dict
from trainmon.run.anomaly_table import anomaly_ranks, read_anomaly_rows
from trainmon.run.columnar import array_numpy, column_numpy, signature
from trainmon.run.damage import note
from trainmon.run.layout import anomalies_dir, anomalies_file, anomalies_rank_dir, summary_dir, summary_file
from trainmon.run.records import (
    NON_FINITE_RULES,
    PHASE_ORDER,
    STRAGGLER_RULE,
    SUPPRESSED_RULE,
    Anomaly,
    Phase,
)
from trainmon_tb.rank_rows import MAX_RANK_ROWS, rank_rows

logger = logging.getLogger("trainmon")

MAX_MODULE_ROWS = 300
MAX_EPISODES = 500  # straggler episodes a timeline answer labels (the largest excess first)
MAX_EPISODE_SPANS = 32  # of which the first ones get their span (each a read of the rank's timing table)
_BACKWARD = PHASE_ORDER[Phase.BACKWARD.value]
_ANOMALY_FIELDS = frozenset(f.name for f in dataclasses.fields(Anomaly))
# the columns the index reads (the record's other fields are read when it is shown)
_READ = [
    "step", "kind", "name", "stat", "value", "rule", "origin", "collectives", "phase", "micro_step",
    "pp_stage", "seq", "baseline",
]  # fmt: skip
# A folder's modification time is kept at the kernel's clock tick: a rename within the same tick as the
# last one seen leaves it unchanged. Only a time older than this is trusted to mean "nothing since".
_SETTLED_NS = 2_000_000_000
# Threads reading ranks' records at a first load (most of a small file's time is spent without the GIL).
_READERS = min(4, os.cpu_count() or 1)
# (rank, step) records kept for the event list's next pages; steps this close are read together.
_STEP_CACHE = 1024
_STEP_GAP = 16

# Columns of the index, with their dtypes. ``k``: the record's place among its rank's records of its step
# (in write order), which finds it again in the rank's table.
_COLUMNS = {
    "step": np.int64,
    "rank": np.int32,
    "name": np.int32,
    "kind": np.int16,
    "stat": np.int16,
    "value": np.float64,
    "baseline": np.float64,  # NaN: none (the straggler rule's: the ranks' median, for the factor)
    "rule": np.int16,
    "origin": np.bool_,
    "collectives": np.int64,
    "phase": np.int8,
    "micro_step": np.int32,
    "stage": np.int32,
    "seq": np.int64,
    "k": np.int32,
}


class Interner:
    """Strings to dense ids, in order of first appearance. Only ever grows, so a reader holding an id of an
    older snapshot always finds its string."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}
        self.values: list[str] = []

    def __call__(self, value: str) -> int:
        i = self.ids.get(value)
        if i is None:
            i = len(self.values)
            self.values.append(value)
            self.ids[value] = i
        return i


@dataclass
class Timeline:
    axis: str
    step_lo: int
    step_hi: int
    bins: int
    edges: list[int]
    rows: list[str]
    rows_total: int
    kinds: list[str]
    cells: dict[str, list[int]]
    origins: dict[str, list[int]]
    total: int
    first: dict[str, Any] | None = field(default=None)
    first_cell: dict[str, int] | None = None  # the row and bin of ``first``
    anomalies: int = 0  # records of ``total`` but the per-step cap's summary lines and straggler episodes
    suppressed: int = 0  # the anomalies those summary lines stand for
    stragglers: int = 0  # the straggler episodes among ``total`` (said apart, as ``analyze`` does)
    # rank axis: what each row is (rank_rows: rank, group, open, member) and the ranks per group
    row_kinds: list[str] | None = None
    group_size: int = 1
    version: int = 0  # the index's version the answer was computed from (see AnomalyIndex.version)
    # the straggler episodes among the records (one record each): where they are and what they say
    episodes: list[dict[str, Any]] = field(default_factory=list)


def bin_edges(step_lo: int, step_hi: int, bins: int) -> tuple[int, list[int]]:
    """Bins actually used (never more than the steps) and their ``bins + 1`` edges: bin ``i`` holds the
    steps ``edges[i] .. edges[i+1] - 1``."""
    span = step_hi - step_lo + 1
    bins = max(1, min(bins, span))
    return bins, [step_lo + (i * span + bins - 1) // bins for i in range(bins + 1)]


def step_bins(steps: np.ndarray, step_lo: int, step_hi: int, bins: int) -> np.ndarray:
    """The bin of each step, consistent with :func:`bin_edges`."""
    span = step_hi - step_lo + 1
    return ((steps.astype(np.int64) - step_lo) * bins) // span


def glob_ids(interner: Interner, pattern: str | None) -> np.ndarray | None:
    """Ids of the names an ``fnmatch`` glob matches (an exact name always matches itself); None: no filter."""
    if pattern is None:
        return None
    regex = re.compile(fnmatch.translate(pattern))
    ids = [i for i, name in enumerate(list(interner.values)) if name == pattern or regex.match(name)]
    return np.asarray(ids, dtype=np.int64)


class _Vec:
    """A growing 1-D array: appends write past the end of what readers see, growth copies into a new
    buffer, so a view taken earlier never changes."""

    __slots__ = ("data", "n")

    def __init__(self, dtype: Any) -> None:
        self.data = np.empty(1024, dtype=dtype)
        self.n = 0

    def append(self, values: np.ndarray) -> None:
        if self.n == 0 and len(values) > len(self.data) and values.dtype == self.data.dtype:
            # the first load: the array itself (made for the index, nobody else writes it), not a copy
            self.data, self.n = values, len(values)
            return
        end = self.n + len(values)
        if end > len(self.data):
            grown = np.empty(max(end, 2 * len(self.data)), dtype=self.data.dtype)
            grown[: self.n] = self.data[: self.n]
            self.data = grown
        self.data[self.n : end] = values
        self.n = end

    def view(self) -> np.ndarray:
        return self.data[: self.n]


@dataclass(frozen=True)
class _Snapshot:
    """What queries read: ``cols`` (records in the order they were read), ``order`` (record indices in
    collection order), ``pos`` (each record's place in that order), ``steps`` (the steps in that order)."""

    n: int
    cols: dict[str, np.ndarray]
    order: np.ndarray
    pos: np.ndarray
    steps: np.ndarray
    ranks: tuple[int, ...]
    version: int
    summary_ranks: tuple[int, ...] = ()  # ranks with a summary (records or not)
    summary_steps: tuple[int, int] | None = None  # first and last step any summary has
    # (anomalies, suppressed, straggler episodes) recorded: see AnomalyIndex.summary
    counts: tuple[int, int, int] = (0, 0, 0)


_EMPTY = _Snapshot(
    0,
    {k: np.empty(0, dtype=t) for k, t in _COLUMNS.items()},
    np.empty(0, np.int64),
    np.empty(0, np.int64),
    np.empty(0, np.int64),
    (),
    0,
)


@dataclass(frozen=True)
class _Cube:
    """Every record of a snapshot counted by (rank, step, kind, marking an onset or not), by rank then step:
    what the unfiltered timeline of rank rows draws (a NaN that stays in 24 tensors of 256 ranks: 25 times
    fewer entries than records), and the straggler episodes' records apart (in collection order)."""

    rank: np.ndarray
    step: np.ndarray
    kind: np.ndarray
    count: np.ndarray
    marked: np.ndarray
    stragglers: np.ndarray


@dataclass
class _Rank:
    """What the index knows of one rank's files."""

    rank: int
    summary: tuple | None = None  # (mtime_ns, size) of its summary when last read
    counts: tuple | None = None  # (records, suppressed, last step with a record) of that summary
    files: tuple | None = None  # signature of its record files (ranks without a summary)
    last_step: int = -(1 << 62)  # the last step indexed
    records: int = 0
    steps: tuple[int, int] | None = None  # the first and last step its summary has
    summarised: bool = False  # a summary of it was read (a rank of the run, whatever its records)
    # (anomalies, suppressed, straggler episodes) its last summary read says it recorded
    recorded: tuple[int, int, int] | None = None


class AnomalyIndex:
    """The anomalies of one run. Refreshes are serialised by a lock that queries never take."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.directory = anomalies_dir(run_dir)
        self._refresh_lock = threading.Lock()
        self.names, self.kinds, self.rules = Interner(), Interner(), Interner()
        self.stats = Interner()
        self._snap = _EMPTY
        self._reset()
        self._records: OrderedDict[tuple[int, int], list[dict[str, Any]]] = OrderedDict()
        self._records_lock = threading.Lock()
        self.malformed = 0
        self.refreshes = 0  # refreshes that read anything (tests, benchmarks)
        self._onset_cache: tuple[tuple, np.ndarray] | None = None
        self._cube_cache: tuple[tuple, _Cube] | None = None
        self._spans: dict[tuple, tuple[int, int] | None] = {}  # straggler episode -> its span (_span)

    def _reset(self) -> None:
        self._vecs = {k: _Vec(t) for k, t in _COLUMNS.items()}
        self._order = _Vec(np.int64)
        self._steps = _Vec(np.int64)
        self._pos = _Vec(np.int64)
        self._ranks: dict[int, _Rank] = {}
        self._dirs: dict[str, int] = {}  # folder -> modification time seen
        self._version = 0

    # ------------------------------------------------------------------ state
    def __len__(self) -> int:
        return self._snap.n

    @property
    def version(self) -> int:
        """Grows with every change of the index: an answer computed at a version is still true at it."""
        return self._snap.version

    @property
    def loaded(self) -> bool:
        return self.refreshes > 0

    # ------------------------------------------------------------------ refresh
    def refresh(self, wait: bool = True) -> bool:
        """Index what was written since the last refresh; True when something changed. With ``wait`` False,
        return at once (False) when another thread is refreshing."""
        if not self._refresh_lock.acquire(blocking=wait):
            return False
        try:
            return self._refresh()
        finally:
            self._refresh_lock.release()

    def _settled(self, folder: Path) -> bool:
        """True when ``folder`` did not change since it was last seen (certain: its time is old enough)."""
        try:
            mtime = os.stat(folder).st_mtime_ns
        except OSError:
            mtime = -1
        seen = self._dirs.get(str(folder))
        self._dirs[str(folder)] = mtime
        return seen == mtime and (mtime < 0 or time.time_ns() - mtime > _SETTLED_NS)

    def _refresh(self) -> bool:
        sums, recs = summary_dir(self.run_dir), self.directory
        quiet_sums, quiet_recs = self._settled(sums), self._settled(recs)
        no_summary = [s for s in self._ranks.values() if s.summary is None]
        if quiet_sums and quiet_recs and not no_summary and self.refreshes:
            return False
        if not (quiet_recs and self.refreshes):
            for rank in anomaly_ranks(self.run_dir):
                self._ranks.setdefault(rank, _Rank(rank))
        wanted: dict[int, int | None] = {}  # rank -> first step to read (None: all of it, again)
        steps_moved = False
        if not (quiet_sums and self.refreshes):
            steps_moved = self._check_summaries(wanted)
        for state in self._ranks.values():
            if state.summary is None and state.rank not in wanted:
                files = self._files(state.rank)
                if files != state.files:
                    state.files = files
                    wanted[state.rank] = state.last_step + 1
        for state in self._ranks.values():  # new ranks: everything
            if state.records == 0 and state.last_step < -(1 << 61) and state.rank not in wanted:
                wanted[state.rank] = None
        again = [r for r, lo in wanted.items() if lo is None and self._ranks[r].records]
        tables = [(rank, t) for rank, t in self._tables(sorted(wanted.items())) if t is not None]
        parts = [self._columns(tables)] if tables else []
        for rank, table in tables:
            state = self._ranks[rank]
            steps = table.column("step")
            if len(steps):
                state.last_step = max(state.last_step, int(pc.max(steps).as_py()))
            elif state.last_step < -(1 << 61):
                state.last_step = -(1 << 61)  # read once: no record yet
            if wanted[rank] is None:
                state.records = 0
            state.records += table.num_rows
        for rank in wanted:
            state = self._ranks[rank]
            promised = state.counts[2][1] if state.counts and state.counts[2] else None
            if promised is not None and state.last_step < promised:
                # the summary promises records not readable yet (a batch being appended): look again
                state.summary = state.counts = state.files = None
        self.refreshes += 1
        if again:  # a rank's records were replaced (a job resumed into the run): index everything again
            self._rebuild(parts, set(again))
            return True
        if not any(len(p["step"]) for p in parts):
            if steps_moved:  # steps ended without records: the run's step range moved on
                self._publish()
            return steps_moved
        self._merge(parts)
        return True

    def _check_summaries(self, wanted: dict[int, int | None]) -> bool:
        """Read the summaries that changed; note the ranks with new records in ``wanted``. True when a
        summary's step range moved."""
        moved = False
        try:
            entries = list(os.scandir(summary_dir(self.run_dir)))
        except OSError:
            return moved
        for entry in entries:
            name = entry.name
            if not (name.startswith("rank_") and name.endswith(".json")):
                continue
            try:
                rank = int(name[5:-5])
                st = entry.stat()
            except (ValueError, OSError):
                continue
            state = self._ranks.setdefault(rank, _Rank(rank))
            stamp = (st.st_mtime_ns, st.st_size)
            if stamp == state.summary:
                continue
            try:
                summary = _summary_counts(entry.path)  # summary_file(run, rank), found by the listing
            except ValueError as e:  # damaged: its records are checked by their files
                note(summary_file(self.run_dir, rank), str(e))
                state.summary = None
                continue
            if summary is None:
                continue
            state.summary, state.summarised = stamp, True
            first_step, last_step, counts, episodes = summary
            state.recorded = (counts[0] - episodes, counts[1], episodes)
            if first_step is not None and last_step is not None:
                moved |= (first_step, last_step) != state.steps
                state.steps = (first_step, last_step)
            if counts == state.counts:
                continue
            if not self.refreshes:  # the first load reads every rank's records anyway
                state.counts = counts
                continue
            last = counts[2][1] if counts[2] else None
            if state.counts is not None and last is not None and last <= state.last_step:
                wanted[rank] = None  # more records at steps already indexed: a resumed job wrote them again
            elif last is not None:
                wanted[rank] = state.last_step + 1
            state.counts = counts
        return moved

    def _files(self, rank: int) -> tuple:
        old = anomalies_file(self.run_dir, rank)
        try:
            size = os.stat(old).st_size
        except OSError:
            size = -1
        return (signature(anomalies_rank_dir(self.run_dir, rank)), size)

    def _tables(self, wanted: list[tuple[int, int | None]]) -> Iterable[tuple[int, pa.Table | None]]:
        """The index columns of each wanted (rank, first step), read by a few threads (pyarrow decodes
        without the GIL), in rank order."""

        def read(item: tuple[int, int | None]) -> pa.Table | None:
            rank, step_lo = item
            try:
                return read_anomaly_rows(self.run_dir, rank, _READ, step_lo=step_lo)
            except (OSError, ValueError, pa.ArrowException) as e:
                self.malformed += 1
                logger.warning("trainmon: anomaly records of rank %d unreadable: %s", rank, e)
                return None

        if len(wanted) < 8:
            return [(rank, read((rank, lo))) for rank, lo in wanted]

        def read_all(batch: list[tuple[int, int | None]]) -> list[pa.Table | None]:
            return [read(item) for item in batch]

        # a few batches of ranks, not a task a rank (a thousand futures cost a quarter of a second)
        size = -(-len(wanted) // (4 * _READERS))
        batches = [wanted[i : i + size] for i in range(0, len(wanted), size)]
        with ThreadPoolExecutor(_READERS) as pool:
            tables = [t for batch in pool.map(read_all, batches) for t in batch]
        return list(zip((r for r, _ in wanted), tables, strict=True))

    def _strings(self, column: pa.ChunkedArray, interner: Interner) -> np.ndarray:
        """Interned ids of a dictionary column, one lookup per distinct value of each chunk (a first load's
        thousand ranks are a thousand chunks, each with its own small dictionary: no unification)."""
        if not pa.types.is_dictionary(column.type):
            column = column.dictionary_encode()
        parts = []
        for chunk in column.chunks:
            values = chunk.dictionary.to_pylist()
            lookup = np.asarray([interner(str(v)) for v in values] or [0], dtype=np.int32)
            parts.append(lookup[array_numpy(chunk.indices)])
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int32)

    def _columns(self, tables: list[tuple[int, pa.Table]]) -> dict[str, np.ndarray]:
        """The index columns of several ranks' tables, converted together."""
        table = pa.concat_tables([t for _, t in tables], promote_options="permissive")
        n = table.num_rows
        rank = np.repeat(np.asarray([r for r, _ in tables], dtype=np.int32), [t.num_rows for _, t in tables])

        def num(name: str) -> np.ndarray:  # never pyarrow's to_numpy: its first call imports pandas (0.5 s)
            return np.asarray(column_numpy(table.column(name)), dtype=_COLUMNS.get(name, np.int64))

        phase_names = Interner()
        phase_ids = self._strings(table.column("phase"), phase_names)
        phase_order = np.asarray([PHASE_ORDER.get(p, len(PHASE_ORDER)) for p in phase_names.values] or [0])
        phase = phase_order[phase_ids].astype(np.int8)
        stage = num("pp_stage").astype(np.int32)
        steps = num("step")
        # the place of each record among its rank's records of its step, in write order
        rank_up = rank[1:] > rank[:-1]
        step_up = (rank[1:] == rank[:-1]) & (steps[1:] >= steps[:-1])
        if bool((rank_up | step_up).all()):  # ranks in order, each one's steps as written: sorted already
            by = None
            key_rank, key_step = rank, steps
        else:
            by = np.lexsort((np.arange(n), steps, rank))
            key_rank, key_step = rank[by], steps[by]
        change = np.r_[True, (key_rank[1:] != key_rank[:-1]) | (key_step[1:] != key_step[:-1])]
        group_start = np.maximum.accumulate(np.where(change, np.arange(n), 0))
        k = np.empty(n, dtype=np.int32)
        k[slice(None) if by is None else by] = np.arange(n) - group_start
        return {
            "step": steps,
            "rank": rank,
            "name": self._strings(table.column("name"), self.names),
            "kind": self._strings(table.column("kind"), self.kinds).astype(np.int16),
            "stat": self._strings(table.column("stat"), self.stats).astype(np.int16),
            "value": num("value"),
            "baseline": _floats(table.column("baseline")),
            "rule": self._strings(table.column("rule"), self.rules).astype(np.int16),
            "origin": num("origin"),
            "collectives": num("collectives"),
            "phase": phase,
            "micro_step": num("micro_step").astype(np.int32),
            "stage": np.where(phase == _BACKWARD, -stage, stage).astype(np.int32),
            "seq": num("seq"),
            "k": k,
        }

    # ------------------------------------------------------------------ merging
    def _sort_keys(self, cols: dict[str, np.ndarray], idx: np.ndarray) -> np.ndarray:
        """``idx`` in collection order (Anomaly.order_key: step, collectives, phase, micro-step, stage, seq,
        rank)."""
        names = ("rank", "seq", "stage", "micro_step", "phase", "collectives", "step")
        if len(idx) and int(idx[-1]) - int(idx[0]) + 1 == len(idx) and bool((np.diff(idx) == 1).all()):
            # records just appended (every record on the first load): views, not 7 copies gathered
            lo, hi = int(idx[0]), int(idx[-1]) + 1
            return lo + np.lexsort(_packed([cols[k][lo:hi] for k in names]))
        return idx[np.lexsort(_packed([cols[k][idx] for k in names]))]

    def _append_records(self, parts: list[dict[str, np.ndarray]]) -> np.ndarray:
        first = self._vecs["step"].n
        for p in parts:
            for key, vec in self._vecs.items():
                vec.append(p[key])
        return np.arange(first, self._vecs["step"].n, dtype=np.int64)

    def _merge(self, parts: list[dict[str, np.ndarray]]) -> None:
        new = self._append_records(parts)
        cols = {k: v.view() for k, v in self._vecs.items()}
        order, steps = self._order.view(), self._steps.view()
        new_sorted = self._sort_keys(cols, new)
        new_steps = cols["step"][new_sorted]
        if not len(order) or new_steps[0] > steps[-1]:
            # the usual case while a job runs: steps after every step indexed, appended in place
            start = len(order)
            self._order.append(new_sorted)
            self._steps.append(new_steps)
            self._pos.append(np.empty(len(new_sorted), dtype=np.int64))
            self._pos.data[new_sorted] = np.arange(start, start + len(new_sorted))
        else:
            # steps some records already had (ranks behind the others): order those steps again, place the
            # rest by step
            distinct = np.unique(new_steps)
            lo = np.searchsorted(steps, distinct, side="left")
            hi = np.searchsorted(steps, distinct, side="right")
            shared = np.concatenate([np.arange(a, b) for a, b in zip(lo, hi, strict=True) if b > a] or [[]])
            shared = shared.astype(np.int64)
            again = self._sort_keys(cols, np.concatenate([order[shared], new]))
            rest = np.delete(order, shared)
            rest_steps = np.delete(steps, shared)
            at = np.searchsorted(rest_steps, cols["step"][again], side="left")
            merged = np.insert(rest, at, again)
            self._order = _Vec(np.int64)
            self._order.append(merged)
            self._steps = _Vec(np.int64)
            self._steps.append(cols["step"][merged])
            pos = np.empty(len(merged), dtype=np.int64)
            pos[merged] = np.arange(len(merged))
            self._pos = _Vec(np.int64)
            self._pos.append(pos)
        self._publish()

    def _rebuild(self, parts: list[dict[str, np.ndarray]], replaced: set[int]) -> None:
        """Every record again, the replaced ranks' from ``parts`` (after a rank's files were replaced)."""
        old = self._snap
        keep = ~np.isin(old.cols["rank"], list(replaced)) if old.n else np.empty(0, bool)
        kept = {k: v[keep] for k, v in old.cols.items()}
        ranks, dirs = self._ranks, self._dirs
        self._reset()
        self._ranks, self._dirs = ranks, dirs
        with self._records_lock:
            self._records.clear()
        self._merge([kept, *parts])

    def _publish(self) -> None:
        self._version += 1
        cols = {k: v.view() for k, v in self._vecs.items()}
        ranks = tuple(sorted(r.rank for r in self._ranks.values() if r.records))
        summarised = [r for r in self._ranks.values() if r.summarised]
        steps = [r.steps for r in summarised if r.steps is not None]
        self._snap = _Snapshot(
            len(cols["step"]),
            cols,
            self._order.view(),
            self._pos.view(),
            self._steps.view(),
            ranks,
            self._version,
            tuple(sorted(r.rank for r in summarised)),
            (min(a for a, _ in steps), max(b for _, b in steps)) if steps else None,
        )
        self._snap = replace(self._snap, counts=self._recorded(self._snap))

    def _recorded(self, snap: _Snapshot) -> tuple[int, int, int]:
        """(anomalies, suppressed, straggler episodes) recorded in the run, as ``analyze`` counts them: each
        rank's summary's counts (a rank whose records cannot all be read still counts what it recorded: its
        notice says what is missing), else its records'."""
        said = {r.rank: r.recorded for r in self._ranks.values() if r.recorded is not None}
        totals = [sum(c[i] for c in said.values()) for i in range(3)]
        rest = [r for r in snap.ranks if r not in said]
        if rest:
            idx = np.arange(snap.n) if not said else np.flatnonzero(np.isin(snap.cols["rank"], rest))
            totals = [a + b for a, b in zip(totals, self._counts(snap, idx), strict=True)]
        return totals[0], totals[1], totals[2]

    # ------------------------------------------------------------------ summaries
    def summary(self) -> dict[str, Any]:
        """Anomalies, suppressed ones and straggler episodes recorded (the numbers ``analyze`` gives: an
        episode is said apart, not counted among the anomalies), ranks (with records or a summary), steps (of
        records and summaries), kinds, rules."""
        snap = self._snap
        ranges = [r for r in (snap.summary_steps, (snap.steps[0], snap.steps[-1]) if snap.n else None) if r]
        steps = [int(min(r[0] for r in ranges)), int(max(r[1] for r in ranges))] if ranges else None
        anomalies, suppressed, episodes = snap.counts
        return {
            "anomalies": anomalies,
            "suppressed": suppressed,
            "stragglers": episodes,
            "ranks": sorted(set(snap.ranks) | set(snap.summary_ranks)),
            "steps": steps,
            "kinds": sorted(self.kinds.values),
            "rules": sorted(self.rules.values),
        }

    def _counts(self, snap: _Snapshot, idx: np.ndarray) -> tuple[int, int, int]:
        """(anomalies, suppressed, straggler episodes) of the records ``idx``, as ``analyze`` counts them: the
        per-step cap's summary lines are no anomaly of their own (the anomalies they stand for, their values,
        are counted apart), nor are straggler episodes (the time's, said apart from the numerics')."""
        if not len(idx):
            return 0, 0, 0
        rules = snap.cols["rule"][idx]
        episode = self.rules.ids.get(STRAGGLER_RULE)
        episodes = int(np.count_nonzero(rules == episode)) if episode is not None else 0
        rule = self.rules.ids.get(SUPPRESSED_RULE)
        if rule is None:
            return int(len(idx)) - episodes, 0, episodes
        lines = rules == rule
        values = snap.cols["value"][idx][lines]
        values = values[np.isfinite(values) & (values > 0)]
        return int(len(idx) - lines.sum()) - episodes, int(values.astype(np.int64).sum()), episodes

    def step_range(self) -> tuple[int, int] | None:
        snap = self._snap
        return (int(snap.steps[0]), int(snap.steps[-1])) if snap.n else None

    # ------------------------------------------------------------------ queries
    def _select(
        self,
        snap: _Snapshot,
        step_lo: int,
        step_hi: int,
        kinds: list[str] | None,
        rules: list[str] | None,
        name: str | None,
        ranks: list[int] | None,
    ) -> np.ndarray:
        """Indices of the matching records, in collection order."""
        a, b = np.searchsorted(snap.steps, [step_lo, step_hi + 1])
        idx = snap.order[a:b]
        c = snap.cols
        mask = None
        for col, interner, wanted in (("kind", self.kinds, kinds), ("rule", self.rules, rules)):
            if wanted is not None:
                ids = [interner.ids[w] for w in wanted if w in interner.ids]
                m = np.isin(c[col][idx], ids)
                mask = m if mask is None else mask & m
        ids = glob_ids(self.names, name)
        if ids is not None:
            m = np.isin(c["name"][idx], ids)
            mask = m if mask is None else mask & m
        if ranks is not None:
            m = np.isin(c["rank"][idx], ranks)
            mask = m if mask is None else mask & m
        return idx if mask is None else idx[mask]

    def timeline(
        self,
        axis: str,
        step_lo: int,
        step_hi: int,
        bins: int,
        kinds: list[str] | None = None,
        rules: list[str] | None = None,
        name: str | None = None,
        ranks: list[int] | None = None,
        all_ranks: list[int] | None = None,
        expand: list[int] | None = None,
        max_rows: int = MAX_RANK_ROWS,
        since: int | None = None,
        interval: int = 1,
    ) -> Timeline:
        """The anomalies of a step range binned by row (rank, or tensor) and bin of steps.

        ``cells`` are runs: a cell of ``span`` bins, from ``bin`` on, that hold the same anomalies per kind
        (a NaN that stays in every step is one run, not a cell a bin), one entry per kind. ``origins`` are the
        cells where a NaN/Inf started (:meth:`onsets`): each rank's first non-finite step, and each step
        after a collected step without one; steps where it persists are not marked. ``first_cell`` is the
        cell of ``first``, the first NaN/Inf across ranks. ``interval``: the steps between two collected
        steps (the config's ``step_interval``)."""
        snap = self._snap
        bins, edges = bin_edges(step_lo, step_hi, bins)
        c = snap.cols
        idx = self._select(snap, step_lo, step_hi, kinds, rules, name, ranks)  # in collection order
        total = len(idx)
        anomalies, suppressed, stragglers = self._counts(snap, idx)
        first_at = self._first_index(snap, idx)
        marks = self._onsets(snap, (kinds, rules, name, ranks), interval)
        records = idx
        row_kinds, size = None, 1
        nk = max(1, len(self.kinds.values))
        weights = None  # records per entry (the cube's counts), else one
        if axis == "rank":
            known = set(all_ranks or []) | set(snap.ranks)
            labels = sorted(set(ranks) & known if ranks is not None else known)
            grouped = rank_rows(labels, expand or (), max_rows)
            top = (max(snap.ranks) + 1) if snap.ranks else 0
            base = _lookup(grouped.base, top)
            member = _lookup(grouped.member, top)
            row_labels, rows_total = grouped.labels, len(labels)
            row_kinds, size = grouped.kinds, grouped.group_size
        unfiltered = kinds is None and rules is None and name is None and ranks is None
        if axis == "rank" and unfiltered and snap.n:
            # the first view's question: from the records counted by rank, step and kind beforehand
            cube = self._cube(snap, interval)
            inside = (cube.step >= step_lo) & (cube.step <= step_hi)
            rows, take = _rank_rows_of(cube.rank[inside], base, member)
            b = step_bins(cube.step[inside][take], step_lo, step_hi, bins)
            k, o = cube.kind[inside][take], cube.marked[inside][take]
            weights = cube.count[inside][take]
            keep = rows >= 0
            rows, b, k, o, weights = rows[keep], b[keep], k[keep], o[keep], weights[keep]
            st = cube.stragglers
            st = st[(c["step"][st] >= step_lo) & (c["step"][st] <= step_hi)]
            st_rows, st_take = _rank_rows_of(c["rank"][st], base, member)
            st = st[st_take]
            st_bins = step_bins(c["step"][st], step_lo, step_hi, bins)
            st_keep = st_rows >= 0
            episodes = self._episodes(snap, st_rows[st_keep], st_bins[st_keep], st[st_keep])
            first_cell = None
            if first_at is not None:
                r = int(c["rank"][first_at])
                row = int(member[r]) if member[r] >= 0 else int(base[r])  # its own row, else its group's
                if row >= 0:
                    at_bin = step_bins(c["step"][first_at : first_at + 1], step_lo, step_hi, bins)
                    first_cell = {"row": row, "bin": int(at_bin[0])}
        else:
            if axis == "rank":
                rows, take = _rank_rows_of(c["rank"][idx], base, member)
                records = idx[take]
            else:
                # names in order of their first record (idx is in collection order: first occurrence)
                present, first_seen = np.unique(c["name"][idx], return_index=True)
                ordered = present[np.argsort(first_seen, kind="stable")]
                rows_total = len(ordered)
                ordered = ordered[:MAX_MODULE_ROWS]
                name_row = np.full(len(self.names.values), -1, dtype=np.int64)
                name_row[ordered] = np.arange(len(ordered))
                rows = name_row[c["name"][idx]]
                row_labels = [self.names.values[i] for i in ordered.tolist()]
            b = step_bins(c["step"][records], step_lo, step_hi, bins)
            keep = rows >= 0
            rows, b, records = rows[keep], b[keep], records[keep]
            k = c["kind"][records].astype(np.int64)
            marked = np.zeros(snap.n, dtype=bool)  # a gather, not np.isin's sort of a million records
            marked[marks] = True
            o = marked[records]
            episodes = self._episodes(snap, rows, b, records)
            first_cell = None
            if first_at is not None:
                at = np.flatnonzero(records == first_at)
                if len(at):  # its own row under an expanded group, else its group's
                    i = int(at[-1])
                    first_cell = {"row": int(rows[i]), "bin": int(b[i])}
        okey = np.unique(rows[o] * bins + b[o])
        return Timeline(
            axis=axis,
            step_lo=step_lo,
            step_hi=step_hi,
            bins=bins,
            edges=edges,
            rows=row_labels,
            rows_total=rows_total,
            kinds=list(self.kinds.values),
            cells=_runs((rows * bins + b) * nk + k, bins, nk, okey, weights),
            origins={"row": (okey // bins).tolist(), "bin": (okey % bins).tolist()},
            total=int(total),
            first=None if first_at is None else self._summary_of(snap, first_at),
            first_cell=first_cell,
            anomalies=anomalies,
            suppressed=suppressed,
            stragglers=stragglers,
            row_kinds=row_kinds,
            group_size=size,
            version=snap.version,
            episodes=episodes,
        )

    def _episodes(
        self, snap: _Snapshot, rows: np.ndarray, bins: np.ndarray, records: np.ndarray
    ) -> list[dict[str, Any]]:
        """The straggler records among ``records`` (each drawn at ``rows``, ``bins``): rank, step, phase (the
        part of the step), the rank's time and the ranks' median (ms), the factor; the largest excess over
        the median first, :data:`MAX_EPISODES` at most."""
        rule = self.rules.ids.get(STRAGGLER_RULE)
        if rule is None or not len(records):
            return []
        c = snap.cols
        at = np.flatnonzero(c["rule"][records] == rule)
        if not len(at):
            return []
        rec = records[at]
        value, base = c["value"][rec], c["baseline"][rec]
        excess = np.where(np.isfinite(base), value - base, value)
        order = np.lexsort((c["rank"][rec], c["step"][rec], -excess))[:MAX_EPISODES]
        out = []
        for n, j in enumerate(order.tolist()):
            i = int(rec[j])
            v, m = float(value[j]), float(base[j])
            factor = v / m if math.isfinite(m) and m > 0 else None
            rank, step = int(c["rank"][i]), int(c["step"][i])
            phase = self.names.values[int(c["name"][i])]
            span = self._span(snap, rank, step, phase, v, m) if n < MAX_EPISODE_SPANS else None
            out.append({
                "rank": rank,
                "step": step,
                "from_step": span[0] if span else None,
                "to_step": span[1] if span else None,
                "phase": phase,
                "time_ms": json_number(v * 1e3),
                "median_ms": json_number(m * 1e3) if math.isfinite(m) else None,
                "factor": factor,
                "row": int(rows[at[j]]),
                "bin": int(bins[at[j]]),
            })  # fmt: skip
        return out

    def _span(
        self, snap: _Snapshot, rank: int, step: int, phase: str, value: float, median: float
    ) -> tuple[int, int] | None:
        """The episode's first and last slow step (:func:`trainmon.read.stragglers.slow_span`), read from the
        rank's timing table once per episode and range of steps the summaries have (an episode that goes on
        grows)."""
        key = (rank, step, phase, snap.summary_steps)
        if key not in self._spans:
            from trainmon.read.stragglers import slow_span

            if len(self._spans) >= 4 * MAX_EPISODE_SPANS:
                self._spans.clear()
            self._spans[key] = slow_span(self.run_dir, rank, phase, step, value, median)
        return self._spans[key]

    def prepare(self, interval: int = 1) -> None:
        """Compute what the unfiltered timeline needs beyond the index (its onsets) now, off any request."""
        self._cube(self._snap, interval)

    def _cube(self, snap: _Snapshot, interval: int) -> _Cube:
        """The snapshot's records counted by (rank, step, kind, onset mark) (:class:`_Cube`), kept for its
        version."""
        key = (snap.version, interval)
        cached = self._cube_cache
        if cached is not None and cached[0] == key:
            return cached[1]
        n, c = snap.n, snap.cols
        marked = np.zeros(n, dtype=np.int64)
        marked[self._onsets(snap, (None, None, None, None), interval)] = 1
        s0 = int(snap.steps[0]) if n else 0
        span = int(snap.steps[-1]) - s0 + 1 if n else 1
        nk = max(1, len(self.kinds.values))
        cell = (c["rank"][:n].astype(np.int64) * span + (c["step"][:n] - s0)) * nk + c["kind"][:n]
        cell = cell * 2 + marked
        size = (int(cell.max()) + 1) if n else 0
        if size <= 4 * n + (1 << 20):  # a dense count, no sort
            counts = np.bincount(cell, minlength=0)
            cells = np.flatnonzero(counts)
            counts = counts[cells]
        else:
            cells, counts = np.unique(cell, return_counts=True)
        pair, kind = cells // 2 // nk, cells // 2 % nk
        rule = self.rules.ids.get(STRAGGLER_RULE)
        stragglers = np.flatnonzero(c["rule"][:n] == rule) if rule is not None else np.empty(0, np.int64)
        cube = _Cube(
            rank=pair // span,
            step=pair % span + s0,
            kind=kind,
            count=counts,
            marked=(cells % 2).astype(bool),
            stragglers=stragglers[np.argsort(snap.pos[stragglers], kind="stable")],
        )
        self._cube_cache = (key, cube)
        return cube

    def _onsets(self, snap: _Snapshot, filters: tuple, interval: int) -> np.ndarray:
        """The records (indices) marking where a NaN/Inf started, over every step (a zoom never makes a step
        where the NaN persists an onset): on each rank, a step with a non-finite record is an onset when it
        is the rank's first such step or the rank's previous such step is more than ``interval`` steps
        before it (a NaN that went away at a collected step and came back). At an onset, its origin records
        mark it, else its first non-finite record in collection order. Kept for the snapshot's version."""
        key = (snap.version, repr(filters), interval)
        cached = self._onset_cache
        if cached is not None and cached[0] == key:
            return cached[1]
        bad = [self.rules.ids[r] for r in sorted(NON_FINITE_RULES) if r in self.rules.ids]
        marks = np.empty(0, dtype=np.int64)
        if snap.n and bad:
            c = snap.cols
            idx = self._select(snap, int(snap.steps[0]), int(snap.steps[-1]), *filters)
            idx = idx[np.isin(c["rule"][idx], bad)]  # non-finite records, in collection order
            if len(idx):
                span = int(snap.steps[-1]) - int(snap.steps[0]) + 1
                pair = c["rank"][idx].astype(np.int64) * span + (c["step"][idx] - int(snap.steps[0]))
                top = max(snap.ranks) + 1 if snap.ranks else 0
                pairs, first_of, which = _distinct(pair, top * span)
                rank, step = pairs // span, pairs % span
                onset = np.r_[True, (rank[1:] != rank[:-1]) | (step[1:] - step[:-1] > max(1, interval))]
                at_onset = onset[which]
                origin = at_onset & c["origin"][idx]
                with_origin = np.zeros(len(pairs), dtype=bool)
                with_origin[which[origin]] = True
                firsts = first_of[onset & ~with_origin]  # onsets without an origin record: their first record
                marks = np.sort(np.concatenate([idx[origin], idx[firsts]]))
        self._onset_cache = (key, marks)
        return marks

    def _first_index(self, snap: _Snapshot, idx: np.ndarray) -> int | None:
        """The first non-finite record of ``idx`` (in collection order), else its first record."""
        if not len(idx):
            return None
        bad = [self.rules.ids[r] for r in sorted(NON_FINITE_RULES) if r in self.rules.ids]
        if not bad:
            return int(idx[0])
        rules = snap.cols["rule"][idx]
        hit = rules == bad[0]
        for rule in bad[1:]:
            hit |= rules == rule
        j = int(hit.argmax())
        return int(idx[j]) if hit[j] else int(idx[0])

    def _summary_of(self, snap: _Snapshot, i: int) -> dict[str, Any]:
        record = self._record(snap, i)
        return {k: record[k] for k in ("step", "rank", "kind", "name", "stat", "rule", "origin", "phase")}

    def events(
        self,
        step_lo: int,
        step_hi: int,
        kinds: list[str] | None = None,
        rules: list[str] | None = None,
        name: str | None = None,
        ranks: list[int] | None = None,
        limit: int = 200,
        offset: int = 0,
    ) -> tuple[int, list[dict[str, Any]]]:
        """(matching count, records ``offset .. offset+limit``): origins first, then collection order."""
        snap = self._snap
        idx = self._select(snap, step_lo, step_hi, kinds, rules, name, ranks)
        origin = snap.cols["origin"][idx]
        page = np.concatenate([idx[origin], idx[~origin]])[offset : offset + limit]
        return len(idx), self._records_of(snap, page)

    def markers(self, rank: int, kind: str, name: str) -> list[dict[str, Any]]:
        """The anomalies of one tensor on one rank (step, rule, stat, value, origin), by step."""
        snap = self._snap
        c = snap.cols
        if kind not in self.kinds.ids or name not in self.names.ids:
            return []
        # the columns as stored (no gather of a million records into collection order), then the few
        # matches put in that order
        n = snap.n
        m = c["name"][:n] == self.names.ids[name]
        m &= c["rank"][:n] == rank
        m &= c["kind"][:n] == self.kinds.ids[kind]
        found = np.flatnonzero(m)
        chosen = found[np.argsort(snap.pos[found], kind="stable")][:5000]
        return [  # from the index alone: no record is read
            {
                "step": int(c["step"][i]),
                "rule": self.rules.values[int(c["rule"][i])],
                "stat": self.stats.values[int(c["stat"][i])],
                "value": float(c["value"][i]),
                "origin": bool(c["origin"][i]),
            }
            for i in chosen.tolist()
        ]

    # ------------------------------------------------------------------ full records
    def _read_steps(self, rank: int, steps: list[int]) -> dict[int, list[dict[str, Any]]]:
        """The records of some steps of one rank, by step, in write order: each run of nearby steps is one
        read (the store's step statistics skip the rest); a step is kept for later pages."""
        out: dict[int, list[dict[str, Any]]] = {}
        todo = []
        with self._records_lock:
            for step in steps:
                found = self._records.get((rank, step))
                if found is None:
                    todo.append(step)
                else:
                    out[step] = found
        runs: list[list[int]] = []
        for step in sorted(set(todo)):
            if runs and step - runs[-1][-1] <= _STEP_GAP:
                runs[-1].append(step)
            else:
                runs.append([step])
        wanted = set(todo)
        for run in runs:
            table = read_anomaly_rows(self.run_dir, rank, step_lo=run[0], step_hi=run[-1])
            got: dict[int, list[dict[str, Any]]] = {step: [] for step in run}
            for row in table.to_pylist():
                if row["step"] in wanted:
                    fields = {k: v for k, v in row.items() if k in _ANOMALY_FIELDS}
                    got[row["step"]].append(anomaly_to_dict(Anomaly(**{**fields, "rank": rank})))
            out.update(got)
            with self._records_lock:
                for step, records in got.items():
                    self._records[(rank, step)] = records
                while len(self._records) > _STEP_CACHE:
                    self._records.popitem(last=False)
        return out

    def _record(self, snap: _Snapshot, i: int) -> dict[str, Any]:
        return self._records_of(snap, [i])[0]

    def _records_of(self, snap: _Snapshot, idx: Iterable[int]) -> list[dict[str, Any]]:
        c = snap.cols
        idx = [int(i) for i in idx]
        steps: dict[int, list[int]] = {}
        for i in idx:
            steps.setdefault(int(c["rank"][i]), []).append(int(c["step"][i]))
        found = {rank: self._read_steps(rank, s) for rank, s in steps.items()}
        out = []
        for i in idx:
            rank, step, k = int(c["rank"][i]), int(c["step"][i]), int(c["k"][i])
            records = found[rank].get(step, [])
            if k < len(records):
                out.append(records[k])
                continue
            out.append(
                {  # gone from the files since it was indexed (a rewritten step): what the index knows
                    "step": step,
                    "rank": rank,
                    "kind": self.kinds.values[int(c["kind"][i])],
                    "name": self.names.values[int(c["name"][i])],
                    "stat": self.stats.values[int(c["stat"][i])],
                    "value": float(c["value"][i]),
                    "rule": self.rules.values[int(c["rule"][i])],
                    "origin": bool(c["origin"][i]),
                    "phase": "",
                }
            )
        return out


def _summary_counts(path: str | Path) -> tuple[int | None, int | None, tuple, int] | None:
    """(first step, last step, (records, suppressed, (first, last) step with a record), straggler episodes)
    of a rank's summary (:mod:`trainmon.run.summary`), without building its records; None when there is
    none."""
    try:
        with open(path, "rb") as f:
            d = json.loads(f.read())
        steps = d.get("anomaly_steps")
        counts = (int(d.get("anomalies", 0)), int(d.get("suppressed", 0)), tuple(steps) if steps else None)
        first, last = d.get("first_step"), d.get("last_step")
        episodes = int(dict(d.get("counts") or {}).get(STRAGGLER_RULE, 0))
        return (None if first is None else int(first), None if last is None else int(last), counts, episodes)
    except FileNotFoundError:
        return None
    except (ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"not a rank summary: {e}") from e


def _packed(keys: list[np.ndarray]) -> list[np.ndarray]:
    """Sort keys (least significant first, as ``np.lexsort`` takes them) packed into as few int64 words as
    their ranges allow: each key offset to its minimum and given the bits its range needs; a key of one value
    orders nothing and is left out. The same order as the keys themselves, at a fraction of the cost (a sort
    over 7 keys of a million records: 0.4 s; over 2 words: a third of that)."""
    words: list[np.ndarray] = []
    word, bits = None, 0
    for k in keys:
        if not len(k):
            return [k.astype(np.int64)]
        low, high = int(k.min()), int(k.max())
        if high == low:
            continue
        width = (high - low).bit_length()
        if width > 62:  # a range no word holds: the key as it is
            if word is not None:
                words.append(word)
            words.append(k.astype(np.int64, copy=False))
            word, bits = None, 0
            continue
        if word is not None and bits + width > 62:
            words.append(word)
            word, bits = None, 0
        shifted = np.subtract(k, low, dtype=np.int64)  # one pass, whatever the key's own type
        if bits:
            np.left_shift(shifted, bits, out=shifted)
        if word is None:
            word = shifted
        else:
            np.bitwise_or(word, shifted, out=word)
        bits += width
    if word is not None:
        words.append(word)
    return words or [np.zeros(len(keys[0]) if keys else 0, dtype=np.int64)]


def _runs(
    key: np.ndarray, bins: int, nk: int, origins: np.ndarray, weights: np.ndarray | None = None
) -> dict[str, list[int]]:
    """The timeline's cells from one ``(row * bins + bin) * nk + kind`` key a record (or an entry standing
    for ``weights`` records): per (row, bin), the records of each kind, with consecutive bins of a row
    holding the same counts of the same kinds joined into one run (``span`` bins from ``bin``). A cell of
    ``origins`` (row * bins + bin) is a run of its own."""
    if not len(key):
        counts = np.empty(0, np.int64)
    elif weights is None:
        counts = np.bincount(key)
    else:
        counts = np.bincount(key, weights).astype(np.int64)  # exact: counts far below 2**53
    uniq = np.flatnonzero(counts)
    if not len(uniq):
        return {"row": [], "bin": [], "kind": [], "count": [], "span": []}
    cell, kind, count = uniq // nk, uniq % nk, counts[uniq]
    cells, at = np.unique(cell, return_inverse=True)
    mix = np.zeros((len(cells), nk), dtype=np.int64)  # per cell, its records of each kind
    mix[at, kind] = count
    row, b = cells // bins, cells % bins
    marked = np.isin(cells, origins)
    joins = (row[1:] == row[:-1]) & (b[1:] == b[:-1] + 1) & (mix[1:] == mix[:-1]).all(axis=1)
    joins &= ~marked[1:] & ~marked[:-1]
    start = np.r_[True, ~joins]
    run_of = np.cumsum(start) - 1
    span = np.bincount(run_of)
    keep = start[at]  # the entries (cell, kind) of each run's first cell
    return {
        "row": row[at[keep]].tolist(),
        "bin": b[at[keep]].tolist(),
        "kind": kind[keep].tolist(),
        "count": count[keep].tolist(),
        "span": span[run_of[at[keep]]].tolist(),
    }


def _distinct(keys: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``np.unique(keys, return_index=True, return_inverse=True)`` for keys in ``[0, size)``: by a table of
    ``size`` entries when that is not much more than the keys (no sort of a million records)."""
    if size > 4 * len(keys) + (1 << 20):
        return np.unique(keys, return_index=True, return_inverse=True)
    first = np.full(size, len(keys), dtype=np.int64)
    np.minimum.at(first, keys, np.arange(len(keys)))
    distinct = np.flatnonzero(first < len(keys))
    place = np.empty(size, dtype=np.int64)
    place[distinct] = np.arange(len(distinct))
    return distinct, first[distinct], place[keys]


def _rank_rows_of(rank_of: np.ndarray, base: np.ndarray, member: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(row of each entry, the entries taken) for entries on ranks ``rank_of``: each in its rank's (group's)
    row, and again, after them all, in its own row when its group is expanded (it counts in both)."""
    rows = base[rank_of]
    inside = member[rank_of]
    more = np.flatnonzero(inside >= 0)
    take = np.arange(len(rank_of))
    if len(more):
        rows = np.concatenate([rows, inside[more]])
        take = np.concatenate([take, more])
    return rows, take


def _lookup(table: np.ndarray, size: int) -> np.ndarray:
    """``table`` padded with -1 to at least ``size`` entries (ranks beyond it map to no row)."""
    if len(table) >= size:
        return table
    return np.concatenate([table, np.full(size - len(table), -1, dtype=table.dtype)])


def _floats(column: pa.ChunkedArray) -> np.ndarray:
    """A float column with nulls as NaN."""
    return np.asarray(column_numpy(column) if column.num_chunks else np.empty(0), dtype=np.float64)


def json_number(x: float) -> float | str:
    """A float for JSON: non-finite values as the strings the record files use."""
    if math.isfinite(x):
        return x
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
