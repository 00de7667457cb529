"""``trainmon compare --source stats``: two runs' statistics, the first divergent tensor, and why.

Reads the statistics store of both runs step range by step range (:mod:`trainmon.read.compare`), prints the
verdict in one screen (or ``--json``), writes the report folder (``--out``) and, with ``--request-dumps``,
asks both runs for dumps of the divergent tensor and its module at that step.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from trainmon.cli.compare_exit import EXIT_DIVERGED, EXIT_ERROR, EXIT_SAME, error
from trainmon.cli.damaged import warn_damaged
from trainmon.read.compare.dumps import request_dumps
from trainmon.read.compare.engine import Options, common_range, compare
from trainmon.read.compare.mapfile import MapError, load_map
from trainmon.read.compare.output import ReportWriter
from trainmon.read.compare.plan import make_plan
from trainmon.read.compare.report import summary, text
from trainmon.read.compare.source import (
    CompareError,
    RankReader,
    RunInfo,
    WholeTensorReader,
    open_run,
    step_ranges,
)
from trainmon.read.compare.tensors import WHOLE_TENSOR_KINDS
from trainmon.read.compare.tolerance import Tolerance, ToleranceError, load_tolerance
from trainmon.read.compare.verdict import judge
from trainmon.run.damage import damaged
from trainmon.run.layout import stats_dir

_SHOWN = 3


def _readers(args: argparse.Namespace, a, b) -> tuple[RankReader, RankReader, list[int]]:
    layout = args.layout or ("whole" if a.world_size != b.world_size else "ranks")
    if layout == "whole":
        return WholeTensorReader(a), WholeTensorReader(b), [0]
    if args.rank is not None:
        missing = [r.name for r in (a, b) if args.rank not in r.ranks]
        if missing:
            raise CompareError(f"rank {args.rank} has no statistics in {' and '.join(missing)}")
        return RankReader(a), RankReader(b), [args.rank]
    ranks = sorted(set(a.ranks) & set(b.ranks))
    if not ranks:
        raise CompareError(
            f"no rank has statistics in both runs (A: ranks {list(a.ranks)}, B: ranks {list(b.ranks)}); "
            "--layout whole compares the whole-tensor statistics whatever rank holds them"
        )
    return RankReader(a), RankReader(b), ranks


def _check_names(
    ra: RankReader, rb: RankReader, rank: int, span: tuple[int, int], tolerance: Tolerance, name_map
) -> None:
    """Fail early (exit 2) when no tensor pairs up, or when no entry of the map names anything. The first
    step range's rows are read for it, and handed to the comparison (read once)."""
    first = step_ranges(*span)[0]
    meta_a, meta_b = ra.meta(rank, *first), rb.meta(rank, *first)
    plan = make_plan(rank, meta_a.tensors, meta_b.tensors, meta_a, meta_b, tolerance, name_map)
    if not plan.pairs and plan.left_out:  # the names pair up: what they hold does not
        x = plan.left_out[0]
        raise CompareError(
            f"every tensor that pairs up on rank {rank} is a {x.kind} whose rows hold a different number of "
            f"micro-batches' gradients in the two runs (A {x.rows_a}, B {x.rows_b} a step, e.g. {x.name}): "
            "nothing comparable; record grad_reduced (wg_distribution) or activations"
        )
    if not plan.pairs:
        shown_a = ", ".join(f"{k} {n}" for k, n in meta_a.tensors[:_SHOWN])
        shown_b = ", ".join(f"{k} {n}" for k, n in meta_b.tensors[:_SHOWN])
        raise CompareError(
            f"no tensor of {ra.run.name} pairs with a tensor of {rb.run.name} on rank {rank} (A: "
            f"{shown_a}...; B: {shown_b}...): give the names that differ in a --map file"
        )
    if name_map is not None and len(plan.alignment.unused_map) == len(name_map.pairs):
        raise CompareError(f"{name_map.path}: no entry names a tensor or module of either run")


def _not_compared(ra: RankReader, rb: RankReader) -> dict | None:
    if not isinstance(ra, WholeTensorReader):
        return None
    kinds = sorted((ra.kinds_left_out | rb.kinds_left_out) - WHOLE_TENSOR_KINDS)
    ambiguous = sorted(ra.ambiguous | rb.ambiguous)
    return {
        "why": "the runs' parallel layouts differ (or --layout whole): only whole-tensor statistics compare",
        "kinds": kinds,
        "ambiguous": [[k, n] for k, n in ambiguous],
        "world_size_a": ra.run.world_size,
        "world_size_b": rb.run.world_size,
    }


def run(args: argparse.Namespace, opened: tuple[RunInfo, RunInfo] | None = None) -> int:
    """The comparison of ``args.run_a`` and ``args.run_b`` (``opened``: both, opened already)."""
    try:
        a, b = opened or (open_run(args.run_a), open_run(args.run_b))
        name_map = load_map(args.map) if args.map else None
        tolerance = load_tolerance(args.tolerance) if args.tolerance else Tolerance()
        tolerance = replace(tolerance, scale=args.rtol_scale)
        ra, rb, ranks = _readers(args, a, b)
        lo, hi = args.steps or (None, None)
        options = Options(first_only=args.first, step_lo=lo, step_hi=hi)
        span = common_range(ra, rb, ranks, options)
        if span is None:

            def spans(reader: RankReader) -> str:
                return ", ".join(f"rank {r}: {x}..{y}" for r in reader.ranks for x, y in [reader.span(r)])

            within = f" within --steps {lo}:{hi}" if args.steps else ""
            raise CompareError(
                f"the two runs have no collected step in common{within} (A: {spans(ra)}; B: {spans(rb)})"
            )
        _check_names(ra, rb, ranks[0], span, tolerance, name_map)
    except (CompareError, MapError, ToleranceError) as e:  # (a store that cannot be read is a CompareError)
        warn_damaged(args.run_a, args.run_b)  # what may be why (nothing of a store readable)
        return error(str(e))
    out = None if args.no_report else Path(args.out or f"compare-{a.name}-vs-{b.name}")
    try:
        writer = ReportWriter(out) if out is not None else None
        result = compare(ra, rb, ranks, tolerance, name_map, options, writer.add if writer else None)
        verdict = judge(result, a, b)
        doc = summary(result, verdict, a, b)
        doc["layout"] = ra.layout
        doc["not_compared"] = _not_compared(ra, rb)
        # files of either run that could not be read; those of the statistics stores: compared is the rest
        doc["damaged"] = [{"path": str(d.path), "why": d.why} for run in (a, b) for d in damaged(run.path)]
        doc["damaged_statistics"] = [str(d.path) for run in (a, b) for d in damaged(stats_dir(run.path))]
        if args.request_dumps and result.first is not None:
            made = request_dumps(a.path, b.path, result.first, verdict)
            doc["dump_requests"] = [{"run": run, **request.to_dict()} for run, request in made]
        if writer is not None:
            writer.finish(doc, result)
    except CompareError as e:  # a store that cannot be read (removed under the comparison)
        return error(str(e))
    except OSError as e:  # the report folder cannot be written
        return error(f"the report folder {out} cannot be written: {e}")
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print(text(doc, str(out) if out else None))
        if doc.get("dump_requests"):
            print(
                f"dump requests: {len(doc['dump_requests'])} written to both runs' requests.jsonl (served "
                f"when a job in those folders reaches step {result.first.step}; then: trainmon dump ls RUN)"
            )
    sys.stdout.flush()
    warn_damaged(a.path, b.path)
    if result.first is None and doc["damaged_statistics"]:  # not "the same": their steps were not compared
        return EXIT_ERROR
    return EXIT_SAME if result.first is None else EXIT_DIVERGED
