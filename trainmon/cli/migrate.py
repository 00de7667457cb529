"""``trainmon migrate RUN``: convert a run of the old layout (statistics store ``stats/rank_<r>.bin``, anomaly
records ``anomalies/rank_<r>.jsonl``) to the columnar tables and rank summaries (:mod:`trainmon.run.migrate`),
and seal the streams a killed job left open."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from trainmon.run.layout import is_run

EXIT_OK = 0
EXIT_ERROR = 2


def _run(args: argparse.Namespace) -> int:
    run = Path(args.run)
    if not is_run(run):
        print(f"error: {run} is not a trainmon run (no plugins/trainmon folder)", file=sys.stderr)
        return EXIT_ERROR
    from trainmon.run.migrate import migrate, old_files

    old = old_files(run)
    try:
        done = migrate(run, keep_old=args.keep_old)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ERROR
    if not old and not done.sealed:
        print(f"{run}: nothing to migrate (already in the columnar layout)")
        return EXIT_OK
    print(f"{run}:")
    if done.stats_ranks:
        ranks = len(done.stats_ranks)
        print(f"  statistics store: {done.stats_rows} rows of {ranks} rank(s) -> stats/rank=<r>/")
    if done.anomaly_ranks:
        print(f"  anomaly records: {done.anomaly_records} of {len(done.anomaly_ranks)} rank(s) "
              "-> anomalies/rank=<r>/")  # fmt: skip
    if done.summaries:
        print(f"  summaries written: {len(done.summaries)} rank(s)")
    if done.sealed:
        print(f"  open segments of a killed job sealed: {done.sealed}")
    if done.removed:
        print(f"  old files removed: {len(done.removed)}")
    elif old:
        print(f"  old files kept (--keep-old): {len(old)}")
    return EXIT_OK


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "migrate",
        help="convert a run of the old layout to columnar tables (and seal a killed job's open segments)",
        description="Convert RUN's old statistics store (stats/rank_<r>.bin) and anomaly records "
        "(anomalies/rank_<r>.jsonl) into Parquet segments partitioned by rank, write each rank's summary, "
        "and seal the Arrow streams a killed job left open. Readers read both layouts; this makes the run "
        "readable by DuckDB, pandas, Polars and Spark and lets `analyze` answer from summaries.",
    )
    parser.add_argument("run", metavar="RUN", help="the run directory")
    parser.add_argument("--keep-old", action="store_true", help="keep the old files after converting them")
    parser.set_defaults(func=_run)
