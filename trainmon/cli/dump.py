"""``trainmon dump``: request tensor dumps from a running job, list a run's dumps, show one dump.

* ``trainmon dump request RUN --name GLOB [--step S|next] [--rank R] [--kind K]`` appends a request to
  ``RUN/plugins/trainmon/requests.jsonl`` and prints its id.
* ``trainmon dump ls RUN [--step S] [--json]`` lists the dumps of a run.
* ``trainmon dump show FILE [--bins N]`` prints a dump's metadata, statistics and a text histogram.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any

import numpy as np

from trainmon.cli.argtypes import name_glob, non_negative_int, positive_int, step_or_next
from trainmon.cli.damaged import warn_damaged
from trainmon.cli.words import plural
from trainmon.read.requests import not_a_run, unserved
from trainmon.read.runstate import run_state
from trainmon.run.dumps import DumpError, DumpRequest, append_request, list_dumps
from trainmon.run.records import STATS, Kind

EXIT_OK = 0
EXIT_ERROR = 2

DEFAULT_BINS = 20
BAR_WIDTH = 40
_KINDS = tuple(k.value for k in Kind)


def _kind(text: str) -> str:
    if text not in _KINDS:
        raise argparse.ArgumentTypeError(f"unknown kind {text!r}; allowed: {', '.join(_KINDS)}")
    return text


def _error(msg: str) -> int:
    print(f"trainmon dump: error: {msg}", file=sys.stderr)
    return EXIT_ERROR


def _request(args: argparse.Namespace) -> int:
    if (problem := not_a_run(args.run)) is not None:  # a request there would be read by no job
        return _error(problem)
    req = DumpRequest.new(args.name, step=args.step, rank=args.rank, kind=args.kind)
    try:
        append_request(args.run, req)
    except OSError as e:
        return _error(f"cannot write the request to {args.run}: {e}")
    warnings = _request_warnings(args.run, args.step) + unserved(args.run, args.name, args.rank, args.kind)
    for line in warnings:
        print(f"trainmon dump: warning: {line}", file=sys.stderr)
    print(req.id)
    return EXIT_OK


def _request_warnings(run: str, step: int | None) -> list[str]:
    """What will happen to a request nobody is going to serve: the run has ended, or its step has passed
    (a running job drops requests for steps behind it)."""
    state = run_state(run)
    at = "at its first collected step" if step is None else f"when it reaches step {step}"
    if state.closed is not None:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(state.closed))
        last = "" if state.last_step is None else f", last step {state.last_step}"
        return [
            f"the run in {run} has ended (its monitor closed at {when}{last}): no job reads its requests "
            f"now. The request is kept and is served only if a job attaches to {run} again (resumed "
            f"training), "
            f"{at}."
        ]
    if step is not None and state.last_step is not None and step <= state.last_step:
        return [
            f"step {step} has already passed in {run} (the latest step written is {state.last_step}): the "
            f"running job drops requests for steps behind it, so this one will not be served unless a job "
            f"attaches to {run} again and runs step {step} (resumed from an earlier checkpoint). "
            "Use --step next for the next collected step."
        ]
    return []


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    raise AssertionError  # unreachable


def _ls(args: argparse.Namespace) -> int:
    if (problem := not_a_run(args.run)) is not None:  # "no dumps" would be the wrong answer
        return _error(problem)
    entries = [e for e in list_dumps(args.run) if args.step is None or e.step == args.step]
    try:
        return _print_dumps(args, entries)
    finally:
        sys.stdout.flush()
        warn_damaged(args.run)


def _print_dumps(args: argparse.Namespace, entries: list) -> int:
    if args.json:
        print(json.dumps([e.to_dict() for e in entries], indent=2, ensure_ascii=False))
        return EXIT_OK
    if not entries:
        print(f"no dumps in {args.run}" + ("" if args.step is None else f" at step {args.step}"))
        return EXIT_OK
    header = ("step", "rank", "kind", "name", "micro", "shape", "dtype", "size", "reason", "path")
    rows = [
        (
            str(e.step),
            str(e.rank),
            e.kind,
            e.name,
            str(e.micro_step),
            "x".join(map(str, e.shape)) or "scalar",
            e.dtype,
            _size(e.bytes),
            e.reason,
            e.path,
        )
        for e in entries
    ]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    for r in (header, *rows):
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    return EXIT_OK


def _fmt(x: float) -> str:
    return f"{x:.6g}"


def _histogram(values: np.ndarray, bins: int) -> list[str]:
    counts, edges = np.histogram(values, bins=bins)
    top = int(counts.max()) if len(counts) else 0
    labels = [(_fmt(edges[i]), _fmt(edges[i + 1])) for i in range(bins)]
    lw = max(len(a) for a, _ in labels)
    rw = max(len(b) for _, b in labels)
    lines = []
    for i, c in enumerate(counts):
        n = 0 if c == 0 else max(1, round(c / top * BAR_WIDTH))
        close = "]" if i == bins - 1 else ")"
        lo, hi = labels[i]
        lines.append(f"  [{lo.rjust(lw)}, {hi.rjust(rw)}{close} {('#' * n).ljust(BAR_WIDTH)} {int(c)}")
    return lines


def _show(args: argparse.Namespace) -> int:
    from trainmon.read.dump_contents import read_dump  # here: the other dump commands need no framework

    if not os.path.isfile(args.file):
        return _error(f"dump file not found: {args.file}")
    try:
        dump = read_dump(args.file)
    except DumpError as e:
        return _error(str(e))
    print(f"file: {args.file}")
    print("metadata:")
    kw = max((len(k) for k in dump.metadata), default=0)
    for k in sorted(dump.metadata):
        print(f"  {k.ljust(kw)}  {dump.metadata[k]}")
    print(f"tensor: {dump.dtype} {list(dump.shape)} ({plural(dump.numel, 'element')})")
    print("stats:")
    for k in STATS:
        v = dump.stats[k]
        text = str(int(v)) if k in ("nans", "infs") and math.isfinite(v) else _fmt(v)
        print(f"  {k.ljust(5)}  {text}")
    values = dump.finite_values
    if values.size == 0:
        print("histogram: no finite values")
        return EXIT_OK
    print(f"histogram of {values.size} finite values ({args.bins} bins):")
    for line in _histogram(values, args.bins):
        print(line.rstrip())
    return EXIT_OK


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "dump",
        help="request, list and show tensor dumps",
        description="Request tensor dumps from a running job (served when the monitor polls its requests), "
        "list the dumps of a run, and show one dump's metadata, statistics and histogram.",
    )
    sub = parser.add_subparsers(dest="dump_command", required=True, metavar="ACTION")

    p = sub.add_parser(
        "request",
        help="ask a running job to dump tensors; prints the request id",
        description="Append a dump request to RUN/plugins/trainmon/requests.jsonl.",
    )
    p.add_argument("run", metavar="RUN", help="the run directory (the logdir given to attach)")
    p.add_argument(
        "--name",
        required=True,
        type=name_glob,
        metavar="GLOB",
        help="tensor names to dump (glob, e.g. 'layers.3.*'; '*': every tensor)",
    )
    p.add_argument(
        "--step",
        type=step_or_next,
        default=None,
        metavar="S|next",
        help="step to dump at, or 'next' (default): the next collected step",
    )
    p.add_argument(
        "--rank", type=non_negative_int, default=None, metavar="R", help="only rank R (default: all)"
    )
    p.add_argument(
        "--kind",
        type=_kind,
        default=None,
        metavar="K",
        help=f"only tensors of this record kind (default: all); one of {', '.join(_KINDS)}",
    )
    p.set_defaults(func=_request)

    p = sub.add_parser("ls", help="list the dumps of a run", description="List the dumps of a run.")
    p.add_argument("run", metavar="RUN", help="the run directory")
    p.add_argument("--step", type=non_negative_int, default=None, metavar="S", help="only dumps of step S")
    p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    p.set_defaults(func=_ls)

    p = sub.add_parser(
        "show",
        help="show one dump: metadata, statistics, histogram",
        description="Show a dump file's metadata, statistics and a histogram of its finite values.",
    )
    p.add_argument("file", metavar="FILE", help="a .safetensors dump file")
    p.add_argument(
        "--bins",
        type=positive_int,
        default=DEFAULT_BINS,
        metavar="N",
        help=f"histogram bins (default {DEFAULT_BINS})",
    )
    p.set_defaults(func=_show)
