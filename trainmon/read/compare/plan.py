"""What is compared on one rank: the tensor pairs of the two runs, in A's order, with their tolerances."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trainmon.read.compare.align import Alignment, align
from trainmon.read.compare.mapfile import NameMap
from trainmon.read.compare.tensors import module_of, phase_of
from trainmon.read.compare.tolerance import Tolerance, compute_dtype
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
    dtype: str | None
    shape: str | None
    rtol: float
    ztol: float


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


def _compute(meta: TensorMeta) -> str | None:
    """A run's compute dtype: the lowest precision among its activations' dtypes."""
    found = zip(meta.tensors, meta.dtypes, strict=True)
    return compute_dtype([d for (k, _), d in found if k == Kind.ACTV.value])


def make_plan(
    rank: int,
    tensors_a: tuple[tuple[str, str], ...],
    tensors_b: tuple[tuple[str, str], ...],
    meta_a: TensorMeta,
    meta_b: TensorMeta,
    tolerance: Tolerance,
    name_map: NameMap | None = None,
) -> RankPlan:
    """Pair the tensors of one rank's two frames and give each pair its tolerance (the larger of the two
    runs': each side's dtype, size and compute dtype)."""
    info_a = {t: (d, s, n) for t, d, s, n in zip(meta_a.tensors, meta_a.dtypes, meta_a.shapes, meta_a.numel,
                                                  strict=True)}  # fmt: skip
    info_b = {t: (d, s, n) for t, d, s, n in zip(meta_b.tensors, meta_b.dtypes, meta_b.shapes, meta_b.numel,
                                                  strict=True)}  # fmt: skip
    unknown = (None, None, -1)
    shapes_a = [info_a.get(t, unknown)[1] for t in tensors_a]
    shapes_b = [info_b.get(t, unknown)[1] for t in tensors_b]
    found = align(tensors_a, tensors_b, shapes_a, shapes_b, name_map)
    compute_a, compute_b = _compute(meta_a), _compute(meta_b)
    pairs = []
    for i, j, how in zip(found.a, found.b, found.how, strict=True):
        kind, name = tensors_a[i]
        dtype_a, shape_a, numel_a = info_a.get(tensors_a[i], unknown)
        dtype_b, _, numel_b = info_b.get(tensors_b[j], unknown)
        rtol_a, ztol_a = tolerance.of(kind, name, dtype_a, _count(numel_a), compute_a)
        rtol_b, ztol_b = tolerance.of(kind, name, dtype_b, _count(numel_b), compute_b)
        pairs.append(
            Pair(
                kind,
                name,
                tensors_b[j][1],
                how,
                phase_of(kind),
                module_of(kind, name),
                dtype_a or dtype_b,
                shape_a,
                max(rtol_a, rtol_b),
                max(ztol_a, ztol_b),
            )  # fmt: skip
        )
    return RankPlan(
        rank,
        tensors_a,
        tensors_b,
        tuple(pairs),
        np.asarray(found.a, dtype=np.intp),
        np.asarray(found.b, dtype=np.intp),
        np.asarray([p.rtol for p in pairs], dtype=np.float32),
        np.asarray([p.ztol for p in pairs], dtype=np.float32),
        found,
    )
