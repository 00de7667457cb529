"""``trainmon migrate RUN``: a run of the old layout converted to the columnar one, in place.

- The old statistics store (``stats/rank_<r>.{names.jsonl,bin}``) becomes Parquet segments of
  ``stats/rank=<r>/``, the same rows and values.
- Old anomaly records (``anomalies/rank_<r>.jsonl``) become Parquet segments of ``anomalies/rank=<r>/``, and
  each such rank gets its summary (``summary/rank_<r>.json``; steps from its statistics store when it has
  one, else from its records).
- Streams a killed job left open are sealed (every table, every rank).

Each old file is removed only after its rows were written and read back in full (``keep_old`` keeps them);
readers read both layouts, so a run stays readable whatever point a migration stopped at.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from trainmon.run.anomalies import iter_anomalies
from trainmon.run.anomaly_table import ANOMALY_OPTIONS, ANOMALY_SCHEMA, AnomalyEncoder
from trainmon.run.columnar import read_partition, seal_leftovers, write_segments
from trainmon.run.layout import (
    RANK_BIN,
    RANK_JSONL,
    anomalies_dir,
    anomalies_rank_dir,
    rank_files,
    rank_partitions,
    stats_dir,
    stats_names_file,
    stats_rank_dir,
    steps_dir,
    summary_file,
)
from trainmon.run.statstore import STATS_OPTIONS, STATS_SCHEMA, _old_rows
from trainmon.run.steptable import STEPS_OPTIONS, STEPS_SCHEMA
from trainmon.run.summary import RankSummary, read_summary, write_summary

__all__ = ["Migration", "migrate"]


@dataclass
class Migration:
    """What :func:`migrate` did."""

    stats_ranks: list[int] = field(default_factory=list)
    stats_rows: int = 0
    anomaly_ranks: list[int] = field(default_factory=list)
    anomaly_records: int = 0
    summaries: list[int] = field(default_factory=list)
    sealed: int = 0  # streams of killed jobs sealed
    removed: list[Path] = field(default_factory=list)


def _seal_all(run: Path) -> int:
    count = 0
    for table_dir, schema, options in (
        (stats_dir(run), STATS_SCHEMA, STATS_OPTIONS),
        (anomalies_dir(run), ANOMALY_SCHEMA, ANOMALY_OPTIONS),
        (steps_dir(run), STEPS_SCHEMA, STEPS_OPTIONS),
    ):
        for _, partition in rank_partitions(table_dir):
            streams = [n for n in os.listdir(partition) if n.startswith("_open-")]
            seal_leftovers(partition, schema, options)
            count += len(streams)
    return count


def _stat_steps(run: Path, rank: int) -> pa.Array | None:
    table = read_partition(stats_rank_dir(run, rank), STATS_SCHEMA, ["step"])
    return pc.unique(table.column("step")) if table.num_rows else None


def migrate(run: str | os.PathLike[str], keep_old: bool = False) -> Migration:
    """Convert the old-layout files of ``run`` (see the module's doc)."""
    run = Path(run)
    done = Migration(sealed=_seal_all(run))
    for rank, path in rank_files(stats_dir(run), RANK_BIN):
        old = _old_rows(run, rank, None, None)
        before = read_partition(stats_rank_dir(run, rank), STATS_SCHEMA, ["step"]).num_rows
        write_segments(stats_rank_dir(run, rank), old, STATS_OPTIONS)
        after = read_partition(stats_rank_dir(run, rank), STATS_SCHEMA, ["step"]).num_rows
        if after - before != old.num_rows:
            got = after - before
            raise OSError(f"{path}: {old.num_rows} rows to convert, {got} read back; old files kept")
        done.stats_ranks.append(rank)
        done.stats_rows += old.num_rows
        if not keep_old:
            for p in (path, stats_names_file(run, rank)):
                p.unlink(missing_ok=True)
                done.removed.append(p)
    for rank, path in rank_files(anomalies_dir(run), RANK_JSONL):
        records = list(iter_anomalies(path))
        summary = read_summary(summary_file(run, rank))
        if summary is None:  # the old layout had none: made from the records and the store's steps
            summary = RankSummary(rank).with_records(records)
            steps = _stat_steps(run, rank)
            if steps is not None and len(steps):
                lo, hi = pc.min(steps).as_py(), pc.max(steps).as_py()
                summary = replace(summary, steps=len(steps), first_step=lo, last_step=hi)
            elif summary.anomaly_steps is not None:
                lo, hi = summary.anomaly_steps
                summary = replace(summary, first_step=lo, last_step=hi)
            done.summaries.append(rank)
        partition = anomalies_rank_dir(run, rank)
        before = read_partition(partition, ANOMALY_SCHEMA, ["step"]).num_rows
        if records:
            table = pa.Table.from_batches([AnomalyEncoder().encode(records)])
            write_segments(partition, table, ANOMALY_OPTIONS)
        after = read_partition(partition, ANOMALY_SCHEMA, ["step"]).num_rows
        if after - before != len(records):
            got = after - before
            raise OSError(f"{path}: {len(records)} records to convert, {got} read back; old file kept")
        if not keep_old:
            path.unlink()
            done.removed.append(path)
        if rank in done.summaries:
            write_summary(run, summary)
        done.anomaly_ranks.append(rank)
        done.anomaly_records += len(records)
    return done


def old_files(run: str | os.PathLike[str]) -> list[Path]:
    """The old-layout files of ``run`` (nothing to migrate when empty)."""
    run = Path(run)
    found = [p for _, p in rank_files(stats_dir(run), RANK_BIN)]
    found += [stats_names_file(run, r) for r, _ in rank_files(stats_dir(run), RANK_BIN)]
    found += [p for _, p in rank_files(anomalies_dir(run), RANK_JSONL)]
    return [p for p in found if p.exists()]
