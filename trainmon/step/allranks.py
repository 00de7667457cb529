"""Each collected step's tensors merged over every rank of the job, for the ``all_ranks`` TensorBoard run.

At the step end, before the one host copy, every rank adds its rows into a table of *slots*, one per tensor
(kind, vpp_stage, name) of the job, and the table is all-reduced: SUM for the counts, sums and sums of
squares, MAX for max and -min (the partials algebra, as shards and micro-steps merge). Both all-reduces are
issued with ``async_op`` and waited for with ``Work.wait()``, which on an accelerator only orders the
device's stream after them: the host never waits, and the result rides in the step's host copy.

Every rank must place a tensor in the same slot, so the table is agreed between the ranks: at the first
collected step, each distinct set of tensors (ranks of a data-parallel group share one) is sent once with
``all_gather_object``, and the union, in rank order, is the table on every rank. A tensor a rank meets
later (a step the loss scaler skipped has no optimizer rows; a config reload adds kinds) goes to an extra
slot whose element count, summed over the ranks, says "some rank has tensors outside the table"; that flag of
collected step n is read from the host copy at collected step n + :data:`LAG` (long landed) on every rank,
which then agree on the new tensors together. Only the agreements exchange names on the host.
"""

from __future__ import annotations

import hashlib
import logging
import pickle
from collections import deque
from collections.abc import Callable, Sequence

import numpy as np
import torch

from trainmon.device import collective_device, upload
from trainmon.run.records import MAX, MIN, N_PARTIALS, NUMEL, SUM, SUMSQ, ZEROS, Row, kind_name
from trainmon.writer.layouts import LayoutCache

logger = logging.getLogger("trainmon")

# Collected steps between a step and the reading of its "tensors outside the table" flag.
LAG = 2

Key = tuple[str, int, str]


def row_key(row: Row) -> Key:
    return (kind_name(row.kind), row.vpp_stage, row.name)


class _StorePlan:
    """How one device's rows of a layout go into the slots: all rows summed into their slot (tensors outside
    the table into the extra slot), and per pass (the j-th row of each tensor: micro-steps) rows and slots
    for the maxima, each slot at most once per pass."""

    __slots__ = ("slots", "passes")

    def __init__(self, device: torch.device, slots: np.ndarray, table_size: int) -> None:
        self.slots = upload(torch.from_numpy(slots.astype(np.int64)), device)
        self.passes: list[tuple[torch.Tensor, torch.Tensor]] = []
        seen: dict[int, int] = {}
        occurrence = np.empty(len(slots), dtype=np.int64)
        for i, s in enumerate(slots.tolist()):
            occurrence[i] = seen.get(s, 0)
            seen[s] = occurrence[i] + 1
        known = slots < table_size
        for j in range(int(occurrence.max()) + 1 if len(slots) else 0):
            rows = np.flatnonzero(known & (occurrence == j))
            if len(rows):
                self.passes.append(
                    (
                        upload(torch.from_numpy(rows.astype(np.int64)), device),
                        upload(torch.from_numpy(slots[rows].astype(np.int64)), device),
                    )
                )


class _Plan:
    __slots__ = ("stores", "outside")

    def __init__(self, stores: list[_StorePlan], outside: list[Key]) -> None:
        self.stores = stores
        self.outside = outside


class AllRanksAggregate:
    """The agreed table of tensors and the per-step reduction. One per monitor, used on the training thread;
    every rank of ``group()`` must call :meth:`reduce` at every collected step, in the same order as its
    other collectives (the step buffer does, after merging shards)."""

    def __init__(self, group: Callable[[], object]) -> None:
        self._group = group
        self.keys: tuple[Key, ...] = ()
        self._slot: dict[Key, int] = {}
        self._agreed = False
        self._pending: dict[Key, None] = {}  # this rank's tensors outside the table, first seen first
        self._flags: deque[Callable[[], float]] = deque()
        self._plans = LayoutCache(self._plan)
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None
        self.agreements = 0  # how many times the table was agreed (tests; the log says when)

    # ------------------------------------------------------------------ agreement
    def _agree(self) -> None:
        """Add every rank's pending tensors to the table, the same on every rank."""
        import torch.distributed as dist

        group = self._group()
        world = dist.get_world_size(group)
        mine = list(self._pending)
        digest = hashlib.blake2b(pickle.dumps(mine, protocol=4), digest_size=16).digest() if mine else b""
        digests: list[object] = [None] * world
        dist.all_gather_object(digests, digest, group=group)
        first_of = {}
        for r, d in enumerate(digests):
            first_of.setdefault(d, r)
        me = dist.get_rank(group)
        lists: list[object] = [None] * world
        # ranks with the same tensors send them once (a data-parallel group is one list, not hundreds)
        dist.all_gather_object(lists, mine if mine and first_of[digest] == me else None, group=group)
        added = 0
        for keys in lists:
            for key in keys or ():
                if key not in self._slot:
                    self._slot[key] = len(self._slot)
                    added += 1
        self.keys = tuple(self._slot)
        self._pending = {}
        self._agreed = True
        self.agreements += 1
        self._flags.clear()  # flags of earlier steps refer to the table before this agreement
        logger.info("trainmon: all_ranks: %d tensors over %d ranks (%d new)", len(self.keys), world, added)

    # ------------------------------------------------------------------ per step
    def _plan(self, key: tuple) -> _Plan:
        rows, placement, devices, table_size = key
        slots = np.asarray([self._slot.get(row_key(r), table_size) for r in rows], dtype=np.int64)
        outside = list(dict.fromkeys(row_key(r) for r, s in zip(rows, slots, strict=True) if s == table_size))
        place = np.frombuffer(placement, dtype=np.int64)
        stores = [_StorePlan(device, slots[place == index], table_size) for index, device in devices]
        return _Plan(stores, outside)

    def _slot_buffers(self, size: int, extra: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        b = self._buffers
        if b is None or b[0].shape[0] != size + extra or b[1].shape[0] != size or b[0].device != device:
            b = self._buffers = (
                torch.zeros((size + extra, 6), dtype=torch.float64, device=device),
                torch.zeros((size, 2), dtype=torch.float64, device=device),
            )
        return b

    def reduce(
        self,
        rows: tuple[Row, ...],
        placement: np.ndarray,
        stores: Sequence[tuple[int, torch.Tensor]],
        extra: np.ndarray | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step's (len(keys) + 1, 8) partials merged over every rank, on the collective device (the last
        row: the tensors outside the table). ``stores``: (store index, its rows' partials on its device).

        ``extra`` (float64, any length) rides in the summed table's last rows and comes back summed over the
        ranks, on the collective device (the ranks' step times: trainmon.step.timing); None without it."""
        import torch.distributed as dist

        if len(self._flags) >= LAG and self._flags.popleft()() > 0:
            for r in rows:  # a tensor outside the table on some rank: agree on it at this step
                key = row_key(r)
                if key not in self._slot:
                    self._pending[key] = None
            self._agree()
        if not self._agreed:
            self._pending = dict.fromkeys(row_key(r) for r in rows)
            self._agree()
        devices = tuple((index, data.device) for index, data in stores)
        plan = self._plans.get(
            (rows, np.ascontiguousarray(placement, dtype=np.int64).tobytes(), devices, len(self.keys))
        )
        for key in plan.outside:
            self._pending[key] = None
        device = collective_device()
        size = len(self.keys) + 1
        extra_rows = 0 if extra is None else -(-len(extra) // 6)
        summed, extremes = self._slot_buffers(size, extra_rows, device)
        summed.zero_()
        extremes.fill_(-np.inf)
        riding = None
        if extra is not None:
            riding = summed[size:].view(-1)[: len(extra)]
            riding.copy_(upload(torch.from_numpy(extra), device))
        for (_, data), sp in zip(stores, plan.stores, strict=True):
            sums = torch.cat((data[:, NUMEL : ZEROS + 1], data[:, SUM : SUMSQ + 1]), dim=1).to(device)
            ext = torch.stack((data[:, MAX], -data[:, MIN]), dim=1).to(device)
            summed[:size].index_put_((sp.slots.to(device),), sums, accumulate=True)
            for rows_j, slots_j in sp.passes:
                slots_j = slots_j.to(device)
                extremes[slots_j] = torch.maximum(extremes[slots_j], ext[rows_j.to(device)])
        group = self._group()
        works = [
            dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=group, async_op=True),
            dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group, async_op=True),
        ]
        for work in works:
            work.wait()  # on an accelerator: the stream waits, the host does not
        out = torch.empty((len(self.keys) + 1, N_PARTIALS), dtype=torch.float64, device=device)
        out[:, NUMEL : ZEROS + 1] = summed[:size, :4]
        out[:, SUM : SUMSQ + 1] = summed[:size, 4:]
        out[:, MAX] = extremes[:, 0]
        out[:, MIN] = -extremes[:, 1]
        return out, riding

    def track(self, flag: Callable[[], float]) -> None:
        """The step's "tensors outside the table" count, readable once its host copy landed."""
        self._flags.append(flag)
