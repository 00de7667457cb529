"""What a TensorBoard run shows (config key ``tensorboard_tensors``).

TensorBoard keeps every series of a run in memory and lists every tag in its dashboards: a tag per tensor and
statistic is thousands of tags for a real model (16,000 for 8 ranks of ~300 tensors), minutes to load. So by
default (``summary``) a run gets the figures a person reads there, a few hundred tags whatever the model:

- ``scalar/{name}/{stat}``: the tracked scalars (``Monitor.track``: the loss), every statistic of ``ops``;
- ``step/grad_norm``, ``step/grad_nans``, ``step/grad_infs``: the L2 norm of the step's gradients (every
  ``grad_reduced`` tensor, else every ``grad_unreduced`` one; finite elements, as the steps table has it) and
  their NaN and Inf elements; ``step/nan_tensors``, ``step/inf_tensors``: the tensors (tracked scalars
  included) holding a NaN, an Inf element;
- ``{kind}/*/{stat}``: each kind's statistics of ``ops`` over all its tensors' elements together (the largest
  ``max``, the smallest ``min``, the norm of them all, the NaN and Inf elements summed, ...);
- ``{kind}/{layer}.*/norm``: the norm of each layer's tensors of a kind. A layer is a name up to its first
  numeric part (``layers.3`` of ``layers.3.mlp.fc1.weight``, ``1:decoder.layers.0`` in model chunk 1); a
  stack of more than :data:`MAX_LAYER_FIGURES` layers is shown in as many ranges of layers
  (``layers.0-5.*``). A name without a numeric part is grouped by its module (the name without its last
  part: ``embedding.word_embeddings`` of ``embedding.word_embeddings.weight``), or by its first part when a
  kind has more than :data:`MAX_MODULE_GROUPS` such modules.

A group's figures are those of all its elements together, as if the group were one tensor: they come from the
merged partial statistics, so the ``all_ranks`` run shows the same figures over every rank.

``all`` writes every statistic of ``ops`` for every tensor (``{kind}/{name}/{stat}``, as before the summary);
a list of name patterns writes the summary plus those tensors' tags. Every statistic of every tensor is in the
statistics store in any case.
"""

from __future__ import annotations

import fnmatch
import math
import re
from collections.abc import Sequence

import numpy as np

from trainmon.run.records import (
    INFS,
    MAX,
    MIN,
    N_PARTIALS,
    NANS,
    SUMSQ,
    Kind,
    chunk_name,
    derive,
    grad_norm,
    tag,
)

__all__ = [
    "ALL",
    "MAX_LAYER_FIGURES",
    "MAX_MODULE_GROUPS",
    "SUMMARY",
    "STEP_TAGS",
    "SummaryLayout",
    "TensorPatterns",
    "group_labels",
    "view_of",
]

SUMMARY = "summary"
ALL = "all"
# The layers of one stack shown apart per kind; a deeper stack is shown in as many ranges of layers.
MAX_LAYER_FIGURES = 16
# Modules outside the numbered layers shown apart per kind; past it they are grouped by their first name part.
MAX_MODULE_GROUPS = 16
STEP_GRAD_TAGS = ("step/grad_norm", "step/grad_nans", "step/grad_infs")
STEP_COUNT_TAGS = ("step/nan_tensors", "step/inf_tensors")
STEP_TAGS = (*STEP_GRAD_TAGS, *STEP_COUNT_TAGS)
# the tag of a kind's statistics over all its tensors: "{kind}/*/{stat}"
ALL_TENSORS = "*"
_GLOB_CHARS = frozenset("*?[")
_SCALAR = Kind.SCALAR.value
_GRADIENTS = (Kind.GRAD_REDUCED.value, Kind.GRAD_UNREDUCED.value)  # the first present is the step's gradient


def view_of(setting: object) -> str | tuple[str, ...]:
    """``tensorboard_tensors`` as the sinks take it: ``"summary"``, ``"all"`` or a tuple of patterns."""
    if setting in (SUMMARY, ALL):
        return str(setting)
    if isinstance(setting, str):
        return (setting,)
    patterns = tuple(str(p) for p in setting)  # type: ignore[attr-defined]
    return patterns if patterns else SUMMARY


class TensorPatterns:
    """Tensors named by patterns: each matches a tensor's name (as TensorBoard shows it) or ``kind/name``; an
    exact text, a glob (``*`` crosses dots, as in ``targets``) or ``re:`` and a regular expression (whole
    text)."""

    def __init__(self, patterns: Sequence[str]) -> None:
        self.exact: set[str] = set()
        self.regexes: list[re.Pattern[str]] = []
        for p in patterns:
            if p.startswith("re:"):
                self.regexes.append(re.compile(p[3:]))
            elif _GLOB_CHARS.intersection(p):
                self.regexes.append(re.compile(fnmatch.translate(p)))
            else:
                self.exact.add(p)

    def matches(self, kind: str, name: str) -> bool:
        full = f"{kind}/{name}"
        if name in self.exact or full in self.exact:
            return True
        return any(r.fullmatch(name) or r.fullmatch(full) for r in self.regexes)


# ---------------------------------------------------------------------------------------------- groups


def _layer(name: str) -> tuple[str, int] | None:
    """(the name up to its first numeric part, that number) or None: ``layers.3.mlp.fc1.weight`` ->
    (``layers``, 3); ``0.weight`` -> ("", 0)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit() and part.isascii():
            return ".".join(parts[:i]), int(part)
    return None


def _module(name: str) -> str:
    """The module of a name outside the layers: without its last part (``weight``, ``output``, ...)."""
    stem, dot, _ = name.rpartition(".")
    return stem if dot else name


def group_labels(names: Sequence[str]) -> list[str]:
    """The group label of each name of one kind (names without a chunk prefix; see the module doc)."""
    layers = [_layer(n) for n in names]
    stacks: dict[str, set[int]] = {}
    for found in layers:
        if found is not None:
            stacks.setdefault(found[0], set()).add(found[1])
    ranges: dict[tuple[str, int], str] = {}
    for stem, numbers in stacks.items():
        ordered = sorted(numbers)
        width = max(1, math.ceil(len(ordered) / MAX_LAYER_FIGURES))
        for start in range(0, len(ordered), width):
            members = ordered[start : start + width]
            span = str(members[0]) if len(members) == 1 else f"{members[0]}-{members[-1]}"
            label = f"{stem}.{span}" if stem else span
            for n in members:
                ranges[(stem, n)] = label
    modules = {_module(n) for n, found in zip(names, layers, strict=True) if found is None}
    coarse = len(modules) > MAX_MODULE_GROUPS
    out = []
    for n, found in zip(names, layers, strict=True):
        if found is not None:
            out.append(ranges[found])
        else:
            out.append(n.split(".", 1)[0] if coarse else _module(n))
    return out


def _merge(p: np.ndarray, order: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """The partials of each group (rows ``order[starts[g]:starts[g+1]]``), merged as records.merge does."""
    rows = p[order]
    merged = np.add.reduceat(rows, starts, axis=0)
    merged[:, MIN] = np.minimum.reduceat(rows[:, MIN], starts)
    merged[:, MAX] = np.maximum.reduceat(rows[:, MAX], starts)
    return merged


def _grouping(ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(order, starts) gathering equal ``ids`` (numbered from 0 in order of first appearance)."""
    order = np.argsort(np.asarray(ids, dtype=np.int64), kind="stable").astype(np.intp)
    counts = np.bincount(np.asarray(ids, dtype=np.int64))
    starts = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.intp)
    return order, starts


class SummaryLayout:
    """The summary view of one set of tensors (``keys``: (kind, vpp_stage, name) in hook order): its tags, and
    how a step's values come from the tensors' merged partials and derived statistics."""

    __slots__ = (
        "tags", "_grads", "_rows", "_kinds", "_groups", "_detail", "_ops", "_size",
    )  # fmt: skip

    def __init__(
        self,
        keys: Sequence[tuple[str, int, str]],
        ops: Sequence[str],
        multi_chunk: bool,
        patterns: TensorPatterns | None = None,
    ) -> None:
        self._ops = tuple(ops)
        shown = [chunk_name(vpp, name, multi_chunk) for _, vpp, name in keys]
        kinds = [str(k) for k, _, _ in keys]
        tags: list[str] = []
        # the step's gradients: grad_reduced when the step has any, else grad_unreduced
        grad_kind = next((k for k in _GRADIENTS if k in kinds), None)
        self._grads = np.asarray([i for i, k in enumerate(kinds) if k == grad_kind], dtype=np.intp)
        self._rows = len(keys)
        if grad_kind is not None:
            tags += STEP_GRAD_TAGS
        if keys:
            tags += STEP_COUNT_TAGS
        # each kind over all its tensors (tracked scalars are shown one by one)
        tensor_rows = [i for i, k in enumerate(kinds) if k != _SCALAR]
        kind_ids: dict[str, int] = {}
        for i in tensor_rows:
            kind_ids.setdefault(kinds[i], len(kind_ids))
        self._kinds = None
        if tensor_rows:
            order, starts = _grouping([kind_ids[kinds[i]] for i in tensor_rows])
            self._kinds = (np.asarray(tensor_rows, dtype=np.intp)[order], starts)
            tags += [tag(k, ALL_TENSORS, op) for k in kind_ids for op in self._ops]
        # each layer (or module) of each kind: its norm
        group_ids: dict[tuple[str, str], int] = {}
        member_ids: list[int] = []
        for kind in kind_ids:
            rows = [i for i in tensor_rows if kinds[i] == kind]
            prefixes = [f"{keys[i][1]}:" if multi_chunk else "" for i in rows]
            labels = group_labels([keys[i][2] for i in rows])
            for prefix, label in zip(prefixes, labels, strict=True):
                gid = group_ids.setdefault((kind, prefix + label), len(group_ids))
                member_ids.append(gid)
        self._groups = None
        if group_ids:
            rows = [i for kind in kind_ids for i in tensor_rows if kinds[i] == kind]
            order, starts = _grouping(member_ids)
            self._groups = (np.asarray(rows, dtype=np.intp)[order], starts)
            tags += [tag(kind, f"{label}.{ALL_TENSORS}", "norm") for kind, label in group_ids]
        # tensors shown one by one: tracked scalars, and those the patterns name
        detail = [
            i for i, kind in enumerate(kinds)
            if kind == _SCALAR or (patterns is not None and patterns.matches(kind, shown[i]))
        ]  # fmt: skip
        self._detail = np.asarray(detail, dtype=np.intp)
        tags += [tag(kinds[i], shown[i], op) for i in detail for op in self._ops]
        self.tags = tuple(tags)
        self._size = len(tags)

    def values(self, partials: np.ndarray, stats: dict[str, np.ndarray]) -> np.ndarray:
        """The float64 value of each tag: ``partials`` (tensors x 8, micro-steps merged) and ``stats`` (each
        statistic per tensor, derived from them) of one step."""
        p = np.asarray(partials, dtype=np.float64).reshape(-1, N_PARTIALS)
        out = np.empty(self._size, dtype=np.float64)
        at = 0
        if len(self._grads):
            g = p[self._grads]
            out[at : at + 3] = (grad_norm(g[:, SUMSQ]), g[:, NANS].sum(), g[:, INFS].sum())
            at += 3
        if self._rows:
            out[at] = np.count_nonzero(p[:, NANS] > 0)
            out[at + 1] = np.count_nonzero(p[:, INFS] > 0)
            at += 2
        if self._kinds is not None:
            derived = derive(_merge(p, *self._kinds))
            width = len(self._ops)
            n = len(self._kinds[1]) * width
            block = out[at : at + n].reshape(-1, width) if width else out[at:at]
            for j, op in enumerate(self._ops):
                block[:, j] = derived[op]
            at += n
        if self._groups is not None:
            n = len(self._groups[1])
            out[at : at + n] = derive(_merge(p, *self._groups))["norm"]
            at += n
        if len(self._detail) and self._ops:
            width = len(self._ops)
            block = out[at:].reshape(-1, width)
            for j, op in enumerate(self._ops):
                block[:, j] = np.asarray(stats[op], dtype=np.float64)[self._detail]
        return out
