"""Where a NaN/Inf started: the first module whose output went bad while its inputs were clean.

Works on the statistics a step already has (no extra host read): module hooks record inputs and outputs
of every call in execution order (forward, then backward), so walking the rows in ``seq`` order finds the
first call with clean inputs and a non-finite (or, in saturation mode, dtype-saturated) output. Later calls
with bad outputs are propagation.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from trainmon.records import Anomaly, Kind, StepRecord

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


@dataclass
class _Call:
    module: str
    kind: str
    vpp_stage: int
    micro_step: int
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


def bad_rows(record: StepRecord, derived: dict[str, np.ndarray], saturation: bool = False) -> np.ndarray:
    """Boolean mask of rows holding NaN/Inf, or (saturation mode, as on Ascend) a value at the dtype's
    largest magnitude."""
    bad = (derived["nans"] > 0) | (derived["infs"] > 0)
    if saturation and len(record.rows):
        limits = np.array([_saturation_limit(r.dtype) for r in record.rows])
        with np.errstate(invalid="ignore"):
            bad |= (np.abs(derived["max"]) >= limits) | (np.abs(derived["min"]) >= limits)
    return bad


def locate_overflow(
    record: StepRecord, derived: dict[str, np.ndarray], saturation: bool = False
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
            call = _Call(module, row.kind, row.vpp_stage, row.micro_step)
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
    )


def mark(anomalies: Sequence[Anomaly], overflow: Overflow | None) -> list[Anomaly]:
    """Set ``origin``/``propagated`` on anomalies of the rows the overflow names."""
    if overflow is None:
        return list(anomalies)
    out = []
    for a in anomalies:
        if a.seq in overflow.origin_seqs:
            a = dataclasses.replace(a, origin=True)
        elif a.seq in overflow.propagated_seqs:
            a = dataclasses.replace(a, propagated=True)
        out.append(a)
    return out
