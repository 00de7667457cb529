"""Reading fingerprints back: a run's ranks, and each rank's steps as :class:`Fingerprint` objects."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainmon.run.gradprobe import FORMAT_VERSION, ParamLayout
from trainmon.run.layout import probe_bin_file, probe_dir, probe_index_file
from trainmon.run.records import N_PARTIALS, NANS, NUMEL

_INDEX = re.compile(r"^rank_(\d+)\.index\.jsonl$")


class FingerprintError(ValueError):
    """Fingerprint files that cannot be read; the message names the file (and line)."""


@dataclass(frozen=True)
class Fingerprint:
    """One parameter's fingerprint at one step."""

    layout: ParamLayout
    partials: np.ndarray  # (8,) float64
    counts: np.ndarray | None  # (len(bounds)+1,) float64: cumulative counts, then exact zeros (L2)
    sample: np.ndarray | None  # (k,) float32 (L1, L2)
    signs: np.ndarray | None  # packed sign bits (sign_bitmap)

    def bins(self) -> np.ndarray | None:
        """Fractions of the elements in ``(-inf, b0], (b0, b1], ..., (bn, inf)`` and ``== 0`` (msprobe's
        L2 columns); NaN elements are in no interval."""
        if self.counts is None:
            return None
        numel = self.partials[NUMEL]
        le = self.counts[:-1]
        intervals = np.diff(np.concatenate(([0.0], le, [numel - self.partials[NANS]])))
        return np.concatenate((intervals, self.counts[-1:])) / max(numel, 1.0)

    def sign_bits(self) -> np.ndarray | None:
        """``grad > 0`` for every element (from the bitmap), as bool."""
        if self.signs is None:
            return None
        return np.unpackbits(self.signs, count=self.layout.numel).astype(bool)


def ranks(run_dir: str | Path) -> list[int]:
    """Ranks with a fingerprint index in ``run_dir``, ascending."""
    d = probe_dir(run_dir)
    if not d.is_dir():
        return []
    return sorted(int(m.group(1)) for p in d.iterdir() if (m := _INDEX.match(p.name)))


@dataclass(frozen=True)
class _Step:
    step: int
    offset: int
    nbytes: int
    params: tuple[int, ...]


class RankFingerprints:
    """The fingerprints one rank wrote. Steps are read lazily, one block at a time."""

    def __init__(self, run_dir: str | Path, rank: int) -> None:
        self.run_dir = Path(run_dir)
        self.rank = rank
        self._index_path = probe_index_file(run_dir, rank)
        self._bin_path = probe_bin_file(run_dir, rank)
        self.params: dict[int, ParamLayout] = {}
        self._steps: dict[int, _Step] = {}  # a step written twice (a resumed run): the last one counts
        self._read_index()

    def _read_index(self) -> None:
        try:
            raw = self._index_path.read_bytes()
        except OSError as e:
            raise FingerprintError(f"{self._index_path}: cannot read: {e.strerror or e}") from None
        lines = raw.split(b"\n")
        if lines and lines[-1]:  # a partial last line: the writer was killed mid-line
            lines = lines[:-1]
        size = self._bin_path.stat().st_size if self._bin_path.exists() else 0
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{self._index_path}:{number}"
            try:
                entry = json.loads(line)
                kind = entry["type"]
                if kind == "header":
                    if entry.get("v") != FORMAT_VERSION:
                        raise FingerprintError(f"{where}: format version {entry.get('v')!r} is not supported")
                elif kind == "param":
                    self.params[int(entry["id"])] = ParamLayout.from_json(entry)
                elif kind == "step":
                    step = _Step(
                        int(entry["step"]),
                        int(entry["offset"]),
                        int(entry["bytes"]),
                        tuple(int(i) for i in entry["params"]),
                    )
                    unknown = [i for i in step.params if i not in self.params]
                    if unknown:
                        raise FingerprintError(f"{where}: step lists undescribed param ids {unknown}")
                    if sum(self.params[i].nbytes for i in step.params) != step.nbytes:
                        raise FingerprintError(f"{where}: the step's size does not match its params")
                    if step.offset + step.nbytes > size:
                        raise FingerprintError(f"{where}: points past the end of {self._bin_path}")
                    self._steps[step.step] = step
            except FingerprintError:
                raise
            except (ValueError, KeyError, TypeError) as e:
                raise FingerprintError(f"{where}: not a fingerprint index line ({e})") from None

    @property
    def steps(self) -> list[int]:
        return sorted(self._steps)

    def step(self, step: int) -> dict[tuple[int, str], Fingerprint]:
        """Fingerprints of ``step`` keyed by (vpp_stage, name)."""
        entry = self._steps[step]
        with open(self._bin_path, "rb") as f:
            f.seek(entry.offset)
            block = f.read(entry.nbytes)
        out: dict[tuple[int, str], Fingerprint] = {}
        pos = 0
        for param_id in entry.params:
            layout = self.params[param_id]
            partials = np.frombuffer(block, "<f8", N_PARTIALS, pos)
            pos += 8 * N_PARTIALS
            counts = sample = signs = None
            if layout.n_counts:
                counts = np.frombuffer(block, "<f8", layout.n_counts, pos)
                pos += 8 * layout.n_counts
            if layout.k:
                sample = np.frombuffer(block, "<f4", layout.k, pos)
                pos += 4 * layout.k
            if layout.bitmap_bytes:
                signs = np.frombuffer(block, np.uint8, layout.bitmap_bytes, pos)
                pos += layout.bitmap_bytes
            out[(layout.vpp_stage, layout.name)] = Fingerprint(layout, partials, counts, sample, signs)
        return out

    def __iter__(self) -> Iterator[tuple[int, dict[tuple[int, str], Fingerprint]]]:
        for step in self.steps:
            yield step, self.step(step)
