"""A statistics comparison as a script reads it (:func:`summary`, the JSON of ``--json`` and of
``summary.json``) and as a person reads it (:func:`text`, one screen)."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from trainmon.read.compare.diff import worst
from trainmon.read.compare.dumps import dump_targets
from trainmon.read.compare.engine import Result
from trainmon.read.compare.microbatch import describe
from trainmon.read.compare.microstep import first_micro_step
from trainmon.read.compare.source import RunInfo
from trainmon.read.compare.verdict import Verdict, downstream

__all__ = ["summary", "text"]

_LISTED = 20  # unmatched tensors and divergent tensors listed in the summary
_SHOWN = 4  # ... and on the screen
_STATS = ("min", "max", "mean", "norm", "zeros", "nans", "infs", "numel")


def _number(x: float) -> float | str | None:
    """JSON has no NaN or infinity: written as text."""
    x = float(x)
    if math.isnan(x):
        return None
    return x if math.isfinite(x) else ("inf" if x > 0 else "-inf")


def _unmatched(result: Result) -> dict[str, Any]:
    only_a: dict[tuple[str, str], None] = {}
    only_b: dict[tuple[str, str], None] = {}
    unused: dict[str, None] = {}
    how: Counter = Counter()
    by_order = []
    for tally in result.ranks:
        if tally.plan is None:
            continue
        found = tally.plan.alignment
        only_a.update(dict.fromkeys(found.only_a))
        only_b.update(dict.fromkeys(found.only_b))
        unused.update(dict.fromkeys(found.unused_map))
        how.update(p.how for p in tally.plan.pairs)
        by_order += [[p.kind, p.name, p.name_b] for p in tally.plan.pairs if p.how == "order"]
    kinds_a = sorted({k for k, _ in only_a} - {k for k, _ in only_b})
    kinds_b = sorted({k for k, _ in only_b} - {k for k, _ in only_a})
    return {
        "only_a": [[k, n] for k, n in only_a],
        "only_b": [[k, n] for k, n in only_b],
        "kinds_only_a": kinds_a,
        "kinds_only_b": kinds_b,
        "unused_map": list(unused),
        "paired_by": dict(how),
        "paired_by_order": by_order[:_LISTED],
    }


def _left_out(result: Result, a: RunInfo, b: RunInfo) -> list[dict[str, Any]]:
    """The pairs not compared because the runs' rows hold different things (:mod:`~.microbatch`): one group
    per kind and what each run holds, every rank's pairs counted once by name."""
    groups: dict[tuple, dict[tuple[str, str], None]] = {}
    compared: set[str] = set()
    for tally in result.ranks:
        if tally.plan is None:
            continue
        compared.update(p.kind for p in tally.plan.pairs)
        for x in tally.plan.left_out:
            key = (x.kind, x.rows_a, x.rows_b, x.micro_a, x.micro_b)
            groups.setdefault(key, {})[(x.name, x.name_b)] = None
    out = []
    for (kind, rows_a, rows_b, micro_a, micro_b), names in groups.items():
        out.append(
            {
                "kind": kind,
                "tensors": len(names),
                "why": "the runs' rows hold a different number of micro-batches' gradients",
                "rows_a": rows_a,  # gradients of the tensor's shape in one stored row (one step)
                "rows_b": rows_b,
                "a": describe(rows_a, micro_a, a.grads_per_micro_step),
                "b": describe(rows_b, micro_b, b.grads_per_micro_step),
                "names": [list(n) for n in list(names)[:_LISTED]],
                "compared_instead": "grad_reduced" if "grad_reduced" in compared else None,
            }
        )
    return out


def _first(result: Result, verdict: Verdict | None, a: RunInfo, b: RunInfo) -> dict[str, Any] | None:
    row = result.first
    if row is None:
        return None
    run_a, run_b = a, b
    p = row.first_divergent()
    pair = row.plan.pairs[p]
    a = {s: float(row.a[s][p]) for s in _STATS}
    b = {s: float(row.b[s][p]) for s in _STATS}
    slack = float(row.slack[p])
    stat, _ = worst(a, b, pair.rtol + slack, pair.ztol + slack)
    names = (pair.name, pair.name_b)
    micro = first_micro_step(run_a.path, run_b.path, row.rank, pair.kind, names, row.step, pair.rtol + slack,
                             pair.ztol + slack)  # fmt: skip
    out = {
        "rank": row.rank,
        "step": row.step,
        "micro_step": micro,  # from the CSV files when both runs have them (the store merges micro-steps)
        "phase": pair.phase,
        "kind": pair.kind,
        "name": pair.name,
        "name_b": pair.name_b,
        "statistic": stat,
        "rel": _number(row.rel[p]),
        "tolerance": _number(pair.rtol),
        "dtype_a": pair.dtype,
        "dtype_b": pair.dtype_b,
        "precision": pair.precision,  # the rounding the tolerance allows for, and why
        "tolerance_why": pair.why,
        "slack": _number(slack),
        "score": _number(row.score[p]),
        "a": {k: _number(v) for k, v in a.items()},
        "b": {k: _number(v) for k, v in b.items()},
        "previous_step_score": _number(row.previous_score),
    }
    if verdict is not None:
        out.update(
            cause=verdict.cause,
            stage=verdict.stage,
            module=verdict.module,
            summary=verdict.summary,
            drift=verdict.drift,
            notes=list(verdict.notes),
            evidence=[
                {
                    "role": e.role,
                    "kind": e.kind,
                    "name": e.name,
                    "name_b": e.name_b,
                    "agrees": e.agrees,
                    "rel": _number(e.rel),
                    "score": _number(e.score),
                }
                for e in verdict.evidence
            ],  # fmt: skip
            dumps=[
                {"kind": t.kind, "name_a": t.name_a, "name_b": t.name_b} for t in dump_targets(row, verdict)
            ],  # fmt: skip
        )
    return out


def _tolerances(result: Result) -> list[dict[str, Any]]:
    """The tolerances used, by the precision each was taken from and why (the first rank's pairs; per pair
    in tensors.csv): a mixed-precision pair's verdicts say which tensors were judged at which rounding."""
    tally = next((t for t in result.ranks if t.plan is not None), None)
    if tally is None:
        return []
    groups: dict[tuple[str | None, str], list] = {}
    for pair in tally.plan.pairs:
        groups.setdefault((pair.precision, pair.why.partition(": ")[2]), []).append(pair)
    return [
        {
            "precision": precision,
            "why": why,
            "tensors": len(pairs),
            "rtol": [_number(min(p.rtol for p in pairs)), _number(max(p.rtol for p in pairs))],
            "first": [pairs[0].kind, pairs[0].name],
        }
        for (precision, why), pairs in groups.items()
    ]


def summary(result: Result, verdict: Verdict | None, a: RunInfo, b: RunInfo) -> dict[str, Any]:
    """Everything a script needs, as plain JSON data."""
    divergent = sorted(
        ((t.pair_first[k], t.rank, k, t.pair_counts[k]) for t in result.ranks for k in t.pair_counts),
        key=lambda x: (x[0], x[1]),
    )
    tallies = [t for t in result.ranks if t.plan is not None]
    return {
        "source": "stats",
        "run_a": str(a.path),
        "run_b": str(b.path),
        "diverged": result.first is not None,
        "ranks": [t.rank for t in tallies],
        "steps_compared": result.steps_compared,
        "step_range": [
            min((t.step_lo for t in tallies), default=None),
            max((t.step_hi for t in tallies), default=None),
        ],
        "tensors_compared": max((len(t.plan.pairs) for t in tallies), default=0),
        "ranges_read": result.ranges_read,
        "ranges_total": result.ranges_total,
        "stopped_early": result.stopped_early,
        "first_divergence": _first(result, verdict, a, b),
        "downstream": downstream(result) if result.first is not None else None,
        "divergent_tensors": [
            {"rank": r, "kind": k[0], "name": k[1], "first_step": s, "steps": n}
            for s, r, k, n in divergent[:_LISTED]
        ],
        "unmatched": _unmatched(result),
        "left_out": _left_out(result, a, b),
        "tolerances": _tolerances(result),
        "layouts": {str(t.rank): t.layouts for t in tallies if t.layouts > 1},
    }


def _fmt(x: Any, digits: int = 4) -> str:
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    return f"{x:.{digits}g}"


def _names(items: list[list[str]]) -> str:
    shown = ", ".join(f"{k} {n}" for k, n in items[:_SHOWN])
    return shown + (f" and {len(items) - _SHOWN} more" if len(items) > _SHOWN else "")


def _left_out_line(group: dict[str, Any]) -> str:
    name, name_b = group["names"][0]
    example = name if name == name_b else f"{name} (B: {name_b})"
    instead = f"; {group['compared_instead']} is compared" if group["compared_instead"] else ""
    tensors = f"{group['tensors']} tensor{'s' if group['tensors'] != 1 else ''}"
    return (
        f"not compared: {group['kind']} of {tensors} (e.g. {example}), whose runs hold "
        f"different things: A {group['a']}, B {group['b']}{instead}"
    )


def text(doc: dict[str, Any], out: str | None = None) -> str:
    """The one-screen report of :func:`summary`'s document."""
    lines = []
    span = doc["step_range"]
    stopped = f"; stopped after {doc['ranges_read']} of {doc['ranges_total']} step ranges"
    lines.append(
        f"trainmon compare: {doc['run_a']} (A) vs {doc['run_b']} (B): {len(doc['ranks'])} rank(s), "
        f"{doc['steps_compared']} steps ({span[0]}..{span[1]}), {doc['tensors_compared']} tensors"
        + (stopped if doc["stopped_early"] else "")
    )
    first = doc["first_divergence"]
    damaged = doc.get("damaged_statistics") or []
    if first is None and damaged:
        lines.append(
            f"no divergence in what could be read: {len(damaged)} damaged file(s) of statistics were left "
            "out (the warnings name them), so the steps they held were not compared"
        )
    elif first is None:
        lines.append("no divergence: every compared tensor agrees within tolerance at every step")
    else:
        other = f" (B: {first['name_b']})" if first["name_b"] != first["name"] else ""
        micro = f", micro-step {first['micro_step']}" if first["micro_step"] is not None else ""
        lines.append(
            f"DIVERGED at step {first['step']}{micro}, rank {first['rank']}, phase {first['phase']}: "
            f"{first['kind']} {first['name']}{other}"
        )
        if "cause" in first:
            lines.append(f"  cause [{first['stage']}]: {first['summary']}")
        slack = f" + state {_fmt(first['slack'])}" if first["slack"] else ""
        lines.append(
            f"  {first['statistic']} differs most: relative difference {_fmt(first['rel'])}, tolerance "
            f"{_fmt(first['tolerance'])}{slack} (score {_fmt(first['score'])})"
        )
        if first.get("tolerance_why"):
            lines.append(f"  tolerance of {first['tolerance_why']}")
        for side in ("a", "b"):
            v = first[side]
            lines.append(
                f"    {side.upper()}: min {_fmt(v['min'], 7)}  max {_fmt(v['max'], 7)}  mean "
                f"{_fmt(v['mean'], 7)}  norm {_fmt(v['norm'], 7)}  nans {_fmt(v['nans'])}  "
                f"infs {_fmt(v['infs'])}"
            )
        evidence = first.get("evidence") or []
        if evidence:
            lines.append(f"  evidence at step {first['step']}:")
            for e in evidence:
                mark = "agrees " if e["agrees"] else "DIFFERS"
                lines.append(f"    {mark} {e['role']:<34} {e['kind']} {e['name']}  rel {_fmt(e['rel'])}")
        for note in first.get("notes") or []:
            lines.append(f"  note: {note}")
        down = doc["downstream"]
        lines.append(
            f"  downstream (not causes): {down['at_first_step']} more tensors at step {first['step']}, "
            f"{down['tensors']} divergent tensors, {down['cells']} divergent cells over "
            f"{down['steps']} steps"
        )
    un = doc["unmatched"]
    if un["only_a"] or un["only_b"]:
        kinds = [f"{k} only in A" for k in un["kinds_only_a"]]
        kinds += [f"{k} only in B" for k in un["kinds_only_b"]]
        lines.append(
            f"unmatched: {len(un['only_a'])} only in A, {len(un['only_b'])} only in B"
            + (f" ({'; '.join(kinds)})" if kinds else "")
        )
        rest_a = [x for x in un["only_a"] if x[0] not in un["kinds_only_a"]]
        rest_b = [x for x in un["only_b"] if x[0] not in un["kinds_only_b"]]
        if rest_a:
            lines.append(f"  only in A: {_names(rest_a)}")
        if rest_b:
            lines.append(f"  only in B: {_names(rest_b)}")
    for group in doc.get("left_out") or []:
        lines.append(_left_out_line(group))
    missing = doc.get("not_compared")
    if missing:
        ambiguous = missing["ambiguous"]
        lines.append(
            f"layouts differ (world size {missing['world_size_a']} vs {missing['world_size_b']}): compared "
            f"the whole-tensor statistics; not compared: {', '.join(missing['kinds']) or 'nothing else'}"
            + (f"; {len(ambiguous)} names held by several ranks with other values" if ambiguous else "")
        )
    if un["paired_by_order"]:
        lines.append(f"paired by call order and shape (check them): {len(un['paired_by_order'])}, e.g. "
                     + ", ".join(f"{a} <-> {b}" for _, a, b in un["paired_by_order"][:2]))  # fmt: skip
    if un["unused_map"]:
        lines.append(f"map entries that name nothing of either run: {', '.join(un['unused_map'][:_SHOWN])}")
    groups = doc.get("tolerances") or []
    if len({t["precision"] for t in groups}) > 1:  # a mixed-precision pair: which tensors got which rounding
        lines.append("tolerances by the precision each tensor is computed in (per tensor: tensors.csv):")
        for t in groups:
            low, high = t["rtol"]
            rtol = _fmt(low, 3) if _fmt(low, 3) == _fmt(high, 3) else f"{_fmt(low, 3)}..{_fmt(high, 3)}"
            kind, name = t["first"]
            lines.append(f"  {t['precision']:<9} {t['tensors']:>4} tensors, rtol {rtol}: {t['why']} "
                         f"(first: {kind} {name})")  # fmt: skip
    if first is not None and "dump_requests" not in doc:
        lines.append("next: dump the divergent tensors of both runs at that step: add --request-dumps")
    if out:
        lines.append(f"report in {out}")
    return "\n".join(lines)
