"""What is compared on one rank: the tensor pairs of the two runs, in A's order, with their tolerances; and
the pairs left out because the two runs' rows hold different things (:mod:`~.microbatch`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trainmon.read.compare.align import Alignment, align
from trainmon.read.compare.mapfile import NameMap
from trainmon.read.compare.microbatch import LeftOut, micro_batches, rows_differ
from trainmon.read.compare.precision import Carried, carried, coarser, reason
from trainmon.read.compare.tensors import module_of, phase_of
from trainmon.read.compare.tolerance import Tolerance
from trainmon.run.names import module_call
from trainmon.run.records import Kind
from trainmon.run.statstore import TensorMeta

__all__ = ["Pair", "RankPlan", "make_plan"]


@dataclass(frozen=True)
class Pair:
    """One tensor both runs recorded: A's name and B's, how they were paired, and its tolerance."""

    kind: str
    name: str  # as run A names it
    name_b: str
    how: str  # map, exact, wrapper, framework, order
    phase: str
    module: str | None
    dtype: str | None  # as run A recorded it
    shape: str | None
    rtol: float
    ztol: float
    dtype_b: str | None = None  # as run B recorded it
    precision: str | None = None  # the dtype whose rounding the tolerance allows (precision.carried)
    why: str = ""  # which run computes it in that precision, or after what


@dataclass(frozen=True)
class RankPlan:
    """The pairs of one rank: ``ia[p]``/``ib[p]`` index pair ``p``'s columns in the two runs' frames."""

    rank: int
    tensors_a: tuple[tuple[str, str], ...]
    tensors_b: tuple[tuple[str, str], ...]
    pairs: tuple[Pair, ...]
    ia: np.ndarray
    ib: np.ndarray
    rtol: np.ndarray
    ztol: np.ndarray
    alignment: Alignment
    data: np.ndarray | None = None  # (P,) bool: the step's data, its first input (state.slack)
    left_out: tuple[LeftOut, ...] = ()  # paired, not compared: the runs' rows hold different things

    @property
    def kinds(self) -> list[str]:
        return [p.kind for p in self.pairs]

    def index(self, kind: str, name: str) -> int | None:
        """The pair of A's tensor (kind, name), if compared."""
        lookup = self.__dict__.get("_lookup")
        if lookup is None:
            lookup = {(p.kind, p.name): i for i, p in enumerate(self.pairs)}
            object.__setattr__(self, "_lookup", lookup)
        return lookup.get((kind, name))


def _count(numel: int) -> float:
    return float(numel) if numel >= 0 else float("nan")


def _data(pairs: list[Pair]) -> np.ndarray:
    """The step's data: the first activation in A's order, when it is a module's input (what the verdict
    calls the data: nothing recorded comes before it)."""
    mask = np.zeros(len(pairs), dtype=bool)
    first = next((p for p, pair in enumerate(pairs) if pair.kind == Kind.ACTV.value), None)
    if first is not None:
        call = module_call(pairs[first].kind, pairs[first].name)
        mask[first] = call is not None and call.role == "input"
    return mask


def make_plan(
    rank: int,
    tensors_a: tuple[tuple[str, str], ...],
    tensors_b: tuple[tuple[str, str], ...],
    meta_a: TensorMeta,
    meta_b: TensorMeta,
    tolerance: Tolerance,
    name_map: NameMap | None = None,
    carried_a: dict[tuple[str, str], Carried] | None = None,
    carried_b: dict[tuple[str, str], Carried] | None = None,
) -> RankPlan:
    """Pair the tensors of one rank's two frames and give each pair its tolerance (the larger of the two
    runs': each side's size and the precision it computes the tensor in, :mod:`~.precision`: from each
    run's ``meta`` unless given as ``carried_a``/``carried_b``). A pair whose rows hold a different number
    of micro-batches' gradients in the two runs is set aside in ``left_out``, not compared."""
    info_a = {t: (d, s, n) for t, d, s, n in zip(meta_a.tensors, meta_a.dtypes, meta_a.shapes, meta_a.numel,
                                                  strict=True)}  # fmt: skip
    info_b = {t: (d, s, n) for t, d, s, n in zip(meta_b.tensors, meta_b.dtypes, meta_b.shapes, meta_b.numel,
                                                  strict=True)}  # fmt: skip
    unknown = (None, None, -1)
    shapes_a = [info_a.get(t, unknown)[1] for t in tensors_a]
    shapes_b = [info_b.get(t, unknown)[1] for t in tensors_b]
    found = align(tensors_a, tensors_b, shapes_a, shapes_b, name_map)
    precision_a = carried(meta_a) if carried_a is None else carried_a
    precision_b = carried(meta_b) if carried_b is None else carried_b
    micro_a, micro_b = micro_batches(meta_a), micro_batches(meta_b)
    pairs, ia, ib, left_out = [], [], [], []
    for i, j, how in zip(found.a, found.b, found.how, strict=True):
        kind, name = tensors_a[i]
        dtype_a, shape_a, numel_a = info_a.get(tensors_a[i], unknown)
        dtype_b, shape_b, numel_b = info_b.get(tensors_b[j], unknown)
        rows = rows_differ(kind, shape_a, numel_a, shape_b, numel_b)
        if rows is not None:  # a sum of micro-batch gradients against the gradients themselves
            left_out.append(LeftOut(kind, name, tensors_b[j][1], *rows, micro_a, micro_b))
            continue
        ia.append(i)
        ib.append(j)
        carried_a = precision_a.get(tensors_a[i], Carried(dtype_a, dtype_a))
        carried_b = precision_b.get(tensors_b[j], Carried(dtype_b, dtype_b))
        rtol_a, ztol_a = tolerance.of(kind, name, carried_a.dtype, _count(numel_a))
        rtol_b, ztol_b = tolerance.of(kind, name, carried_b.dtype, _count(numel_b))
        wider = carried_b if coarser(carried_b.dtype, carried_a.dtype) else carried_a
        pairs.append(
            Pair(
                kind,
                name,
                tensors_b[j][1],
                how,
                phase_of(kind),
                module_of(kind, name),
                dtype_a,
                shape_a,
                max(rtol_a, rtol_b),
                max(ztol_a, ztol_b),
                dtype_b,
                wider.dtype or "float32",
                reason(kind, carried_a, carried_b),
            )
        )
    return RankPlan(
        rank,
        tensors_a,
        tensors_b,
        tuple(pairs),
        np.asarray(ia, dtype=np.intp),
        np.asarray(ib, dtype=np.intp),
        np.asarray([p.rtol for p in pairs], dtype=np.float32),
        np.asarray([p.ztol for p in pairs], dtype=np.float32),
        found,
        _data(pairs),
        tuple(left_out),
    )
