"""``trainmon analyze RUN``: the first anomaly of a run across ranks, and the K earliest.

Streams every ``RUN/plugins/trainmon/anomalies/rank_*.jsonl`` one line at a time and keeps only a bounded
heap of the K earliest anomalies by :meth:`trainmon.records.Anomaly.order_key`, so runs with thousands of
ranks need memory for K anomalies, not for the run.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from trainmon.anomaly.jsonl import SUPPRESSED_RULE, anomalies_dir, anomaly_to_dict, iter_anomalies
from trainmon.anomaly.rules import RULES
from trainmon.anomaly.sink import LOSS_SCALE_RULE, SKIPPED_RULE
from trainmon.cli.argtypes import positive_int
from trainmon.records import Anomaly

EXIT_OK = 0
EXIT_ERROR = 2

DEFAULT_TOP = 8
# Show a progress counter on stderr when reading more files than this.
PROGRESS_MIN_FILES = 64

_COUNT_STATS = ("nans", "infs")
_RANK_FILE = re.compile(r"^rank_(\d+)\.jsonl$")

# The rule names anomaly records carry: the nan rule records "nan" and "inf"; the monitor adds the last two.
RECORDED_RULES = ("nan", "inf", *(r for r in RULES if r != "nan"), LOSS_SCALE_RULE, SKIPPED_RULE)


def rule_list(text: str) -> frozenset[str]:
    """``--rule nan,inf``: known rule names only, so a misspelt rule is an error rather than no anomalies."""
    rules = [r.strip() for r in text.split(",") if r.strip()]
    unknown = [r for r in rules if r not in RECORDED_RULES]
    if unknown or not rules:
        what = f"unknown rule {', '.join(map(repr, unknown))}" if unknown else "no rule given"
        raise argparse.ArgumentTypeError(f"{what}; rules: {', '.join(RECORDED_RULES)}")
    return frozenset(rules)


def plural(n: int, noun: str, nouns: str | None = None) -> str:
    """``1 rank file``, ``2 rank files``."""
    return f"{n} {noun if n == 1 else nouns or noun + 's'}"


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


def rank_files(directory: Path) -> list[tuple[int, Path]]:
    """The ``rank_<r>.jsonl`` files of an anomalies directory, by rank."""
    found = []
    for p in directory.iterdir():
        m = _RANK_FILE.match(p.name)
        if m and p.is_file():
            found.append((int(m.group(1)), p))
    found.sort()
    return found


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


def _fmt_value(x: float | None, stat: str = "") -> str:
    if x is None:
        return "-"
    if stat in _COUNT_STATS and math.isfinite(x) and x == int(x):
        return str(int(x))  # an element count: 12345678, not 1.23457e+07
    return f"{x:.6g}"


def _flags(a: Anomaly) -> str:
    return ",".join(f for f, on in (("origin", a.origin), ("propagated", a.propagated)) if on) or "-"


def _print_first(a: Anomaly, out: TextIO) -> None:
    origin = "yes (first module to go non-finite with clean inputs)" if a.origin else "no"
    if a.propagated:
        origin += ", propagated"
    lines = [
        ("step", str(a.step)),
        ("rank", str(a.rank)),
        ("kind", a.kind),
        ("name", a.name),
        ("stat", a.stat),
        ("value", _fmt_value(a.value, a.stat)),
        ("rule", a.rule),
        ("phase", a.phase),
        ("micro-step", str(a.micro_step)),
        ("pp stage", f"{a.pp_stage} (vpp {a.vpp_stage})"),
        ("collectives", str(a.collectives)),
        ("origin", origin),
    ]
    if a.baseline is not None:
        lines.insert(6, ("baseline", _fmt_value(a.baseline)))
    if a.message:
        lines.append(("message", a.message))
    if a.dump:
        lines.append(("dump", a.dump))
    print("FIRST ANOMALY", file=out)
    value = _fmt_value(a.value, a.stat)
    print(f"  step {a.step}, rank {a.rank}: {a.kind} {a.name} {a.stat} = {value} [{a.rule}]", file=out)
    width = max(len(k) for k, _ in lines)
    for k, v in lines:
        print(f"    {k:<{width}}  {v}", file=out)


_COLUMNS = (
    "#",
    "step",
    "rank",
    "kind",
    "name",
    "stat",
    "value",
    "rule",
    "phase",
    "mb",
    "pp",
    "coll",
    "seq",
    "flags",
)


def _print_table(top: list[Anomaly], out: TextIO) -> None:
    rows = [
        (
            str(i),
            str(a.step),
            str(a.rank),
            a.kind,
            a.name,
            a.stat,
            _fmt_value(a.value, a.stat),
            a.rule,
            a.phase,
            str(a.micro_step),
            str(a.pp_stage),
            str(a.collectives),
            str(a.seq),
            _flags(a),
        )
        for i, a in enumerate(top, start=1)
    ]
    widths = [max(len(c), *(len(r[j]) for r in rows)) for j, c in enumerate(_COLUMNS)]
    numeric = {0, 1, 2, 6, 9, 10, 11, 12}

    def line(cells: tuple[str, ...]) -> str:
        return "  ".join(
            c.rjust(w) if j in numeric else c.ljust(w)
            for j, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    print(line(_COLUMNS), file=out)
    for r in rows:
        print(line(r), file=out)


def _run(args: argparse.Namespace) -> int:
    try:
        return _analyze(args)
    except BrokenPipeError:  # `trainmon analyze RUN | head`: the reader has all it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return EXIT_OK


def _analyze(args: argparse.Namespace) -> int:
    run = Path(args.run)
    if not run.is_dir():
        print(f"error: run directory {run} does not exist", file=sys.stderr)
        return EXIT_ERROR
    directory = anomalies_dir(run)
    if not directory.is_dir():
        print(f"error: {run} has no anomalies directory (looked for {directory})", file=sys.stderr)
        return EXIT_ERROR

    if args.explain:  # what the run's files say about its first NaN/Inf (issue 16: trainmon/explain.py)
        from trainmon.explain import run_explain

        return run_explain(run, as_json=args.json, out=sys.stdout)
    summary = scan(directory, top=args.top, step=args.step, progress=sys.stderr, rules=args.rule)
    top = summary.top[: args.top]
    where = f"{run}" if args.step is None else f"{run} at step {args.step}"

    if args.json:
        doc: dict[str, Any] = {
            "first": anomaly_to_dict(summary.first) if summary.first else None,
            "top": [anomaly_to_dict(a) for a in top],
            "ranks": summary.ranks,
            "anomalies": summary.anomalies,
            "suppressed": summary.suppressed,
        }
        json.dump(doc, sys.stdout, indent=2, allow_nan=False)
        print()
        if summary.first is None:
            print(f"no anomalies recorded in {where}", file=sys.stderr)
        return EXIT_OK

    out = sys.stdout
    if summary.first is None:
        print(f"no anomalies recorded in {where}", file=out)
        return EXIT_OK
    suppressed = f", {summary.suppressed} more dropped by the per-step cap" if summary.suppressed else ""
    found = f"{plural(summary.anomalies, 'anomaly', 'anomalies')} on {plural(summary.ranks, 'rank file')}"
    print(f"{where}: {found}{suppressed}", file=out)
    print(file=out)
    _print_first(summary.first, out)
    print(file=out)
    print(f"EARLIEST {len(top)} (step, collectives, phase, micro-step, pp stage, seq, rank)", file=out)
    _print_table(top, out)
    return EXIT_OK


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "analyze",
        help="show the first anomaly of a run across ranks and the earliest ones",
        description="Read RUN/plugins/trainmon/anomalies/rank_*.jsonl and show the first anomaly of the run "
        "across ranks (by step, collectives issued, phase, micro-step, pipeline stage, seq, rank) and a "
        "table of the K earliest.",
    )
    parser.add_argument("run", metavar="RUN", help="the run directory (the logdir given to attach)")
    parser.add_argument(
        "--top",
        type=positive_int,
        default=DEFAULT_TOP,
        metavar="K",
        help=f"how many of the earliest anomalies to list (default {DEFAULT_TOP})",
    )
    parser.add_argument("--step", type=int, default=None, metavar="S", help="only anomalies of step S")
    parser.add_argument(
        "--rule",
        type=rule_list,
        metavar="R[,R...]",
        default=None,
        help="only anomalies of these rules, e.g. nan,inf: where non-finite values started; "
        f"rules: {', '.join(RECORDED_RULES)}",
    )
    parser.add_argument(
        "--explain",
        action="store_true",
        help="explain the first NaN/Inf: its origin module's inputs at that step (finite? near the dtype's "
        "max?), loss-scale and learning-rate changes, skipped steps, and the dump files to open",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of text")
    parser.set_defaults(func=_run)
