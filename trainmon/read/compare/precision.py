"""The precision each tensor of a run was computed in, from the dtypes its statistics store recorded.

The store records each tensor's own dtype as the hook saw it (:func:`~trainmon.run.records.dtype_name`): under
``torch.autocast`` the outputs of the matmuls are ``bfloat16``, the data fed to the model, the parameters and
the optimizer's state ``float32``. How far two runs' statistics of a tensor may differ depends on the rounding
the tensor carries, which is its own dtype's and that of everything it was computed from: a ``float32``
LayerNorm output computed from a ``bfloat16`` matmul's output carries ``bfloat16`` rounding, and so do the
``float32`` weight gradients autocast computes in ``bfloat16`` and casts back, the reduced gradients, the
updated parameters and the Adam moments computed from them. A step's tensors are stored in the order their
hooks fired, so a tensor **carries the lowest precision among its own dtype and every tensor before it in
the step** (the backward and the optimizer come after the whole forward). Two tensors are their own start:

- the step's first inputs (the data), computed by nothing the step recorded before them;
- the parameters a step starts from (``param_origin``), stored in their own dtype (their difference at a
  later step is the state the previous step left, which the state's slack covers:
  :mod:`~trainmon.read.compare.state`); initial weights that differ are judged in the dtype they are
  stored in.

So a 3% error in the data of a ``bfloat16``-autocast run is judged at ``float32``'s tolerance, as in a
``float32`` run, while the matmul outputs after it get ``bfloat16``'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainmon.read.compare.tolerance import unit_roundoff
from trainmon.run.records import Kind
from trainmon.run.statstore import TensorMeta

_U32 = 2.0**-24

__all__ = ["Carried", "carried", "coarser", "reason"]

_OWN_START = frozenset({Kind.PARAM_ORIGIN.value})


@dataclass(frozen=True)
class Carried:
    """The precision a tensor carries in one run: ``dtype`` (None: unknown, judged as float32), its own
    recorded dtype, and the earlier tensor (kind, name) whose lower precision it inherits (None: its own)."""

    dtype: str | None
    own: str | None
    source: tuple[str, str] | None = None


def _lower(x: str | None, y: str | None) -> bool:
    """Whether dtype ``x`` has less precision than ``y`` (unknown and non-floating dtypes: never)."""
    ux, uy = unit_roundoff(x), unit_roundoff(y)
    return ux is not None and (uy is None or ux > uy)


def coarser(x: str | None, y: str | None) -> bool:
    """Whether dtype ``x`` rounds more coarsely than ``y`` (an unknown dtype counts as float32)."""
    return (unit_roundoff(x) or _U32) > (unit_roundoff(y) or _U32)


def carried(meta: TensorMeta) -> dict[tuple[str, str], Carried]:
    """Per tensor of one rank's store (in the order its hooks fired), the precision it carries."""
    out: dict[tuple[str, str], Carried] = {}
    lowest: str | None = None  # the lowest precision met so far in the step, and where
    where: tuple[str, str] | None = None
    for tensor, dtype in zip(meta.tensors, meta.dtypes, strict=True):
        if tensor[0] in _OWN_START:
            out[tensor] = Carried(dtype, dtype)
            continue
        if _lower(lowest, dtype):
            out[tensor] = Carried(lowest, dtype, where)
        else:
            out[tensor] = Carried(dtype, dtype)
            if _lower(dtype, lowest) or lowest is None and unit_roundoff(dtype) is not None:
                lowest, where = dtype, tensor
    return out


def reason(kind: str, a: Carried, b: Carried, runs: tuple[str, str] = ("A", "B")) -> str:
    """Why a pair's tolerance is that of its precision: which run computes it in what, or from what."""
    wider = b if _lower(b.dtype, a.dtype) else a
    run = runs[1] if wider is b else runs[0]
    dtype = wider.dtype or "float32"
    same = a.dtype == b.dtype
    if kind in _OWN_START:
        stored = "in both runs" if same else f"in {run}"
        return f"{dtype}: the parameters the step starts from, stored in {dtype} {stored}"
    if same and a.source is None and b.source is None:
        return f"{dtype}: computed in {dtype} in both runs, from {dtype} tensors only"
    if wider.source is not None:
        k, n = wider.source
        return f"{dtype}: {run} computes it after its {dtype} {k} {n}"
    return f"{dtype}: {run} computes it in {dtype}"
