"""What a row of the statistics store is, for a comparison: its phase in the step, the module it belongs to.

The store keeps, per rank and step, one row per tensor in the order the hooks fired (the order of first
appearance: forward activations in call order, the backward's gradients in the order they were produced,
weight gradients among them, then the optimizer's rows). ``kind`` says the rest: activations are forward,
their gradients and the gradients before reduction backward, the reduced gradients, updated parameters and
Adam moments belong to the optimizer step. The parameters a step starts from (``param_origin``) are read at
the optimizer step but are what the step's forward ran with: their phase is ``start``, before the forward.
"""

from __future__ import annotations

from trainmon.run.names import module_call
from trainmon.run.records import PHASE_ORDER, Kind, Phase

__all__ = [
    "PARAM_KINDS",
    "START",
    "WHOLE_TENSOR_KINDS",
    "module_of",
    "phase_of",
    "phase_rank",
]

_K = Kind
# kinds named after a parameter (the name is the parameter's)
PARAM_KINDS = frozenset(
    k.value
    for k in (_K.GRAD_UNREDUCED, _K.GRAD_REDUCED, _K.PARAM_ORIGIN, _K.PARAM_UPDATED, _K.EXP_AVG,
              _K.EXP_AVG_SQ, _K.UPDATE, _K.RATIO)
)  # fmt: skip
# kinds whose statistics are those of the whole tensor on every rank that has it, whatever the tensor- or
# data-parallel layout (the adapters merge the shards: trainmon.adapters.Shard)
WHOLE_TENSOR_KINDS = PARAM_KINDS - {_K.GRAD_UNREDUCED.value}

START = "start"  # the state a step starts from: before its forward
_PHASES = {
    _K.PARAM_ORIGIN.value: START,
    _K.ACTV.value: Phase.FORWARD.value,
    _K.SCALAR.value: Phase.FORWARD.value,
    _K.ACTV_GRAD.value: Phase.BACKWARD.value,
    _K.GRAD_UNREDUCED.value: Phase.BACKWARD.value,
    _K.COMM.value: Phase.COMM.value,
}


def phase_of(kind: str) -> str:
    """The phase of the step a row of ``kind`` belongs to."""
    return _PHASES.get(kind, Phase.OPTIMIZER.value)


def phase_rank(kind: str) -> int:
    """Where the phase of ``kind`` comes in a step (start -1, forward 0, backward 1, collectives 2,
    optimizer 3)."""
    phase = phase_of(kind)
    return -1 if phase == START else PHASE_ORDER[phase]


def module_of(kind: str, name: str) -> str | None:
    """The module a row belongs to: the module of an activation or activation gradient, the module holding a
    parameter; None for other rows (scalars, collectives)."""
    if kind in PARAM_KINDS:
        module, _, _ = name.rpartition(".")
        return module or None
    call = module_call(kind, name)
    return call.module if call is not None else None
