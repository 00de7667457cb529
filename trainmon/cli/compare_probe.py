"""``trainmon compare --source gradprobe``: the first step at which two runs' gradients part ways.

Reads the ``grad_probe`` fingerprints of both runs, compares every matched parameter at every step both
collected, prints the first divergent step and the parameters that diverged first, and writes a CSV, a
summary, TensorBoard scalars and PNG plots to ``--out``. Exit status: 0 no divergence, 1 divergence, 2 error.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from trainmon.cli.compare_exit import EXIT_DIVERGED, EXIT_SAME, error
from trainmon.gradprobe.compare import Comparison, Thresholds, compare_runs, load_mapping
from trainmon.gradprobe.reader import FingerprintError, ranks
from trainmon.gradprobe.report import summary, write_report

_SHOWN = 10  # parameters listed per rank


def _print(comparison: Comparison, out: Path | None) -> None:
    t = comparison.thresholds
    for r in comparison.ranks:
        params = len({row.name for row in r.rows})
        print(f"rank {r.rank}: {len(r.steps)} steps, {params} parameters compared")
        if r.only_a or r.only_b:
            print(
                f"  unmatched: {len(r.only_a)} only in run A, {len(r.only_b)} only in run B "
                "(see summary.json)"
            )
        if r.unaligned_samples:
            print(
                f"  {len(r.unaligned_samples)} parameters were sampled at different positions (renamed?); "
                "their sign and cosine are not compared: collect with grad_probe.sample_seed: shape"
            )
        if r.first_step is None:
            print(f"  no divergence (similarity >= {t.first:g} at first, no drop > {t.drop:g})")
        else:
            shown = ", ".join(r.first_params[:_SHOWN])
            more = f" and {len(r.first_params) - _SHOWN} more" if len(r.first_params) > _SHOWN else ""
            print(f"  first divergent step {r.first_step}: {shown}{more}")
    first = comparison.first_step
    print("no divergence" if first is None else f"first divergent step: {first}")
    if out is not None:
        print(f"report in {out}")


def run(args: argparse.Namespace) -> int:
    for run in (args.run_a, args.run_b):
        if not Path(run).is_dir():
            return error(f"run directory not found: {run}")
    found_a, found_b = ranks(args.run_a), ranks(args.run_b)
    for run, found in ((args.run_a, found_a), (args.run_b, found_b)):
        if not found:
            return error(f"no grad_probe fingerprints in {run} (collect with grad_probe: {{enable: true}})")
    if args.rank is not None:
        missing = [
            run for run, found in ((args.run_a, found_a), (args.run_b, found_b)) if args.rank not in found
        ]
        if missing:
            return error(f"rank {args.rank} has no fingerprints in {', '.join(missing)}")
        selected = [args.rank]
    else:
        selected = sorted(set(found_a) & set(found_b))
        if not selected:
            return error(f"no rank has fingerprints in both runs (A: {found_a}, B: {found_b})")
    try:
        mapping = load_mapping(args.map) if args.map else None
        comparison = compare_runs(
            args.run_a, args.run_b, selected, mapping, Thresholds(args.threshold, args.drop)
        )
    except FingerprintError as e:
        return error(str(e))
    if not any(r.steps for r in comparison.ranks):
        return error("the two runs have no collected step in common")
    if not any(r.rows for r in comparison.ranks):
        return error("no parameter matches between the two runs (a --map file gives renamed ones)")
    out = Path(args.out) if args.out else Path(f"compare-{Path(args.run_a).name}-vs-{Path(args.run_b).name}")
    if not getattr(args, "no_report", False):
        write_report(comparison, out, plots=not args.no_plots)
    if args.json:
        print(json.dumps(summary(comparison), indent=2))
    else:
        _print(comparison, None if getattr(args, "no_report", False) else out)
    return EXIT_SAME if comparison.first_step is None else EXIT_DIVERGED
