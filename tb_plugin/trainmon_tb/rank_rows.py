"""The rows of the timeline's rank axis: one row per rank up to :data:`MAX_RANK_ROWS` ranks; beyond, one row
per group of consecutive ranks (``g`` ranks, ``g`` the smallest power of two that brings the rows under the
limit, so that a group is often one node: 8 GPUs), and an expanded group followed by its ranks.

A group is named by its first and last rank, ``"64-71"``: the same text is a valid ``ranks`` filter of the
plugin's routes, so a group's cell lists the anomalies of its ranks."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np

MAX_RANK_ROWS = 200

# what each row is: a rank (no grouping), a collapsed group, an expanded group, a rank of an expanded group
RANK, GROUP, OPEN, MEMBER = "rank", "group", "open", "member"


@dataclass(frozen=True)
class RankRows:
    labels: list[str]
    kinds: list[str]
    group_size: int  # ranks per group; 1: every rank is a row
    base: np.ndarray  # rank -> the row of the rank, or of its group (-1: not a row)
    member: np.ndarray  # rank -> its own row under its expanded group (-1: none)


def group_size(ranks: np.ndarray, max_rows: int) -> int:
    g = 1
    while len(np.unique(ranks // g)) > max_rows:
        g *= 2
    return g


def rank_rows(ranks: Sequence[int], expand: Collection[int] = (), max_rows: int = MAX_RANK_ROWS) -> RankRows:
    """Rows for the sorted distinct ``ranks``; ``expand``: ranks whose groups are shown with their ranks."""
    r = np.asarray(sorted(set(ranks)), dtype=np.int64)
    size = int(r.max()) + 1 if len(r) else 0
    base = np.full(size, -1, dtype=np.int64)
    member = np.full(size, -1, dtype=np.int64)
    if len(r) <= max_rows:
        base[r] = np.arange(len(r))
        return RankRows([str(x) for x in r.tolist()], [RANK] * len(r), 1, base, member)
    g = group_size(r, max_rows)
    opened = {int(x) // g for x in expand}
    labels: list[str] = []
    kinds: list[str] = []
    groups = r // g
    starts = np.flatnonzero(np.r_[True, groups[1:] != groups[:-1]])
    stops = np.r_[starts[1:], len(r)]
    for a, b in zip(starts.tolist(), stops.tolist(), strict=True):
        members = r[a:b]
        row = len(labels)
        base[members] = row
        labels.append(f"{int(members[0])}-{int(members[-1])}" if len(members) > 1 else str(int(members[0])))
        if int(groups[a]) in opened:
            kinds.append(OPEN)
            member[members] = np.arange(row + 1, row + 1 + len(members))
            labels.extend(str(x) for x in members.tolist())
            kinds.extend([MEMBER] * len(members))
        else:
            kinds.append(GROUP)
    return RankRows(labels, kinds, g, base, member)
