"""Each tensor's shape and dtype on a rank, as the statistics store recorded them (its ``shape`` and ``dtype``
columns, read through :func:`trainmon.run.statstore.read_meta`; for a ZeRO or DTensor shard the whole
tensor's shape), for the tab's names of tensors: the heat map's rows, the series' title, the anomaly list.

The texts are sent as the store writes them (``[256, 64]``, ``bfloat16``), once per tensor of an answer (the
heat map's name list), never per cell. A rank's shapes are read once, at its first step (one row group of its
first segment: a few milliseconds), and kept (ranks with the same shapes share one table): rows are only
appended, so what was read stays true. A tensor that step does not hold (added by a config reload) is looked
up at a step that holds it (the first step the heat map has of it, an anomaly's own step), each step of a
rank read at most once. One call reads at most :data:`MAX_READS` steps, so an anomaly list spread over
hundreds of ranks costs a bounded time; the shapes it could not read yet come with a later answer (the tab
asks again while live)."""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from trainmon.run.columnar import segments
from trainmon.run.layout import stats_rank_dir
from trainmon.run.statstore import read_meta

# reads of one rank's step a call may make: at ~5 ms each (a 289-tensor rank), a third of a second at most
MAX_READS = 64
# ranks whose shapes are kept: ranks holding the same tensors (every rank of a data-parallel job) share one
# table, so a thousand ranks cost about what one does (~90 KB for 289 tensors)
MAX_RANKS = 1024

Meta = tuple[str | None, str | None]  # (dtype, shape) as the store writes them; None: not recorded
UNKNOWN: Meta = (None, None)
Tensor = tuple[int, str, str]  # (rank, kind, name)


class _Table(dict):
    """(kind, name) -> (dtype, shape): a dict that a weak reference can name (ranks share one; never
    changed once shared)."""


@dataclass
class _RankShapes:
    """What one rank's store said, and the steps already read for it."""

    of: _Table
    steps: set[int] = field(default_factory=set)


class ShapeIndex:
    """The shapes and dtypes of one run's tensors, per rank, read when first asked for. Thread-safe: the
    lock guards the cache, never a read."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self._ranks: OrderedDict[int, _RankShapes] = OrderedDict()
        self._tables: weakref.WeakValueDictionary[tuple, _Table] = weakref.WeakValueDictionary()
        self._lock = threading.Lock()

    def lookup(self, tensors: Sequence[Tensor], where: Callable[[Tensor], int | None]) -> list[Meta]:
        """The (dtype, shape) of each tensor (:data:`UNKNOWN` where the store has none, or not read yet).
        ``where(tensor)`` names a step that holds a tensor its rank's first step lacks (None: none known);
        it is called only for those."""
        budget = [MAX_READS]
        stored = {rank for rank in dict.fromkeys(r for r, _, _ in tensors) if self._first_step(rank, budget)}
        for tensor in tensors:
            if tensor[0] in stored and self._get(tensor) is None:
                step = where(tensor)
                if step is not None:
                    self._read(tensor[0], step, budget)
        return [self._get(t) or UNKNOWN for t in tensors]

    def kept(self) -> tuple[int, int]:
        """(ranks, distinct tables) whose shapes are kept (tests, benchmarks)."""
        with self._lock:
            return len(self._ranks), len({id(shapes.of) for shapes in self._ranks.values()})

    def _get(self, tensor: Tensor) -> Meta | None:
        with self._lock:
            shapes = self._ranks.get(tensor[0])
            return None if shapes is None else shapes.of.get(tensor[1:])

    def _first_step(self, rank: int, budget: list[int]) -> bool:
        """Reads the rank's first step, unless known already. False: the rank has no columnar store (none, or
        an old one, which recorded no shapes): nothing to look up there."""
        with self._lock:
            if rank in self._ranks:
                self._ranks.move_to_end(rank)
                return True
        found = segments(stats_rank_dir(self.run_dir, rank))
        if found:
            self._read(rank, min(s.lo for s in found), budget)
        return bool(found)

    def _read(self, rank: int, step: int, budget: list[int]) -> None:
        """Adds what the rank's store holds at ``step`` (its first record of each tensor there)."""
        with self._lock:
            known = self._ranks.get(rank)
            if budget[0] <= 0 or (known is not None and step in known.steps):
                return
        budget[0] -= 1
        meta = read_meta(self.run_dir, rank, step, step)
        if not meta.tensors:  # nothing written there yet (a rank of a job that just started): ask again later
            return
        found = dict(zip(meta.tensors, zip(meta.dtypes, meta.shapes, strict=True), strict=True))
        with self._lock:
            shapes = self._ranks.get(rank)
            if shapes is None:
                shapes = self._ranks[rank] = _RankShapes(self._shared(found))
            elif found.keys() - shapes.of.keys():  # the first step read wins (the rank's first)
                shapes.of = self._shared({**found, **shapes.of})  # a new table: the old one may be shared
            self._ranks.move_to_end(rank)
            shapes.steps.add(step)
            while len(self._ranks) > MAX_RANKS:
                self._ranks.popitem(last=False)

    def _shared(self, found: dict[tuple[str, str], Meta]) -> _Table:
        """The table of these shapes, one for every rank that has the same (the lock is held)."""
        key = tuple(found.items())
        table = self._tables.get(key)
        if table is None:
            table = self._tables[key] = _Table(found)
        return table
