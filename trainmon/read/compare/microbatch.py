"""What a stored row of a weight gradient before reduction holds, and when two runs' rows hold different
things.

The statistics store merges a step's micro-step rows of a tensor into one (the element counts add up), so a
row holds ``numel / prod(shape)`` tensors of the recorded shape. ``grad_unreduced`` of an ordinary parameter
(one process, DDP, Megatron, DeepSpeed) is read once a step, at the last micro-batch: the gradient summed
over the step's micro-batches, one tensor a row. FSDP2 holds no such sum, so its parameters' gradient is
read on every micro-batch, each micro-batch's own: one tensor per micro-batch (``monitor_mbs_grad`` reads
every parameter on every micro-batch too, where an ordinary parameter's is the running sum).

The statistics of a concatenation of micro-batch gradients are not those of their sum, so a pair whose
rows hold a different number of tensors is not compared: its difference says nothing about the training.
Only counts both runs' metadata give are used: a pair whose counts are unknown, or equal, is compared.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from trainmon.run.records import Kind
from trainmon.run.statstore import TensorMeta

__all__ = ["LeftOut", "describe", "micro_batches", "per_row", "rows_differ"]

# the kinds whose rows may hold one tensor a step in one run and one a micro-batch in the other
_PER_MICRO_BATCH_IN_FSDP2 = frozenset({Kind.GRAD_UNREDUCED.value})
_STEP_KINDS = (Kind.ACTV.value, Kind.ACTV_GRAD.value)  # recorded on every micro-batch in every run


@dataclass(frozen=True)
class LeftOut:
    """A tensor both runs recorded whose rows hold different things: not compared.

    ``rows_a``/``rows_b``: tensors a stored row holds in each run; ``micro_a``/``micro_b``: each run's
    micro-batches per step as its activations show them (None: unknown)."""

    kind: str
    name: str  # as run A names it
    name_b: str
    rows_a: int
    rows_b: int
    micro_a: int | None = None
    micro_b: int | None = None


def _elements(shape: str | None) -> int | None:
    """The element count of a recorded shape text (``[16, 8]``, ``(16, 8)``; ``[]``: a scalar)."""
    if not shape:
        return None
    inner = shape.strip().strip("[]()").strip()
    if not inner:
        return 1
    try:
        dims = [int(d) for d in inner.split(",") if d.strip()]
    except ValueError:
        return None
    return math.prod(dims) if all(d >= 0 for d in dims) else None


def per_row(shape: str | None, numel: int) -> int | None:
    """How many tensors of ``shape`` one stored row holds; None when the shape or the count is unknown, or
    the count is not a whole multiple of the shape's (micro-batches of different shapes)."""
    size = _elements(shape)
    if size is None or size <= 0 or numel <= 0 or numel % size:
        return None
    return numel // size


def micro_batches(meta: TensorMeta) -> int | None:
    """The run's micro-batches per step: what most of its activation rows hold (every micro-batch's
    activations are recorded); None without activations whose counts say it."""
    found = Counter(
        n
        for (kind, _), shape, numel in zip(meta.tensors, meta.shapes, meta.numel, strict=True)
        if kind in _STEP_KINDS and (n := per_row(shape, numel)) is not None
    )
    return found.most_common(1)[0][0] if found else None


def rows_differ(
    kind: str, shape_a: str | None, numel_a: int, shape_b: str | None, numel_b: int
) -> tuple[int, int] | None:
    """The tensors a row holds in each run, when the kind may differ in that and the two counts are known
    and differ; else None (the pair is compared)."""
    if kind not in _PER_MICRO_BATCH_IN_FSDP2:
        return None
    rows_a, rows_b = per_row(shape_a, numel_a), per_row(shape_b, numel_b)
    if rows_a is None or rows_b is None or rows_a == rows_b:
        return None
    return rows_a, rows_b


def describe(rows: int, micro: int | None, per_micro_step: bool | None) -> str:
    """What one run's ``grad_unreduced`` rows hold, in words: ``rows`` tensors a row, ``micro`` the run's
    micro-batches per step, ``per_micro_step`` its ``monitor_mbs_grad`` (None: unknown)."""
    if rows == 1:
        if micro is None:
            return "each rank's gradient accumulated over the step's micro-batches"
        if micro == 1:
            return "each rank's gradient of the step's one micro-batch"
        return f"each rank's gradient summed over the step's {micro} micro-batches"
    if per_micro_step:  # every parameter read on every micro-batch: only FSDP2's are their own
        return (
            f"one gradient per micro-batch, {rows} a step (each micro-batch's own under FSDP2, the running "
            "sum otherwise: monitor_mbs_grad)"
        )
    return f"each micro-batch's own gradient (FSDP2), {rows} a step"
