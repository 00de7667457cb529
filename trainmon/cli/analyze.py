"""``trainmon analyze RUN``: the first anomaly of a run across ranks, and the K earliest (the reading is
:mod:`trainmon.read.scan`; ``--explain``: :mod:`trainmon.read.explain`)."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, TextIO

from trainmon.cli.argtypes import non_negative_int, positive_int
from trainmon.cli.damaged import warn_damaged
from trainmon.cli.words import plural
from trainmon.read.scan import DEFAULT_TOP, Summary, scan
from trainmon.run.anomalies import anomaly_to_dict
from trainmon.run.damage import damaged
from trainmon.run.dumps import list_dumps
from trainmon.run.layout import anomalies_dir, summary_dir
from trainmon.run.records import NON_FINITE_RULES, RECORDED_RULES, STRAGGLER_RULE, Anomaly
from trainmon.run.summary import summary_key

EXIT_OK = 0
EXIT_ERROR = 2

_COUNT_STATS = ("nans", "infs")


def rule_list(text: str) -> frozenset[str]:
    """``--rule nan,inf``: known rule names only, so a misspelt rule is an error rather than no anomalies."""
    rules = [r.strip() for r in text.split(",") if r.strip()]
    unknown = [r for r in rules if r not in RECORDED_RULES]
    if unknown or not rules:
        what = f"unknown rule {', '.join(map(repr, unknown))}" if unknown else "no rule given"
        raise argparse.ArgumentTypeError(f"{what}; rules: {', '.join(RECORDED_RULES)}")
    return frozenset(rules)


def _fmt_value(x: float | None, stat: str = "") -> str:
    if x is None:
        return "-"
    if stat in _COUNT_STATS and math.isfinite(x) and x == int(x):
        return str(int(x))  # an element count: 12345678, not 1.23457e+07
    return f"{x:.6g}"


def _flags(a: Anomaly) -> str:
    return ",".join(f for f, on in (("origin", a.origin), ("propagated", a.propagated)) if on) or "-"


def _dump_lines(run: Path, a: Anomaly) -> list[tuple[str, str]]:
    """The anomaly's dump and where it is: at its step, or at a later one, and then why and how to get one
    at the step."""
    if not a.dump.startswith("request:"):
        return [("dump", a.dump)]
    request = a.dump.split(":", 1)[1]
    made = [e for e in list_dumps(run) if e.reason.split()[:2] == ["request", request]]
    own = [e for e in made if (e.rank, e.kind, e.name) == (a.rank, a.kind, a.name)] or made
    if not own:
        return [("dump", f"{a.dump}: not written (yet): no dump of that request in the run's index")]
    e = min(own, key=lambda e: e.step)
    if e.step == a.step:
        return [("dump", f"{a.dump}: {run / e.path}")]
    return [
        ("dump", f"{a.dump}: at step {e.step} only, {e.step - a.step} after: {run / e.path}"),
        ("", "a dump request is served at the next collected step once the job has read it; with "
             f"alert.capture: exact the monitor dumps at step {a.step} itself"),
    ]  # fmt: skip


def _print_first(a: Anomaly, out: TextIO, run: Path) -> None:
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
        lines.extend(_dump_lines(run, a))
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
    if not directory.is_dir() and not summary_dir(run).is_dir():
        print(f"error: {run} has no anomalies directory (looked for {directory})", file=sys.stderr)
        return EXIT_ERROR

    if args.explain:  # what the run's files say about its first NaN/Inf (trainmon/read/explain.py)
        from trainmon.read.explain import run_explain

        if args.top is not None:
            print("error: --top lists the K earliest anomalies; --explain explains one: give one of them",
                  file=sys.stderr)  # fmt: skip
            return EXIT_ERROR
        rules = NON_FINITE_RULES if args.rule is None else args.rule & NON_FINITE_RULES
        if not rules:
            print(f"error: --explain explains a NaN/Inf anomaly; --rule {','.join(sorted(args.rule))} names "
                  f"neither {' nor '.join(sorted(NON_FINITE_RULES))}", file=sys.stderr)  # fmt: skip
            return EXIT_ERROR
        if args.rule is not None and args.rule - rules:
            print(f"error: --explain explains a NaN/Inf anomaly; give --rule {','.join(sorted(rules))} "
                  f"without {','.join(sorted(args.rule - rules))}", file=sys.stderr)  # fmt: skip
            return EXIT_ERROR
        code = run_explain(
            run, as_json=args.json, out=sys.stdout, step=args.step, rules=rules, rank=args.rank
        )
        sys.stdout.flush()
        warn_damaged(run)
        return code
    top_k = DEFAULT_TOP if args.top is None else args.top
    if args.rule == {STRAGGLER_RULE}:  # which ranks held the job back, the worst first, and why
        return _print_stragglers(run, args, top_k)
    ranks = None if args.rank is None else {args.rank}
    summary = scan(run, top=top_k, step=args.step, progress=sys.stderr, rules=args.rule, ranks=ranks)
    left_out: dict[str, int] = {}
    if args.rule is None and summary.counts.get(STRAGGLER_RULE):
        # about the statistics by default: straggler episodes (per-rank time) have their own view, --rule
        # straggler (the summaries alone answer when there are none)
        left_out = {STRAGGLER_RULE: summary.counts[STRAGGLER_RULE]}
        numerics = frozenset(RECORDED_RULES) - {STRAGGLER_RULE}
        summary = scan(run, top=top_k, step=args.step, progress=sys.stderr, rules=numerics, ranks=ranks)
    top = summary.top[:top_k]
    where = f"{run}" if args.step is None else f"{run} at step {args.step}"
    where += "" if args.rank is None else f" on rank {args.rank}"
    try:
        return _answer(args, summary, top, where, left_out, _first_non_finite(run, args, summary))
    finally:
        sys.stdout.flush()
        warn_damaged(run)


def _first_non_finite(run: Path, args: argparse.Namespace, summary: Summary) -> Anomaly | None:
    """Where the run's first NaN/Inf started, when another rule fired first (a loss spike before the NaN): a
    NaN is what a user must not miss, whatever came before it. None when the first anomaly is the NaN. The
    ranks' summaries hold each rule's earliest record, so only an answer for one step reads records."""
    first = summary.first
    if first is None or first.rule in NON_FINITE_RULES:
        return None
    rules = NON_FINITE_RULES if args.rule is None else args.rule & NON_FINITE_RULES
    if not rules:
        return None
    if args.step is None:
        found = [summary.firsts[r] for r in rules if r in summary.firsts]
        return min(found, key=summary_key) if found else None
    ranks = None if args.rank is None else {args.rank}
    return scan(run, top=1, step=args.step, rules=frozenset(rules), ranks=ranks).first


def _answer(
    args: argparse.Namespace,
    summary: Summary,
    top: list[Anomaly],
    where: str,
    left_out: dict[str, int],
    non_finite: Anomaly | None = None,
) -> int:
    """``left_out``: records of rules the answer leaves out unasked (rule -> records); ``non_finite``: the
    first NaN/Inf when it is not the first anomaly."""
    if args.json:
        first = summary.first
        if non_finite is None and first is not None and first.rule in NON_FINITE_RULES:
            non_finite = first
        doc: dict[str, Any] = {
            "first": anomaly_to_dict(first) if first else None,
            "first_non_finite": anomaly_to_dict(non_finite) if non_finite else None,
            "top": [anomaly_to_dict(a) for a in top],
            "ranks": summary.ranks,
            "anomalies": summary.anomalies,
            "suppressed": summary.suppressed,
            "left_out": left_out,
            "damaged": [{"path": str(d.path), "why": d.why} for d in damaged(args.run)],
        }
        json.dump(doc, sys.stdout, indent=2, allow_nan=False)
        print()
        if summary.first is None:
            print(f"no anomalies recorded in {where}", file=sys.stderr)
        return EXIT_OK

    out = sys.stdout
    episodes = left_out.get(STRAGGLER_RULE, 0)
    stragglers = (f"and {plural(episodes, 'straggler episode')} (slow ranks): trainmon analyze {args.run} "
                  "--rule straggler") if episodes else ""  # fmt: skip
    if summary.first is None:
        print(f"no anomalies of the statistics recorded in {where}, {stragglers}" if episodes
              else f"no anomalies recorded in {where}", file=out)  # fmt: skip
        return EXIT_OK
    suppressed = f", {summary.suppressed} more dropped by the per-step cap" if summary.suppressed else ""
    found = f"{plural(summary.anomalies, 'anomaly', 'anomalies')} on {plural(summary.ranks, 'rank')}"
    print(f"{where}: {found}{suppressed}", file=out)
    print(file=out)
    _print_first(summary.first, out, Path(args.run))
    print(file=out)
    if non_finite is not None:
        _print_non_finite(non_finite, summary.first, out, args.run)
        print(file=out)
    print(f"EARLIEST {len(top)} (step, collectives, phase, micro-step, pp stage, seq, rank)", file=out)
    _print_table(top, out)
    if stragglers:
        print(file=out)
        print(stragglers, file=out)
    return EXIT_OK


def _print_non_finite(a: Anomaly, first: Anomaly, out: TextIO, run: str) -> None:
    what = "NaN" if a.rule == "nan" else "Inf"
    flags = " (origin)" if a.origin else " (propagated)" if a.propagated else ""
    after = f"after the first anomaly above: {first.rule}, step {first.step}"
    print(f"WHERE THE {what} STARTED ({after})", file=out)
    value = _fmt_value(a.value, a.stat)
    where = f"step {a.step}, rank {a.rank}, {a.phase}"
    print(f"  {where}: {a.kind} {a.name} {a.stat} = {value} [{a.rule}]{flags}", file=out)
    print(f"  explain it: trainmon analyze {run} --explain   (every NaN/Inf: --rule nan,inf)", file=out)


_TIME_PARTS = ("data", "forward", "backward", "optimizer", "comm", "wait", "gc", "monitor", "other")


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None or not math.isfinite(seconds) else f"{seconds * 1e3:.1f}"


def _print_stragglers(run: Path, args: argparse.Namespace, top_k: int) -> int:
    from trainmon.read.stragglers import stragglers

    episodes = [
        e
        for e in stragglers(run)
        if (args.step is None or e.record.step == args.step)
        and (args.rank is None or e.record.rank == args.rank)
    ]
    shown = episodes[:top_k]
    if args.json:
        doc = {"episodes": len(episodes), "ranks": len({e.record.rank for e in episodes}),
               "stragglers": [e.to_dict() for e in shown]}  # fmt: skip
        json.dump(doc, sys.stdout, indent=2, allow_nan=False)
        print()
        return EXIT_OK
    out = sys.stdout
    if not episodes:
        print(f"no straggler recorded in {run}", file=out)
        return EXIT_OK
    ranks = len({e.record.rank for e in episodes})
    print(f"{run}: {plural(len(episodes), 'straggler episode')} on {plural(ranks, 'rank')}", file=out)
    print(file=out)
    print(f"SLOWEST {len(shown)} (the most time over the ranks' median first; ms a step; steps: the "
          "episode from its first slow step to its last, named by the rule at the step it first held)",
          file=out)  # fmt: skip
    head = ("#", "rank", "part", "steps", "length", "named at", "its time", "median", "+", "x")
    rows = [
        (str(i), str(e.record.rank), e.record.name, f"{e.span[0]}-{e.span[1]}" if e.span else "-",
         str(e.length) if e.length else "-", str(e.record.step), _ms(e.record.value), _ms(e.record.baseline),
         _ms(e.excess), f"{e.factor:.1f}" if math.isfinite(e.factor) else "-")
        for i, e in enumerate(shown, start=1)
    ]  # fmt: skip
    widths = [max(len(h), *(len(r[j]) for r in rows)) for j, h in enumerate(head)]

    def line(cells: tuple[str, ...]) -> str:
        return "  ".join(
            c.ljust(w) if j == 2 else c.rjust(w) for j, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    print(line(head), file=out)
    for r in rows:
        print(line(r), file=out)
    print(file=out)
    print("WHAT THEIR TIME WENT TO (ms a step: the rank's mean over the episode's steps)", file=out)
    for i, e in enumerate(shown, start=1):
        if not e.times:
            print(f"  {i}. rank {e.record.rank}: no timing table", file=out)
            continue
        parts = ", ".join(f"{p} {_ms(e.times.get(p))}" for p in _TIME_PARTS if e.times.get(p, 0.0) >= 5e-5)
        at = f"steps {e.steps[0]}-{e.steps[1]}" if e.steps else ""
        print(f"  {i}. rank {e.record.rank} ({at}): step {_ms(e.times.get('step'))} = {parts}", file=out)
    return EXIT_OK


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "analyze",
        help="show the first anomaly of a run across ranks and the earliest ones",
        description="Read the ranks' summaries (RUN/plugins/trainmon/summary/rank_*.json; the anomaly "
        "records only where those are not enough) and show the first anomaly of the run across ranks (by "
        "step, collectives issued, phase, micro-step, pipeline stage, seq, rank) and a table of the K "
        "earliest.",
    )
    parser.add_argument("run", metavar="RUN", help="the run directory (the logdir given to attach)")
    parser.add_argument(
        "--top",
        type=positive_int,
        default=None,
        metavar="K",
        help=f"how many of the earliest anomalies to list (default {DEFAULT_TOP})",
    )
    parser.add_argument("--step", type=int, default=None, metavar="S", help="only anomalies of step S")
    parser.add_argument(
        "--rank",
        type=non_negative_int,
        default=None,
        metavar="R",
        help="only anomalies of rank R (with --explain: rank R's first NaN/Inf, and where it came from)",
    )
    parser.add_argument(
        "--rule",
        type=rule_list,
        metavar="R[,R...]",
        default=None,
        help="only anomalies of these rules, e.g. nan,inf: where non-finite values started; straggler alone: "
        "the ranks that held the job back, the slowest first, and what their time went to; "
        f"rules: {', '.join(RECORDED_RULES)}",
    )
    parser.add_argument(
        "--explain",
        action="store_true",
        help="explain the first NaN/Inf (of step S with --step, of rule nan or inf with --rule): its origin "
        "module's inputs at that step (finite? near the dtype's max?), loss-scale and learning-rate changes, "
        "skipped steps, and the dump files to open",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of text")
    parser.set_defaults(func=_run)
