"""The on-disk format of gradient fingerprints (``grad_probe``), shared by the writer and the reader.

Per rank, two files under ``RUN/plugins/trainmon/gradprobe/``:

* ``rank_<r>.bin``: step blocks, back to back. A block is the records of the step's parameters in the order
  its index line lists them; a parameter's record is, little-endian and unpadded::

      partials   8 x float64     the stats kernel's vector (numel, nans, infs, zeros, min, max, sum, sumsq)
      counts     (B+1) x float64 L2 only: elements <= each of the B bounds (cumulative), then exact zeros
      sample     k x float32     L1/L2: the gradient at k fixed positions (all elements when numel <= k)
      signs      ceil(numel/8)   with sign_bitmap: bit i (MSB first, numpy.packbits order) is grad[i] > 0

* ``rank_<r>.index.jsonl``: one JSON object a line. ``{"type": "header", "v": 1}`` first; then a
  ``"param"`` line the first time a record layout is used (its ``id``, name, shape, seed, ...) and a
  ``"step"`` line per step written (``step``, ``offset`` and ``bytes`` in the .bin file, ``params``: ids).
  The block is written and flushed before its step line, so every step line points at complete data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from trainmon.run.records import N_PARTIALS

FORMAT_VERSION = 1


@dataclass(frozen=True)
class ParamLayout:
    """How one parameter's record is laid out; identical layouts share one ``param`` line."""

    name: str
    vpp_stage: int
    shape: tuple[int, ...]
    dtype: str
    level: str
    bounds: tuple[float, ...]  # empty below L2
    seed: int  # of the sample positions (see trainmon.gradprobe.sampling.sample_positions)
    sample_seed: str  # "name" or "shape": what the seed was derived from
    k: int  # sampled elements (0 at L0)
    sign_bitmap: bool

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def n_counts(self) -> int:
        return len(self.bounds) + 1 if self.bounds else 0

    @property
    def bitmap_bytes(self) -> int:
        return (self.numel + 7) // 8 if self.sign_bitmap else 0

    @property
    def nbytes(self) -> int:
        return 8 * N_PARTIALS + 8 * self.n_counts + 4 * self.k + self.bitmap_bytes

    def to_json(self, param_id: int) -> dict[str, Any]:
        return {
            "type": "param",
            "id": param_id,
            "name": self.name,
            "vpp_stage": self.vpp_stage,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "level": self.level,
            "bounds": list(self.bounds),
            "seed": self.seed,
            "sample_seed": self.sample_seed,
            "k": self.k,
            "sign_bitmap": self.sign_bitmap,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ParamLayout:
        return cls(
            name=str(d["name"]),
            vpp_stage=int(d["vpp_stage"]),
            shape=tuple(int(x) for x in d["shape"]),
            dtype=str(d["dtype"]),
            level=str(d["level"]),
            bounds=tuple(float(x) for x in d["bounds"]),
            seed=int(d["seed"]),
            sample_seed=str(d["sample_seed"]),
            k=int(d["k"]),
            sign_bitmap=bool(d["sign_bitmap"]),
        )
