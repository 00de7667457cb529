"""``trainmon compare RUN_A RUN_B``: where two runs part ways, and why.

Two sources (``--source``): the statistics store (``stats``: every recorded tensor, in the order things
happened in a step; :mod:`trainmon.cli.compare_stats`) and the ``grad_probe`` fingerprints (``gradprobe``:
weight gradients only; :mod:`trainmon.cli.compare_probe`). ``auto`` (the default) takes the statistics when
both runs' statistics stores hold rows, else the fingerprints when both have them. Exit status: 0 no
divergence, 1 divergence, 2 error.
"""

from __future__ import annotations

import argparse

from trainmon.cli.argtypes import non_negative_int
from trainmon.cli.compare_exit import error
from trainmon.read.requests import not_a_run

SOURCES = ("auto", "stats", "gradprobe")


def _unit(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number between 0 and 1, got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number between 0 and 1, got {text!r}")
    return value


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _steps(text: str) -> tuple[int | None, int | None]:
    """``LO:HI``, ``LO:`` or ``:HI`` (both ends included)."""
    lo, sep, hi = text.partition(":")
    try:
        if not sep:
            raise ValueError
        out = (int(lo) if lo.strip() else None, int(hi) if hi.strip() else None)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO:HI (e.g. 0:999, 500:, :99), got {text!r}") from None
    if any(x is not None and x < 0 for x in out) or (None not in out and out[1] < out[0]):  # type: ignore[operator]
        raise argparse.ArgumentTypeError(f"expected 0 <= LO <= HI, got {text!r}")
    return out


def _pick(args: argparse.Namespace) -> tuple[str, tuple | None] | int:
    """The source ``auto`` means for these runs, with the runs opened for it (or the exit status of an
    error): the statistics when both stores hold rows (a store's folder may exist and hold none: a job that
    recorded only fingerprints), else the fingerprints when both runs have them."""
    from trainmon.gradprobe.reader import ranks as probe_ranks
    from trainmon.read.compare.source import CompareError, open_run

    for run in (args.run_a, args.run_b):
        problem = not_a_run(run)
        if problem is not None:
            return error(problem)
    try:
        opened = (open_run(args.run_a), open_run(args.run_b))
        if all(run.ranks for run in opened):
            return "stats", opened
    except CompareError:
        pass
    if probe_ranks(args.run_a) and probe_ranks(args.run_b):
        return "gradprobe", None
    return "stats", None  # whose error says what is missing


def _run(args: argparse.Namespace) -> int:
    found = (args.source, None) if args.source != "auto" else _pick(args)
    if isinstance(found, int):
        return found
    source, opened = found
    if source == "gradprobe":
        from trainmon.cli import compare_probe

        return compare_probe.run(args)
    from trainmon.cli import compare_stats

    return compare_stats.run(args, opened)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "compare",
        help="where two runs part ways: the first divergent tensor, its step and why",
        description=(
            "Compare two runs tensor by tensor in the order things happened in each step, and name the first "
            "tensor whose statistics differ beyond tolerance: its step, rank, phase and what it means "
            "(forward, backward, weight gradient, reduction, update, data). Exit status 0: no divergence, "
            "1: divergence, 2: error."
        ),
    )
    p.add_argument("run_a", metavar="RUN_A", help="run directory of the reference run")
    p.add_argument("run_b", metavar="RUN_B", help="run directory of the run to check")
    p.add_argument(
        "--source",
        choices=SOURCES,
        default="auto",
        help="what to compare: the statistics store (stats), the grad_probe fingerprints (gradprobe); auto: "
        "stats when both runs' statistics stores hold rows, else gradprobe when both have fingerprints",
    )
    p.add_argument("--rank", type=non_negative_int, help="this rank only (default: every common rank)")
    p.add_argument(
        "--map",
        metavar="MAPPING",
        help="JSON/YAML file of names that denote the same tensor or module in both runs (msprobe's mapping "
        "files are read too)",
    )
    p.add_argument("--out", metavar="DIR", help="report directory (default: ./compare-<A>-vs-<B>)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    stats = p.add_argument_group("statistics (--source stats)")
    stats.add_argument("--steps", type=_steps, metavar="LO:HI", help="compare these steps only")
    stats.add_argument(
        "--first", action="store_true", help="stop after the step range holding the first divergence"
    )
    stats.add_argument("--tolerance", metavar="FILE", help="tolerance settings (JSON/YAML; docs/compare.md)")
    stats.add_argument(
        "--rtol-scale", type=_positive, default=1.0, metavar="X", help="multiply the default tolerances by X"
    )
    stats.add_argument(
        "--layout",
        choices=("ranks", "whole"),
        default=None,
        help="ranks: each rank with the same rank; whole: the whole-tensor statistics (parameters, gradients "
        "after reduction, moments) whatever rank holds them, for runs of different parallel layouts "
        "(default: whole when the world sizes differ)",
    )
    stats.add_argument(
        "--request-dumps",
        action="store_true",
        help="ask both runs for dumps of the first divergent tensor and its module at that step",
    )
    stats.add_argument("--no-report", action="store_true", help="write no report directory")
    probe = p.add_argument_group("fingerprints (--source gradprobe)")
    probe.add_argument("--threshold", type=_unit, default=0.97, help="similarity floor at first (0.97)")
    probe.add_argument("--drop", type=_unit, default=0.03, help="largest drop between steps (0.03)")
    probe.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.set_defaults(func=_run)
