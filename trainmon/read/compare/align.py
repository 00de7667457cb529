"""Pairing the tensors of two runs: which row of run B is which row of run A.

Per tensor of A, in A's order, the first of these that finds one unpaired tensor of B of the same kind:

1. ``map``: the ``--map`` file names it (a tensor, or a module or parameter whose rows it holds);
2. ``exact``: the same name;
3. ``wrapper``: the same name without model wrappers (:func:`~trainmon.read.compare.names.unwrapped`);
4. ``framework``: the same name spelled as the other framework does
   (:func:`~trainmon.read.compare.names.spelled`);
5. ``order``: what remains of each kind, paired in call order where the shapes agree (the longest run of
   matching shapes, :class:`difflib.SequenceMatcher`), for modules that are named otherwise altogether.

A canonical name two tensors of one run share is no evidence for either: it is left to the later steps.
Whatever is left unpaired is listed, never dropped silently.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass, field

from trainmon.read.compare.mapfile import NameMap
from trainmon.read.compare.names import spelled, unwrapped

__all__ = ["Alignment", "align"]

Tensor = tuple[str, str]  # (kind, name)


@dataclass(frozen=True)
class Alignment:
    """Pairs ``(a[i], b[i])`` of column indices into the two runs' tensors, in A's order, and how each was
    found; the tensors of each run left unpaired; the map entries that named nothing of either run."""

    a: tuple[int, ...]
    b: tuple[int, ...]
    how: tuple[str, ...]
    only_a: tuple[Tensor, ...] = ()
    only_b: tuple[Tensor, ...] = ()
    unused_map: tuple[str, ...] = field(default=())


def _holds(names: set[str], modules: set[str], x: str) -> bool:
    return x in names or x in modules


def _module_prefixes(names: set[str]) -> set[str]:
    out: set[str] = set()
    for name in names:
        parts = name.split(".")
        for i in range(1, len(parts)):
            out.add(".".join(parts[:i]))
    return out


def _directed(name_map: NameMap | None, names_a: set[str], names_b: set[str]) -> tuple[dict[str, str], list]:
    """The map's pairs as {A's name or module: B's}, each entry turned the way the runs hold it."""
    if name_map is None:
        return {}, []
    mods_a, mods_b = _module_prefixes(names_a), _module_prefixes(names_b)
    out: dict[str, str] = {}
    unused = []
    for x, y in name_map.pairs:
        if _holds(names_a, mods_a, x) and _holds(names_b, mods_b, y):
            out[x] = y
        elif _holds(names_a, mods_a, y) and _holds(names_b, mods_b, x):
            out[y] = x
        else:
            unused.append(f"{x}: {y}")
    return out, unused


def _translate(directed: dict[str, str], name: str) -> str | None:
    """B's name of A's ``name`` through the map: the name itself, else its longest mapped module."""
    if name in directed:
        return directed[name]
    cut = len(name)
    while True:
        cut = name.rfind(".", 0, cut)
        if cut <= 0:
            return None
        target = directed.get(name[:cut])
        if target is not None:
            return target + name[cut:]


def _unique(keys: Sequence[tuple[str, str]]) -> dict[tuple[str, str], int]:
    seen: dict[tuple[str, str], int] = {}
    twice: set[tuple[str, str]] = set()
    for i, key in enumerate(keys):
        if key in seen:
            twice.add(key)
        seen[key] = i
    return {k: i for k, i in seen.items() if k not in twice}


def align(
    tensors_a: Sequence[Tensor],
    tensors_b: Sequence[Tensor],
    shapes_a: Sequence[str | None] | None = None,
    shapes_b: Sequence[str | None] | None = None,
    name_map: NameMap | None = None,
) -> Alignment:
    """Pair the tensors of A with those of B (see the module's docstring)."""
    directed, unused = _directed(name_map, {n for _, n in tensors_a}, {n for _, n in tensors_b})
    if not directed and tuple(tensors_a) == tuple(tensors_b) and len(set(tensors_a)) == len(tensors_a):
        every = tuple(range(len(tensors_a)))  # one layout (the usual case): every tensor is itself
        return Alignment(every, every, ("exact",) * len(every), unused_map=tuple(unused))
    exact = {t: i for i, t in enumerate(tensors_b)}
    wrapped = _unique([(k, unwrapped(n)) for k, n in tensors_b])
    spelt = _unique([(k, spelled(k, n)) for k, n in tensors_b])
    wrapped_a = _unique([(k, unwrapped(n)) for k, n in tensors_a])
    spelt_a = _unique([(k, spelled(k, n)) for k, n in tensors_a])
    taken: set[int] = set()
    found: dict[int, tuple[int, str]] = {}
    for i, (kind, name) in enumerate(tensors_a):
        candidates = []
        mapped = _translate(directed, name)
        if mapped is not None:
            candidates.append((exact.get((kind, mapped)), "map"))
        candidates.append((exact.get((kind, name)), "exact"))
        key = (kind, unwrapped(name))
        if key in wrapped_a:
            candidates.append((wrapped.get(key), "wrapper"))
        key = (kind, spelled(kind, name))
        if key in spelt_a:
            candidates.append((spelt.get(key), "framework"))
        for j, how in candidates:
            if j is not None and j not in taken:
                found[i] = (j, how)
                taken.add(j)
                break
    _by_order(tensors_a, tensors_b, shapes_a, shapes_b, found, taken)
    order = sorted(found)
    return Alignment(
        a=tuple(order),
        b=tuple(found[i][0] for i in order),
        how=tuple(found[i][1] for i in order),
        only_a=tuple(t for i, t in enumerate(tensors_a) if i not in found),
        only_b=tuple(t for j, t in enumerate(tensors_b) if j not in taken),
        unused_map=tuple(unused),
    )


def _by_order(
    tensors_a: Sequence[Tensor],
    tensors_b: Sequence[Tensor],
    shapes_a: Sequence[str | None] | None,
    shapes_b: Sequence[str | None] | None,
    found: dict[int, tuple[int, str]],
    taken: set[int],
) -> None:
    """Pair what is left of each kind in call order where the shapes agree (shapes unknown: nothing)."""
    if shapes_a is None or shapes_b is None:
        return
    for kind in dict.fromkeys(k for k, _ in tensors_a):
        left_a = [i for i, (k, _) in enumerate(tensors_a) if k == kind and i not in found]
        left_b = [j for j, (k, _) in enumerate(tensors_b) if k == kind and j not in taken]
        if not left_a or not left_b:
            continue
        sa = [shapes_a[i] for i in left_a]
        sb = [shapes_b[j] for j in left_b]
        if None in sa or None in sb:
            continue
        matcher = difflib.SequenceMatcher(None, sa, sb, autojunk=False)
        for block in matcher.get_matching_blocks():
            for k in range(block.size):
                i, j = left_a[block.a + k], left_b[block.b + k]
                found[i] = (j, "order")
                taken.add(j)
