"""Where a run stands, read from its files by the CLI: has its monitor closed, which step was written last."""

from __future__ import annotations

import contextlib
import csv
import os
from dataclasses import dataclass
from pathlib import Path

from trainmon.run.layout import RANK_BIN, rank_files, stats_dir
from trainmon.run.manifest import read_manifest
from trainmon.run.summary import read_summary, summary_ranks

# the old store's record layout (trainmon.run.statstore.STAT_RECORD): step (int64) first, 40 bytes a record
_OLD_RECORD_SIZE = 40

_TAIL = 64 * 1024  # enough for a CSV line with any sane tensor name


@dataclass(frozen=True)
class RunState:
    closed: float | None  # Unix time rank 0's monitor closed (None: running, or killed before closing)
    last_step: int | None  # the latest step any rank has written (None: nothing written yet, or unknown)


def _last_stored_step(path: Path) -> int | None:
    """The step of the last whole record of a rank's old statistics store (a torn last record is skipped)."""
    size = os.path.getsize(path)
    whole = size // _OLD_RECORD_SIZE
    if whole == 0:
        return None
    with open(path, "rb") as f:
        f.seek((whole - 1) * _OLD_RECORD_SIZE)
        rec = f.read(_OLD_RECORD_SIZE)
    return int.from_bytes(rec[:8], "little", signed=True)  # "step" is the first field, <i8


def _last_columnar_step(run: Path) -> int | None:
    from trainmon.run.statstore import last_step, stat_ranks  # pyarrow: only without summaries

    last = None
    for rank in stat_ranks(run):
        with contextlib.suppress(OSError, ValueError):
            last = _max(last, last_step(run, rank))
    return last


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
    """Read what the run's files say (the ranks' summaries, else their statistics stores, else the CSV files);
    unreadable files count as unknown, never as an error."""
    run = Path(run)
    manifest = read_manifest(run) or {}
    closed = manifest.get("closed")
    closed = float(closed) if isinstance(closed, (int, float)) and not isinstance(closed, bool) else None
    last: int | None = None
    summaries = summary_ranks(run)
    for _, path in summaries:
        with contextlib.suppress(OSError, ValueError):
            found = read_summary(path)
            last = _max(last, found.last_step if found else None)
    try:
        stores = [path for _, path in rank_files(stats_dir(run), RANK_BIN)]
    except OSError:
        stores = []
    for p in stores:
        with contextlib.suppress(OSError):
            last = _max(last, _last_stored_step(p))
    if not summaries:
        last = _max(last, _last_columnar_step(run))
    if last is None:  # no summary and no store: the CSV files say the same, at more cost
        for p in run.glob("rank_*/*.csv"):
            with contextlib.suppress(OSError):
                last = _max(last, _last_csv_step(p))
    step = manifest.get("last_step")
    if isinstance(step, int) and not isinstance(step, bool):
        last = _max(last, step)
    return RunState(closed, last)
