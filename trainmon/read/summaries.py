"""The ranks' summaries of a run (:mod:`trainmon.run.summary`): the cross-rank answers without the records.

- :func:`read_summaries` ``(run) -> {rank: RankSummary}``: every rank that wrote a summary or records. A rank
  without a summary (a run of the old layout, or a job killed between its first records and its first
  summary) gets one computed from its records.
- :func:`first_non_finite` ``(summaries) -> Anomaly | None``: where the first NaN/Inf appeared, over ranks.
- :func:`overview` ``(run or summaries) -> RunOverview``: ranks, steps, anomaly counts per rule and kind: the
  plugin's run list.

Nothing here imports pyarrow unless a summary must be computed from records.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TextIO

from trainmon.run.layout import RANK_JSONL, anomalies_dir, rank_files, rank_partitions
from trainmon.run.records import NON_FINITE_RULES, Anomaly
from trainmon.run.summary import RankSummary, read_summary, summary_key, summary_ranks

__all__ = ["RunOverview", "first_non_finite", "overview", "read_summaries", "summary_from_records"]

logger = logging.getLogger("trainmon")

Summaries = Mapping[int, RankSummary]
# Count on stderr when computing the summaries of more ranks than this from their records.
PROGRESS_MIN_RANKS = 64


def summary_from_records(run: str | os.PathLike[str], rank: int) -> RankSummary:
    """A summary computed by reading every record of ``rank`` (the old layout, or no summary on disk)."""
    from trainmon.run.anomaly_table import read_anomalies  # pyarrow: only on this slow path

    summary = RankSummary(rank).with_records(read_anomalies(run, rank))
    if summary.anomaly_steps is None:
        return summary
    return replace(summary, first_step=summary.anomaly_steps[0], last_step=summary.anomaly_steps[1])


def _record_ranks(run: Path) -> set[int]:
    directory = anomalies_dir(run)
    return {r for r, _ in rank_partitions(directory)} | {r for r, _ in rank_files(directory, RANK_JSONL)}


def read_summaries(run: str | os.PathLike[str], progress: TextIO | None = None) -> dict[int, RankSummary]:
    """``{rank: summary}`` of every rank of the run with a summary or records, by rank. ``progress``: where
    to count the ranks whose summaries are computed from their records, when there are many."""
    run = Path(run)
    out: dict[int, RankSummary] = {}
    for rank, path in summary_ranks(run):
        try:
            found = read_summary(path)
        except (ValueError, OSError) as e:  # damaged (noted by read_summary): from the rank's records instead
            logger.debug("trainmon: %s; computing the rank's summary from its records", e)
            continue
        if found is not None:
            out[rank] = found
    missing = sorted(_record_ranks(run) - set(out))
    show = progress is not None and len(missing) > PROGRESS_MIN_RANKS
    every = max(1, len(missing) // 100)
    for i, rank in enumerate(missing, start=1):
        out[rank] = summary_from_records(run, rank)
        if show and (i % every == 0 or i == len(missing)):
            line = f"\rreading the records of ranks without a summary: {i}/{len(missing)}"
            print(line, end="", file=progress, flush=True)
    if show:
        print(file=progress, flush=True)
    return dict(sorted(out.items()))


def first_non_finite(summaries: Summaries) -> Anomaly | None:
    """The earliest NaN/Inf record over every rank (:meth:`~trainmon.run.records.Anomaly.order_key`)."""
    found = [a for s in summaries.values() for rule, a in s.first.items() if rule in NON_FINITE_RULES]
    return min(found, key=summary_key) if found else None


@dataclass(frozen=True)
class RunOverview:
    ranks: tuple[int, ...]  # ranks with a summary or records
    steps: tuple[int, int] | None  # first and last step any rank ended
    anomalies: int
    suppressed: int
    rules: Mapping[str, int] = field(default_factory=dict)  # records per rule
    kinds: Mapping[str, int] = field(default_factory=dict)  # records per kind
    first: Anomaly | None = None  # the earliest record of the run
    first_non_finite: Anomaly | None = None


def overview(run_or_summaries: str | os.PathLike[str] | Summaries) -> RunOverview:
    """What the run list shows: ranks, steps, counts, the first anomaly and the first NaN/Inf."""
    if isinstance(run_or_summaries, Mapping):
        summaries = run_or_summaries
    else:
        summaries = read_summaries(run_or_summaries)
    rules: dict[str, int] = {}
    kinds: dict[str, int] = {}
    lo = [s.first_step for s in summaries.values() if s.first_step is not None]
    hi = [s.last_step for s in summaries.values() if s.last_step is not None]
    for s in summaries.values():
        for k, n in s.counts.items():
            rules[k] = rules.get(k, 0) + n
        for k, n in s.kinds.items():
            kinds[k] = kinds.get(k, 0) + n
    firsts = [s.earliest[0] for s in summaries.values() if s.earliest]
    return RunOverview(
        ranks=tuple(summaries),
        steps=(min(lo), max(hi)) if lo and hi else None,
        anomalies=sum(s.anomalies for s in summaries.values()),
        suppressed=sum(s.suppressed for s in summaries.values()),
        rules=dict(sorted(rules.items())),
        kinds=dict(sorted(kinds.items())),
        first=min(firsts, key=summary_key) if firsts else None,
        first_non_finite=first_non_finite(summaries),
    )
