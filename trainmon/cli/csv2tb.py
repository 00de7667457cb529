"""``trainmon csv2tb INPUT... [-o OUT]``: trainmon or msprobe CSV into TensorBoard event files, one TB run
per rank (``OUT/rank_<r>/``); ``trainmon tb2csv INPUT [-o OUT]``: the reverse. See ``docs/csv2tb.md``."""

from __future__ import annotations

import argparse
import os
import sys

from trainmon.cli.argtypes import positive_int
from trainmon.cli.words import plural
from trainmon.csvtb.convert import ConvertError, convert
from trainmon.csvtb.tb2csv import EventFileError, tb2csv
from trainmon.read.csv import CsvError

EXIT_OK = 0
EXIT_ERROR = 2


def _names(text: str) -> set[str]:
    names = {t.strip() for t in text.split(",") if t.strip()}
    if not names:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
    return names


def _ranks(text: str) -> set[int]:
    try:
        ranks = {int(t) for t in _names(text)}
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated ranks such as 0,1,7, got {text!r}"
        ) from None
    if any(r < 0 for r in ranks):
        raise argparse.ArgumentTypeError(f"ranks are >= 0, got {text!r}")
    return ranks


def step_range(text: str) -> tuple[int | None, int | None]:
    """``A:B`` (inclusive), ``A:`` or ``:B``."""
    lo, sep, hi = text.partition(":")
    try:
        bounds = (int(lo) if lo.strip() else None, int(hi) if hi.strip() else None)
    except ValueError:
        bounds = None
    if not sep or bounds is None or any(b is not None and b < 0 for b in bounds):
        raise argparse.ArgumentTypeError(f"expected steps as A:B, A: or :B with integers >= 0, got {text!r}")
    if bounds[0] is not None and bounds[1] is not None and bounds[0] > bounds[1]:
        raise argparse.ArgumentTypeError(f"empty step range {text!r} (A > B)")
    return bounds


def _error(cmd: str, msg: object) -> int:
    print(f"trainmon {cmd}: error: {msg}", file=sys.stderr)
    return EXIT_ERROR


def _csv2tb(args: argparse.Namespace) -> int:
    progress = sys.stderr if (args.progress or (args.progress is None and sys.stderr.isatty())) else None
    try:
        s = convert(
            args.inputs,
            args.out,
            kinds=args.kinds,
            ranks=args.ranks,
            steps=args.steps,
            workers=args.workers,
            skip_bad=args.skip_bad,
            force=args.force,
            progress=progress,
        )
    except (CsvError, ConvertError, OSError) as e:
        return _error("csv2tb", e)
    for note in s.notes:
        print(f"trainmon csv2tb: note: {note}", file=sys.stderr)
    if s.skipped:
        print(f"trainmon csv2tb: {s.skipped} bad rows skipped", file=sys.stderr)
    print(
        f"{plural(s.rows, 'row')} ({plural(s.scalars, 'scalar')}, {plural(s.steps, 'rank-step')}) from "
        f"{plural(s.files, 'file')} of {plural(len(s.ranks), 'rank')} -> {s.out} in {s.seconds:.2f} s"
        + (f"; {s.duplicates} values replaced by later rows" if s.duplicates else "")
    )
    return EXIT_OK


def _tb2csv(args: argparse.Namespace) -> int:
    try:
        s = tb2csv(args.input, args.out, kinds=args.kinds, force=args.force)
    except (ValueError, EventFileError, OSError) as e:
        return _error("tb2csv", e)
    for note in s.notes:
        print(f"trainmon tb2csv: note: {note}", file=sys.stderr)
    print(f"{s.rows} rows in {len(s.files)} CSV files from {s.runs} runs -> {s.out}")
    return EXIT_OK


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "csv2tb",
        help="convert trainmon/msprobe CSV into TensorBoard event files (one run per rank)",
        description="Convert the CSV of a trainmon run (RUN/rank_<r>/<kind>.csv) or msprobe monitor output "
        "(<time>-rank<R>-<id>/<kind>_<a>-<b>.csv) into TensorBoard event files, OUT/rank_<r>/. All INPUTs "
        "are one job: files of one rank become one TensorBoard run.",
    )
    p.add_argument(
        "inputs", nargs="+", metavar="INPUT", help="run/output directory, rank directory or CSV file"
    )
    p.add_argument(
        "-o",
        "--out",
        default=None,
        metavar="OUT",
        help="output directory (default: INPUT-csv2tb, beside INPUT: never inside the run it converts)",
    )
    p.add_argument(
        "--kinds", type=_names, default=None, metavar="K,...", help="only these kinds (file prefixes)"
    )
    p.add_argument(
        "--steps", type=step_range, default=None, metavar="A:B", help="only steps A..B (inclusive)"
    )
    p.add_argument("--ranks", type=_ranks, default=None, metavar="R,...", help="only these ranks")
    p.add_argument(
        "--workers",
        type=positive_int,
        default=None,
        metavar="N",
        help=f"worker processes (default: min(cores={os.cpu_count()}, files))",
    )
    p.add_argument(
        "--skip-bad", action="store_true", help="skip malformed rows (and count them) instead of stopping"
    )
    p.add_argument("--force", action="store_true", help="replace event files already in OUT/rank_<r>/")
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: when stderr is a terminal)",
    )
    p.set_defaults(func=_csv2tb)

    q = sub.add_parser(
        "tb2csv",
        help="convert TensorBoard event files back into msprobe-style CSV",
        description="Write the scalars of every TensorBoard run under INPUT as OUT/<run>/<kind>.csv "
        "with columns vpp_stage,name,step,micro_step,<stats>,shape,dtype (shape and dtype left empty).",
    )
    q.add_argument("input", metavar="INPUT", help="directory holding event files (searched recursively)")
    q.add_argument(
        "-o",
        "--out",
        default=None,
        metavar="OUT",
        help="output directory (default: INPUT-tb2csv, beside INPUT: never inside the run it converts)",
    )
    q.add_argument("--kinds", type=_names, default=None, metavar="K,...", help="only these kinds")
    q.add_argument("--force", action="store_true", help="replace CSV files that exist")
    q.set_defaults(func=_tb2csv)
