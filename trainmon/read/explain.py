"""``trainmon analyze RUN --explain``: what the run's files say about its first NaN/Inf.

Read, never guessed: the first non-finite anomaly and its origin (``plugins/trainmon/anomalies``, through the
same scan as ``analyze``), the statistics of the origin module's inputs, outputs and parameters at that step
(``rank_<r>/<kind>.csv``, through the CSV reader of ``csv2tb``), the loss scale and learning rate where a
scalar of that name was tracked (else "not recorded"), skipped steps before it, and the dump files to open
(``list_dumps``; an exact capture's dumps of that step first).
"""

from __future__ import annotations

import csv
import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

from trainmon.read.csv_sources import LayoutError, find_sources
from trainmon.read.scan import scan
from trainmon.read.summaries import read_summaries
from trainmon.run.anomalies import anomaly_to_dict
from trainmon.run.anomaly_table import read_anomalies
from trainmon.run.damage import damaged
from trainmon.run.dumps import DumpEntry, list_dumps
from trainmon.run.layout import rank_dir, stats_rank_dir
from trainmon.run.names import module_call, module_role
from trainmon.run.records import LOSS_SCALE_RULE, NON_FINITE_RULES, SKIPPED_RULE, STATS, Anomaly

__all__ = ["Explanation", "TensorFacts", "explain", "format_text", "module_role", "run_explain", "to_dict"]

# ``alert.capture: exact`` writes its dumps with a reason starting so, at the anomaly's own step.
EXACT_PREFIX = "exact:"
# Anomalies that mean a step's update did not land (GradScaler/DeepSpeed/Megatron overflow, alert.on_nan).
SKIP_RULES = frozenset({LOSS_SCALE_RULE, SKIPPED_RULE})
# The origin is among the first anomalies of its step; this many of the earliest are searched for it.
_FIRST_ANOMALIES = 64
# Steps before the NaN looked at for loss-scale / learning-rate changes and skipped steps.
LOOKBACK_STEPS = 20
# A magnitude within this fraction of the dtype's largest finite value is "near the max": a sum of 16 such
# values, or a product with anything above 16, overflows.
NEAR_MAX_FRACTION = 1 / 16
# Largest finite value per dtype (IEEE / OCP definitions), by the names torch, numpy and MindSpore print.
_DTYPE_MAX = {
    "float16": 65504.0,
    "half": 65504.0,
    "bfloat16": 3.3895313892515355e38,
    "float32": 3.4028234663852886e38,
    "float": 3.4028234663852886e38,
    "float64": 1.7976931348623157e308,
    "double": 1.7976931348623157e308,
    "float8_e4m3fn": 448.0,
    "float8_e5m2": 57344.0,
}


def dtype_max(dtype: str) -> float | None:
    """The largest finite value of a floating dtype by any of its printed names; None when unknown."""
    return _DTYPE_MAX.get(dtype.rpartition(".")[2].lower())


_LOSS_SCALE = re.compile(r"(?:^|[._/-])(?:loss[_-]?scale|grad[_-]?scaler?(?:[_-]?scale)?)(?:$|[._/-])", re.I)
_LEARNING_RATE = re.compile(r"(?:^|[._/-])(?:lr|learning[_-]?rate)(?:$|[._/-]|_\d+$)", re.I)

# A parameter's tensors in the order they come about in a step: value, gradient, then the Adam moments.
_STATE_ORDER = {"param_origin": 0, "grad_unreduced": 1, "grad_reduced": 2, "exp_avg": 3, "exp_avg_sq": 4}
ROLE_ORDER = {"input": 0, "output": 1, "output_grad": 2, "input_grad": 3}
# What flows into a module call, and out of it, per phase.
_FLOW = {"input": ("input", "output"), "output": ("input", "output")}
_FLOW.update({"output_grad": ("output_grad", "input_grad"), "input_grad": ("output_grad", "input_grad")})


def key_order(key: str) -> tuple[int, int, str]:
    """Order of the inputs of one call: a single input, then positional ones by number, then keywords."""
    if not key:
        return (0, 0, "")
    return (1, int(key), "") if key.isdigit() else (2, 0, key)


@dataclass(frozen=True)
class TensorFacts:
    """One tensor's statistics at the step (CSV row; counts are of its elements, min/max of the finite
    ones), its role in the origin's module call (``input``, ``output``, ``param``, ...) and its dtype."""

    role: str
    kind: str
    name: str
    nans: float
    infs: float
    min: float
    max: float
    norm: float
    dtype: str  # "" when neither a dump nor the CSV names it

    @property
    def finite(self) -> bool:
        return self.nans == 0 and self.infs == 0

    @property
    def max_abs(self) -> float:
        """The largest finite magnitude (NaN when no value was finite)."""
        return max(abs(self.min), abs(self.max))

    @property
    def of_dtype_max(self) -> float | None:
        """``max_abs`` over the dtype's largest finite value; None for an unknown dtype."""
        return self.of_max(self.dtype)

    def of_max(self, dtype: str) -> float | None:
        """``max_abs`` over ``dtype``'s largest finite value; None for an unknown dtype."""
        top = dtype_max(dtype)
        return self.max_abs / top if top else None

    @property
    def near_max(self) -> bool:
        ratio = self.of_dtype_max
        return ratio is not None and ratio >= NEAR_MAX_FRACTION


@dataclass(frozen=True)
class ScalarTrack:
    """A tracked scalar over the steps before the NaN: its value at each step (the first micro-step's row)
    and where it changed."""

    name: str
    values: tuple[tuple[int, float], ...]
    changes: tuple[tuple[int, float, float], ...]  # (step, before, after)


@dataclass(frozen=True)
class Explanation:
    first: Anomaly  # the first NaN/Inf anomaly of the run
    origin: Anomaly  # the origin at that step (first itself when none is marked)
    module: str  # the origin's module; "" when the origin is not a module input or output
    tensors: tuple[TensorFacts, ...]  # the module call at the step: inputs, outputs, then its parameters
    statistics: str  # "" when read; else why there are none (no CSV, no rows at the step)
    loss_scale: tuple[ScalarTrack, ...]
    learning_rate: tuple[ScalarTrack, ...]
    skipped: tuple[tuple[int, str], ...]  # (step, rule) of skipped steps in the look-back window
    window: tuple[int, int]  # steps looked at for changes and skips
    exact_dumps: tuple[DumpEntry, ...]  # dumps of the origin's step, by alert.capture: exact, to open first
    more_exact: int  # the exact capture's other dumps of that step (other parameters and their state)
    other_dumps: tuple[DumpEntry, ...]  # the origin tensor's other dumps (requests, later steps)
    verdict: str
    notes: tuple[str, ...] = field(default=())
    # the first anomaly's rank made no NaN/Inf of its own at that step: it reached it from another rank
    received: bool = False


def _first_non_finite(
    run: Path, step: int | None = None, rules: frozenset[str] = NON_FINITE_RULES, rank: int | None = None
) -> tuple[Anomaly, Anomaly, bool] | None:
    """(the first NaN/Inf anomaly, of ``rank`` when given; the origin at its step: its rank's own, else the
    earliest on another rank, else the first itself; whether its rank received it from another rank)."""
    summary = scan(run, top=_FIRST_ANOMALIES, step=step, rules=rules, ranks=None if rank is None else {rank})
    first = summary.first
    if first is None:
        return None
    at_step = [a for a in summary.top if a.step == first.step and a.origin]
    own = next((a for a in at_step if a.rank == first.rank), None)
    if own is not None:
        return first, own, False
    if not at_step:  # the step's earliest over every rank: an origin on another rank is among them
        at_step = [a for a in scan(run, top=_FIRST_ANOMALIES, step=first.step, rules=rules).top if a.origin]
    origin = next((a for a in at_step if a.rank == first.rank), at_step[0] if at_step else first)
    return first, origin, _received(run, first)


def _received(run: Path, a: Anomaly) -> bool:
    """Whether ``a``'s rank made no NaN/Inf of its own at ``a``'s step but received another rank's: its
    records there are propagated, none is an origin. A rank's records are propagated only after its own
    origin, or after another rank's NaN/Inf showed in its statistics merged over ranks while its own pieces
    held none (trainmon.anomaly.origin)."""
    records = read_anomalies(run, a.rank, a.step, a.step)
    return any(r.propagated for r in records) and not any(r.origin for r in records)


def _skipped_steps(run: Path, lo: int, hi: int) -> tuple[tuple[int, str], ...]:
    found: set[tuple[int, str]] = set()
    for rank, s in read_summaries(run).items():  # only the ranks that recorded a skip, only the window
        if not SKIP_RULES & set(s.counts):
            continue
        for a in read_anomalies(run, rank, lo, hi):
            if a.rule in SKIP_RULES:
                found.add((a.step, a.rule))
    return tuple(sorted(found))


def _rows(
    run: Path, rank: int, kind: str, steps: tuple[int, int]
) -> Iterable[tuple[str, int, int | None, dict]]:
    """(name, step, micro_step, {stat: value}) of every CSV row of ``kind`` on ``rank`` in ``steps``; for a
    rank without CSV files (above 16 ranks only the ranks with TensorBoard events write them), the
    statistics store's rows, whose micro-steps are merged (``micro_step`` None)."""
    try:
        sources = find_sources([rank_dir(run, rank)], kinds={kind}, steps=steps)
    except (LayoutError, OSError):
        sources = []
    if not sources and not _has_csv(run, rank):
        yield from _store_rows(run, rank, kind, steps)
        return
    # imported here: it imports pandas (half a second), which the TensorBoard plugin (importing this module
    # for its dump ordering) would otherwise pay at TensorBoard's start, before it reads any run
    from trainmon.read.csv import read_kind

    for source in sources:
        tables, _ = read_kind(source, steps=steps, skip_bad=True)
        for t in tables:
            for i in range(len(t)):
                values = dict(zip(t.stats, (float(v) for v in t.values[i]), strict=True))
                yield t.names[t.code[i]], int(t.step[i]), int(t.micro[i]), values


def _has_csv(run: Path, rank: int) -> bool:
    return any(rank_dir(run, rank).glob("*.csv"))


def _store_rows(
    run: Path, rank: int, kind: str, steps: tuple[int, int]
) -> Iterable[tuple[str, int, None, dict]]:
    """The statistics store's rows of ``kind`` on ``rank`` in ``steps`` (micro-steps merged)."""
    from trainmon.run.statstore import read_stats  # pyarrow: only for a rank without CSV

    try:
        frame = read_stats(run, rank, STATS, steps[0], steps[1], kinds=[kind])
    except (OSError, ValueError):
        return
    for i, step in enumerate(frame.steps.tolist()):
        for j, (_, name) in enumerate(frame.tensors):
            values = {s: float(frame.values[s][i, j]) for s in STATS}
            if not math.isnan(values["nans"]):  # NaN counts: the tensor has no row at this step
                yield name, step, None, values


def _csv_dtypes(run: Path, rank: int, kind: str, step: int, names: set[str]) -> dict[str, str]:
    """The ``dtype`` column of the rows of ``names`` at ``step`` (the statistics reader drops it)."""
    out: dict[str, str] = {}
    for path in sorted(rank_dir(run, rank).glob(f"{kind}*.csv")):
        try:
            with open(path, newline="") as f:
                for row in csv.DictReader(f):
                    if row.get("name") in names and row.get("step") == str(step) and row.get("dtype"):
                        out[row["name"]] = row["dtype"]
        except (OSError, csv.Error, UnicodeDecodeError):
            continue
    return out


def _module_facts(
    run: Path, origin: Anomaly, module: str, flow: tuple[str, str], dtypes: dict[tuple[str, str], str]
) -> tuple[TensorFacts, ...]:
    """TensorFacts of the origin's module call (the origin's micro-step) and, for a forward origin, of the
    module's parameters before the update (``param_origin``), at the origin's step."""
    step, rank = origin.step, origin.rank
    kind = "actv" if flow[0] == "input" else "actv_grad"
    facts: list[tuple[tuple, TensorFacts]] = []  # (display order, facts): inputs, outputs, parameters
    own = module_call(origin.kind, origin.name)
    number = own.call if own else 0
    for name, _, micro, v in _rows(run, rank, kind, (step, step)):
        found = module_call(kind, name)
        if (
            found is None
            or (found.module, found.call) != (module, number)
            or found.role not in flow
            or micro not in (None, origin.micro_step)
        ):
            continue
        order = (flow.index(found.role), key_order(found.key), name)
        facts.append((order, _facts(found.role, kind, name, v)))
    if flow[0] == "input":
        for name, _, micro, v in _rows(run, rank, "param_origin", (step, step)):
            if name.startswith(module + ".") and micro in (None, 0):
                facts.append(((2, (0, 0, ""), name), _facts("param", "param_origin", name, v)))
    facts.sort(key=lambda f: f[0])
    return _with_dtypes(run, origin, [f for _, f in facts], dtypes)


def _with_dtypes(
    run: Path, origin: Anomaly, facts: list[TensorFacts], dtypes: dict[tuple[str, str], str]
) -> tuple[TensorFacts, ...]:
    """``facts`` with their dtype: from the step's dumps, else from the CSV rows."""
    missing: dict[str, set[str]] = {}
    for f in facts:
        if (f.kind, f.name) not in dtypes:
            missing.setdefault(f.kind, set()).add(f.name)
    for kind, names in missing.items():
        found = _csv_dtypes(run, origin.rank, kind, origin.step, names)
        dtypes.update({(kind, n): d for n, d in found.items()})
    if any((f.kind, f.name) not in dtypes for f in facts):  # the statistics store keeps every tensor's dtype
        stored = _store_dtypes(run, origin.rank, origin.step)
        dtypes.update({k: d for k, d in stored.items() if k not in dtypes})
    return tuple(replace(f, dtype=_short_dtype(dtypes.get((f.kind, f.name), ""))) for f in facts)


def _store_dtypes(run: Path, rank: int, step: int) -> dict[tuple[str, str], str]:
    """The dtype of each tensor of ``rank`` at ``step`` the statistics store holds (stores written before
    dtypes were kept hold none)."""
    from trainmon.run.statstore import read_meta  # pyarrow: only when neither dumps nor CSV name the dtype

    meta = read_meta(run, rank, step, step)
    return {t: d for t, d in zip(meta.tensors, meta.dtypes, strict=True) if d}


def _facts(role: str, kind: str, name: str, v: dict[str, float]) -> TensorFacts:
    nan = float("nan")
    return TensorFacts(
        role=role,
        kind=kind,
        name=name,
        nans=v.get("nans", nan),
        infs=v.get("infs", nan),
        min=v.get("min", nan),
        max=v.get("max", nan),
        norm=v.get("norm", nan),
        dtype="",
    )


def _short_dtype(dtype: str) -> str:
    return dtype.rpartition(".")[2]  # "torch.float16" -> "float16"


def _scalar_tracks(
    run: Path, rank: int, window: tuple[int, int], pattern: re.Pattern
) -> tuple[ScalarTrack, ...]:
    series: dict[str, dict[int, float]] = {}
    for name, step, micro, v in _rows(run, rank, "scalar", window):
        if pattern.search(name) and micro in (None, 0):
            series.setdefault(name, {}).setdefault(step, v.get("max", float("nan")))
    tracks = []
    for name, by_step in sorted(series.items()):
        values = tuple(sorted(by_step.items()))
        changes = tuple(
            (s, a, b) for (_, a), (s, b) in zip(values, values[1:], strict=False) if not _same(a, b)
        )
        tracks.append(ScalarTrack(name, values, changes))
    return tuple(tracks)


def _same(a: float, b: float) -> bool:
    return a == b or (a != a and b != b)  # NaN stays NaN: no change


def _dumps(
    run: Path, origin: Anomaly, module: str
) -> tuple[tuple[DumpEntry, ...], int, tuple[DumpEntry, ...]]:
    """(the exact capture's dumps of the origin's step to open first, how many other dumps that capture
    made, the origin tensor's other dumps).

    Shown in this order, each group from the origin's micro-step on (the micro-step where the NaN/Inf was,
    then the others in order): the origin module's call (inputs, outputs, their gradients), the tracked
    scalars, the activations of the modules inside it, then its parameters with their gradients and Adam
    state."""
    entries = list_dumps(run)
    exact = [
        e
        for e in entries
        if e.step == origin.step and e.rank == origin.rank and e.reason.startswith(EXACT_PREFIX)
    ]
    call = module_call(origin.kind, origin.name)
    number = call.call if call else 0

    def micro(e: DumpEntry) -> tuple[bool, int]:
        return (e.micro_step != origin.micro_step, e.micro_step)

    def rank_of(e: DumpEntry) -> tuple | None:
        """The place of ``e`` in the list (unique with ``e.path`` last), None for dumps not shown."""
        found = module_call(e.kind, e.name)
        if module and found and (found.module, found.call) == (module, number):
            return (0, *micro(e), ROLE_ORDER[found.role], key_order(found.key), e.name, e.path)
        if (e.kind, e.name) == (origin.kind, origin.name):
            return (0, *micro(e), -1, (0, 0, ""), e.name, e.path)
        if e.kind == "scalar":
            return (1, *micro(e), 0, (0, 0, ""), e.name, e.path)
        if module and found and found.module.startswith(module + "."):  # a module inside the origin's
            return (2, *micro(e), ROLE_ORDER[found.role], key_order(found.key), e.name, e.path)
        if module and e.name.startswith(module + "."):  # the module's parameters, gradients, Adam state
            state = _STATE_ORDER.get(e.kind, len(_STATE_ORDER))
            return (3, False, 0, 0, (0, 0, ""), f"{e.name}\0{state}", e.path)
        return None

    shown = sorted(((r, e) for e in exact if (r := rank_of(e)) is not None), key=lambda re_: re_[0])
    first = tuple(e for _, e in shown)
    seen = {e.path for e in first}
    other = tuple(
        e
        for e in entries
        if (e.kind, e.name, e.rank) == (origin.kind, origin.name, origin.rank) and e.path not in seen
    )
    return first, len(exact) - len(first), other


def explain(
    run: str | Path,
    step: int | None = None,
    rules: frozenset[str] = NON_FINITE_RULES,
    rank: int | None = None,
) -> Explanation | None:
    """What the run's files say about its first NaN/Inf (at ``step``, of ``rules``: ``nan``, ``inf`` or both,
    on ``rank``, when given); None when it has no such anomaly. On a rank that received the NaN/Inf from
    another rank, the origin explained is that rank's."""
    if not rules or not rules <= NON_FINITE_RULES:
        raise ValueError(f"explain: rules must be among {sorted(NON_FINITE_RULES)}, got {sorted(rules)}")
    run = Path(run)
    found = _first_non_finite(run, step, rules, rank)
    if found is None:
        return None
    first, origin, received = found
    role = module_role(origin.kind, origin.name)
    module = role[0] if role else ""
    exact, more_exact, other = _dumps(run, origin, module)
    dtypes = {(e.kind, e.name): e.dtype for e in exact if e.micro_step == origin.micro_step}
    tensors: tuple[TensorFacts, ...] = ()
    if role is not None:
        tensors = _module_facts(run, origin, module, _FLOW[role[1]], dtypes)
    else:
        own = [
            _facts("origin", origin.kind, n, v)
            for n, _, micro, v in _rows(run, origin.rank, origin.kind, (origin.step, origin.step))
            if n == origin.name and micro in (None, origin.micro_step)
        ]
        tensors = _with_dtypes(run, origin, own, dtypes)
    statistics = ""
    notes: tuple[str, ...] = ()
    if not _has_csv(run, origin.rank):
        if tensors:
            notes = (f"statistics from the statistics store: rank {origin.rank} wrote no CSV (format, "
                     "csv_ranks), so they are of the whole step, micro-steps merged",)  # fmt: skip
        elif damaged(stats_rank_dir(run, origin.rank)):
            statistics = (f"rank {origin.rank} wrote no CSV (format, csv_ranks) and its statistics store is "
                          "damaged (see the warning below)")  # fmt: skip
        else:
            statistics = f"no statistics CSV in {run / f'rank_{origin.rank}'} (format without csv?)"
    elif not tensors:
        statistics = f"no statistics row of {module or origin.name} at step {origin.step}"
    window = (max(0, origin.step - LOOKBACK_STEPS), origin.step)
    if received and not origin.origin:  # no rank's origin to judge: only where this rank's NaN/Inf came from
        verdict = _received_verdict(first)
    else:
        verdict = _verdict(origin, module, tensors, statistics)
    return Explanation(
        first=first,
        origin=origin,
        module=module,
        tensors=tensors,
        statistics=statistics,
        loss_scale=_scalar_tracks(run, origin.rank, window, _LOSS_SCALE),
        learning_rate=_scalar_tracks(run, origin.rank, window, _LEARNING_RATE),
        skipped=_skipped_steps(run, window[0], window[1] - 1),
        window=window,
        exact_dumps=exact,
        more_exact=more_exact,
        other_dumps=other,
        verdict=verdict,
        notes=notes,
        received=received,
    )


def _fmt(x: float) -> str:
    return f"{x:.6g}"


def _ratio(t: TensorFacts) -> str:
    """``max |x|`` over the dtype's largest value: "?" for an unknown dtype, "-" without a finite element."""
    ratio = t.of_dtype_max
    if ratio is None:
        return "?"
    return "-" if math.isnan(ratio) else f"{ratio:.2g}" + (" (near)" if t.near_max else "")


def _count(x: float) -> str:
    """An element count as the integer it is (1048576, never 1.04858e+06); "?" when not recorded."""
    return str(int(x)) if math.isfinite(x) and x == int(x) else "?" if math.isnan(x) else _fmt(x)


def compute_dtype(tensors: tuple[TensorFacts, ...]) -> tuple[str, bool]:
    """The dtype a module call computed in, and whether that is narrower than what flowed in (autocast).

    Read from what flowed out: under ``torch.autocast`` a Linear fed float32 returns float16 (or bfloat16),
    having cast its input to that dtype first, so an input beyond float16's range overflows there, however
    far it is from float32's largest value. Without a narrower output it is the inputs' own dtype."""
    inflow = [t for t in tensors if t.role in ("input", "output_grad") and dtype_max(t.dtype)]
    outflow = [t for t in tensors if t.role in ("output", "input_grad") and dtype_max(t.dtype)]
    if not outflow:
        return "", False
    narrowest = min(outflow, key=lambda t: dtype_max(t.dtype) or 0.0).dtype
    widest_in = max((dtype_max(t.dtype) or 0.0 for t in inflow), default=0.0)
    return narrowest, bool(inflow) and (dtype_max(narrowest) or 0.0) < widest_in


def _received_verdict(first: Anomaly) -> str:
    """What a rank that received another rank's NaN/Inf can say when no rank marked the origin."""
    return (
        f"rank {first.rank} received the NaN/Inf from another rank (its own pieces held none) and no origin "
        f"is marked among step {first.step}'s earliest records: look at the ranks whose statistics "
        f"{first.kind} {first.name} is merged with (trainmon analyze --step {first.step} --rule nan,inf)"
    )


def _verdict(origin: Anomaly, module: str, tensors: tuple[TensorFacts, ...], statistics: str) -> str:
    if statistics:
        return f"no statistics to judge by: {statistics}"
    inputs = [t for t in tensors if t.role in ("input", "output_grad")]
    params = [t for t in tensors if t.role == "param"]
    if not module:
        return (
            f"{origin.kind} {origin.name} is not a module input or output: look at what produced it "
            "(its module's activations and gradients at this step)"
        )
    if not inputs:
        return f"the inputs of {module} were not recorded at step {origin.step}"
    if bad := [t.name for t in inputs if not t.finite]:
        return f"input {', '.join(bad)} of {module} was already non-finite: the NaN/Inf came from upstream"
    if bad := [t.name for t in params if not t.finite]:
        return (
            f"parameter {', '.join(bad)} of {module} was already non-finite before this step's update: an "
            "earlier update wrote it"
        )
    compute, narrowed = compute_dtype(tensors)
    if narrowed:  # judged against the dtype the module computed in, not the inputs' own
        ratio = {t.name: t.of_max(compute) or 0.0 for t in inputs}
        t = max(inputs, key=lambda t: ratio[t.name])
        if ratio[t.name] > 1:
            return (
                f"input {t.name} (|x| up to {_fmt(t.max_abs)}, {t.dtype}) exceeds {compute}'s range under "
                f"autocast ({compute}'s largest value is {_fmt(dtype_max(compute) or 0.0)}, and {module} "
                f"computes in {compute}): the overflow happened inside {module}, casting it down"
            )
        if ratio[t.name] >= NEAR_MAX_FRACTION:
            return (
                f"input {t.name} reaches {ratio[t.name]:.2g} of {compute}'s largest value, the dtype "
                f"{module} computes in under autocast (|x| up to {_fmt(t.max_abs)}): an overflow inside "
                f"{module} is likely"
            )
    if not narrowed and (near := [t for t in inputs if t.near_max]):
        t = max(near, key=lambda t: t.of_dtype_max or 0)
        return (
            f"input {t.name} reaches {t.of_dtype_max:.2g} of {t.dtype}'s largest value (|x| up to "
            f"{_fmt(t.max_abs)}): an overflow inside {module} is likely"
        )
    big = max(inputs, key=lambda t: t.max_abs if t.max_abs == t.max_abs else -1.0)
    if narrowed:
        dtype = f" and far from {compute}'s largest value (it computes in {compute} under autocast)"
    else:
        dtype = f" and far from {big.dtype}'s largest value" if big.of_dtype_max is not None else ""
    return (
        f"the inputs of {module} were finite{dtype} (|x| up to {_fmt(big.max_abs)}): the NaN/Inf was made "
        f"inside {module}, by its own computation or its parameters"
    )


# ----------------------------------------------------------------------------------------------- output


def _dump_line(run: Path, e: DumpEntry) -> str:
    shape = "x".join(map(str, e.shape)) or "scalar"
    micro = f" m{e.micro_step}" if e.micro_step else ""
    note = f"  ({e.note})" if e.note else ""
    return f"    {run / e.path}\n        step {e.step}{micro}: {e.kind} {e.name}, {e.dtype} {shape}{note}"


def _track_lines(
    label: str, tracks: tuple[ScalarTrack, ...], window: tuple[int, int], hint: str
) -> list[str]:
    if not tracks:
        return [f"  {label}: not recorded ({hint})"]
    lines = []
    for t in tracks:
        last_step, last = t.values[-1]
        head = f"  {label} ({t.name}): {_fmt(last)} at step {last_step}"
        if t.changes:
            changes = ", ".join(f"step {s}: {_fmt(a)} -> {_fmt(b)}" for s, a, b in t.changes)
            lines.append(f"{head}; changed at {changes}")
        else:
            lines.append(f"{head}; unchanged over steps {t.values[0][0]}-{last_step}")
    return lines


def _origin_lines(e: Explanation) -> list[str]:
    """The origin as its record says: ``origin:`` only for a record marked so; the first anomaly's rank when
    it received the NaN/Inf from another rank."""
    f, o = e.first, e.origin
    place = f"{o.phase}, micro-step {o.micro_step}, rank {o.rank}"
    if o.origin:
        lines = [f"  origin: {o.kind} {o.name} (origin, {place})"]
    else:
        flags = "propagated, " if o.propagated else ""
        why = "" if e.received else " (no module call turned finite inputs into a non-finite output)"
        lines = [f"  no origin marked at step {o.step}{why}; explained: {o.kind} {o.name} ({flags}{place})"]
    if o.message:
        lines.append(f"  {o.message}")
    if e.received:
        source = f"rank {o.rank}'s origin above" if o.origin and o.rank != f.rank else "no origin marked"
        lines.append(
            f"  rank {f.rank} made no NaN/Inf of its own at step {f.step}: it came from another rank "
            f"({source}), first seen in statistics merged over ranks whose own piece on rank {f.rank} "
            "was finite"
        )
        if f.message and f is not o:
            lines.append(f"  {f.message}")
    return lines


def format_text(e: Explanation, run: Path) -> str:
    o = e.origin
    lines = [
        f"FIRST NaN/Inf in {run}: step {e.first.step}, rank {e.first.rank}: {e.first.kind} {e.first.name} "
        f"[{e.first.rule}]",
        *_origin_lines(e),
    ]
    lines.append("")
    title = f"module {e.module}" if e.module else f"{o.kind} {o.name}"
    lines.append(f"STATISTICS AT STEP {o.step} ({title}, rank {o.rank}, micro-step {o.micro_step})")
    if e.statistics:
        lines.append(f"  {e.statistics}")
    else:
        rows = [("role", "name", "dtype", "finite", "nans", "infs", "max |x|", "of dtype max")]
        for t in e.tensors:
            rows.append(
                (
                    t.role,
                    t.name,
                    t.dtype or "?",
                    "yes" if t.finite else "NO",
                    _count(t.nans),
                    _count(t.infs),
                    _fmt(t.max_abs),
                    _ratio(t),
                )
            )
        widths = [max(len(r[j]) for r in rows) for j in range(len(rows[0]))]
        for r in rows:
            lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    lines.append(f"  => {e.verdict}")
    lines.extend(f"  ({note})" for note in e.notes)
    lines.append("")
    lo, hi = e.window
    lines.append(f"LOSS SCALE, LEARNING RATE, SKIPPED STEPS (steps {lo}-{hi}, rank {o.rank})")
    lines += _track_lines(
        "loss scale", e.loss_scale, e.window, 'track it: monitor.track("loss_scale", scale)'
    )
    lines += _track_lines("learning rate", e.learning_rate, e.window, 'track it: monitor.track("lr", lr)')
    if e.skipped:
        lines.append("  skipped steps: " + ", ".join(f"{s} ({rule})" for s, rule in e.skipped))
    else:
        lines.append(
            f"  skipped steps: none recorded in steps {lo}-{hi - 1}" if hi > lo else "  skipped: none"
        )
    lines.append("")
    lines.append("DUMPS TO OPEN")
    if e.exact_dumps:
        lines.append(f"  at step {o.step} (alert.capture: exact), the origin module's call first:")
        lines += [_dump_line(run, d) for d in e.exact_dumps]
        if e.more_exact:
            lines.append(
                f"  + {e.more_exact} more of that capture (other parameters, gradients, Adam moments): "
                f"trainmon dump ls {run} --step {o.step}"
            )
    else:
        lines.append(
            f"  none at step {o.step}: with alert.capture: exact the monitor dumps the origin module's "
            "inputs and outputs at the step it happens"
        )
    if e.other_dumps:
        lines.append(f"  other dumps of {o.kind} {o.name}:")
        lines += [_dump_line(run, d) for d in e.other_dumps]
    if e.exact_dumps or e.other_dumps:  # nothing to open otherwise
        lines.append(
            f"  open one with: trainmon dump show FILE, or in TensorBoard's trainmon tab (step {o.step})"
        )
    return "\n".join(lines)


def _num(x: float) -> float | str:
    return x if x == x and abs(x) != float("inf") else ("nan" if x != x else ("inf" if x > 0 else "-inf"))


def to_dict(e: Explanation, run: Path) -> dict[str, Any]:
    """A JSON-ready form (non-finite numbers as the strings "nan", "inf", "-inf", as in the JSONL files)."""

    def tensor(t: TensorFacts) -> dict[str, Any]:
        d = {k: _num(v) if isinstance(v, float) else v for k, v in t.__dict__.items()}
        for count in ("nans", "infs"):  # element counts as integers
            x = getattr(t, count)
            if math.isfinite(x) and x == int(x):
                d[count] = int(x)
        ratio = t.of_dtype_max
        return {
            **d,
            "finite": t.finite,
            "max_abs": _num(t.max_abs),
            "of_dtype_max": None if ratio is None else _num(ratio),  # NaN: no finite element
            "near_max": t.near_max,
        }

    def track(t: ScalarTrack) -> dict[str, Any]:
        return {
            "name": t.name,
            "values": [[s, _num(v)] for s, v in t.values],
            "changes": [[s, _num(a), _num(b)] for s, a, b in t.changes],
        }

    def dump(d: DumpEntry) -> dict[str, Any]:
        return {**d.to_dict(), "file": str(run / d.path)}

    return {
        "first": anomaly_to_dict(e.first),
        "origin": anomaly_to_dict(e.origin),
        "received": e.received,
        "module": e.module,
        "tensors": [tensor(t) for t in e.tensors],
        "statistics": e.statistics,
        "notes": list(e.notes),
        "verdict": e.verdict,
        "window": list(e.window),
        "loss_scale": [track(t) for t in e.loss_scale] or "not recorded",
        "learning_rate": [track(t) for t in e.learning_rate] or "not recorded",
        "skipped": [[s, r] for s, r in e.skipped],
        "exact_dumps": [dump(d) for d in e.exact_dumps],
        "more_exact_dumps": e.more_exact,
        "other_dumps": [dump(d) for d in e.other_dumps],
    }


def run_explain(
    run: Path,
    as_json: bool,
    out: TextIO,
    step: int | None = None,
    rules: frozenset[str] = NON_FINITE_RULES,
    rank: int | None = None,
) -> int:
    """``trainmon analyze RUN --explain [--step S] [--rule nan|inf] [--rank R] [--json]``: 0, also when the
    run has no such NaN/Inf (it says so)."""
    e = explain(run, step, rules, rank)
    if as_json:
        json.dump(to_dict(e, run) if e else None, out, indent=2, allow_nan=False)
        print(file=out)
    elif e is None:
        what = "NaN/Inf" if rules == NON_FINITE_RULES else "/".join(sorted(rules))
        where = ("" if step is None else f" at step {step}") + ("" if rank is None else f" on rank {rank}")
        print(f"no {what} anomaly recorded in {run}{where}", file=out)
    else:
        print(format_text(e, run), file=out)
    return 0
