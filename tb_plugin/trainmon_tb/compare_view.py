"""The comparison view of the trainmon tab: two runs of the logdir compared from their statistics
(:mod:`trainmon.read.compare`), one rank at a time, as a step x tensor heatmap of the relative difference with
the first divergence marked; and the dump requests of that divergence in both runs.

A comparison is kept (an LRU of :data:`CACHED`) until either run's statistics store of that rank changes, so
moving the mouse over the heatmap or asking for dumps does not compare again."""

from __future__ import annotations

import base64
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from trainmon.read.compare.dumps import dump_targets, request_dumps
from trainmon.read.compare.heatmap import CompareHeatmap, compare_heatmap
from trainmon.read.compare.report import summary
from trainmon.read.compare.source import CompareError, RankReader, open_run
from trainmon.read.compare.tolerance import Tolerance
from trainmon.read.compare.verdict import judge
from trainmon.run.statstore import store_signature
from trainmon_tb.anomaly_index import json_number
from trainmon_tb.params import BadRequest, NotFound
from trainmon_tb.runs import Run

CACHED = 4


def _b64(array: np.ndarray, dtype: str) -> str:
    return base64.b64encode(np.ascontiguousarray(array, dtype=dtype).tobytes()).decode("ascii")


class _Found:
    def __init__(self, heatmap: CompareHeatmap, a, b, ranks: list[int]) -> None:
        self.heatmap, self.ranks = heatmap, ranks
        self.verdict = judge(heatmap.result, a, b)
        self.doc = summary(heatmap.result, self.verdict, a, b)
        self.a, self.b = a, b


class CompareView:
    """Comparisons asked for by the tab, cached by (runs, rank, bins, the stores' state)."""

    def __init__(self) -> None:
        self._cache: OrderedDict[tuple, _Found] = OrderedDict()
        self._lock = threading.Lock()

    def _compare(self, run_a: Run, run_b: Run, rank: int | None, bins: int) -> tuple[int, _Found]:
        try:
            a, b = open_run(run_a.dir), open_run(run_b.dir)
        except CompareError as e:
            raise NotFound(str(e)) from None
        common = sorted(set(a.ranks) & set(b.ranks))
        if not common:
            raise NotFound(f"runs {run_a.id!r} and {run_b.id!r} have no rank with statistics in common")
        if rank is None:
            rank = common[0]
        elif rank not in common:
            raise BadRequest(f"parameter 'rank': {rank} is not a rank both runs have (ranks: {common})")
        key = (run_a.id, run_b.id, rank, bins, store_signature(a.path, rank), store_signature(b.path, rank))
        with self._lock:
            found = self._cache.get(key)
            if found is not None:
                self._cache.move_to_end(key)
                return rank, found
        heatmap = compare_heatmap(RankReader(a), RankReader(b), rank, Tolerance(), bins)
        if heatmap is None or heatmap.result.ranks[0].plan is None:
            raise NotFound(f"runs {run_a.id!r} and {run_b.id!r} share no step or tensor on rank {rank}")
        found = _Found(heatmap, a, b, common)
        with self._lock:
            self._cache[key] = found
            while len(self._cache) > CACHED:
                self._cache.popitem(last=False)
        return rank, found

    def answer(self, run_a: Run, run_b: Run, rank: int | None, bins: int) -> dict[str, Any]:
        """The view's JSON: the heatmap (base64 arrays), the pairs, the verdict."""
        rank, found = self._compare(run_a, run_b, rank, bins)
        hm = found.heatmap
        plan = hm.result.ranks[0].plan
        first = found.doc["first_divergence"]
        marked = None
        if first is not None:
            row = plan.index(first["kind"], first["name"])
            column = int(np.searchsorted(hm.edges, first["step"], side="right") - 1)
            marked = {"row": row, "bin": column}
        finite = hm.values[np.isfinite(hm.values) & (hm.values > 0)]
        return {
            "run_a": run_a.id,
            "run_b": run_b.id,
            "rank": rank,
            "ranks": found.ranks,
            "pairs": [
                {
                    "kind": p.kind,
                    "name": p.name,
                    "name_b": p.name_b,
                    "how": p.how,
                    "rtol": float(p.rtol),
                    "ztol": float(p.ztol),
                    "precision": p.precision,
                    "why": p.why,
                }
                for p in plan.pairs
            ],  # fmt: skip
            "edges": hm.edges.tolist(),
            "bins": len(hm.edges) - 1,
            "values": _b64(hm.values, "<f4"),
            "flags": _b64(hm.flags, "u1"),
            # each cell's decision with its parts (the bin's highest score, and at its step the relative
            # difference and the state allowance): divergent when the score is above 1, as on the command line
            "scores": _b64(hm.scores, "<f4"),
            "rel_at": _b64(hm.rel_at, "<f4"),
            "slack_at": _b64(hm.slack_at, "<f4"),
            "range": [
                json_number(float(finite.min())) if finite.size else None,
                json_number(float(finite.max())) if finite.size else None,
            ],  # fmt: skip
            "diverged": first is not None,
            "first": first,
            "marked": marked,
            "steps_compared": found.doc["steps_compared"],
            "unmatched": {k: len(v) for k, v in found.doc["unmatched"].items() if k in ("only_a", "only_b")},
            # pairs whose runs hold different things (FSDP2's per micro-batch gradients): no row, said once
            "left_out": found.doc["left_out"],
        }

    def request_dumps(self, run_a: Run, run_b: Run, rank: int | None, bins: int) -> dict[str, Any]:
        """Append the dump requests of the first divergence to both runs."""
        rank, found = self._compare(run_a, run_b, rank, bins)
        row = found.heatmap.result.first
        if row is None:
            raise BadRequest(f"runs {run_a.id!r} and {run_b.id!r} agree on rank {rank}: nothing to dump")
        made = request_dumps(run_a.dir, run_b.dir, row, found.verdict)
        return {
            "step": row.step,
            "rank": row.rank,
            "targets": [
                {"kind": t.kind, "name_a": t.name_a, "name_b": t.name_b}
                for t in dump_targets(row, found.verdict)
            ],
            "requests": [
                {
                    "run": run_a.id if run == str(run_a.dir) else run_b.id,
                    "id": r.id,
                    "name": r.name,
                    "kind": r.kind,
                    "step": r.step,
                    "rank": r.rank,
                }
                for run, r in made
            ],  # fmt: skip
        }
