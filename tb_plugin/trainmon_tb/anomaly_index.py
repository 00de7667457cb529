"""An index of a run's anomaly files (``plugins/trainmon/anomalies/rank_<r>.jsonl``) as numpy columns.

Files are tailed: each refresh parses only the complete lines appended since the last one (a partial last
line waits for the next refresh). A file that shrank or was replaced is indexed again from its start. The
columns keep what queries filter and order on; a record's full fields are read back from its file by byte
offset, through the shared record schema.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import math
import os
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from trainmon.run.anomalies import anomaly_from_json, anomaly_to_dict
from trainmon.run.layout import anomalies_dir
from trainmon.run.records import NON_FINITE_RULES, PHASE_ORDER, Phase
from trainmon_tb.rank_rows import MAX_RANK_ROWS, rank_rows

logger = logging.getLogger("trainmon")

_RANK_FILE = re.compile(r"^rank_(\d+)\.jsonl$")
MAX_MODULE_ROWS = 300
_READ_BLOCK = 16 << 20
_BACKWARD = PHASE_ORDER[Phase.BACKWARD.value]

# Columns of the index, with their dtypes.
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
class _Tail:
    path: Path
    rank: int
    inode: int = -1
    offset: int = 0
    lines: int = 0


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
        self._tails: dict[str, _Tail] = {}
        self._files: list[Path] = []
        self._cols = {k: np.empty(0, dtype=t) for k, t in _COLUMNS.items()}
        self._order_pos = np.empty(0, dtype=np.int64)  # position of each record in collection order
        self._dirty = False
        self.malformed = 0

    # ------------------------------------------------------------------ indexing
    def __len__(self) -> int:
        return len(self._cols["step"])

    def refresh(self) -> bool:
        """Index what was appended since the last refresh; True when something changed."""
        with self._lock:
            try:
                entries = sorted(os.scandir(self.directory), key=lambda e: e.name)
            except OSError:
                entries = []
            found = {}
            for e in entries:
                m = _RANK_FILE.match(e.name)
                if m and e.is_file():
                    found[e.name] = (int(m.group(1)), e)
            for name, tail in self._tails.items():  # a file that vanished, shrank or was replaced
                entry = found.get(name)
                st = entry[1].stat() if entry else None
                if st is None or st.st_ino != tail.inode or st.st_size < tail.offset:
                    self._reset()
                    return self.refresh() or True
            new_parts: list[dict[str, list]] = []
            for name, (rank, entry) in found.items():
                tail = self._tails.get(name)
                if tail is None:
                    tail = self._tails[name] = _Tail(Path(entry.path), rank, entry.stat().st_ino)
                    self._files.append(tail.path)
                new_parts.extend(self._read_new(tail, self._files.index(tail.path)))
            if not new_parts:
                return False
            for k in _COLUMNS:
                self._cols[k] = np.concatenate([self._cols[k], *(p[k] for p in new_parts)])
            self._sort()
            return True

    def _read_new(self, tail: _Tail, file_id: int) -> Iterator[dict[str, np.ndarray]]:
        """Columns of the complete lines appended since the last read, a block at a time (bounded memory
        for a file indexed the first time)."""
        with open(tail.path, "rb") as f:
            f.seek(tail.offset)
            carry = b""
            while True:
                block = f.read(_READ_BLOCK)
                data = carry + block
                end = data.rfind(b"\n") + 1
                if end:
                    yield self._parse(data[:end], tail, file_id)
                carry = data[end:]
                if not block:
                    return

    def _parse(self, data: bytes, tail: _Tail, file_id: int) -> dict[str, np.ndarray]:
        cols: dict[str, list] = {k: [] for k in _COLUMNS}
        pos = tail.offset
        names, kinds, rules = self.names, self.kinds, self.rules
        for raw in data.split(b"\n")[:-1]:
            start, pos = pos, pos + len(raw) + 1
            tail.lines += 1
            if not raw.strip():
                continue
            try:
                d = json.loads(raw)
                phase = PHASE_ORDER.get(d.get("phase", "forward"), len(PHASE_ORDER))
                stage = int(d.get("pp_stage", 0))
                row = (
                    int(d["step"]),
                    int(d["rank"]),
                    names(str(d["name"])),
                    kinds(str(d["kind"])),
                    rules(str(d["rule"])),
                    bool(d.get("origin", False)),
                    int(d.get("collectives", 0)),
                    phase,
                    int(d.get("micro_step", 0)),
                    -stage if phase == _BACKWARD else stage,
                    int(d.get("seq", 0)),
                )
            except (ValueError, KeyError, TypeError) as e:
                self.malformed += 1
                if self.malformed <= 10:
                    logger.warning(
                        "trainmon: %s:%d: malformed anomaly line skipped: %s", tail.path, tail.lines, e
                    )
                continue
            for key, value in zip(_COLUMNS, row, strict=False):
                cols[key].append(value)
            cols["file"].append(file_id)
            cols["offset"].append(start)
        tail.offset += len(data)
        return {k: np.asarray(v, dtype=_COLUMNS[k]) for k, v in cols.items()}

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
        path = self._files[int(self._cols["file"][i])]
        with open(path, "rb") as f:
            f.seek(int(self._cols["offset"][i]))
            line = f.readline()
        return anomaly_to_dict(anomaly_from_json(line))


def json_number(x: float) -> float | str:
    """A float for JSON: non-finite values as the strings the record files use."""
    if math.isfinite(x):
        return x
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
