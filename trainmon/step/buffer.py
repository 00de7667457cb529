"""The step buffer: per-step rows whose statistics stay on their device until the step ends."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from trainmon import stats
from trainmon.adapters import Piece, Shard
from trainmon.device import collective_counter, copy_to_host, no_collectives
from trainmon.run.records import (
    INFS,
    MAX,
    MIN,
    N_PARTIALS,
    NANS,
    NUMEL,
    SUM,
    SUMSQ,
    ZEROS,
    Kind,
    RankAggregate,
    Row,
    StepRecord,
)
from trainmon.run.timing import WIDTH
from trainmon.step.gate import GATE, is_dense, is_plain

_no_dispatch_modes = torch.utils._python_dispatch._disable_current_modes
_Tensor, _Parameter, _STRIDED = torch.Tensor, torch.nn.Parameter, torch.strided
_PLAIN_TYPES = (_Tensor, _Parameter)
_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor

if TYPE_CHECKING:
    from trainmon.step.allranks import AllRanksAggregate
    from trainmon.step.boundary import HeldTensors
    from trainmon.step.capture import Capture
    from trainmon.step.timing import StepTimer, TimesExchange

logger = logging.getLogger("trainmon")

try:  # optional, as the native stats kernel is (setup.py): without it every row takes the Python path
    from trainmon.step._fastrows import FastRows
except Exception as exc:  # ImportError, OSError (bad .so), anything a broken build raises
    FastRows = None
    logger.debug("trainmon.step._fastrows not available (%s); rows take the Python path", exc)

_INITIAL_ROWS = 1024
# Distinct row descriptions kept for reuse (see StepBuffer._interned); a job whose shapes never repeat clears
# the table when it is full rather than grow without bound
_MAX_INTERNED = 1 << 18
# Kinds whose tensors nothing rewrites behind their version counter: a backend may reduce a tensor once when
# it appears again in the step (a module's input that is the previous module's output). Gradients join them
# when no process group exists, as then no collective can reduce them in place.
_SHAREABLE = frozenset({Kind.ACTV.value, Kind.ACTV_GRAD.value})
_SHAREABLE_UNDISTRIBUTED = _SHAREABLE | {Kind.GRAD_UNREDUCED.value, Kind.GRAD_REDUCED.value}


class AdamMoments(NamedTuple):
    """What update/ratio rows are computed from: Adam's moments and its step's hyper-parameters."""

    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    c1: float  # bias corrections 1 - beta**t
    c2: float
    adam_eps: float


class _DeviceStore:
    """Preallocated (capacity, 8) float64 partials on one device, and the stats backend that fills them;
    kept across steps."""

    def __init__(self, device: torch.device, index: int) -> None:
        self.device = device
        self.index = index
        self.count = 0
        with _no_dispatch_modes():  # a store made under FakeTensorMode would be fake for the whole run
            self.data = torch.empty((_INITIAL_ROWS, N_PARTIALS), dtype=torch.float64, device=device)
        self.capacity = _INITIAL_ROWS  # rows of ``data`` (kept as an int: read once per row)
        self.reducer: stats.Reducer = stats.reducer_for(device)

    def reserve(self, extra: int) -> int:
        """Return the first free row, growing the store when ``extra`` rows do not fit."""
        first = self.count
        if first + extra > self.capacity:
            with _no_dispatch_modes():
                grown = torch.empty(
                    (max(2 * self.capacity, first + extra), N_PARTIALS),
                    dtype=torch.float64,
                    device=self.device,
                )
                grown[:first].copy_(self.data[:first])
            self.data = grown
            self.capacity = grown.shape[0]
        self.count = first + extra
        return first


class _HostAssembly:
    """Waits for the host copies of a step and places each device's rows at their global positions.

    Idempotent and thread-safe: the writer thread and ``Monitor.latest()`` may both call it.
    """

    def __init__(
        self,
        target: np.ndarray,
        placement: np.ndarray,
        parts: list[tuple[int, torch.Tensor, Callable[[], None] | None]],
    ) -> None:
        self._target, self._placement, self._parts = target, placement, parts
        self._lock = threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            for store_index, host, ready in self._parts:
                if ready is not None:
                    ready()
                if len(self._parts) > 1:
                    self._target[self._placement == store_index] = host.numpy()
            self._parts = []


class StepBuffer:
    """Rows and partials of one step: hooks call :meth:`add`, the step boundary calls :meth:`finish`."""

    def __init__(self, eps: float) -> None:
        self.eps = eps
        self.rows: list[Row] = []
        self._placement: list[int] = []
        self._stores: dict[torch.device, _DeviceStore] = {}
        self._last: _DeviceStore | None = None
        self._cpu: _DeviceStore | None = None  # the CPU's store, found without building a device object
        self._cuda: dict[int, _DeviceStore] = {}  # CUDA stores by device index, found the same way
        # set by the monitor for steps with dump requests: sees every collected tensor (trainmon.step.capture)
        self.capture: Capture | None = None
        # set by the monitor with alert.capture: exact: keeps the step's activations until the boundary check
        self.hold: HeldTensors | None = None
        # collectives issued so far (device.collective_counter); rows remember it, relative to the step start
        self.count_collectives: Callable[[], int] = collective_counter()
        self._collectives: list[int] = []
        self._collectives_at_start = self.count_collectives()
        # rows holding shards of tensors split over ranks: id(group) -> (group, [(store, first row, count)])
        self._shards: dict[int, tuple[object, list[tuple[_DeviceStore | torch.device, int, int]]]] = {}
        self._shareable = _shareable_kinds()
        # set by the monitor when the job writes the all_ranks run: every rank merges each step's tensors
        # over the job (trainmon.step.allranks); ``keep_all_ranks``: this rank's records carry the result
        self.all_ranks: AllRanksAggregate | None = None
        self.keep_all_ranks = False
        # set by the monitor while steps are timed (trainmon.step.timing); the ranks' step times ride in the
        # all_ranks merge when there is one, else in a small all-reduce of the monitor's own (``exchange``)
        self.timer: StepTimer | None = None
        self.exchange: TimesExchange | None = None
        # every distinct Row seen, mapped to itself: a step's rows are the objects of earlier steps, so a step
        # leaves no new objects for Python's collector behind (each one that outlives a step is promoted to
        # the oldest generation, and enough of them trigger a full collection of the whole process)
        self._rows_seen: dict[Row, Row] = {}
        # the rows of the last add_many of each (kind, micro-step, phase): the optimizer side hands over the
        # same parameters step after step, so comparing whole columns (names, shapes, dtypes) finds its
        # rows without a lookup per tensor
        self._many: dict[tuple[str, int, str], tuple[list, list, list, list[Row]]] = {}
        # add's usual case for the first device whose reducer batches tensors, in C (see fast_rows)
        self._fast: Callable[[str, str, int, int, str, torch.Tensor], bool] | None = None

    def _interned(self, row: Row) -> Row:
        """``row`` itself the first time, the equal Row seen before afterwards."""
        seen = self._rows_seen.get(row)
        if seen is None:
            if len(self._rows_seen) >= _MAX_INTERNED:
                self._rows_seen.clear()
            seen = self._rows_seen[row] = row
        return seen

    def _row(self, *fields: object) -> Row:
        """The Row of these fields (Row's order), seen before or new: a plain tuple of them hashes and
        compares as the Row does, so the lookup builds no Row."""
        seen = self._rows_seen.get(fields)
        return seen if seen is not None else self._interned(Row(*fields))

    def _store_for(self, device: torch.device) -> _DeviceStore:
        last = self._last
        if last is not None and last.device == device:
            return last
        store = self._stores.get(device)
        if store is None:
            store = self._stores[device] = _DeviceStore(device, len(self._stores))
            if device.type == "cpu":
                self._cpu = store
            elif device.type == "cuda" and device.index is not None:
                self._cuda[device.index] = store
            if self._fast is None:
                self._fast = fast_rows(self, store)
        self._last = store
        return store

    def add(
        self, kind: str, name: str, vpp_stage: int, micro_step: int, phase: str, tensor: torch.Tensor
    ) -> None:
        """A row of ``tensor``. Runs for every tensor a hook sees, so it is written out flat: the CPU's or a
        CUDA device's store found without a device object (``tensor.device`` builds one each time), the
        row's description looked up by a plain tuple of its fields (:meth:`_row`), one call into the
        reducer. The usual case of a tensor that joins a Triton batch runs in C (:func:`fast_rows`)."""
        fast = self._fast
        if fast is not None and fast(kind, name, vpp_stage, micro_step, phase, tensor):
            return
        # is_plain, written out for the usual devices (the meta device is no CPU or CUDA one; the functional
        # wrapper without functorch exists only under AOT tracing, where tensors are of another type): a
        # DTensor, a tensor under tracing, ... goes to the gate, which says what it is
        tp = type(tensor)
        if (
            (tp is not _Tensor and tp is not _Parameter)
            or tensor.layout is not _STRIDED
            or _functorch_wrapped(tensor)
            or tensor.is_quantized
            or tensor.is_nested
        ):
            self._add_piece(kind, name, vpp_stage, micro_step, phase, tensor)
            return
        if tensor.is_cpu:
            store = self._cpu
        elif tensor.is_cuda:
            store = self._cuda.get(tensor.get_device())
        else:
            if not is_plain(tensor):
                self._add_piece(kind, name, vpp_stage, micro_step, phase, tensor)
                return
            store = None
        if store is None:
            store = self._store_for(tensor.device)
        row = store.count
        if row < store.capacity:
            store.count = row + 1
        else:
            store.reserve(1)
        fields = (kind, name, vpp_stage, micro_step, phase, tensor.shape, tensor.dtype)
        row_meta = self._rows_seen.get(fields)
        if row_meta is None:
            row_meta = self._interned(Row(*fields))
        try:
            store.reducer.row(tensor, store.data, row, self.eps, kind in self._shareable, row_meta)
        except BaseException:
            store.count = row  # keep rows and partials aligned
            raise
        self.rows.append(row_meta)
        count = self.count_collectives
        self._collectives.append(0 if count is no_collectives else count())
        self._placement.append(store.index)
        if self.capture is not None:
            self.capture.offer(row_meta, tensor)
        if self.hold is not None:
            self.hold.keep(len(self.rows) - 1, row_meta, tensor)

    def _add_piece(
        self, kind: str, name: str, vpp_stage: int, micro_step: int, phase: str, tensor: object
    ) -> None:
        """A row of a tensor that is not plain: its local tensor when the gate admits it (a shard's row
        shows the whole tensor's shape and is merged over the shard's groups at the step end)."""
        piece = GATE.piece(tensor, f"{kind} {name!r}")
        if piece is None:
            return
        if not isinstance(piece, Shard):
            self.add(kind, name, vpp_stage, micro_step, phase, piece)
            return
        self.add_shard(kind, name, vpp_stage, micro_step, phase, piece)

    def add_shard(
        self, kind: str, name: str, vpp_stage: int, micro_step: int, phase: str, piece: Shard
    ) -> None:
        """A row of this rank's piece of a tensor split over ranks, merged over its groups at the step end."""
        local = piece.local
        self.add(kind, name, vpp_stage, micro_step, phase, local)
        if piece.shape is not None:
            self.rows[-1] = self._interned(self.rows[-1]._replace(shape=tuple(piece.shape)))
        store = self._store_for(local.device)
        self.mark_shards(piece.group, store, store.count - 1, 1)

    def add_many(
        self,
        kind: str,
        names: Sequence[tuple[int, str]],
        tensors: Sequence[torch.Tensor],
        micro_step: int,
        phase: str,
    ) -> None:
        """Rows for many tensors (grads, params, optimizer states): one batched kernel call per device."""
        if not tensors:
            return
        plain, strided = _PLAIN_TYPES, _STRIDED  # is_dense, written out: a few thousand tensors a step
        if not all([type(t) in plain and t.layout is strided for t in tensors]):
            self.add_pieces(kind, names, tensors, micro_step, phase)
            return
        head = tensors[0]
        if head.is_cpu:
            store = self._cpu if self._cpu is not None else self._store_for(head.device)
            together = all([t.is_cpu for t in tensors])
        elif head.is_cuda:  # device indices, not device objects (``t.device`` builds one per tensor)
            index = head.get_device()
            store = self._cuda.get(index) or self._store_for(head.device)
            together = all([t.is_cuda for t in tensors]) and all([t.get_device() == index for t in tensors])
        else:
            device = head.device
            store = self._store_for(device)
            together = all([t.device == device for t in tensors])
        if not together:
            for (vpp, name), t in zip(names, tensors, strict=True):
                self.add(kind, name, vpp, micro_step, phase, t)
            return
        first = store.reserve(len(tensors))
        try:
            store.reducer.rows(tensors, store.data, first, self.eps, kind in self._shareable)
        except BaseException:
            store.count = first
            raise
        rows = self.rows
        before = len(rows)
        shapes = [t.shape for t in tensors]
        dtypes = [t.dtype for t in tensors]
        key = (kind, micro_step, phase)
        last = self._many.get(key)
        if last is not None and last[1] == shapes and last[2] == dtypes and last[0] == names:
            rows.extend(last[3])
        else:
            seen = self._rows_seen
            for (vpp, name), shape, dtype in zip(names, shapes, dtypes, strict=True):
                fields = (kind, name, vpp, micro_step, phase, shape, dtype)
                row_meta = seen.get(fields)
                rows.append(row_meta if row_meta is not None else self._interned(Row(*fields)))
            self._many[key] = (list(names), shapes, dtypes, rows[before:])
        count = self.count_collectives
        self._collectives.extend([0 if count is no_collectives else count()] * len(tensors))
        if self.capture is not None:
            for row_meta, t in zip(rows[before:], tensors, strict=True):
                self.capture.offer(row_meta, t)
        self._placement.extend([store.index] * len(tensors))

    def add_pieces(
        self,
        kind: str,
        names: Sequence[tuple[int, str]],
        pieces: Sequence[Piece],
        micro_step: int,
        phase: str,
    ) -> None:
        """Like :meth:`add_many` for what adapters return: whole tensors, or this rank's shards of tensors
        split over a process group (merged over the group when the step ends). Anything else goes through
        the gate first (trainmon.step.gate): a DTensor becomes its shard, what cannot be read is left out."""
        if not all([isinstance(p, Shard) or is_dense(p) for p in pieces]):
            admitted = [
                (n, p if isinstance(p, Shard) else GATE.piece(p, f"{kind} {n[1]!r}"))
                for n, p in zip(names, pieces, strict=True)
            ]
            names = [n for n, p in admitted if p is not None]
            pieces = [p for _, p in admitted if p is not None]
        start = 0
        while start < len(pieces):  # runs of whole tensors, and of shards of one group, keep their order
            first = pieces[start]
            group = first.group if isinstance(first, Shard) else None
            end = start + 1
            while end < len(pieces) and (
                isinstance(pieces[end], Shard) == isinstance(first, Shard)
                and (not isinstance(first, Shard) or pieces[end].group is group)
            ):
                end += 1
            run = pieces[start:end]
            if isinstance(first, Shard):
                self._add_shards(kind, names[start:end], run, micro_step, phase, group)
            else:
                self.add_many(kind, names[start:end], run, micro_step, phase)
            start = end

    def _add_shards(self, kind, names, shards, micro_step, phase, group) -> None:
        """Rows of a run of shards of one group, in order; an absent shard keeps its place in the merge."""
        start = 0
        while start < len(shards):
            absent = shards[start].absent
            end = start + 1
            while end < len(shards) and shards[end].absent == absent:
                end += 1
            if absent:
                self.mark_gap(group, shards[start].local.device, end - start)
            else:
                self._add_present_shards(kind, names[start:end], shards[start:end], micro_step, phase, group)
            start = end

    def _add_present_shards(self, kind, names, shards, micro_step, phase, group) -> None:
        tensors = [s.local for s in shards]
        device = tensors[0].device
        if any(t.device != device for t in tensors):
            raise ValueError(f"shards of {kind} rows are on several devices")
        store = self._store_for(device)
        before = len(self.rows)
        first = store.count
        self.add_many(kind, names, tensors, micro_step, phase)
        for i, shard in enumerate(shards):  # the records show the whole tensor's shape
            if shard.shape is not None:
                whole = self.rows[before + i]._replace(shape=tuple(shard.shape))
                self.rows[before + i] = self._interned(whole)
        self.mark_shards(group, store, first, len(shards))

    def mark_shards(self, group: object, store: _DeviceStore | torch.device, first: int, count: int) -> None:
        """Rows ``first .. first+count-1`` of ``store`` are shards merged over ``group`` at the step end."""
        if isinstance(store, torch.device):
            store = self._store_for(store)
        self._mark(group, (store, first, count))

    def mark_gap(self, group: object, device: torch.device, count: int) -> None:
        """``count`` tensors this rank does not hold take their places in ``group``'s merge (other ranks may
        hold them): the merge's layout never depends on which gradients or states exist on a rank."""
        self._mark(group, (device, -1, count))

    def _mark(self, group: object, span: tuple[_DeviceStore | torch.device, int, int]) -> None:
        # a tensor sharded over several mesh dimensions (FSDP2 over tensor parallelism) is merged over each
        # dimension's group in turn: sums and extremes over the whole grid of ranks, whatever the order
        for one in group if isinstance(group, tuple) else (group,):
            self._shards.setdefault(id(one), (one, []))[1].append(span)

    def add_merged(self, row_meta: Row, tensors: Sequence[torch.Tensor]) -> None:
        """One row with the statistics of the concatenation of ``tensors`` (a coalesced collective)."""
        if not all([is_plain(t) for t in tensors]):
            admitted = [GATE.piece(t, f"{row_meta.kind} {row_meta.name!r}") for t in tensors]
            if any(p is None or isinstance(p, Shard) for p in admitted):
                if not any(p is None for p in admitted):  # else the gate said why
                    GATE.skip(None, f"{row_meta.kind} {row_meta.name!r}", "coalesced collective of shards")
                return
            tensors = admitted
        store = self._store_for(tensors[0].device)
        index = store.reserve(1)
        try:
            store.reducer.merged_row(tensors, store.data, index, self.eps)
        except BaseException:
            store.count = index
            raise
        self._append_rows([row_meta], store)

    def add_update_ratio(
        self,
        device: torch.device,
        moments: Sequence[tuple[AdamMoments, tuple[Row, Row]]],
        shard_group: object = None,
        sharded: bool = False,
    ) -> None:
        """Rows of Adam's update and update ratio (two per parameter, in that order) computed from the
        moments without materialising either; with ``sharded`` the moments are shards merged over
        ``shard_group``."""
        if not moments:
            return
        store = self._store_for(device)
        first = store.reserve(2 * len(moments))
        items = [
            stats.AdamItem(m.exp_avg, m.exp_avg_sq, m.c1, m.c2, m.adam_eps, first + 2 * i, first + 2 * i + 1)
            for i, (m, _) in enumerate(moments)
        ]
        try:
            store.reducer.adam_rows(items, store.data, self.eps)
        except BaseException:
            store.count = first
            raise
        if sharded:
            self.mark_shards(shard_group, store, first, 2 * len(moments))
        self._append_rows([row for _, pair in moments for row in pair], store)

    def _append_rows(self, rows: Sequence[Row], store: _DeviceStore) -> None:
        self.rows.extend(map(self._interned, rows))
        self._collectives.extend([self.count_collectives()] * len(rows))
        self._placement.extend([store.index] * len(rows))

    def partials_so_far(self) -> tuple[int, np.ndarray]:
        """The partials of every row so far, read on the host with one small copy per device (this
        synchronises the device: only ``alert.capture: exact`` and ``on_nan: skip`` call it, once a step).

        Returns (the worst NaN + Inf count of a row of this rank, an (n, N_PARTIALS) array of this rank's
        partials in row order). Shard rows hold this rank's shards, not yet merged; agreeing over the ranks
        is the caller's business (trainmon.step.agree), on the host: no device takes part in it.
        """
        partials = np.zeros((len(self.rows), N_PARTIALS), dtype=np.float64)
        placement = np.asarray(self._placement, dtype=np.int64)
        worst = 0
        for store in self._stores.values():
            if not store.count:
                continue
            store.reducer.complete(store.data)  # rows deferred so far (Triton); the rest complete at finish
            rows = store.data[: store.count]
            top = rows[:, NANS : INFS + 1].sum(dim=1).max().reshape(1, 1).expand(1, N_PARTIALS)
            host = torch.cat((top, rows)).cpu().numpy()  # the one copy (and wait) of this device
            worst = max(worst, int(host[0, 0]))
            partials[placement == store.index] = host[1:]
        return worst, partials

    def unmerged_rows(self) -> np.ndarray:
        """Per row so far: True for a shard of a tensor split over ranks (merged only at the step end)."""
        mask = np.zeros(len(self.rows), dtype=bool)
        placement = np.asarray(self._placement, dtype=np.int64)
        for _, spans in self._shards.values():
            for store, first, count in spans:
                if not isinstance(store, _DeviceStore):
                    continue  # a gap: no row
                global_rows = np.flatnonzero(placement == store.index)
                mask[global_rows[first : first + count]] = True
        return mask

    def finish(
        self, step: int, rank: int, skipped: bool = False, skip_reason: str = "", timed: bool = False
    ) -> tuple[StepRecord, Callable[[], None] | None]:
        """Close the step with one host copy per device holding statistics (normally exactly one).

        Returns the record and, when the copy may still be in flight, a callable that must run
        before ``record.partials`` is read. Shards are merged over their groups first (two collectives per
        group: every rank of a group reaches this point with the same shard rows). ``timed``: the step was
        timed (:attr:`timer`), and its times go with the record.
        """
        for store in self._stores.values():
            if store.count:
                store.reducer.complete(store.data)  # deferred rows (Triton): one launch per device
        stores = [store for store in self._stores.values() if store.count]
        own = None  # this rank's own NaN + Inf counts, taken before the merge makes them the whole tensor's
        if self._shards:
            own = _own_counts(stores) or None  # None: no row (only gaps) on this rank
            self._merge_shards()
        rows = tuple(self.rows)
        timer = self.timer
        slot = timer.ready_row() if timer is not None and timed else None
        vector = timer.vector(slot) if timer is not None and slot is not None else None
        (aggregate, exchanged), own_rows = self._reduce_over_ranks(rows, stores, vector), None
        alone = None  # the times exchanged apart from the all_ranks merge: (rows, their wait)
        if vector is not None and exchanged is None and self.exchange is not None:
            alone = self.exchange.start(vector)
        # the merged table, the ranks' times and this rank's own counts ride in this device's one host copy,
        # after the step's own rows (own counts of rows on several devices are assembled apart, below)
        own_one = own[0] if own is not None and len(own) == 1 else None
        candidates = (("all_ranks", aggregate), ("times", exchanged), ("own", own_one))
        riders = {key: t for key, t in candidates if t is not None}
        spans: list[tuple[int, int]] = []
        if riders and len(stores) == 1 and all(t.device == stores[0].device for t in riders.values()):
            own_rows = stores[0].count
            for t in riders.values():
                flat = t.reshape(-1)
                count = -(-flat.numel() // N_PARTIALS)
                first = stores[0].reserve(count)
                stores[0].data[first : first + count].view(-1)[: flat.numel()].copy_(flat)
                spans.append((first, flat.numel()))
        parts = [(store.index, *copy_to_host(store.data[: store.count])) for store in stores]
        placement = np.asarray(self._placement, dtype=np.int64)
        if len(parts) == 1:
            partials, ready = parts[0][1].numpy(), parts[0][2]
        else:
            partials = np.empty((len(rows), N_PARTIALS), dtype=np.float64)
            ready = _HostAssembly(partials, placement, parts) if parts else None
        riding: dict[str, np.ndarray] = {}
        for (key, t), (first, numel) in zip(riders.items(), spans, strict=False):
            riding[key] = partials[first:].reshape(-1)[:numel].reshape(t.shape)
        if own_rows is not None:
            partials = partials[:own_rows]
        for key, t in list(riders.items())[len(riding) :]:  # rows on several devices, or none on this rank:
            host, also_ready = copy_to_host(t)  # a copy of their own
            riding[key] = host.numpy()
            ready = _chain(ready, also_ready)
        own_nonfinite = riding.get("own")
        if own is not None and own_one is None:  # rows on several devices: placed as their partials are
            own_nonfinite = np.empty(len(rows), dtype=np.float64)
            own_parts = [
                (store.index, *copy_to_host(counts)) for store, counts in zip(stores, own, strict=True)
            ]
            ready = _chain(ready, _HostAssembly(own_nonfinite, placement, own_parts))
        all_ranks = None
        if aggregate is not None:
            merged = riding["all_ranks"]
            self.all_ranks.track(_flag_reader(merged, ready))
            if self.keep_all_ranks:
                all_ranks = RankAggregate(self.all_ranks.keys, merged[:-1])
        timing = None
        if slot is not None:
            ranks = riding["times"].reshape(-1, WIDTH) if exchanged is not None else None
            if alone is not None:
                ranks, ready = alone[0], _chain(ready, alone[1])
            timing = timer.timing(slot, ranks)
        collectives = None
        if self.count_collectives is not no_collectives:
            collectives = np.asarray(self._collectives, dtype=np.int64) - self._collectives_at_start
        self.discard()
        record = StepRecord(
            step, rank, rows, partials, time.time(), skipped, collectives, skip_reason, all_ranks, timing,
            own_nonfinite,
        )  # fmt: skip
        return record, ready

    def _reduce_over_ranks(
        self, rows: tuple[Row, ...], stores: list[_DeviceStore], extra: np.ndarray | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The step's tensors merged over every rank (trainmon.step.allranks), on the collective device, and
        ``extra`` summed over the ranks with them (None, None without the merge)."""
        if self.all_ranks is None:
            return None, None
        placement = np.asarray(self._placement, dtype=np.int64)
        try:
            return self.all_ranks.reduce(
                rows, placement, [(s.index, s.data[: s.count]) for s in stores], extra
            )
        except Exception:  # the monitor's own fault: no all_ranks run from here on, training goes on
            logger.exception("trainmon: merging the step over the ranks failed; all_ranks is off")
            self.all_ranks = None
            return None, None

    def _merge_shards(self) -> None:
        """Two collectives per group; column slices only, so no index tensor is copied to the device. A gap
        (:meth:`mark_gap`) joins with the partials of no element, and is written nowhere."""
        import torch.distributed as dist

        for group, spans in self._shards.values():
            device = next((s.device for s, _, _ in spans if isinstance(s, _DeviceStore)), spans[0][0])
            blocks = [
                s.data[first : first + count] if isinstance(s, _DeviceStore) else _no_elements(count, device)
                for s, first, count in spans
            ]
            block = torch.cat([b.to(device) for b in blocks]) if len(blocks) > 1 else blocks[0]
            # numel, nans, infs, zeros | sum, sumsq are summed; max and -min take the maximum
            summed = torch.cat((block[:, NUMEL : ZEROS + 1], block[:, SUM : SUMSQ + 1]), dim=1)
            extremes = torch.stack((block[:, MAX], -block[:, MIN]), dim=1)
            if dist.is_available() and dist.is_initialized():
                dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=group)
                dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
            offset = 0
            for store, first, count in spans:
                if isinstance(store, _DeviceStore):
                    rows = store.data[first : first + count]
                    merged = summed[offset : offset + count].to(rows.device)
                    rows[:, NUMEL : ZEROS + 1] = merged[:, :4]
                    rows[:, SUM : SUMSQ + 1] = merged[:, 4:]
                    rows[:, MAX] = extremes[offset : offset + count, 0].to(rows.device)
                    rows[:, MIN] = -extremes[offset : offset + count, 1].to(rows.device)
                offset += count

    def discard(self) -> None:
        self._shards = {}
        self.rows = []
        self._placement = []
        self._collectives = []
        self._collectives_at_start = self.count_collectives()
        self._shareable = _shareable_kinds()  # the process group may come up after attach
        for store in self._stores.values():
            store.count = 0
            store.reducer.reset()


def fast_rows(buffer: StepBuffer, store: _DeviceStore) -> Callable[..., bool] | None:
    """:meth:`StepBuffer.add` in C for tensors of ``store``'s device that join its reducer's batch, where
    the reducer batches (Triton), the extension is built and ``TRAINMON_HOT_PATH`` is not ``python``. It
    reads and writes the buffer's, the store's and the reducer's own attributes, so either path may take any
    row; rows it does not take (a first sight, capture, anything unusual) it leaves to the Python path."""
    join_state = getattr(store.reducer, "join_state", None)
    if FastRows is None or join_state is None or _hot_path() == "python":
        return None
    device = store.device
    if device.type not in ("cpu", "cuda") or (device.type == "cuda" and device.index is None):
        return None
    index = -1 if device.type == "cpu" else device.index
    try:
        fast = FastRows(
            buffer=buffer,
            store=store,
            strided=torch.strided,
            no_collectives=no_collectives,
            device_index=index,
            tensor_type=torch.Tensor,
            **join_state(),
        )
    except Exception as error:  # state the extension does not expect (a stale build): the Python path
        logger.warning("trainmon: rows take the Python path on %s (%s)", device, error)
        return None
    return fast.add


def _hot_path() -> str:
    value = os.environ.get("TRAINMON_HOT_PATH", "").strip().lower() or "native"
    if value not in ("native", "python"):
        logger.warning("trainmon: ignoring TRAINMON_HOT_PATH=%r (expected native or python)", value)
        return "native"
    return value


def _own_counts(stores: Sequence[_DeviceStore]) -> list[torch.Tensor]:
    """Per store, the NaN + Inf elements of each of its rows as this rank holds them, before shards are
    merged over ranks: what this rank itself computed, which the origin of a NaN is judged by
    (trainmon.anomaly.origin). One elementwise op per device, queued on it: no sync, no collective."""
    return [store.data[: store.count, NANS] + store.data[: store.count, INFS] for store in stores]


def _no_elements(count: int, device: torch.device) -> torch.Tensor:
    """``count`` rows of the partials of a tensor without elements: what a merge adds nothing to."""
    rows = torch.zeros((count, N_PARTIALS), dtype=torch.float64, device=device)
    rows[:, MIN] = float("inf")
    rows[:, MAX] = float("-inf")
    return rows


def _chain(first: Callable[[], None] | None, second: Callable[[], None] | None) -> Callable[[], None] | None:
    """One ready callable for two host copies."""
    if first is None or second is None:
        return first or second

    def both() -> None:
        first()
        second()

    return both


def _flag_reader(merged: np.ndarray, ready: Callable[[], None] | None) -> Callable[[], float]:
    """Reads the merged table's last row (elements of tensors outside the table, over every rank) once the
    host copy has landed."""

    def read() -> float:
        if ready is not None:
            ready()
        return float(merged[-1, NUMEL])

    return read


def _shareable_kinds() -> frozenset[str]:
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    return _SHAREABLE if distributed else _SHAREABLE_UNDISTRIBUTED
