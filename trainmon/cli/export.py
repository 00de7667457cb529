"""``trainmon export RUN --format csv|tensorboard``: the statistics store as msprobe CSV or as every tensor's
TensorBoard scalars, the files the writer would have written (``trainmon.csvtb.export``)."""

from __future__ import annotations

import argparse
import sys

from trainmon.cli.csv2tb import step_range
from trainmon.cli.words import plural
from trainmon.run.records import STATS

EXIT_OK = 0
EXIT_ERROR = 2


def _ranks(text: str) -> list[int]:
    """``0,3,5-7``: ranks and ranges of ranks."""
    out: list[int] = []
    try:
        for part in (p.strip() for p in text.split(",")):
            if not part:
                continue
            lo, sep, hi = part.partition("-")
            first, last = int(lo), int(hi) if sep else int(lo)
            if first < 0 or last < first:
                raise ValueError
            out.extend(range(first, last + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ranks such as 0,3,5-7, got {text!r}") from None
    if not out:
        raise argparse.ArgumentTypeError(f"expected ranks such as 0,3,5-7, got {text!r}")
    return out


def _ops(text: str) -> tuple[str, ...]:
    ops = tuple(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    unknown = [op for op in ops if op not in STATS]
    if unknown or not ops:
        raise argparse.ArgumentTypeError(f"expected statistics among {', '.join(STATS)}, got {text!r}")
    return ops


def _export(args: argparse.Namespace) -> int:
    from trainmon.csvtb.export import ExportError, export

    try:
        s = export(
            args.run,
            args.out,
            fmt=args.format,
            ranks=args.ranks,
            steps=args.steps,
            names=args.names,
            ops=args.ops,
            ndigits="run" if args.ndigits is None else args.ndigits,
            force=args.force,
        )
    except (ExportError, OSError) as e:
        print(f"trainmon export: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    for note in s.notes:
        print(f"trainmon export: note: {note}", file=sys.stderr)
    what = "msprobe CSV" if s.format == "csv" else "TensorBoard events"
    print(
        f"{plural(s.rows, 'row')} ({plural(s.steps, 'rank-step')}) of {plural(len(s.ranks), 'rank')} -> "
        f"{what} in {s.out} ({plural(s.files, 'file')}) in {s.seconds:.2f} s"
    )
    return EXIT_OK


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="write a run's statistics store as msprobe CSV or every tensor's TensorBoard scalars",
        description="Write the statistics store of RUN (every statistic of every tensor and step) as the "
        "files format: csv or tensorboard_tensors: all would have written: OUT/rank_<r>/<kind>.csv "
        "(msprobe's columns) or OUT/rank_<r>/events.out.tfevents.* (a tag per tensor and statistic). "
        "Streams: one segment of the store in memory at a time.",
    )
    p.add_argument("run", metavar="RUN", help="the run folder")
    p.add_argument("--format", required=True, choices=("csv", "tensorboard"), help="what to write")
    p.add_argument(
        "-o",
        "--out",
        default=None,
        metavar="OUT",
        help="output folder (default: RUN-csv or RUN-tensorboard, beside RUN: never inside the run, where "
        "tensorboard --logdir RUN would load every tensor's scalars)",
    )
    p.add_argument("--ranks", type=_ranks, default=None, metavar="R,...", help="only these ranks (0,3,5-7)")
    p.add_argument(
        "--steps", type=step_range, default=None, metavar="A:B", help="only steps A..B (inclusive; A: or :B)"
    )
    p.add_argument(
        "--names",
        nargs="+",
        default=None,
        metavar="PATTERN",
        help="only the tensors a pattern names: a name or kind/name, exact, a glob (layers.0.*, "
        "grad_reduced/*) or re:REGEX",
    )
    p.add_argument(
        "--ops", type=_ops, default=None, metavar="S,...", help="statistics to write (default: the run's ops)"
    )
    p.add_argument(
        "--ndigits",
        type=int,
        default=None,
        metavar="N",
        help="CSV floats rounded to N places (default: the run's ndigits)",
    )
    p.add_argument("--force", action="store_true", help="replace the files of this format already in OUT")
    p.set_defaults(func=_export)
