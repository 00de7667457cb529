"""Comparing two runs' statistics, step range by step range, rank by rank, and finding the first divergence.

The steps both runs stored are cut into the statistics store's segments (1000 steps, aligned); each range is
read for one rank of each run (only its row groups), its tensors paired (:mod:`~trainmon.read.compare.plan`,
once per layout), and every (step, pair) scored (:mod:`~trainmon.read.compare.diff`, with the slack of the
state each step started from, :mod:`~trainmon.read.compare.state`). Ranges are read ahead on two threads
(decoding Parquet releases the GIL) while the ranges read are compared in step order.

**The first divergence** is the divergent (step, tensor) that came first: the earliest step, then the
earliest phase (forward, backward, collectives, optimizer), then the tensor's place in its rank's order (the
order its hooks fired), then the lowest rank. Every other divergent cell after it is **downstream**.
With ``first_only``, no range after the first one holding a divergence is read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import numpy as np

from trainmon.read.compare.diff import DIFF_STATS, differences, scores
from trainmon.read.compare.mapfile import NameMap
from trainmon.read.compare.plan import RankPlan, make_plan
from trainmon.read.compare.source import RankReader, step_ranges
from trainmon.read.compare.state import Slack, slack
from trainmon.read.compare.tensors import phase_rank
from trainmon.read.compare.tolerance import Tolerance
from trainmon.run.statstore import StatFrame, TensorMeta

__all__ = ["Chunk", "Options", "RankTally", "Result", "StepRow", "common_range", "compare"]


@dataclass(frozen=True)
class Options:
    first_only: bool = False  # stop after the step range holding the first divergence
    step_lo: int | None = None
    step_hi: int | None = None
    ranks: tuple[int, ...] | None = None  # None: every rank both runs have
    workers: int = 2


@dataclass(frozen=True)
class StepRow:
    """Every pair of one rank at one step: what the verdict reads around the first divergence."""

    rank: int
    step: int
    plan: RankPlan
    rel: np.ndarray  # (P,)
    score: np.ndarray  # (P,)
    slack: np.ndarray  # (P,) what the state the step started from explains, beside each pair's tolerance
    a: dict[str, np.ndarray]  # stat -> (P,)
    b: dict[str, np.ndarray]
    previous_score: float  # the largest score of the rank's previous compared step (nan: none)

    def first_divergent(self) -> int:
        """The pair that diverged first: the earliest phase, then the earliest in A's order."""
        divergent = np.flatnonzero(self.score > 1)
        return int(min(divergent, key=lambda p: (phase_rank(self.plan.pairs[p].kind), p)))


@dataclass(frozen=True)
class Chunk:
    """One compared step range of one rank, handed to a sink (the report folder) as it is done."""

    rank: int
    index: int
    plan: RankPlan
    steps: np.ndarray  # (S,) the steps both runs hold
    rel: np.ndarray  # (S, P) float32; NaN where a run has no row of the tensor at the step
    score: np.ndarray  # (S, P) float32
    slack: Slack | None = None  # each cell's state allowance (the score's denominator: rtol + slack)


@dataclass
class RankTally:
    """What one rank's comparison found."""

    rank: int
    plan: RankPlan | None = None
    steps: int = 0
    step_lo: int | None = None
    step_hi: int | None = None
    divergent_cells: int = 0
    divergent_steps: int = 0
    first: StepRow | None = None
    pair_counts: dict[tuple[str, str], int] = field(default_factory=dict)  # divergent steps per tensor
    pair_first: dict[tuple[str, str], int] = field(default_factory=dict)  # first divergent step per tensor
    last_max_score: float = float("nan")
    divergent_step_list: list[np.ndarray] = field(default_factory=list)  # the steps holding a divergence
    layouts: int = 0  # tensor layouts met (more than one: the run changed what it collects)


@dataclass
class Result:
    """A whole comparison: per rank tallies, and the first divergence over every rank."""

    ranks: list[RankTally]
    ranges_read: int
    ranges_total: int
    stopped_early: bool

    @property
    def first(self) -> StepRow | None:
        rows = [t.first for t in self.ranks if t.first is not None]
        if not rows:
            return None
        return min(rows, key=lambda r: (r.step, phase_rank(r.plan.pairs[r.first_divergent()].kind),
                                        r.first_divergent(), r.rank))  # fmt: skip

    @property
    def divergent_steps(self) -> np.ndarray:
        """Every step at which some rank holds a divergent tensor, ascending."""
        found = [s for t in self.ranks for s in t.divergent_step_list]
        return np.unique(np.concatenate(found)) if found else np.empty(0, np.int64)

    @property
    def steps_compared(self) -> int:
        return max((t.steps for t in self.ranks), default=0)


@dataclass
class _Done:
    """What one (rank, range) comparison found, merged into the rank's tally in step order."""

    rank: int
    plan: RankPlan | None
    steps: np.ndarray
    row_max: np.ndarray  # (S,) the largest score of each step
    divergent_rows: np.ndarray  # (S,) divergent pairs per step
    pair_counts: np.ndarray  # (P,)
    pair_first: np.ndarray  # (P,) first divergent step, -1: none
    first: StepRow | None
    carried: float  # the state difference the range's last step leaves


class _Plans:
    """Per rank, the plan of each tensor layout met (a run rarely changes layout: config reloads)."""

    def __init__(self, a: RankReader, b: RankReader, tolerance: Tolerance, name_map: NameMap | None) -> None:
        self.a, self.b, self.tolerance, self.name_map = a, b, tolerance, name_map
        self._plans: dict[tuple, RankPlan] = {}

    def get(
        self, rank: int, tensors_a: tuple, tensors_b: tuple, meta_a: TensorMeta, meta_b: TensorMeta
    ) -> RankPlan:
        key = (rank, tensors_a, tensors_b)
        plan = self._plans.get(key)
        if plan is None:
            plan = make_plan(rank, tensors_a, tensors_b, meta_a, meta_b, self.tolerance, self.name_map,
                             self.a.carried(meta_a), self.b.carried(meta_b))  # fmt: skip
            self._plans[key] = plan
        return plan


def _empty(rank: int, plan: RankPlan | None, carried: float) -> _Done:
    none = np.empty(0)
    return _Done(rank, plan, np.empty(0, np.int64), none, np.empty(0, np.intp), none, none, None, carried)


def _take(values: np.ndarray, rows: np.ndarray, columns: np.ndarray) -> np.ndarray:
    """``values[rows][:, columns]``, without a copy where they are every row or column in order (two runs
    of one layout: the usual case)."""
    all_rows = len(rows) == values.shape[0]  # intersect1d's indices are ascending: every row is arange
    all_columns = len(columns) == values.shape[1] and bool((columns[1:] > columns[:-1]).all())
    if all_rows and all_columns:
        return values
    if all_columns:
        return values[rows]
    if all_rows:
        return values[:, columns]
    return values[np.ix_(rows, columns)]


def _compare_range(
    plans: _Plans,
    rank: int,
    index: int,
    read: tuple[tuple[StatFrame, TensorMeta], tuple[StatFrame, TensorMeta]],
    carried: float,
    sink: Callable[[Chunk], None] | None,
) -> _Done:
    (fa, meta_a), (fb, meta_b) = read
    if not len(fa.steps) or not len(fb.steps):
        return _empty(rank, None, carried)
    steps, ra, rb = np.intersect1d(fa.steps, fb.steps, assume_unique=True, return_indices=True)
    if not len(steps):
        return _empty(rank, None, carried)
    plan = plans.get(rank, fa.tensors, fb.tensors, meta_a, meta_b)
    if not plan.pairs:
        return _empty(rank, plan, carried)
    a = {s: _take(fa.values[s], ra, plan.ia) for s in DIFF_STATS}
    b = {s: _take(fb.values[s], rb, plan.ib) for s in DIFF_STATS}
    diff = differences(a, b)
    missing = np.isnan(a["nans"]) | np.isnan(b["nans"])  # a run has no row of the tensor at the step
    rel = diff.rel
    if missing.any():
        rel[missing] = np.nan
    extra, carried = slack(rel, plan.kinds, carried, plans.tolerance.coupling, plan.data)
    score = scores(diff, plan.rtol, plan.ztol, extra)
    if missing.any():
        score[missing] = 0.0
    divergent = score > 1
    per_row = divergent.sum(axis=1)
    per_pair = divergent.sum(axis=0)
    first_step = np.full(len(plan.pairs), -1, dtype=np.int64)
    hit = per_pair > 0
    if hit.any():
        first_step[hit] = steps[np.argmax(divergent[:, hit], axis=0)]
    row_max = score.max(axis=1)
    first = None
    rows = np.flatnonzero(per_row)
    if len(rows):
        s = int(rows[0])
        previous = float(row_max[s - 1]) if s > 0 else float("nan")
        first = StepRow(rank, int(steps[s]), plan, rel[s].copy(), score[s].copy(), extra.of(s),
                        {k: v[s].copy() for k, v in a.items()}, {k: v[s].copy() for k, v in b.items()},
                        previous)  # fmt: skip
    if sink is not None:
        sink(Chunk(rank, index, plan, steps, rel, score, extra))
    return _Done(rank, plan, steps, row_max, per_row, per_pair, first_step, first, carried)


def _merge(tally: RankTally, done: _Done) -> None:
    if done.plan is None or not len(done.steps):
        return
    if tally.plan is None or tally.plan.pairs != done.plan.pairs:
        tally.layouts += 1
    tally.plan = tally.plan or done.plan
    tally.steps += len(done.steps)
    tally.step_lo = int(done.steps[0]) if tally.step_lo is None else tally.step_lo
    tally.step_hi = int(done.steps[-1])
    tally.divergent_cells += int(done.divergent_rows.sum())
    tally.divergent_steps += int(np.count_nonzero(done.divergent_rows))
    if done.divergent_rows.any():
        tally.divergent_step_list.append(done.steps[done.divergent_rows > 0])
    for p in np.flatnonzero(done.pair_counts):
        key = (done.plan.pairs[p].kind, done.plan.pairs[p].name)
        tally.pair_counts[key] = tally.pair_counts.get(key, 0) + int(done.pair_counts[p])
        tally.pair_first.setdefault(key, int(done.pair_first[p]))
    if tally.first is None and done.first is not None:
        first = done.first
        if first.previous_score != first.previous_score and first.step == int(done.steps[0]):
            first = replace(first, previous_score=tally.last_max_score)
        tally.first = first
    tally.last_max_score = float(done.row_max[-1]) if len(done.row_max) else tally.last_max_score


def common_range(
    a: RankReader, b: RankReader, ranks: Sequence[int], options: Options = Options()
) -> tuple[int, int] | None:
    """The steps to compare: from the earliest step both runs hold on some rank to the latest, within
    ``options``' steps; None when there is none."""
    spans = [(a.span(r), b.span(r)) for r in ranks]
    los = [max(x[0], y[0]) for x, y in spans if max(x[0], y[0]) <= min(x[1], y[1])]
    his = [min(x[1], y[1]) for x, y in spans if max(x[0], y[0]) <= min(x[1], y[1])]
    if not los:
        return None
    lo, hi = min(los), max(his)
    if options.step_lo is not None:
        lo = max(lo, options.step_lo)
    if options.step_hi is not None:
        hi = min(hi, options.step_hi)
    return (lo, hi) if lo <= hi else None


def compare(
    a: RankReader,
    b: RankReader,
    ranks: Sequence[int],
    tolerance: Tolerance,
    name_map: NameMap | None = None,
    options: Options = Options(),
    sink: Callable[[Chunk], None] | None = None,
) -> Result:
    """Compare ``ranks`` (each with the same rank of the other run) over the steps both runs hold.

    Step ranges are read ahead on ``options.workers`` threads (a range's ranks of both runs) while this
    thread compares the ranges already read, in step order (each rank's state difference is carried from one
    range to the next)."""
    tallies = [RankTally(r) for r in ranks]
    span = common_range(a, b, ranks, options) if ranks else None
    if span is None:
        return Result(tallies, 0, 0, False)
    ranges = step_ranges(*span)
    plans = _Plans(a, b, tolerance, name_map)
    by_rank = {t.rank: t for t in tallies}
    carried = dict.fromkeys(ranks, 0.0)
    ahead = 1 if options.first_only else 2  # ranges read ahead of the one being compared
    stopped = False
    read = 0

    def submit(pool: ThreadPoolExecutor, k: int) -> list:
        lo, hi = ranges[k]
        return [(r, pool.submit(a.read, r, lo, hi), pool.submit(b.read, r, lo, hi)) for r in ranks]

    with ThreadPoolExecutor(max_workers=max(1, options.workers)) as pool:
        pending = {k: submit(pool, k) for k in range(min(ahead, len(ranges)))}
        for k in range(len(ranges)):
            reads = pending.pop(k)
            if not options.first_only and k + ahead < len(ranges):
                pending[k + ahead] = submit(pool, k + ahead)
            for rank, fa, fb in reads:
                done = _compare_range(plans, rank, k, (fa.result(), fb.result()), carried[rank], sink)
                carried[rank] = done.carried
                _merge(by_rank[rank], done)
            read += 1
            if options.first_only:
                if any(t.first is not None for t in tallies):
                    stopped = k + 1 < len(ranges)
                    break
                if k + 1 < len(ranges):
                    pending[k + 1] = submit(pool, k + 1)
        for reads in pending.values():  # read ahead, not needed: let them finish unread
            for _, fa, fb in reads:
                fa.cancel()
                fb.cancel()
    return Result(tallies, read, len(ranges), stopped)
