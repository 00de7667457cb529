"""A run as a comparison reads it: its ranks, steps and framework, and its statistics a step range at a time.

A step range is read for one rank at a time from the statistics store (:mod:`trainmon.run.statstore`): only
the Parquet row groups of those steps, so finding a divergence in the first thousand steps of a 20,000-step
run reads a twentieth of it. Opening a run reads no rows: the sealed segments' names say their steps, and
only a stream still open has its step column read (:func:`~trainmon.run.statstore.step_span`); each range's
rows are then read once, its statistics and its tensors' dtypes and shapes together.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainmon.read.compare.diff import DIFF_STATS
from trainmon.read.compare.precision import Carried, carried, coarser
from trainmon.read.compare.tensors import WHOLE_TENSOR_KINDS
from trainmon.read.requests import not_a_run
from trainmon.run.columnar import SEGMENT_STEPS
from trainmon.run.layout import stats_rank_dir
from trainmon.run.manifest import read_manifest
from trainmon.run.statstore import (
    StatFrame,
    TensorMeta,
    read_frame,
    read_meta,
    read_stats,
    stat_ranks,
    step_span,
)

__all__ = [
    "CompareError",
    "RankReader",
    "RunInfo",
    "WholeTensorReader",
    "open_run",
    "step_ranges",
]


class CompareError(ValueError):
    """Input a comparison cannot use (not a run, no statistics, nothing in common): the message says why."""


@dataclass(frozen=True)
class RunInfo:
    """What a comparison needs to know of a run before reading its statistics."""

    path: Path
    ranks: tuple[int, ...]  # ranks whose statistics store holds rows
    world_size: int
    framework: str  # "pytorch", "mindspore"
    first_step: dict[int, int]  # per rank: the first and last stored step
    last_step: dict[int, int]
    # monitor_mbs_grad: every parameter's grad_unreduced read on every micro-batch (None: not said)
    grads_per_micro_step: bool | None = None

    @property
    def name(self) -> str:
        return self.path.name or str(self.path)


def open_run(path: str | os.PathLike[str]) -> RunInfo:
    """The run at ``path``; :class:`CompareError` when it is none or holds no statistics."""
    path = Path(path)
    problem = not_a_run(path)
    if problem is not None:
        raise CompareError(problem)
    manifest = read_manifest(path) or {}
    ranks = stat_ranks(path)
    if not ranks:
        raise CompareError(
            f"{path} holds no statistics store (plugins/trainmon/stats/): it is written when 'tensorboard' "
            "is among the run's formats (the default); compare grad_probe fingerprints with "
            "--source gradprobe"
        )
    first, last = {}, {}
    for rank in ranks:
        span = step_span(path, rank)
        if span is not None:
            first[rank], last[rank] = span
    world = manifest.get("world_size")
    world = int(world) if isinstance(world, int) and not isinstance(world, bool) and world > 0 else len(ranks)
    framework = str(manifest.get("framework") or "pytorch")
    config = manifest.get("config")
    every = config.get("monitor_mbs_grad") if isinstance(config, dict) else None
    every = every if isinstance(every, bool) else None
    return RunInfo(path, tuple(r for r in ranks if r in first), world, framework, first, last, every)


def step_ranges(lo: int, hi: int, size: int = SEGMENT_STEPS) -> list[tuple[int, int]]:
    """``lo..hi`` cut at multiples of ``size`` (the store's segments: each range reads one segment a rank)."""
    out = []
    start = lo
    while start <= hi:
        end = min(hi, (start // size + 1) * size - 1)
        out.append((start, end))
        start = end + 1
    return out


class RankReader:
    """A run's statistics rank by rank: each rank is compared with the same rank of the other run."""

    layout = "ranks"

    def __init__(self, run: RunInfo) -> None:
        self.run = run
        self._ahead: dict[tuple[int, int, int], tuple[StatFrame, TensorMeta]] = {}  # read by meta()

    @property
    def ranks(self) -> tuple[int, ...]:
        return self.run.ranks

    def span(self, rank: int) -> tuple[int, int]:
        return self.run.first_step[rank], self.run.last_step[rank]

    def read(self, rank: int, lo: int, hi: int) -> tuple[StatFrame, TensorMeta]:
        """One rank's steps ``lo..hi``: the statistics :mod:`~trainmon.read.compare.diff` compares, and each
        tensor's dtype, shape and element count as the range's first row of it holds them, from one read of
        the rows (a range :meth:`meta` read first is handed over, not read again)."""
        found = self._ahead.pop((rank, lo, hi), None)
        if found is None:
            with self._reading(rank, lo, hi):
                found = read_frame(self.run.path, rank, DIFF_STATS, lo, hi)
        return found

    def frame(self, rank: int, lo: int, hi: int) -> StatFrame:
        return self.read(rank, lo, hi)[0]

    def carried(self, meta: TensorMeta) -> dict[tuple[str, str], Carried]:
        """The precision each tensor of ``meta`` (one range of a rank, in hook order) was computed in."""
        return carried(meta)

    def meta(self, rank: int, lo: int, hi: int) -> TensorMeta:
        """The metadata of :meth:`read`; the range's statistics, read with it, are kept for :meth:`read`."""
        found = self.read(rank, lo, hi)
        self._ahead[(rank, lo, hi)] = found
        return found[1]

    @contextlib.contextmanager
    def _reading(self, rank: int, lo: int, hi: int) -> Iterator[None]:
        """A file of the store that cannot be read (damaged, removed) is a :class:`CompareError` naming the
        run, rank and steps."""
        try:
            yield
        except (OSError, ValueError) as e:
            folder = stats_rank_dir(self.run.path, rank)
            raise CompareError(f"{folder}: steps {lo}..{hi}: the statistics store cannot be read: {e}") from e


class WholeTensorReader(RankReader):
    """A run's whole-tensor statistics (:data:`~trainmon.read.compare.tensors.WHOLE_TENSOR_KINDS`) as one
    rank, 0, whatever rank holds each tensor: the adapters merge the shards of a tensor- or data-parallel
    tensor, so every rank that has it holds the whole tensor's statistics, and runs of different parallel
    layouts compare on them. A name two ranks hold with different values (pipeline stages that number their
    layers from 0 each) is no whole tensor: it is left out and listed in :attr:`ambiguous`."""

    layout = "whole"
    _SAME = 1e-6  # replicas of a merged statistic agree to rounding

    def __init__(self, run: RunInfo) -> None:
        super().__init__(run)
        self.ambiguous: set[tuple[str, str]] = set()
        self.kinds_left_out: set[str] = set()
        self._carried: dict[tuple[str, str], Carried] = {}  # over every rank's whole order, activations too

    @property
    def ranks(self) -> tuple[int, ...]:
        return (0,)

    def span(self, rank: int) -> tuple[int, int]:
        return min(self.run.first_step.values()), max(self.run.last_step.values())

    def frame(self, rank: int, lo: int, hi: int) -> StatFrame:
        frames = []
        for r in self.run.ranks:
            with self._reading(r, lo, hi):
                frames.append(
                    (r, read_stats(self.run.path, r, DIFF_STATS, lo, hi, kinds=sorted(WHOLE_TENSOR_KINDS)))
                )
        frames = [(r, f) for r, f in frames if len(f.steps)]
        if not frames:
            return StatFrame(np.empty(0, np.int64), (), {s: np.empty((0, 0)) for s in DIFF_STATS})
        steps = np.unique(np.concatenate([f.steps for _, f in frames]))
        columns: dict[tuple[str, str], tuple[int, StatFrame, int]] = {}
        for r, f in frames:
            for j, tensor in enumerate(f.tensors):
                if tensor in self.ambiguous:
                    continue
                if tensor not in columns:
                    columns[tensor] = (r, f, j)
                elif not self._same(columns[tensor], (f, j)):
                    self.ambiguous.add(tensor)
        tensors = tuple(t for t in columns if t not in self.ambiguous)
        values = {}
        for stat in DIFF_STATS:
            matrix = np.full((len(steps), len(tensors)), np.nan, dtype=frames[0][1].values[stat].dtype)
            for c, tensor in enumerate(tensors):
                _, f, j = columns[tensor]
                matrix[np.searchsorted(steps, f.steps), c] = f.values[stat][:, j]
            values[stat] = matrix
        return StatFrame(steps, tensors, values)

    def read(self, rank: int, lo: int, hi: int) -> tuple[StatFrame, TensorMeta]:
        return self.frame(rank, lo, hi), self.meta(rank, lo, hi)

    def carried(self, meta: TensorMeta) -> dict[tuple[str, str], Carried]:
        return {t: self._carried[t] for t in meta.tensors if t in self._carried}

    def _same(self, first: tuple[int, StatFrame, int], other: tuple[StatFrame, int]) -> bool:
        _, fa, ja = first
        fb, jb = other
        common, ia, ib = np.intersect1d(fa.steps, fb.steps, return_indices=True)
        if not len(common):
            return True
        x, y = fa.values["norm"][ia[0], ja], fb.values["norm"][ib[0], jb]
        if np.isnan(x) and np.isnan(y):
            return True
        return bool(abs(x - y) <= self._SAME * max(abs(x), abs(y)))

    def meta(self, rank: int, lo: int, hi: int) -> TensorMeta:
        tensors, dtypes, shapes, numel = [], [], [], []
        seen = set()
        for r in self.run.ranks:
            with self._reading(r, lo, hi):
                found = read_meta(self.run.path, r, lo, hi)
            for t, c in carried(found).items():  # the lowest precision any rank computes it in
                if t not in self._carried or coarser(c.dtype, self._carried[t].dtype):
                    self._carried[t] = c
            for t, d, s, n in zip(found.tensors, found.dtypes, found.shapes, found.numel, strict=True):
                if t[0] not in WHOLE_TENSOR_KINDS:
                    self.kinds_left_out.add(t[0])
                    continue
                if t not in seen:
                    seen.add(t)
                    tensors.append(t)
                    dtypes.append(d)
                    shapes.append(s)
                    numel.append(n)
        return TensorMeta(tuple(tensors), tuple(dtypes), tuple(shapes), tuple(numel))
