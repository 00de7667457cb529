"""Where the CSV files of each rank and kind are, in trainmon's and msprobe's layouts.

- trainmon: ``RUN/rank_<r>/<kind>.csv`` (and ``<kind>.<n>.csv`` after a resume with other ``ops``);
- msprobe (monitor V1): ``OUT/<time>-rank<R>-<id>/<kind>_<a>-<b>.csv``, one file per step range ``a..b``.

An INPUT is a run/output directory holding rank directories, one rank directory, or one CSV file. Every
INPUT of one call belongs to one job: files of the same rank are converted into one TensorBoard run.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["LayoutError", "Source", "find_sources", "output_beside", "rank_of_dir"]

_MSPROBE_FILE = re.compile(r"^(?P<kind>.+)_(?P<a>\d+)-(?P<b>\d+)\.csv$")
_TRAINMON_FILE = re.compile(r"^(?P<kind>[A-Za-z0-9_]+?)(?:\.(?P<n>\d+))?\.csv$")
_MSPROBE_DIR = re.compile(r"-rank(?P<rank>\d+)-[0-9A-Za-z]+$")
_RANK_DIR = re.compile(r"(?:^|[^0-9A-Za-z])rank[_-]?(?P<rank>\d+)$")
# CSV files msprobe writes next to the statistics that are not statistics
_NOT_STATS = frozenset({"stack_info"})


class LayoutError(ValueError):
    """An INPUT that holds no convertible CSV file, or selections that leave nothing."""


@dataclass(frozen=True)
class Source:
    """The CSV files of one kind of one rank, in the order their rows are read."""

    rank: int
    kind: str
    files: tuple[Path, ...]
    size: int  # bytes, for load balancing and the progress bar


def rank_of_dir(path: Path) -> int | None:
    """The rank a directory name says (``rank_3``, ``Dec03_21-34-40-rank3-ab12cd34``), or None."""
    m = _MSPROBE_DIR.search(path.name) or _RANK_DIR.search(path.name)
    return int(m.group("rank")) if m else None


def output_beside(path: str | os.PathLike[str], suffix: str) -> Path:
    """The default output of converting ``path``: next to the run folder, never inside it, where readers of
    the run (``tensorboard --logdir RUN``, csv2tb, the plugin) would see every value twice.

    ``runs/exp1`` -> ``runs/exp1-<suffix>``; a file stands for its directory; a rank directory for the
    run holding it: ``runs/exp1/rank_3`` -> ``runs/exp1-rank_3-<suffix>``."""
    p = Path(path)
    if not p.is_dir():
        p = p.parent
    if p.name in ("", ".", ".."):
        p = Path(os.path.abspath(p))
    name = p.name
    if rank_of_dir(p) is not None:
        run = Path(os.path.abspath(p)).parent if p.parent.name in ("", ".", "..") else p.parent
        name = f"{run.name}-{p.name}"
        p = run
    return p.parent / f"{name}-{suffix}"


def _classify(path: Path) -> tuple[str, tuple[int, int, int]] | None:
    """(kind, sort key) of a statistics CSV file name, or None for anything else. The key orders a kind's
    files: msprobe by step range, trainmon by the ``.<n>`` suffix."""
    m = _MSPROBE_FILE.match(path.name)
    if m:
        return m.group("kind"), (int(m.group("a")), int(m.group("b")), 0)
    m = _TRAINMON_FILE.match(path.name)
    if m:
        return m.group("kind"), (0, 0, int(m.group("n") or 0))
    return None


def _csv_files(directory: Path) -> list[Path]:
    try:
        return sorted(p for p in directory.iterdir() if p.suffix == ".csv" and p.is_file())
    except OSError as e:
        raise LayoutError(f"{directory}: cannot list: {e.strerror}") from None


def _rank_dirs(path: Path) -> list[tuple[int, Path]]:
    """Rank directories of one INPUT directory: itself when it holds CSV files, else its children."""
    if _csv_files(path):
        rank = rank_of_dir(path)
        return [(0 if rank is None else rank, path)]
    found = []
    for child in sorted(path.iterdir()):
        rank = rank_of_dir(child)
        if rank is not None and child.is_dir() and _csv_files(child):
            found.append((rank, child))
    return found


def find_sources(
    inputs: list[str | os.PathLike[str]],
    kinds: set[str] | None = None,
    ranks: set[int] | None = None,
    steps: tuple[int | None, int | None] | None = None,
) -> list[Source]:
    """Every (rank, kind) to convert, by rank then kind. ``steps`` (inclusive bounds) skips msprobe files
    whose step range lies outside; rows are filtered again when read."""
    entries: dict[tuple[int, str], list[tuple[tuple, float, Path]]] = {}
    for item in inputs:
        path = Path(item)
        if not path.exists():
            raise LayoutError(f"{path}: no such file or directory")
        if path.is_file():
            rank = rank_of_dir(path.parent)
            pairs = [(0 if rank is None else rank, path)]
            files_of = {path: [path]}
        else:
            pairs = _rank_dirs(path)
            if not pairs:
                raise LayoutError(
                    f"{path}: no CSV files found (expected RUN/rank_<r>/<kind>.csv, or msprobe's "
                    "<time>-rank<R>-<id>/<kind>_<a>-<b>.csv)"
                )
            files_of = {d: _csv_files(d) for _, d in pairs}
        for rank, where in pairs:
            if ranks is not None and rank not in ranks:
                continue
            mtime = where.stat().st_mtime if where.is_dir() else 0.0
            for f in files_of[where]:
                c = _classify(f)
                if c is None or c[0] in _NOT_STATS:
                    continue
                kind, key = c
                if kinds is not None and kind not in kinds:
                    continue
                if steps is not None and key[1] >= key[0] and _MSPROBE_FILE.match(f.name):
                    lo, hi = steps
                    if (hi is not None and key[0] > hi) or (lo is not None and key[1] < lo):
                        continue
                entries.setdefault((rank, kind), []).append((key, mtime, f))
    if not entries:
        raise LayoutError("nothing to convert: no CSV file matches the given ranks, kinds and steps")
    sources = []
    for (rank, kind), items in sorted(entries.items()):
        files = tuple(dict.fromkeys(f for _, _, f in sorted(items, key=lambda t: (t[0], t[1], str(t[2])))))
        sources.append(Source(rank, kind, files, sum(f.stat().st_size for f in files)))
    return sources
