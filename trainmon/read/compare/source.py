"""A run as a comparison reads it: its ranks, steps and framework, and its statistics a step range at a time.

A step range is read for one rank at a time from the statistics store (:mod:`trainmon.run.statstore`): only
the Parquet row groups of those steps, so finding a divergence in the first thousand steps of a 20,000-step
run reads a twentieth of it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainmon.read.compare.diff import DIFF_STATS
from trainmon.read.requests import not_a_run
from trainmon.run.columnar import SEGMENT_STEPS, segments
from trainmon.run.layout import stats_rank_dir
from trainmon.run.manifest import read_manifest
from trainmon.run.statstore import StatFrame, TensorMeta, last_step, read_meta, read_stats, stat_ranks

__all__ = ["CompareError", "RunInfo", "open_run", "read_block", "step_ranges"]


class CompareError(ValueError):
    """Input a comparison cannot use (not a run, no statistics, nothing in common): the message says why."""


@dataclass(frozen=True)
class RunInfo:
    """What a comparison needs to know of a run before reading its statistics."""

    path: Path
    ranks: tuple[int, ...]  # ranks with a statistics store
    world_size: int
    framework: str  # "pytorch", "mindspore"
    first_step: dict[int, int]  # per rank: the first and last stored step
    last_step: dict[int, int]

    @property
    def name(self) -> str:
        return self.path.name or str(self.path)


def _first_step(run: Path, rank: int) -> int | None:
    found = segments(stats_rank_dir(run, rank))
    if found:
        return min(s.lo for s in found)
    frame = read_stats(run, rank, ("nans",))  # the old store: small runs only
    return int(frame.steps[0]) if len(frame.steps) else None


def _old_last_step(run: Path, rank: int) -> int | None:
    frame = read_stats(run, rank, ("nans",))
    return int(frame.steps[-1]) if len(frame.steps) else None


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
        lo = _first_step(path, rank)
        hi = last_step(path, rank)
        if hi is None:
            hi = _old_last_step(path, rank)
        if lo is not None and hi is not None:
            first[rank], last[rank] = lo, hi
    world = manifest.get("world_size")
    world = int(world) if isinstance(world, int) and not isinstance(world, bool) and world > 0 else len(ranks)
    framework = str(manifest.get("framework") or "pytorch")
    return RunInfo(path, tuple(r for r in ranks if r in first), world, framework, first, last)


def step_ranges(lo: int, hi: int, size: int = SEGMENT_STEPS) -> list[tuple[int, int]]:
    """``lo..hi`` cut at multiples of ``size`` (the store's segments: each range reads one segment a rank)."""
    out = []
    start = lo
    while start <= hi:
        end = min(hi, (start // size + 1) * size - 1)
        out.append((start, end))
        start = end + 1
    return out


@dataclass(frozen=True)
class Block:
    """One rank's statistics over a step range: ``frame.values[stat]`` is steps x tensors."""

    frame: StatFrame

    @property
    def steps(self) -> np.ndarray:
        return self.frame.steps

    @property
    def tensors(self) -> tuple[tuple[str, str], ...]:
        return self.frame.tensors


def read_block(run: RunInfo, rank: int, lo: int, hi: int) -> Block:
    """The statistics :mod:`~trainmon.read.compare.diff` compares, of one rank's steps ``lo..hi``."""
    return Block(read_stats(run.path, rank, DIFF_STATS, lo, hi))


def read_tensor_meta(run: RunInfo, rank: int, lo: int, hi: int) -> TensorMeta:
    """Each tensor's dtype, shape and element count at the first stored step of ``lo..hi``."""
    return read_meta(run.path, rank, lo, hi)
