"""The micro-step of the first divergence, from the runs' CSV files.

The statistics store merges a step's micro-steps; the CSV files (``RUN/rank_<r>/<kind>.csv``, written when
``csv`` is among the formats) keep a row per micro-step. When both runs have them, the divergent tensor's rows
at the divergent step are read from both (lines filtered by name before they are parsed, so a long file
costs one pass over its bytes) and compared micro-step by micro-step with the pair's tolerance: the first
micro-step that differs is the answer; None when a run has no CSV of that kind and rank, or no such rows.
"""

from __future__ import annotations

import csv
import math
import re
from pathlib import Path

from trainmon.read.compare.diff import worst
from trainmon.read.csv_sources import LayoutError, find_sources

__all__ = ["first_micro_step"]

_CHUNK = re.compile(r"^(\d+):")
_STATS = ("min", "max", "mean", "norm", "zeros", "nans", "infs")


def _files(run: Path, rank: int, kind: str) -> tuple[Path, ...]:
    try:
        sources = find_sources([run])
    except (LayoutError, OSError):
        return ()
    return next((s.files for s in sources if s.rank == rank and s.kind == kind), ())


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return math.nan


def _rows(files: tuple[Path, ...], name: str, step: int) -> dict[int, dict[str, float]]:
    """{micro-step: statistics} of ``name`` (``<chunk>:`` prefix: that model chunk) at ``step``."""
    vpp = None
    m = _CHUNK.match(name)
    if m:
        vpp, name = int(m.group(1)), name[m.end() :]
    needle = name.encode("utf-8", "backslashreplace")
    out: dict[int, dict[str, float]] = {}
    for path in files:
        with open(path, "rb") as f:
            header = next(csv.reader([f.readline().decode("utf-8", "replace")]), [])
            where = {column: i for i, column in enumerate(header)}
            if not {"name", "step", "micro_step"} <= set(where):
                continue
            for raw in f:
                if needle not in raw:
                    continue
                fields = next(csv.reader([raw.decode("utf-8", "replace")]), [])
                if len(fields) != len(header) or fields[where["name"]] != name:
                    continue
                if _number(fields[where["step"]]) != step:
                    continue
                if vpp is not None and "vpp_stage" in where and _number(fields[where["vpp_stage"]]) != vpp:
                    continue
                stats = {s: _number(fields[where[s]]) for s in _STATS if s in where}
                out[int(_number(fields[where["micro_step"]]))] = stats  # a resumed job's rewrite wins
    return out


def first_micro_step(
    run_a: Path,
    run_b: Path,
    rank: int,
    kind: str,
    names: tuple[str, str],
    step: int,
    rtol: float,
    ztol: float,
) -> int | None:
    """The first micro-step at which the tensor (``names``: as each run names it) differs beyond ``rtol``/
    ``ztol`` (the pair's tolerance with its slack), from the CSV files of both runs."""
    rows_a = _rows(_files(Path(run_a), rank, kind), names[0], step)
    rows_b = _rows(_files(Path(run_b), rank, kind), names[1], step)
    for micro in sorted(set(rows_a) & set(rows_b)):
        a, b = rows_a[micro], rows_b[micro]
        if set(_STATS) <= set(a) and set(_STATS) <= set(b) and worst(a, b, rtol, ztol)[1] > 1:
            return micro
    return None
