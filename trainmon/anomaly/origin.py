"""Where a NaN/Inf started: the first module whose output went bad while its inputs were clean.

Works on the statistics a step already has (no extra host read): module hooks record inputs and outputs
of every call in execution order (forward, then backward), so walking the rows in ``seq`` order finds the
first call with clean inputs and a non-finite (or, in saturation mode, dtype-saturated) output. Later calls
with bad outputs are propagation.

A module's hook fires when its call ends, after its children's. When the NaN is born in a parent module's
own code (between two children), the children it reaches show it before the parent's output row does: the
origin's anomalies are moved in front of that burst (``mark``), so everything that orders anomalies by
``seq`` (the anomaly files, ``trainmon analyze``, alerts, the plugin) names the origin first.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from trainmon.run.records import Anomaly, Derived, Kind, StepRecord

# The role of a row within a hook call, from the last component of its name (see collect/modules.py).
_FORWARD_ROLE = re.compile(r"^(input|output)(?:_.+)?$")
_BACKWARD_ROLE = re.compile(r"^(output_grad|input_grad)(?:_.+)?$")
# In backward, the gradient of the module's output is what flows in; the gradient of its input flows out.
_IS_INPUT = {"input": True, "output": False, "output_grad": True, "input_grad": False}


@dataclass(frozen=True)
class Overflow:
    """The origin of a step's overflow on one rank, and the rows it spread to."""

    module: str
    kind: str  # actv (forward) or actv_grad (backward)
    vpp_stage: int
    micro_step: int
    origin_seqs: frozenset[int]  # the bad output rows of the origin call
    propagated_seqs: frozenset[int]  # bad output rows of later calls
    # the first bad row of the origin's call: a child row when the NaN was born in a parent's own code
    # (its hook fires after its children's), else the origin's first bad output row
    burst_start: int = -1


@dataclass
class _Call:
    module: str
    kind: str
    vpp_stage: int
    micro_step: int
    start: int  # seq of the call's first row
    inputs_bad: bool = False
    bad_outputs: list[int] = dataclasses.field(default_factory=list)
    seen_output: bool = False


def _split(kind: str, name: str) -> tuple[str, bool] | None:
    """(module, is_input) of an activation row, None for rows that are not module inputs/outputs."""
    base, _, last = name.rpartition(".")
    pattern = _FORWARD_ROLE if kind == Kind.ACTV.value else _BACKWARD_ROLE
    match = pattern.match(last) if base else None
    return (base, _IS_INPUT[match.group(1)]) if match else None


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


def locate_overflow(
    record: StepRecord, derived: Derived, saturation: bool = False
) -> Overflow | None:
    """The first module call (in execution order) with clean inputs and a bad output, or None."""
    bad = bad_rows(record, derived, saturation)
    if not bad.any():
        return None
    origin: _Call | None = None
    propagated: list[int] = []
    call: _Call | None = None
    for seq, row in enumerate(record.rows):
        if row.kind not in (Kind.ACTV.value, Kind.ACTV_GRAD.value):
            call = None
            continue
        split = _split(row.kind, row.name)
        if split is None:
            continue
        module, is_input = split
        key = (module, row.kind, row.vpp_stage, row.micro_step)
        # a new hook call starts with another module, or with an input after this call's outputs
        if (
            call is None
            or (call.module, call.kind, call.vpp_stage, call.micro_step) != key
            or (is_input and call.seen_output)
        ):
            call = _Call(module, row.kind, row.vpp_stage, row.micro_step, seq)
        if is_input:
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
    )


def _burst_start(record: StepRecord, bad: np.ndarray, origin: _Call) -> int:
    """The first bad row among the rows the origin's children recorded during the origin's call.

    They are the rows right before the call's own, of modules under the origin's name (same kind, stage and
    micro-step); a row of the origin itself ends the walk (in backward, its ``output_grad`` fired when the
    call began; in forward, the previous call's rows)."""
    prefix = origin.module + "."
    first = origin.bad_outputs[0]
    seq = origin.start - 1
    while seq >= 0:
        row = record.rows[seq]
        split = _split(row.kind, row.name) if row.kind == origin.kind else None
        if (
            split is None
            or not split[0].startswith(prefix)
            or (row.vpp_stage, row.micro_step) != (origin.vpp_stage, origin.micro_step)
        ):
            break
        if bad[seq]:
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
