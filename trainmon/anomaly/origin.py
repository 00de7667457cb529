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
    """Boolean mask of rows holding NaN/Inf, or (saturation mode, as on Ascend) a value at the dtype's
    largest magnitude."""
    rows = derived.rows
    bad = (rows["nans"] > 0) | (rows["infs"] > 0)
    if saturation and len(record.rows):
        limits = np.array([_saturation_limit(r.dtype) for r in record.rows])
        with np.errstate(invalid="ignore"):
            bad |= (np.abs(rows["max"]) >= limits) | (np.abs(rows["min"]) >= limits)
    return bad


def locate_overflow(record: StepRecord, derived: Derived, saturation: bool = False) -> Overflow | None:
    """The origin (see the module docstring), or None when no call turned finite inflow into bad outflow."""
    bad = bad_rows(record, derived, saturation)
    if not bad.any():
        return None
    origin: _Call | None = None
    propagated: list[int] = []
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
        if inflow:
            call.inputs_bad |= bool(bad[seq])
            continue
        call.seen_output = True
        if not bad[seq]:
            continue
        if origin is None and not call.inputs_bad:
            origin = call
        if call is origin:
            origin.bad_outputs.append(seq)
        else:
            propagated.append(seq)
    if origin is None:
        return None
    return Overflow(
        origin.module,
        origin.kind,
        origin.vpp_stage,
        origin.micro_step,
        frozenset(origin.bad_outputs),
        frozenset(propagated),
        _burst_start(record, bad, origin),
        origin.call,
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
    anomalies: Sequence[Anomaly], overflow: Overflow | None, collectives: np.ndarray | None = None
) -> list[Anomaly]:
    """Set ``origin``/``propagated`` on anomalies of the rows the overflow names, and put the origin first.

    When the origin's call has a burst of bad child rows before its own (a NaN born in a parent's code), the
    origin's rows take the burst's place in the ``seq`` order and the rows from the burst on move one place
    down for each: ``seq`` stays a permutation of the rows, so every order built on it agrees. The origin
    also takes the collectives count of the burst's first row (``collectives``: per row, when distributed):
    the value went bad before the collectives its children issued after that."""
    if overflow is None:
        return list(anomalies)
    moved = sorted(overflow.origin_seqs)
    start = overflow.burst_start
    if not moved or start < 0 or start >= moved[0]:
        moved, start = [], -1  # the origin's row is the first bad one already
    out = []
    for a in anomalies:
        seq = a.seq
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
