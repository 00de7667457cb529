"""Where a NaN/Inf started: the first module call that turned finite inputs into a non-finite output.

Works on the statistics a step already has (no extra host read). Module hooks record the rows of every
call (``trainmon.run.names``): what flows into it (its inputs in forward, the gradients of its outputs in
backward) and what flows out (its outputs, the gradients of its inputs). The rule, one for forward and
backward, leaves and parents:

    The origin is the first module call, in the order calls end, whose inflowing rows were all finite and
    one of whose outflowing rows was not (in saturation mode, as on Ascend: reached its dtype's largest
    magnitude). Forward calls end before backward calls.

A call ends after the calls it makes, so when a NaN is born inside a leaf, the leaf is found before its
parents; when it is born in a parent's own code (between two children, or after the last), every child it
reached had a bad inflow, and the parent is the origin. Later calls with bad outputs are propagation.

Pairing a call's rows: in forward a call's inputs and outputs are recorded together when it ends; in
backward the gradients of its outputs arrive when its backward starts and those of its inputs when it ends,
with its children's rows (and, where a child's output is the parent's output, the parent's ``output_grad``
after the child's) in between. So rows are paired per (module, call number, kind, stage, micro-step): an
inflowing row opens a call unless that module's open call has no outflow yet; an outflowing row belongs to
the module's open call.

A module's hook fires when its call ends, after its children's. When the NaN is born in a parent's own code,
the children it reaches show it before the parent's outflow row does: the origin's anomalies are moved in
front of that burst (``mark``), so everything that orders anomalies by ``seq`` (the anomaly files, ``trainmon
analyze``, alerts, the plugin) names the origin first.

Rows merged over ranks. The statistics of a tensor split over ranks (a DTensor sharded over a mesh dimension:
tensor parallelism's activations, FSDP2's parameters; ZeRO's shards) are the whole tensor's on every rank of
the group, so they carry another rank's NaN as if this rank had made it. The rule judges what each rank
itself computed: a merged row is bad when this rank's own piece held NaN/Inf (``StepRecord.own_nonfinite``,
counted before the merge). A merged row whose whole tensor holds NaN/Inf that this rank's own piece does not
shows another rank's NaN (a *peer* row); it counts as bad inflow, and from the first one on the rank names no
origin of its own: what goes bad after it came from the other rank (through the layers' collectives, as a
row-wise layer's all-reduce), not from a module of this rank. Such a rank gets :class:`Received` instead of
an :class:`Overflow`: its bad outflow rows from there on are propagated, and the peer rows say in their
message that the NaN/Inf is another rank's. The records keep the whole tensor's counts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from trainmon.run.names import flows_in, module_call
from trainmon.run.records import Anomaly, Derived, Kind, StepRecord

_ACTIVATION_KINDS = (Kind.ACTV.value, Kind.ACTV_GRAD.value)


@dataclass(frozen=True)
class Overflow:
    """The origin of a step's overflow on one rank, and the rows it spread to."""

    module: str
    kind: str  # actv (forward) or actv_grad (backward)
    vpp_stage: int
    micro_step: int
    origin_seqs: frozenset[int]  # the bad output rows of the origin call
    propagated_seqs: frozenset[int]  # bad output rows of later calls
    # the first bad row of the origin's call: a descendant's row when the NaN was born in a parent's own code
    # (its outflow is recorded after its children's), else the origin's first bad output row
    burst_start: int = -1
    call: int = 0  # the origin call's number in its micro-step (its rows' ``#n``; 0 for the first)
    peer_seqs: frozenset[int] = frozenset()  # rows holding another rank's NaN/Inf only (after the origin)


@dataclass(frozen=True)
class Received:
    """A step's NaN/Inf on a rank that made none of its own: it first showed in rows merged over ranks whose
    whole tensor held NaN/Inf that this rank's own piece did not, so it was made on another rank."""

    peer_seqs: frozenset[int]  # rows holding another rank's NaN/Inf only (merged; this rank's piece finite)
    propagated_seqs: frozenset[int]  # bad outflow rows of the calls from the first peer row on


@dataclass
class _Call:
    module: str
    call: int
    kind: str
    vpp_stage: int
    micro_step: int
    start: int  # seq of the call's first row
    inputs_bad: bool = False
    bad_outputs: list[int] = dataclasses.field(default_factory=list)
    seen_output: bool = False


def _saturation_limit(dtype: object) -> float:
    """Largest finite magnitude of a floating dtype (inf for anything else)."""
    try:  # imported here: the anomaly sink also serves the MindSpore monitor, whose venv has no torch
        import torch
    except ImportError:
        return _numpy_saturation_limit(dtype)
    found = getattr(torch, dtype.removeprefix("torch."), None) if isinstance(dtype, str) else dtype
    if isinstance(found, torch.dtype):
        return float(torch.finfo(found).max) if found.is_floating_point else float("inf")
    return _numpy_saturation_limit(dtype)


def _numpy_saturation_limit(dtype: object) -> float:
    """Largest finite magnitude of a dtype numpy knows by name (MindSpore's ``Float16``, ``float32``...)."""
    try:
        info = np.finfo(np.dtype(str(dtype).lower()))
    except (TypeError, ValueError):  # not a dtype name, or not a floating one
        return float("inf")
    return float(info.max)


def bad_rows(record: StepRecord, derived: Derived, saturation: bool = False) -> np.ndarray:
    """Boolean mask of rows holding NaN/Inf in what this rank computed, or (saturation mode, as on Ascend) a
    value at the dtype's largest magnitude. A row merged over ranks counts this rank's own piece
    (``record.own_nonfinite``); saturation is judged on the whole tensor's extremes (the pieces' are not
    kept)."""
    rows = derived.rows
    own = record.own_nonfinite
    bad = (rows["nans"] > 0) | (rows["infs"] > 0) if own is None else np.asarray(own) > 0
    if saturation and len(record.rows):
        limits = np.array([_saturation_limit(r.dtype) for r in record.rows])
        with np.errstate(invalid="ignore"):
            bad |= (np.abs(rows["max"]) >= limits) | (np.abs(rows["min"]) >= limits)
    return bad


def peer_rows(record: StepRecord, derived: Derived) -> np.ndarray:
    """Boolean mask of rows merged over ranks whose whole tensor holds NaN/Inf that this rank's own piece
    does not: another rank's NaN/Inf, seen here through the merge of the statistics."""
    rows = derived.rows
    own = record.own_nonfinite
    if own is None:
        return np.zeros(len(rows["nans"]), dtype=bool)
    return ((rows["nans"] > 0) | (rows["infs"] > 0)) & ~(np.asarray(own) > 0)


def locate_overflow(
    record: StepRecord, derived: Derived, saturation: bool = False
) -> Overflow | Received | None:
    """The origin (see the module docstring); :class:`Received` when another rank's NaN/Inf reached this
    rank before any call of its own turned finite inflow into bad outflow; None when neither happened."""
    bad = bad_rows(record, derived, saturation)
    peer = peer_rows(record, derived)
    if not bad.any() and not peer.any():
        return None
    origin: _Call | None = None
    propagated: list[int] = []
    arrived: list[int] = []  # peer rows of activations, in order
    open_calls: dict[tuple[str, int, str, int, int], _Call] = {}
    for seq, row in enumerate(record.rows):
        if row.kind not in _ACTIVATION_KINDS:
            continue
        found = module_call(row.kind, row.name)
        if found is None:
            continue
        key = (found.module, found.call, row.kind, row.vpp_stage, row.micro_step)
        call = open_calls.get(key)
        inflow = flows_in(found.role)
        # an inflowing row opens a call, unless the module's open call is still taking its inflow
        if call is None or (inflow and call.seen_output):
            call = open_calls[key] = _Call(
                found.module, found.call, row.kind, row.vpp_stage, row.micro_step, seq
            )
        if peer[seq]:
            arrived.append(seq)
        if inflow:
            call.inputs_bad |= bool(bad[seq] or peer[seq])
            continue
        call.seen_output = True
        if not (bad[seq] or peer[seq]):
            continue
        # once another rank's NaN/Inf has shown here, what goes bad later spread from it (a layer's
        # collective hands it on): no call of this rank is its origin
        if origin is None and bad[seq] and not call.inputs_bad and not arrived:
            origin = call
        if call is origin and bad[seq]:
            origin.bad_outputs.append(seq)
        else:
            propagated.append(seq)
    if origin is None:
        if not arrived:
            return None
        return Received(frozenset(arrived), frozenset(s for s in propagated if s >= arrived[0]))
    return Overflow(
        origin.module,
        origin.kind,
        origin.vpp_stage,
        origin.micro_step,
        frozenset(origin.bad_outputs),
        frozenset(propagated),
        _burst_start(record, bad, origin),
        origin.call,
        frozenset(arrived),
    )


def _burst_start(record: StepRecord, bad: np.ndarray, origin: _Call) -> int:
    """The first bad row among the rows the origin's descendants recorded during the origin's call.

    Walking back from the origin's first bad outflow row: the call's own rows are passed over, and rows of
    modules under the origin's name (same kind, stage and micro-step) are the descendants'. In forward the
    descendants' rows come before the call's own (recorded when it ends); in backward they lie between the
    call's first row (an ``output_grad``) and its outflow, so the walk ends at the call's first row. Any
    other row ends the walk."""
    prefix = origin.module + "."
    first = origin.bad_outputs[0]
    forward = origin.kind == Kind.ACTV.value
    seq = first - 1
    while seq >= 0 and (forward or seq > origin.start):
        row = record.rows[seq]
        found = module_call(row.kind, row.name) if row.kind == origin.kind else None
        if found is None or (row.vpp_stage, row.micro_step) != (origin.vpp_stage, origin.micro_step):
            break
        if (found.module, found.call) == (origin.module, origin.call):
            if seq < origin.start:
                break  # an earlier call of the same module
        elif not found.module.startswith(prefix):
            break
        elif bad[seq]:
            first = seq
        seq -= 1
    return first


def mark(
    anomalies: Sequence[Anomaly], overflow: Overflow | Received | None, collectives: np.ndarray | None = None
) -> list[Anomaly]:
    """Set ``origin``/``propagated`` on anomalies of the rows the overflow names, and put the origin first.

    When the origin's call has a burst of bad child rows before its own (a NaN born in a parent's code), the
    origin's rows take the burst's place in the ``seq`` order and the rows from the burst on move one place
    down for each: ``seq`` stays a permutation of the rows, so every order built on it agrees. The origin
    also takes the collectives count of the burst's first row (``collectives``: per row, when distributed):
    the value went bad before the collectives its children issued after that.

    :class:`Received` (the NaN/Inf was made on another rank) marks its propagated rows and moves nothing.
    The NaN/Inf counts of peer rows keep the whole tensor's value, and their message says whose they are."""
    if overflow is None:
        return list(anomalies)
    if isinstance(overflow, Received):
        spread = overflow.propagated_seqs
        flagged = [dataclasses.replace(a, propagated=True) if a.seq in spread else a for a in anomalies]
        return [_peer_noted(a, overflow.peer_seqs) for a in flagged]
    moved = sorted(overflow.origin_seqs)
    start = overflow.burst_start
    if not moved or start < 0 or start >= moved[0]:
        moved, start = [], -1  # the origin's row is the first bad one already
    out = []
    for a in anomalies:
        seq = a.seq
        a = _peer_noted(a, overflow.peer_seqs)
        if a.seq in overflow.origin_seqs:
            a = dataclasses.replace(a, origin=True)
            if moved:
                seq = start + moved.index(a.seq)
                if collectives is not None:
                    a = dataclasses.replace(a, collectives=int(collectives[start]))
        else:
            if a.seq in overflow.propagated_seqs:
                a = dataclasses.replace(a, propagated=True)
            if moved and a.seq >= start:
                seq = a.seq + sum(1 for m in moved if m > a.seq)
        out.append(a if seq == a.seq else dataclasses.replace(a, seq=seq))
    return out


_COUNT_STATS = ("nans", "infs")


def _peer_noted(a: Anomaly, peer_seqs: frozenset[int]) -> Anomaly:
    """``a``, its message saying whose NaN/Inf it counts when its row holds another rank's only."""
    if a.seq not in peer_seqs or a.stat not in _COUNT_STATS:
        return a
    note = (f"the whole tensor's, merged over ranks: rank {a.rank}'s own piece has none, they came from "
            "another rank")  # fmt: skip
    return dataclasses.replace(a, message=f"{a.message} ({note})" if a.message else note)
