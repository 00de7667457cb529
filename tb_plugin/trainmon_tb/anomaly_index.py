"""An index of a run's anomaly records (``plugins/trainmon/anomalies/rank=<r>/``, through
:mod:`trainmon.run.anomaly_table`; the old layout's ``rank_<r>.jsonl`` too) as numpy columns.

A rank's records are read again when its files changed (a record batch appended, a segment sealed); ranks
whose files did not change cost a ``scandir``. The columns keep what queries filter and order on; a record's
full fields are read back from the rank's table by row.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
import math
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from trainmon.run.anomalies import anomaly_to_dict
from trainmon.run.anomaly_table import anomaly_ranks, read_anomaly_rows
from trainmon.run.columnar import signature
from trainmon.run.layout import anomalies_dir, anomalies_file, anomalies_rank_dir
from trainmon.run.records import NON_FINITE_RULES, PHASE_ORDER, Anomaly, Phase
from trainmon_tb.rank_rows import MAX_RANK_ROWS, rank_rows

logger = logging.getLogger("trainmon")

MAX_MODULE_ROWS = 300
_BACKWARD = PHASE_ORDER[Phase.BACKWARD.value]
_ANOMALY_FIELDS = frozenset(f.name for f in dataclasses.fields(Anomaly))

# Columns of the index, with their dtypes (``file`` and ``offset``: the record's rank and row in its table).
_COLUMNS = {
    "step": np.int64,
    "rank": np.int32,
    "name": np.int32,
    "kind": np.int16,
    "rule": np.int16,
    "origin": np.bool_,
    "collectives": np.int64,
    "phase": np.int8,
    "micro_step": np.int32,
    "stage": np.int32,
    "seq": np.int64,
    "file": np.int32,
    "offset": np.int64,
}


class Interner:
    """Strings to dense ids, in order of first appearance."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}
        self.values: list[str] = []

    def __call__(self, value: str) -> int:
        i = self.ids.get(value)
        if i is None:
            i = self.ids[value] = len(self.values)
            self.values.append(value)
        return i


@dataclass
class _RankPart:
    """One rank's records: the signature of its files when read, its table and its index columns."""

    rank: int
    signature: tuple = ()
    table: pa.Table | None = None
    cols: dict[str, np.ndarray] = field(default_factory=dict)


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
    # rank axis: what each row is (rank_rows: rank, group, open, member) and the ranks per group
    row_kinds: list[str] | None = None
    group_size: int = 1


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
    ids = [i for i, name in enumerate(interner.values) if name == pattern or regex.match(name)]
    return np.asarray(ids, dtype=np.int64)


class AnomalyIndex:
    """The anomalies of one run. Thread-safe: refreshes and queries take the index's lock."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.directory = anomalies_dir(run_dir)
        self._lock = threading.RLock()
        self._reset()

    def _reset(self) -> None:
        self.names, self.kinds, self.rules = Interner(), Interner(), Interner()
        self._parts: dict[int, _RankPart] = {}
        self._cols = {k: np.empty(0, dtype=t) for k, t in _COLUMNS.items()}
        self._order_pos = np.empty(0, dtype=np.int64)  # position of each record in collection order
        self.malformed = 0

    # ------------------------------------------------------------------ indexing
    def __len__(self) -> int:
        return len(self._cols["step"])

    def _signature(self, rank: int) -> tuple:
        old = anomalies_file(self.run_dir, rank)
        size = old.stat().st_size if old.exists() else -1
        return (signature(anomalies_rank_dir(self.run_dir, rank)), size)

    def refresh(self) -> bool:
        """Read the ranks whose files changed since the last refresh; True when something changed."""
        with self._lock:
            ranks = anomaly_ranks(self.run_dir)
            changed = False
            for gone in set(self._parts) - set(ranks):
                del self._parts[gone]
                changed = True
            for rank in ranks:
                part = self._parts.setdefault(rank, _RankPart(rank))
                sig = self._signature(rank)
                if sig == part.signature:
                    continue
                try:
                    part.table = read_anomaly_rows(self.run_dir, rank)
                except (OSError, ValueError, pa.ArrowException) as e:
                    self.malformed += 1
                    logger.warning("trainmon: anomaly records of rank %d unreadable: %s", rank, e)
                    continue
                part.signature = sig
                part.cols = self._columns(part.table, rank)
                changed = True
            if not changed:
                return False
            parts = [self._parts[r].cols for r in sorted(self._parts) if self._parts[r].cols]
            for k, t in _COLUMNS.items():
                self._cols[k] = np.concatenate([p[k] for p in parts]) if parts else np.empty(0, dtype=t)
            self._sort()
            return True

    def _strings(self, table: pa.Table, column: str, interner: Interner) -> np.ndarray:
        """Interned ids of a dictionary column, one lookup per distinct value."""
        col = table.column(column)
        out = np.empty(table.num_rows, dtype=np.int32)
        start = 0
        for chunk in col.chunks:
            if not isinstance(chunk, pa.DictionaryArray):
                chunk = chunk.dictionary_encode()
            lookup = np.asarray([interner(str(v)) for v in chunk.dictionary.to_pylist()], dtype=np.int32)
            indices = np.asarray(chunk.indices.to_numpy(zero_copy_only=False), dtype=np.int64)
            out[start : start + len(chunk)] = lookup[indices] if len(lookup) else 0
            start += len(chunk)
        return out

    def _columns(self, table: pa.Table, rank: int) -> dict[str, np.ndarray]:
        n = table.num_rows

        def num(name: str) -> np.ndarray:
            return np.asarray(table.column(name).to_numpy(), dtype=_COLUMNS.get(name, np.int64))

        phase_names = Interner()
        phase_ids = self._strings(table, "phase", phase_names)
        phase_order = np.asarray([PHASE_ORDER.get(p, len(PHASE_ORDER)) for p in phase_names.values] or [0])
        phase = phase_order[phase_ids].astype(np.int8)
        stage = num("pp_stage").astype(np.int32)
        return {
            "step": num("step"),
            "rank": np.full(n, rank, dtype=np.int32),
            "name": self._strings(table, "name", self.names),
            "kind": self._strings(table, "kind", self.kinds).astype(np.int16),
            "rule": self._strings(table, "rule", self.rules).astype(np.int16),
            "origin": np.asarray(table.column("origin").to_numpy(), dtype=np.bool_),
            "collectives": num("collectives"),
            "phase": phase,
            "micro_step": num("micro_step"),
            "stage": np.where(phase == _BACKWARD, -stage, stage).astype(np.int32),
            "seq": num("seq"),
            "file": np.full(n, rank, dtype=np.int32),
            "offset": np.arange(n, dtype=np.int64),
        }

    def _sort(self) -> None:
        c = self._cols
        # collection order, as Anomaly.order_key: step, collectives, phase, micro-step, stage, seq, rank
        order = np.lexsort(
            (c["rank"], c["seq"], c["stage"], c["micro_step"], c["phase"], c["collectives"], c["step"])
        )
        pos = np.empty(len(order), dtype=np.int64)
        pos[order] = np.arange(len(order))
        self._order_pos = pos

    # ------------------------------------------------------------------ summaries
    def summary(self) -> dict[str, Any]:
        with self._lock:
            c = self._cols
            ranks = np.unique(c["rank"]).tolist()
            steps = [int(c["step"].min()), int(c["step"].max())] if len(c["step"]) else None
            return {
                "anomalies": len(self),
                "ranks": ranks,
                "steps": steps,
                "kinds": sorted(self.kinds.values),
                "rules": sorted(self.rules.values),
            }

    # ------------------------------------------------------------------ queries
    def _mask(
        self,
        step_lo: int,
        step_hi: int,
        kinds: list[str] | None,
        rules: list[str] | None,
        name: str | None,
        ranks: list[int] | None,
    ) -> np.ndarray:
        c = self._cols
        mask = (c["step"] >= step_lo) & (c["step"] <= step_hi)
        for col, interner, wanted in (("kind", self.kinds, kinds), ("rule", self.rules, rules)):
            if wanted is not None:
                ids = [interner.ids[w] for w in wanted if w in interner.ids]
                mask &= np.isin(c[col], ids)
        ids = glob_ids(self.names, name)
        if ids is not None:
            mask &= np.isin(c["name"], ids)
        if ranks is not None:
            mask &= np.isin(c["rank"], ranks)
        return mask

    def step_range(self) -> tuple[int, int] | None:
        steps = self._cols["step"]
        return (int(steps.min()), int(steps.max())) if len(steps) else None

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
    ) -> Timeline:
        with self._lock:
            bins, edges = bin_edges(step_lo, step_hi, bins)
            c = self._cols
            idx = np.flatnonzero(self._mask(step_lo, step_hi, kinds, rules, name, ranks))
            pos = self._order_pos[idx]
            total = len(idx)
            row_kinds, size = None, 1
            if axis == "rank":
                labels = sorted(
                    set(ranks if ranks is not None else (all_ranks or []))
                    | set(np.unique(c["rank"][idx]).tolist())
                )
                grouped = rank_rows(labels, expand or (), max_rows)
                rank_of = c["rank"][idx]
                rows = grouped.base[rank_of]
                inside = grouped.member[rank_of]  # a rank of an expanded group counts in its group's row too
                more = np.flatnonzero(inside >= 0)
                if len(more):
                    rows = np.concatenate([rows, inside[more]])
                    idx = np.concatenate([idx, idx[more]])
                    pos = self._order_pos[idx]
                row_labels, rows_total = grouped.labels, len(labels)
                row_kinds, size = grouped.kinds, grouped.group_size
            else:
                first = np.full(len(self.names.values), np.iinfo(np.int64).max, dtype=np.int64)
                np.minimum.at(first, c["name"][idx], pos)
                present = np.flatnonzero(first < np.iinfo(np.int64).max)
                ordered = present[np.argsort(first[present], kind="stable")]
                rows_total = len(ordered)
                ordered = ordered[:MAX_MODULE_ROWS]
                name_row = np.full(len(self.names.values), -1, dtype=np.int64)
                name_row[ordered] = np.arange(len(ordered))
                rows = name_row[c["name"][idx]]
                row_labels = [self.names.values[i] for i in ordered]
            b = step_bins(c["step"][idx], step_lo, step_hi, bins)
            keep = rows >= 0
            rows, b, k = rows[keep], b[keep], c["kind"][idx][keep].astype(np.int64)
            nk = max(1, len(self.kinds.values))
            key = (rows * bins + b) * nk + k
            uniq, counts = np.unique(key, return_counts=True)
            cell_kind = uniq % nk
            cell_bin = (uniq // nk) % bins
            cell_row = uniq // nk // bins
            o = c["origin"][idx][keep]
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
                cells={
                    "row": cell_row.tolist(),
                    "bin": cell_bin.tolist(),
                    "kind": cell_kind.tolist(),
                    "count": counts.tolist(),
                },
                origins={"row": (okey // bins).tolist(), "bin": (okey % bins).tolist()},
                total=int(total),
                first=self._first(idx, pos),
                row_kinds=row_kinds,
                group_size=size,
            )

    def _first(self, idx: np.ndarray, pos: np.ndarray) -> dict[str, Any] | None:
        if not len(idx):
            return None
        bad = [self.rules.ids[r] for r in sorted(NON_FINITE_RULES) if r in self.rules.ids]
        pick = np.isin(self._cols["rule"][idx], bad)
        if pick.any():
            idx, pos = idx[pick], pos[pick]
        record = self._record(int(idx[np.argmin(pos)]))
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
        with self._lock:
            idx = np.flatnonzero(self._mask(step_lo, step_hi, kinds, rules, name, ranks))
            order = np.lexsort((self._order_pos[idx], ~self._cols["origin"][idx]))
            page = idx[order][offset : offset + limit]
            return len(idx), [self._record(int(i)) for i in page]

    def markers(self, rank: int, kind: str, name: str) -> list[dict[str, Any]]:
        """The anomalies of one tensor on one rank (step, rule, stat, value, origin), by step."""
        with self._lock:
            c = self._cols
            if kind not in self.kinds.ids or name not in self.names.ids:
                return []
            m = (
                (c["rank"] == rank)
                & (c["kind"] == self.kinds.ids[kind])
                & (c["name"] == self.names.ids[name])
            )
            idx = np.flatnonzero(m)
            idx = idx[np.argsort(self._order_pos[idx], kind="stable")]
            out = []
            for i in idx[:5000]:
                r = self._record(int(i))
                out.append({k: r[k] for k in ("step", "rule", "stat", "value", "origin")})
            return out

    def _record(self, i: int) -> dict[str, Any]:
        rank = int(self._cols["file"][i])
        table = self._parts[rank].table
        assert table is not None
        row = table.slice(int(self._cols["offset"][i]), 1).to_pylist()[0]
        fields = {k: v for k, v in row.items() if k in _ANOMALY_FIELDS}
        return anomaly_to_dict(Anomaly(rank=rank, **fields))


def json_number(x: float) -> float | str:
    """A float for JSON: non-finite values as the strings the record files use."""
    if math.isfinite(x):
        return x
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
