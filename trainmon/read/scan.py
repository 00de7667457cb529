"""The scan behind ``trainmon analyze``: the K earliest anomalies of a run across ranks.

Reads the ranks' summaries (:mod:`trainmon.read.summaries`), not their records: each summary holds the rank's
first anomaly per rule and its earliest records, so the run's earliest are a merge of the summaries. A
rank's records are read only when the merge needs more of them than its summary holds (``--top`` above
:data:`~trainmon.run.summary.EARLIEST`, or a ``--rule`` filter), and then only the first steps of that rank,
in growing step windows; ranks are opened lazily, in the order of their first anomaly, so at 1,000 ranks the
default answer reads 1,000 small JSON files and no record. ``--step S`` reads the records of step S of the
ranks whose anomalies span it.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from trainmon.read.summaries import read_summaries, summary_from_records
from trainmon.run.damage import note
from trainmon.run.layout import summary_file
from trainmon.run.records import SUPPRESSED_RULE, Anomaly
from trainmon.run.summary import RankSummary, record_key, summary_key

__all__ = ["DEFAULT_TOP", "Summary", "scan"]

DEFAULT_TOP = 8

# The first window of a rank's records read when its summary is not enough; each next one is this much wider.
_WINDOW_GROWTH = 4


@dataclass
class Summary:
    """What :func:`scan` found: the K earliest anomalies in order, and counts."""

    top: list[Anomaly] = field(default_factory=list)
    ranks: int = 0  # ranks with a summary or records
    anomalies: int = 0  # anomalies recorded (summary lines of the burst cap not included)
    suppressed: int = 0  # anomalies the burst cap dropped (sum of the summary lines' values)
    records_read: int = 0  # ranks whose records had to be read
    counts: dict[str, int] = field(default_factory=dict)  # rule -> records, every rule (not by step)
    # rule -> the run's earliest record of it, from the ranks' summaries (not by step)
    firsts: dict[str, Anomaly] = field(default_factory=dict)

    @property
    def first(self) -> Anomaly | None:
        return self.top[0] if self.top else None


def _records(run: Path, rank: int, lo: int, hi: int) -> list[Anomaly]:
    from trainmon.run.anomaly_table import read_anomalies  # pyarrow: only when records are read

    return read_anomalies(run, rank, lo, hi)


def _windows(
    run: Path, s: RankSummary, start: int, rules: frozenset[str] | None, skip: int = 0
) -> Iterator[Anomaly]:
    """The rank's records from step ``start`` on, by :func:`summary_key`, read in growing step windows;
    the first ``skip`` of them (already taken from the summary) left out."""
    last = s.anomaly_steps[1] if s.anomaly_steps else start
    lo, width = start, 1
    while lo <= last:
        hi = lo + width - 1
        found = [a for a in _records(run, s.rank, lo, hi)
                 if a.rule != SUPPRESSED_RULE and (rules is None or a.rule in rules)]  # fmt: skip
        found.sort(key=summary_key)
        if skip:
            dropped, skip = min(skip, len(found)), skip - min(skip, len(found))
            found = found[dropped:]
        yield from found
        lo, width = hi + 1, width * _WINDOW_GROWTH


def _rank_records(
    run: Path, s: RankSummary, rules: frozenset[str] | None, read: list[int]
) -> Iterator[Anomaly]:
    """The rank's records (``rules`` only) in :func:`summary_key` order: from its summary as far as that
    goes, then from its files."""
    if rules is None:
        yield from s.earliest
        if s.complete() or not s.earliest:
            return
        start = s.earliest[-1].step
        already = sum(1 for a in s.earliest if a.step >= start)
    else:
        firsts = sorted((a for rule, a in s.first.items() if rule in rules), key=summary_key)
        if not firsts:
            return
        read.append(s.rank)
        yield from _with_firsts(firsts, _windows(run, s, firsts[0].step, rules))
        return
    read.append(s.rank)
    yield from _windows(run, s, start, rules, already)


def _identity(a: Anomaly) -> tuple:
    return (summary_key(a), a.kind, a.name, a.stat, a.rule)


def _with_firsts(firsts: list[Anomaly], records: Iterator[Anomaly]) -> Iterator[Anomaly]:
    """``records`` (by :func:`summary_key`) with the summary's first record of each rule among them, also
    where its file cannot be read (a damaged segment): what the summary holds is never lost."""
    pending = list(firsts)
    for a in records:
        while pending and summary_key(pending[0]) < summary_key(a):
            yield pending.pop(0)
        same = next((i for i, f in enumerate(pending) if _identity(f) == _identity(a)), None)
        if same is not None:  # the same record, read from its file
            del pending[same]
        yield a
    yield from pending


def _bound(s: RankSummary, rules: frozenset[str] | None) -> tuple | None:
    """A key no record of the rank (``rules`` only) orders before; None: the rank has none."""
    if rules is None:
        return record_key(s.earliest, 0) if s.earliest else None
    keys = [record_key(s.first, rule) for rule in s.first if rule in rules]
    return min(keys) if keys else None


def scan(
    directory: Path,
    top: int = DEFAULT_TOP,
    step: int | None = None,
    progress: TextIO | None = None,
    rules: frozenset[str] | None = None,
    ranks: Collection[int] | None = None,
) -> Summary:
    """The ``top`` earliest anomalies of the run ``directory`` (``step`` only, only the given ``rules`` and
    only those of ``ranks``, if given). ``progress``: where to count ranks whose summaries must be computed
    from their records (runs of the old layout)."""
    run = Path(directory)
    summaries = read_summaries(run, progress)
    if ranks is not None:
        summaries = {rank: s for rank, s in summaries.items() if rank in ranks}
    out = Summary(ranks=len(summaries))
    top = max(1, top)
    read: list[int] = []
    if step is not None:
        found: list[Anomaly] = []
        for s in summaries.values():
            if s.anomaly_steps is None or not s.anomaly_steps[0] <= step <= s.anomaly_steps[1]:
                continue
            read.append(s.rank)
            # the summary's earliest records of the step, where its file holds none (damaged)
            records = _records(run, s.rank, step, step) or [a for a in s.earliest if a.step == step]
            for a in records:
                if a.rule == SUPPRESSED_RULE:
                    if math.isfinite(a.value) and a.value > 0:
                        out.suppressed += int(a.value)
                elif rules is None or a.rule in rules:
                    out.anomalies += 1
                    found.append(a)
        out.top = heapq.nsmallest(top, found, key=summary_key)
        out.records_read = len(set(read))
        return out

    for s in summaries.values():
        counts = s.counts.items()
        out.anomalies += s.anomalies if rules is None else sum(n for r, n in counts if r in rules)
        for r, n in counts:
            if r != SUPPRESSED_RULE:
                out.counts[r] = out.counts.get(r, 0) + n
        out.suppressed += s.suppressed
        for r, a in s.first.items():
            if r not in out.firsts or summary_key(a) < summary_key(out.firsts[r]):
                out.firsts[r] = a
    # a lazy k-way merge: a rank enters with a lower bound of its keys and is opened when that bound is next
    tie = itertools.count()
    heap: list[tuple] = []
    for rank, s in list(summaries.items()):
        try:
            bound = _bound(s, rules)
        except ValueError as e:  # a record of the summary is damaged: the rank's records instead
            note(summary_file(run, rank), f"a record of the summary is damaged: {e}")
            s = summaries[rank] = summary_from_records(run, rank)
            bound = _bound(s, rules)
        if bound is not None:
            heap.append((bound, next(tie), s, None, None))
    heapq.heapify(heap)
    while heap:
        _, _, s, it, record = heapq.heappop(heap)
        if it is None:  # the rank's bound came up: open it
            it = _rank_records(run, s, rules, read)
        else:
            out.top.append(record)
            if len(out.top) >= top:  # done: no rank is asked for more than it gave
                break
        nxt = next(it, None)
        if nxt is not None:
            heapq.heappush(heap, (summary_key(nxt), next(tie), s, it, nxt))
    out.records_read = len(set(read))
    return out
