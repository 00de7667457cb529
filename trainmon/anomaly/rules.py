"""The rules' engine: turn a finished step's statistics into :class:`~trainmon.run.records.Anomaly` records.

Runs in the writer thread, once per finished step, for the rules the ``alert`` section declares
(``trainmon.config.rules``: what each rule means and how a config writes it). Rules are evaluated on
*step-level* values: the rows of one tensor's micro-batches are merged first
(:class:`~trainmon.run.records.TensorGroups`), so history is kept per tensor ``(kind, vpp_stage, name)`` and
per statistic, not per micro-batch. Everything is vectorised over the tensors of a step; the mapping from a
step's row layout to state slots is built once per distinct layout and cached (consecutive steps almost
always have the same layout).

History rules ignore tensors that hold NaN/Inf elements (the nan rule reports those) and never fold a
flagged value into their history, so one spike does not hide the next.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, ClassVar

import numpy as np

from trainmon.config.rules import MaxRatioRule, NanRule, Rule, ThresholdRule, TurbulenceRule, ZScoreRule
from trainmon.run.records import (
    INF_RULE,
    INFS,
    MAX_RATIO_RULE,
    NAN_RULE,
    NANS,
    NON_FINITE_RULES,
    NUMEL,
    STATS,
    THRESHOLD_RULE,
    TURBULENCE_RULE,
    ZSCORE_RULE,
    Anomaly,
    Derived,
    Row,
    StepRecord,
    TensorGroups,
    kind_name,
)

__all__ = ["RuleEngine", "non_finite_part"]

_STAT_COL = {s: i for i, s in enumerate(STATS)}
_NON_FINITE_STATS = ("nans", "infs")


def non_finite_part(rules: Sequence[Rule]) -> list[Rule]:
    """The NaN/Inf counting of ``rules`` alone: what a step that is only checked for NaN/Inf (one the writer
    had no room for) is evaluated with. No history is involved, so it can run beside the full engine."""
    out: list[Rule] = []
    for r in rules:
        if isinstance(r, NanRule) and (stats := tuple(s for s in r.stats if s in _NON_FINITE_STATS)):
            out.append(replace(r, stats=stats, threshold=None))
    return out


# ---------------------------------------------------------------------------------------------------------
# Layout cache: the grouping of one step's rows into tensors, and per rule the selected groups' state slots.


class _Layout:
    __slots__ = (
        "rows", "groups", "kinds", "names", "vpp", "first_row", "row_group", "group_rows", "per_rule"
    )  # fmt: skip

    def __init__(self, rows: tuple[Row, ...]) -> None:
        self.rows = rows
        self.groups = TensorGroups(rows)
        keys = self.groups.keys
        self.kinds = [k for k, _, _ in keys]
        self.vpp = [v for _, v, _ in keys]
        self.names = [n for _, _, n in keys]
        index = {k: i for i, k in enumerate(keys)}
        row_group = np.fromiter(
            (index[(kind_name(r.kind), r.vpp_stage, r.name)] for r in rows), dtype=np.intp, count=len(rows)
        )
        self.row_group = row_group
        self.group_rows = np.bincount(row_group, minlength=len(keys))  # a tensor's rows: its micro-steps
        first = np.full(len(keys), -1, dtype=np.intp)
        # reversed assignment leaves the smallest row index of each group
        first[row_group[::-1]] = np.arange(len(rows), dtype=np.intp)[::-1]
        self.first_row = first
        self.per_rule: list[tuple[np.ndarray, np.ndarray | slice, np.ndarray | slice]] = []


def _as_index(a: np.ndarray) -> np.ndarray | slice:
    """A contiguous ascending index array as a slice (basic indexing: views, no gathers)."""
    if len(a) and a[-1] - a[0] == len(a) - 1 and (len(a) == 1 or bool(np.all(np.diff(a) == 1))):
        return slice(int(a[0]), int(a[-1]) + 1)
    return a


class _Evaluator:
    """State of one rule: slots keyed by (kind, vpp_stage, name), arrays (slots, len(rule.stats))."""

    ARRAYS: ClassVar[tuple[str, ...]] = ()

    def __init__(self, rule: Rule) -> None:
        self.rule = rule
        self.cols = np.asarray([_STAT_COL[s] for s in rule.stats], dtype=np.intp)
        self.all_cols = rule.stats == STATS
        self.slot_of: dict[tuple[str, int, str], int] = {}
        self.arrays: dict[str, np.ndarray] = {
            a: np.zeros((0, len(self.cols))) for a in ("count", *self.ARRAYS)
        }

    def bind(self, lay: _Layout) -> tuple[np.ndarray, np.ndarray]:
        rule = self.rule
        sel = [g for g, (k, n) in enumerate(zip(lay.kinds, lay.names, strict=True)) if rule.selects(k, n)]
        slots = []
        for g in sel:
            key = (lay.kinds[g], lay.vpp[g], lay.names[g])
            slot = self.slot_of.get(key)
            if slot is None:
                slot = self.slot_of[key] = len(self.slot_of)
            slots.append(slot)
        self._grow(len(self.slot_of))
        return np.asarray(sel, dtype=np.intp), np.asarray(slots, dtype=np.intp)

    def take(self, values: np.ndarray, sel: np.ndarray | slice, cols: np.ndarray | None = None) -> np.ndarray:
        """values[sel][:, cols] without copies where the selection is everything (the common case)."""
        v = values[sel]
        if cols is None:
            cols = self.cols
            if self.all_cols:
                return v
        return v[:, cols]

    def _grow(self, n: int) -> None:
        have = len(self.arrays["count"])
        if n <= have:
            return
        cap = max(n, 2 * have, 16)
        for a, arr in self.arrays.items():
            grown = np.zeros((cap, arr.shape[1]))
            grown[:have] = arr
            self.arrays[a] = grown

    def step(
        self, values: np.ndarray, clean: np.ndarray, nonempty: np.ndarray, sel: np.ndarray, slots: np.ndarray
    ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, str]]:
        """Fired (selected-group index, stat position, value, baseline, rule name) batches."""
        raise NotImplementedError

    # -- persistence
    def state_dict(self) -> dict[str, Any]:
        n = len(self.slot_of)
        return {
            "rule": self.rule.rule,
            "stats": list(self.rule.stats),
            "keys": [list(k) for k in self.slot_of],
            **{a: arr[:n].tolist() for a, arr in self.arrays.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("rule") != self.rule.rule or list(state.get("stats", ())) != list(self.rule.stats):
            raise ValueError(
                f"state of rule {state.get('rule')!r} {state.get('stats')} does not match "
                f"{self.rule.rule!r} {list(self.rule.stats)}"
            )
        keys = [(str(k), int(v), str(n)) for k, v, n in state["keys"]]
        self.slot_of = {k: i for i, k in enumerate(keys)}
        width = len(self.cols)
        self.arrays = {
            a: np.asarray(state[a], dtype=np.float64).reshape(len(keys), width) for a in self.arrays
        }


class _NanEval(_Evaluator):
    def __init__(self, rule: NanRule) -> None:
        super().__init__(rule)
        stats = rule.stats
        self.nan_pos = stats.index("nans") if "nans" in stats else -1
        self.inf_pos = stats.index("infs") if "infs" in stats else -1
        self.thr_pos = np.asarray(
            [i for i, s in enumerate(stats) if s not in ("nans", "infs")], dtype=np.intp
        )
        self.threshold = rule.threshold

    def step(self, values, clean, nonempty, sel, slots):
        ne = nonempty[sel]
        if self.rule.warmup:
            count = self.arrays["count"]
            c = count[slots, 0]
            ready = ne & (c >= self.rule.warmup)
            count[slots, 0] = c + ne
        else:
            ready = ne
        out = []
        for pos, name in ((self.nan_pos, NAN_RULE), (self.inf_pos, INF_RULE)):
            if pos < 0:
                continue
            v = values[sel, self.cols[pos]]
            hit = np.flatnonzero(ready & (v > 0))
            if len(hit):
                out.append((hit, np.full(len(hit), pos), v[hit], np.full(len(hit), np.nan), name))
        if self.threshold is not None and len(self.thr_pos):
            v = self.take(values, sel, self.cols[self.thr_pos])
            with np.errstate(invalid="ignore"):
                fire = (np.abs(v) > self.threshold) & ready[:, None]
            gi, pi = np.nonzero(fire)
            if len(gi):
                out.append((gi, self.thr_pos[pi], v[gi, pi], np.full(len(gi), self.threshold), NAN_RULE))
        return out


class _HistoryEval(_Evaluator):
    """Shared plumbing of the rules with history: valid = finite value of a clean tensor."""

    def step(self, values, clean, nonempty, sel, slots):
        v = self.take(values, sel)
        valid = np.isfinite(v) & clean[sel][:, None]
        count = self.arrays["count"]
        c = count[slots]
        ready = valid & (c >= max(self.rule.warmup, 1))
        fire, baseline, upd = self.check(v, valid, ready, c, slots)
        count[slots] = c + upd
        gi, pi = np.nonzero(fire)
        if not len(gi):
            return []
        return [(gi, pi, v[gi, pi], baseline[gi, pi], self.rule.rule)]

    def check(self, v, valid, ready, c, slots):  # -> fire, baseline, updated mask
        raise NotImplementedError


class _TurbulenceEval(_HistoryEval):
    ARRAYS = ("mean",)

    def check(self, v, valid, ready, c, slots):
        rule: TurbulenceRule = self.rule  # type: ignore[assignment]
        ema = self.arrays["mean"]
        m = ema[slots]
        t = rule.threshold
        with np.errstate(invalid="ignore"):
            if rule.direction == "up":
                cond = np.abs(v) > np.abs(m) * (1.0 + t)
            elif rule.direction == "down":
                cond = v < m * (1.0 - t)
            else:
                cond = (np.abs(v) > np.abs(m) * (1.0 + t)) | (v < m * (1.0 - t))
        fire = ready & cond
        upd = valid & ~fire
        b = rule.beta
        new = np.where(c == 0, v, b * m + (1.0 - b) * v)
        ema[slots] = np.where(upd, new, m)
        return fire, m, upd


class _ZScoreEval(_HistoryEval):
    ARRAYS = ("mean", "var")

    def check(self, v, valid, ready, c, slots):
        rule: ZScoreRule = self.rule  # type: ignore[assignment]
        mean, var = self.arrays["mean"], self.arrays["var"]
        m, s2 = mean[slots], var[slots]
        diff = v - m
        with np.errstate(invalid="ignore", divide="ignore"):
            z = np.where(s2 > 0, np.abs(diff) / np.sqrt(s2), np.where(diff == 0, 0.0, np.inf))
            fire = ready & (z > rule.threshold)
        upd = valid & ~fire
        a = 1.0 - rule.beta
        first = c == 0
        new_m = np.where(first, v, m + a * diff)
        new_s2 = np.where(first, 0.0, (1.0 - a) * (s2 + a * diff * diff))
        mean[slots] = np.where(upd, new_m, m)
        var[slots] = np.where(upd, new_s2, s2)
        return fire, m, upd


class _MaxRatioEval(_HistoryEval):
    ARRAYS = ("max",)

    def check(self, v, valid, ready, c, slots):
        rule: MaxRatioRule = self.rule  # type: ignore[assignment]
        mx = self.arrays["max"]
        m = mx[slots]
        with np.errstate(invalid="ignore"):
            fire = ready & (v > rule.threshold * m)
        upd = valid & ~fire
        new = np.where(c == 0, v, np.maximum(m, np.where(valid, v, m)))
        mx[slots] = np.where(upd, new, m)
        return fire, m, upd


class _ThresholdEval(_Evaluator):
    def step(self, values, clean, nonempty, sel, slots):
        rule: ThresholdRule = self.rule  # type: ignore[assignment]
        v = self.take(values, sel)
        ne = nonempty[sel][:, None]
        if rule.warmup:
            count = self.arrays["count"]
            c = count[slots]
            ready = ne & (c >= rule.warmup)
            count[slots] = c + ne
        else:
            ready = ne
        out = []
        with np.errstate(invalid="ignore"):
            for bound, cond in ((rule.above, np.greater), (rule.below, np.less)):
                if bound is None:
                    continue
                gi, pi = np.nonzero(ready & cond(v, bound))
                if len(gi):
                    out.append((gi, pi, v[gi, pi], np.full(len(gi), float(bound)), THRESHOLD_RULE))
        return out


_EVALUATORS: dict[type[Rule], type[_Evaluator]] = {
    NanRule: _NanEval,
    TurbulenceRule: _TurbulenceEval,
    ZScoreRule: _ZScoreEval,
    MaxRatioRule: _MaxRatioEval,
    ThresholdRule: _ThresholdEval,
}


def _fmt(x: float) -> str:
    return f"{x:.6g}"


def _message(
    rule: Rule, fired: str, kind: str, name: str, stat: str, value: float, base: float | None
) -> str:
    where = f"{kind}/{name}"
    if fired == NAN_RULE and stat == "nans":
        return f"{where} has {int(value)} NaN element(s)"
    if fired == INF_RULE:
        return f"{where} has {int(value)} Inf element(s)"
    if fired == NAN_RULE:
        return f"{where} {stat} {_fmt(value)} exceeds |{_fmt(base or 0.0)}|"
    if fired == TURBULENCE_RULE:
        pct = _fmt(rule.threshold * 100)  # type: ignore[attr-defined]
        return (
            f"{where} {stat} {_fmt(value)} deviates from its average {_fmt(base or 0.0)} by more than {pct}%"
        )
    if fired == ZSCORE_RULE:
        z = _fmt(rule.threshold)  # type: ignore[attr-defined]
        avg = _fmt(base or 0.0)
        return f"{where} {stat} {_fmt(value)} is more than {z} standard deviations from its average {avg}"
    if fired == MAX_RATIO_RULE:
        k = _fmt(rule.threshold)  # type: ignore[attr-defined]
        return f"{where} {stat} {_fmt(value)} is above {k} x its previous max {_fmt(base or 0.0)}"
    side = "above" if base is not None and value > base else "below"
    return f"{where} {stat} {_fmt(value)} is {side} the bound {_fmt(base or 0.0)}"


class RuleEngine:
    """Evaluates a fixed list of rules on each finished step, keeping per-tensor history."""

    _MAX_LAYOUTS = 8

    def __init__(self, rules: Sequence[Rule]) -> None:
        self.rules: tuple[Rule, ...] = tuple(rules)
        for r in self.rules:
            if type(r) not in _EVALUATORS:
                raise TypeError(f"not a rule: {r!r}")
        self._evals = [_EVALUATORS[type(r)](r) for r in self.rules]
        self._last: _Layout | None = None
        self._layouts: dict[tuple[Row, ...], _Layout] = {}

    def _layout(self, rows: tuple[Row, ...]) -> _Layout:
        last = self._last
        if last is not None and (rows is last.rows or rows == last.rows):
            return last
        try:
            lay = self._layouts.get(rows)
        except TypeError:  # an unhashable field in a row (e.g. a list shape): do not cache by value
            lay = None
        if lay is None:
            lay = _Layout(rows)
            lay.per_rule = []
            for e in self._evals:
                sel, slots = e.bind(lay)
                lay.per_rule.append((sel, _as_index(sel), _as_index(slots)))
            if len(self._layouts) >= self._MAX_LAYOUTS:
                self._layouts.pop(next(iter(self._layouts)))
            with contextlib.suppress(TypeError):
                self._layouts[rows] = lay
        self._last = lay
        return lay

    def evaluate(self, record: StepRecord, derived: Derived | None = None) -> list[Anomaly]:
        """Anomalies of one step, ordered by the row (``seq``) they point at, then by rule order."""
        if not self._evals or not record.rows:
            return []
        lay = self._layout(record.rows)
        if derived is None:
            derived = Derived(record, lay.groups)
        merged, d = derived.merged, derived.tensors
        values = np.column_stack([d[s] for s in STATS])
        nonempty = merged[:, NUMEL] > 0
        clean = nonempty & (merged[:, NANS] == 0) & (merged[:, INFS] == 0)

        fired = []
        for ri, (ev, (sel, sel_ix, slots)) in enumerate(zip(self._evals, lay.per_rule, strict=True)):
            if not len(sel):
                continue
            for gi, pi, val, base, name in ev.step(values, clean, nonempty, sel_ix, slots):
                fired.append((ri, ev, sel[gi], pi, val, base, name))
        if not fired:
            return []
        return self._anomalies(record, lay, derived.rows, fired)

    def _anomalies(
        self, record: StepRecord, lay: _Layout, per_row: dict[str, np.ndarray], fired: list
    ) -> list[Anomaly]:
        first_bad: dict[str, dict[int, int]] = {}  # nan|inf -> group -> first row with such elements

        def bad_row(which: str, g: int) -> int:
            table = first_bad.get(which)
            if table is None:
                rows = np.flatnonzero(per_row["nans" if which == NAN_RULE else "infs"] > 0)
                groups = lay.row_group[rows]
                _, idx = np.unique(groups, return_index=True)  # first occurrence in row order
                table = first_bad[which] = dict(zip(groups[idx].tolist(), rows[idx].tolist(), strict=True))
            return table.get(g, int(lay.first_row[g]))

        out: list[tuple[int, int, Anomaly]] = []
        rows = record.rows
        for ri, ev, groups, pis, vals, bases, name in fired:
            rule = ev.rule
            for g, p, v, b in zip(groups.tolist(), pis.tolist(), vals.tolist(), bases.tolist(), strict=True):
                stat = rule.stats[p]
                kind, nm = lay.kinds[g], lay.names[g]
                base = None if math.isnan(b) else b
                message = _message(rule, name, kind, nm, stat, v, base)
                n_rows = int(lay.group_rows[g])
                if name in NON_FINITE_RULES and stat in ("nans", "infs"):
                    # a record is one micro-step's: the first that holds such elements, with its own count
                    seq = bad_row(name, g)
                    if n_rows > 1:
                        total, v = v, float(per_row[stat][seq])
                        message = _message(rule, name, kind, nm, stat, v, base) + (
                            f" at micro-step {rows[seq].micro_step} ({int(total)} in the step's {n_rows} "
                            "micro-steps)"
                        )
                else:
                    seq = int(lay.first_row[g])
                    if n_rows > 1:  # judged on the tensor's value over the step, not on one micro-step's
                        message += f" (step total: its {n_rows} micro-steps merged)"
                row = rows[seq]
                out.append(
                    (
                        seq,
                        ri,
                        Anomaly(
                            step=record.step,
                            rank=record.rank,
                            kind=kind,
                            name=nm,
                            stat=stat,
                            value=v,
                            rule=name,
                            seq=seq,
                            micro_step=int(row.micro_step),
                            vpp_stage=int(row.vpp_stage),
                            phase=kind_name(row.phase),
                            baseline=base,
                            wall_time=record.wall_time,
                            message=message,
                        ),
                    )
                )
        out.sort(key=lambda t: (t[0], t[1]))
        return [a for _, _, a in out]

    # -- persistence (plain JSON-able)
    def state_dict(self) -> dict[str, Any]:
        return {"version": 1, "rules": [e.state_dict() for e in self._evals]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        saved = list(state.get("rules", ()))
        if len(saved) != len(self._evals):
            raise ValueError(f"state has {len(saved)} rules, the engine has {len(self._evals)}")
        for ev, s in zip(self._evals, saved, strict=True):
            ev.load_state_dict(s)
        self._last = None
        self._layouts.clear()
