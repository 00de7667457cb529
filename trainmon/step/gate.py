"""The one gate for tensors: what a hook or an adapter hands over is read by a statistics kernel only once
this module has said what it is.

* A plain dense strided tensor (``torch.Tensor`` or ``nn.Parameter``, strided layout, not nested, meta or
  quantized) goes to the device's kernel as it is.
* A DTensor (FSDP2's sharded parameters, gradients and Adam moments; tensor parallelism's weights and
  activations) is read through its local tensor: a ``Partial`` placement is reduced first (its local
  tensor is an addend, not the value), dimensions of the mesh that ``Shard`` the tensor become the groups
  its statistics are merged over at the step end (exactly, as ZeRO shards are: no gather), and
  ``Replicate`` dimensions are counted once (every rank already holds the same elements there).
* An ``AsyncCollectiveTensor`` (what a functional collective returns, e.g. a row-wise parallel layer's
  output) is waited for and read as the tensor it stands for.
* Anything else (tensors under tracing such as FakeTensor and FunctionalTensor, wrapper subclasses such as
  float8 training tensors, nested, sparse, meta, quantized tensors) is skipped with one warning naming the
  row and the tensor's type: never read, never a silent gap.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from trainmon.adapters import Piece, Shard
from trainmon.joblog import job_wide

logger = logging.getLogger("trainmon")

_Tensor = torch.Tensor
_Parameter = nn.Parameter
_STRIDED = torch.strided


_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor  # vmap, grad, functionalize: no storage
_functional = torch._is_functional_tensor  # functionalization's wrapper (AOTAutograd, torch.func)


def is_plain(t: Any) -> bool:
    """A tensor whose memory a kernel may read as ``numel`` elements at ``data_ptr()``. torch's C++
    wrappers (functionalization, functorch's transforms) look like plain tensors to Python but own no
    memory of their own."""
    tp = type(t)
    return (
        (tp is _Tensor or tp is _Parameter)
        and t.layout is _STRIDED
        and not t.is_nested
        and not t.is_meta
        and not t.is_quantized
        and not _functorch_wrapped(t)
        and not _functional(t)
    )


_PLAIN_TYPES = (_Tensor, _Parameter)


def is_dense(t: Any) -> bool:
    """:func:`is_plain` for what an optimizer holds (parameters, their gradients, Adam moments), checked
    for a few thousand tensors a step: a subclass (FSDP2's DTensors) or a sparse gradient. An optimizer's
    tensors are never under tracing, nested or quantized."""
    return type(t) in _PLAIN_TYPES and t.layout is _STRIDED


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except Exception:  # a torch without distributed support
        return None
    return DTensor


def _async_collective_type() -> type | None:
    try:
        from torch.distributed._functional_collectives import AsyncCollectiveTensor
    except Exception:
        return None
    return AsyncCollectiveTensor


class Gate:
    """Admits tensors (:meth:`piece`) and warns once per (row, type) for what it skips."""

    def __init__(self) -> None:
        self._dtensor = _dtensor_type()
        self._async = _async_collective_type()
        # (mesh, the mesh dimensions that shard a tensor) -> the groups its statistics merge over: the same
        # tuple object each time, so runs of pieces of one layout stay one batch (StepBuffer.add_pieces)
        self._groups: dict[tuple[int, tuple[int, ...]], tuple[Any, ...]] = {}
        self._meshes: dict[int, Any] = {}  # keeps each mesh alive while its id is a key above
        self._warned: set[tuple[str, str]] = set()

    def piece(self, t: Any, what: str) -> Piece | None:
        """``t`` as a kernel may read it: a plain tensor, this rank's :class:`Shard` of a tensor split over
        ranks, or None (skipped, with one warning naming ``what`` and the type)."""
        if is_plain(t):
            return t
        if self._async is not None and isinstance(t, self._async):
            return self.piece(t.trigger_wait(), what)
        if self._dtensor is not None and isinstance(t, self._dtensor):
            return self._dtensor_piece(t, what)
        self.skip(t, what)
        return None

    def _dtensor_piece(self, t: Any, what: str) -> Piece | None:
        placements = t.placements
        mesh = t.device_mesh
        if any(p.is_partial() for p in placements):
            from torch.distributed.tensor import Replicate

            if any(type(p).__name__ == "_MaskPartial" for p in placements):
                # a vocabulary-parallel embedding's output: its reduction consumes a mask that the layer's
                # own reduction needs (trainmon.collect.modules reads such outputs once reduced)
                self.skip(t, what, "DTensor pending a masked reduction (_MaskPartial)")
                return None

            # the local tensor is an addend of a pending reduction: its min, max or NaN say nothing of the
            # value, so the value is made (the reduction the layer would run) before it is read
            with torch.no_grad():
                t = t.redistribute(mesh, [Replicate() if p.is_partial() else p for p in placements])
            placements = t.placements
        local = t._local_tensor
        if self._async is not None and isinstance(local, self._async):  # the result of a redistribution
            local = local.trigger_wait()
        if not is_plain(local):
            self.skip(local, what, f"DTensor whose local tensor is a {_type_name(local)}")
            return None
        dims = tuple(i for i, p in enumerate(placements) if not p.is_replicate())
        unknown = [p for i, p in enumerate(placements) if i in dims and not _splits(p)]
        if unknown:
            self.skip(t, what, f"DTensor with placement {unknown[0]!r}")
            return None
        if not dims:
            return local  # replicated over the whole mesh: every rank holds the whole tensor
        return Shard(local, self.groups_of(mesh, dims), tuple(t.shape))

    def groups_of(self, mesh: Any, dims: tuple[int, ...]) -> tuple[Any, ...]:
        """The process groups of ``mesh``'s dimensions ``dims`` (one tuple object per mesh and dims)."""
        key = (id(mesh), dims)
        groups = self._groups.get(key)
        if groups is None:
            groups = self._groups[key] = tuple(mesh.get_group(d) for d in dims)
            self._meshes[id(mesh)] = mesh
        return groups

    def skip(self, t: Any, what: str, kind: str = "") -> None:
        """Say once per (``what``, kind) that ``t`` is not recorded (``kind``: its type, by default)."""
        kind = kind or _type_name(t)
        key = (what, kind)
        if key in self._warned:
            return
        self._warned.add(key)
        job_wide(logger).warning(
            "trainmon: %s is a %s, which trainmon cannot read exactly; its statistics are not recorded%s",
            what,
            kind,
            _why(t),
        )


def _splits(placement: Any) -> bool:
    """A placement that gives each rank of its mesh dimension a disjoint part of the elements: ``Shard``,
    and ``_StridedShard`` (FSDP2 over tensor parallelism), which is no ``Shard`` to ``is_shard()``; the
    statistics need the elements only, not their order."""
    return placement.is_shard() or type(placement).__name__ == "_StridedShard"


def _type_name(t: Any) -> str:
    tp = type(t)
    name = f"{tp.__module__}.{tp.__qualname__}" if tp.__module__ != "torch" else f"torch.{tp.__qualname__}"
    if isinstance(t, torch.Tensor) and tp in (_Tensor, _Parameter):
        if _functorch_wrapped(t) or _functional(t):
            return f"{name} under torch.func's functionalization or transforms (a wrapper without memory)"
        if t.layout is not _STRIDED:
            return f"{name} with layout {t.layout}"
        if t.is_nested:
            return f"nested {name}"
        if t.is_meta:
            return f"{name} on the meta device"
        if t.is_quantized:
            return f"quantized {name} ({t.dtype})"
    return name


def _why(t: Any) -> str:
    name = type(t).__name__
    wrapped = isinstance(t, torch.Tensor) and (_functorch_wrapped(t) or _functional(t))
    if name in ("FakeTensor", "FunctionalTensor") or wrapped:
        return " (a tensor under tracing: see docs/compile.md)"
    return ""


GATE = Gate()
