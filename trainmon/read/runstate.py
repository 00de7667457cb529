"""Where a run stands, read from its files by the CLI: has its monitor closed, which step was written last."""

from __future__ import annotations

import contextlib
import csv
import os
from dataclasses import dataclass
from pathlib import Path

from trainmon.run.layout import PLUGIN_DIR, RANK_BIN, is_run, rank_files, stats_dir
from trainmon.run.manifest import read_manifest
from trainmon.run.statstore import STAT_RECORD

_TAIL = 64 * 1024  # enough for a CSV line with any sane tensor name


_RANK_FOLDER = "rank_"
_MAX_LISTED = 5


def not_a_run(path: str | os.PathLike[str]) -> str | None:
    """Why ``path`` is not a run directory (the folder given to ``attach``), None when it is one: it does
    not exist, it is one rank's folder of a run, it holds runs, or it holds no ``plugins/trainmon``."""
    path = Path(path)
    if not path.exists():
        return f"run directory not found: {path}"
    if not path.is_dir():
        return f"{path} is not a directory"
    if is_run(path):
        return None
    if path.name.startswith(_RANK_FOLDER) and is_run(path.parent):
        return f"{path} is the folder of one rank of the run {path.parent}; give the run: {path.parent}"
    with contextlib.suppress(OSError):
        below = sorted(p for p in path.iterdir() if p.is_dir() and is_run(p))
        if below:
            listed = ", ".join(str(p) for p in below[:_MAX_LISTED])
            more = f" and {len(below) - _MAX_LISTED} more" if len(below) > _MAX_LISTED else ""
            return f"{path} is not a run but holds runs: {listed}{more}; give one of them"
    return f"{path} is not a trainmon run directory (it has no {PLUGIN_DIR.as_posix()} folder)"


@dataclass(frozen=True)
class RunState:
    closed: float | None  # Unix time rank 0's monitor closed (None: running, or killed before closing)
    last_step: int | None  # the latest step any rank has written (None: nothing written yet, or unknown)


def _last_stored_step(path: Path) -> int | None:
    """The step of the last whole record of a rank's statistics store (a torn last record is skipped)."""
    size = os.path.getsize(path)
    whole = size // STAT_RECORD.itemsize
    if whole == 0:
        return None
    with open(path, "rb") as f:
        f.seek((whole - 1) * STAT_RECORD.itemsize)
        rec = f.read(STAT_RECORD.itemsize)
    return int.from_bytes(rec[:8], "little", signed=True)  # "step" is the first field, <i8


def _last_csv_step(path: Path) -> int | None:
    """The step column of a CSV file's last complete line."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        f.seek(max(0, size - _TAIL))
        tail = f.read()
    lines = tail[: tail.rfind(b"\n") + 1].decode("utf-8", "replace").splitlines()
    for line in reversed(lines):
        fields = next(csv.reader([line]), [])
        if len(fields) > 2 and fields[2].strip().lstrip("-").isdigit():
            return int(fields[2])
    return None


def _max(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else max(a, b)


def run_state(run: str | os.PathLike[str]) -> RunState:
    """Read what the run's files say; unreadable files count as unknown, never as an error."""
    run = Path(run)
    manifest = read_manifest(run) or {}
    closed = manifest.get("closed")
    closed = float(closed) if isinstance(closed, (int, float)) and not isinstance(closed, bool) else None
    last: int | None = None
    try:
        stores = [path for _, path in rank_files(stats_dir(run), RANK_BIN)]
    except OSError:
        stores = []
    for p in stores:
        with contextlib.suppress(OSError):
            last = _max(last, _last_stored_step(p))
    if not stores:  # no TensorBoard output: the CSV files say the same, at more cost
        for p in run.glob("rank_*/*.csv"):
            with contextlib.suppress(OSError):
                last = _max(last, _last_csv_step(p))
    step = manifest.get("last_step")
    if isinstance(step, int) and not isinstance(step, bool):
        last = _max(last, step)
    return RunState(closed, last)
