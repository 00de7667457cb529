"""The scan behind ``trainmon analyze``: the K earliest anomalies of a run across ranks.

Streams every ``RUN/plugins/trainmon/anomalies/rank_*.jsonl`` one line at a time and keeps only a bounded
heap of the K earliest anomalies by :meth:`trainmon.run.records.Anomaly.order_key`, so runs with thousands of
ranks need memory for K anomalies, not for the run.
"""

from __future__ import annotations

import heapq
import math
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from trainmon.run.anomalies import iter_anomalies
from trainmon.run.layout import rank_files
from trainmon.run.records import SUPPRESSED_RULE, Anomaly

__all__ = ["DEFAULT_TOP", "Summary", "scan"]

DEFAULT_TOP = 8
# Show a progress counter on stderr when reading more files than this.
PROGRESS_MIN_FILES = 64


@dataclass
class Summary:
    """What :func:`scan` found: the K earliest anomalies in order, and counts."""

    top: list[Anomaly] = field(default_factory=list)
    ranks: int = 0  # rank files read
    anomalies: int = 0  # anomalies recorded (summary lines of the burst cap not included)
    suppressed: int = 0  # anomalies the burst cap dropped (sum of the summary lines' values)
    suppressed_lines: int = 0

    @property
    def first(self) -> Anomaly | None:
        return self.top[0] if self.top else None


def scan(
    directory: Path,
    top: int = DEFAULT_TOP,
    step: int | None = None,
    progress: TextIO | None = None,
    rules: frozenset[str] | None = None,
) -> Summary:
    """Stream the anomaly files of ``directory``; keep the ``top`` earliest (``step`` only, and only the
    given ``rules``, if given)."""
    summary = Summary()
    files = rank_files(directory)
    summary.ranks = len(files)
    show = progress is not None and len(files) > PROGRESS_MIN_FILES
    every = max(1, len(files) // 100)

    def candidates() -> Iterator[Anomaly]:
        for i, (_, path) in enumerate(files, start=1):
            try:
                for a in iter_anomalies(path):
                    if step is not None and a.step != step:
                        continue
                    if rules is not None and a.rule not in rules and a.rule != SUPPRESSED_RULE:
                        continue
                    if a.rule == SUPPRESSED_RULE:
                        summary.suppressed_lines += 1
                        if math.isfinite(a.value) and a.value > 0:
                            summary.suppressed += int(a.value)
                        continue
                    summary.anomalies += 1
                    yield a
            except OSError as e:
                print(f"warning: cannot read {path}: {e}", file=sys.stderr)
            if show and (i % every == 0 or i == len(files)):
                print(f"\rreading anomaly files: {i}/{len(files)}", end="", file=progress, flush=True)
        if show:
            print(file=progress, flush=True)

    # nsmallest keeps a heap of ``top`` items while consuming the stream; ties keep file order (by rank).
    summary.top = heapq.nsmallest(max(1, top), candidates(), key=Anomaly.order_key)
    return summary
