"""Where a rank's step goes: the step cut into its parts at a handful of points, on the training thread,
without a single synchronising call (docs/timing.md; the row's meaning: :mod:`trainmon.run.timing`).

The points: the forward start and end of each micro-batch (the micro-step counter's hooks on the first model
chunk), the start of each backward (the counter's gradient hook) and its end (a callback the autograd engine
runs when that backward is done), the optimizer's pre-step hook, the step end (``Monitor._end_step``), and
the monitor's return to training after it. Between two points the step is in one segment: forward, backward,
optimizer, or a gap, which is data loading when a forward follows it and "other" otherwise (the loss,
gradient clipping, the user's own work). Monitored collectives (their wrappers) and Python's garbage
collections (``gc.callbacks``) are timed where they happen and carved out of the segment they fall in.

On the host the points are ``time.perf_counter()`` readings summed into preallocated lists. On an
accelerator each point also records a device event (:class:`trainmon.device.EventMarks`: a fixed pool,
reused step after step) on the current stream; forward, backward, optimizer and collective times are then
the device's, read :data:`LAG` collected steps later, and only from events that have completed (``query``):
never waited for.

Per step nothing is allocated that outlives it but the record's row. Steps that are not collected cost two
``perf_counter`` readings (the step end and the return to training), nothing else.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
from time import perf_counter
from typing import TYPE_CHECKING, Any

import numpy as np

from trainmon.run.timing import FIELD, SLOT0, SLOTS, WIDTH, StepTiming

if TYPE_CHECKING:
    from trainmon.device import EventMarks

logger = logging.getLogger("trainmon")

__all__ = ["LAG", "StepTimer"]

# On an accelerator: the collected steps between a step and the exchange of its times (its events have long
# completed by then; an event that has not is left out, never waited for).
LAG = 2
# Device events per step: segment points (a few per micro-batch) and collectives (two each) beyond these are
# timed on the host only.
MAX_POINTS = 64
MAX_COLLECTIVE_EVENTS = 2 * SLOTS

# Segments of a step (the gap resolves to data before a forward, else to other).
_GAP, _DATA, _FORWARD, _BACKWARD, _OPTIMIZER, _OTHER = range(6)
_N_SEGMENTS = 6
_SEGMENT_FIELD = {
    _DATA: FIELD["data"],
    _FORWARD: FIELD["forward"],
    _BACKWARD: FIELD["backward"],
    _OPTIMIZER: FIELD["optimizer"],
    _OTHER: FIELD["other"],
}
# segments whose time is the device's where there are events
_DEVICE_SEGMENTS = (_FORWARD, _BACKWARD, _OPTIMIZER)
_HOST_FIELDS = tuple(_SEGMENT_FIELD.items())
_ZEROS_SEGMENTS = (0.0,) * _N_SEGMENTS
_ZEROS_SLOTS = (0.0,) * SLOTS
_ZEROS_ROW = (0.0,) * WIDTH
_STEP, _MONITOR, _COMM, _GC = FIELD["step"], FIELD["monitor"], FIELD["comm"], FIELD["gc"]
_GC_COUNT, _COMM_COUNT, _PP_STAGE, _PRESENT = (
    FIELD["gc_count"], FIELD["comm_count"], FIELD["pp_stage"], FIELD["present"]
)  # fmt: skip


class StepTimer:
    """The parts of each timed step of this rank. One per monitor; everything but :meth:`on_gc` runs on the
    training thread. ``active`` says whether the step running now is timed (a collected step with timing on;
    set at the step boundary)."""

    def __init__(
        self,
        *,
        index: int = 0,
        world: int = 1,
        pp_stage: int = 0,
        exchange: bool = False,
        events: EventMarks | None = None,
    ) -> None:
        self.active = False
        self.index, self.world, self.pp_stage = int(index), max(int(world), 1), int(pp_stage)
        self.exchange = bool(exchange) and self.world > 1
        now = perf_counter()
        self.t_start = now  # the step's start: the previous step's end
        self.t_resume = now  # when the monitor handed back to training after the previous step's end
        self._mark = now
        self._seg = _GAP
        # Python lists, not arrays: a hook's few additions stay plain float arithmetic (a numpy element's
        # update takes several times as long, and more so with the caches cold after a forward or backward)
        self._acc = list(_ZEROS_SEGMENTS)
        self.gc_time = 0.0  # this step's garbage collections so far (any thread: a collection holds the GIL)
        self.gc_count = 0
        self.comm_time = 0.0
        self.comm_count = 0
        self._slots = list(_ZEROS_SLOTS)
        self._values = list(_ZEROS_ROW)  # the row being closed, copied into the ring at once
        self._carved = 0.0  # gc + comm time at the last point (what the open segment must not count)
        self._gc_t0 = 0.0
        self._gc_installed = False
        self._thread = threading.get_ident()
        # finished rows: the current one on the host; LAG + 1 of them where device events finish them later
        self._events = events
        self.lag = LAG if events is not None else 0
        self._ring = np.zeros((self.lag + 1, WIDTH), dtype=np.float64)
        self._ring_step = np.full(self.lag + 1, -1, dtype=np.int64)
        self._ring_points = np.zeros(self.lag + 1, dtype=np.int64)  # device points recorded per row
        self._ring_colls = np.zeros(self.lag + 1, dtype=np.int64)  # device collective events per row
        self._codes = np.zeros((self.lag + 1, MAX_POINTS), dtype=np.int8)  # segment opened at each point
        self._coll_seg = np.zeros((self.lag + 1, MAX_COLLECTIVE_EVENTS // 2), dtype=np.int8)
        self._slot = 0  # the ring row of the step being timed
        self._points = 0
        self._colls = 0
        self._timed = 0  # steps timed so far
        self._vector = np.zeros((self.world, WIDTH), dtype=np.float64) if self.exchange else None
        self.late = 0  # device rows exchanged before their events had completed (their device times left out)

    # ------------------------------------------------------------------ the step's points (training thread)
    def _cut(self, t: float, new: int) -> None:
        seg = self._seg
        if seg == _GAP:
            seg = _DATA if new == _FORWARD else _OTHER
        carved = self.gc_time + self.comm_time
        self._acc[seg] += (t - self._mark) - (carved - self._carved)
        self._carved = carved
        self._mark = t
        self._seg = new
        if self._events is not None and self._points < MAX_POINTS:
            self._events.record(self._slot, self._points)
            self._codes[self._slot, self._points] = new
            self._points += 1

    def forward_start(self) -> None:
        if self._seg != _FORWARD:
            self._cut(perf_counter(), _FORWARD)

    def forward_end(self) -> None:
        if self._seg == _FORWARD:
            self._cut(perf_counter(), _GAP)

    def backward_start(self) -> bool:
        """A backward starts; True when it is a new one (the caller has the engine call :meth:`backward_end`
        when it is done)."""
        if self._seg == _BACKWARD:
            return False
        self._cut(perf_counter(), _BACKWARD)
        return True

    def backward_end(self) -> None:
        if self.active and self._seg == _BACKWARD:
            self._cut(perf_counter(), _GAP)

    def optimizer_start(self) -> None:
        if self._seg != _OPTIMIZER:
            self._cut(perf_counter(), _OPTIMIZER)

    def collective_start(self) -> tuple[float, float]:
        """Before a monitored collective: (now, gc time so far)."""
        if self._events is not None and self._colls < MAX_COLLECTIVE_EVENTS:
            self._events.record_collective(self._slot, self._colls)
        return perf_counter(), self.gc_time

    def collective_end(self, started: tuple[float, float]) -> None:
        t0, gc0 = started
        took = perf_counter() - t0 - (self.gc_time - gc0)  # a collection inside the call is gc's
        self._slots[self.comm_count % SLOTS] += took
        self.comm_count += 1
        self.comm_time += took
        if self._events is not None and self._colls < MAX_COLLECTIVE_EVENTS:
            self._events.record_collective(self._slot, self._colls + 1)
            self._coll_seg[self._slot, self._colls // 2] = self._seg
            self._colls += 2

    # ------------------------------------------------------------------ garbage collections
    def on_gc(self, phase: str, info: dict[str, Any]) -> None:
        """``gc.callbacks`` entry: the collection's pause counts in ``gc`` (whichever thread triggered it: a
        collection holds the GIL the training loop needs)."""
        if phase == "start":
            self._gc_t0 = perf_counter()
        elif self.active:
            self.gc_time += perf_counter() - self._gc_t0
            self.gc_count += 1

    def _watch_gc(self, on: bool) -> None:
        if on and not self._gc_installed:
            gc.callbacks.append(self.on_gc)
            self._gc_installed = True
        elif not on and self._gc_installed:
            self._gc_installed = False
            with contextlib.suppress(ValueError):  # someone cleared the list
                gc.callbacks.remove(self.on_gc)

    # ------------------------------------------------------------------ the step boundary
    def start(self, timed: bool) -> None:
        """At the step boundary, before the next step: whether it is timed."""
        self.active = timed
        self._watch_gc(timed)

    def resume(self, t: float) -> None:
        """The monitor hands back to training at ``t`` (the end of ``_end_step``): the next step's first
        segment starts here, and its ``monitor`` part is ``t - t_start``."""
        self.t_resume = t
        self._mark = t
        self._seg = _GAP
        self._acc[:] = _ZEROS_SEGMENTS
        self.gc_time = self.comm_time = self._carved = 0.0
        self.gc_count = self.comm_count = 0
        self._slots[:] = _ZEROS_SLOTS
        if self.active:
            self._slot = self._timed % (self.lag + 1)
            self._points = self._colls = 0
            if self._events is not None:  # the step's first point: the device's clock starts here
                self._events.record(self._slot, 0)
                self._codes[self._slot, 0] = _GAP
                self._points = 1

    def end(self, t: float, step: int) -> bool:
        """The step ends at ``t``: close its row when it was timed (True), and start the next step's clock."""
        timed = self.active
        if timed:
            self._cut(t, _GAP)
            values, acc = self._values, self._acc
            values[:] = _ZEROS_ROW
            values[_STEP] = t - self.t_start
            values[_MONITOR] = self.t_resume - self.t_start
            for seg, field in _HOST_FIELDS:
                values[field] = acc[seg]
            values[_COMM] = self.comm_time
            values[_GC] = self.gc_time
            values[_GC_COUNT] = self.gc_count
            values[_COMM_COUNT] = self.comm_count
            values[_PP_STAGE] = self.pp_stage
            values[_PRESENT] = 1.0
            values[SLOT0:] = self._slots
            self._ring[self._slot] = values
            self._ring_step[self._slot] = step
            self._ring_points[self._slot] = self._points
            self._ring_colls[self._slot] = self._colls
            self._timed += 1
            self.active = False
        self.t_start = t
        return timed

    # ------------------------------------------------------------------ what the record carries
    def ready_row(self) -> int | None:
        """The ring row whose times go out with the step that just ended (that step itself on the host; on
        an accelerator the step LAG timed steps before), with its device times read; None while there is
        none yet. Call once after :meth:`end` said the step was timed."""
        if self._timed <= self.lag:
            return None
        slot = (self._timed - 1 - self.lag) % (self.lag + 1)
        self._finish_device(slot)
        return slot

    def _finish_device(self, slot: int) -> None:
        """Forward, backward, optimizer and collective times of ``slot`` from its device events, when every
        one of them has completed; left to the host's clock otherwise (counted in :attr:`late`)."""
        events = self._events
        if events is None:
            return
        points, colls = int(self._ring_points[slot]), int(self._ring_colls[slot])
        pending = (points and not events.done(slot, points - 1)) or (
            colls and not events.collective_done(slot, colls - 1)
        )
        if pending:
            self.late += 1
            return
        device = np.zeros(_N_SEGMENTS, dtype=np.float64)
        codes = self._codes[slot]
        for i in range(points - 1):
            device[codes[i]] += events.elapsed_s(slot, i, i + 1)
        comm = 0.0
        for k in range(colls // 2):
            took = events.collective_elapsed_s(slot, 2 * k, 2 * k + 1)
            comm += took
            device[self._coll_seg[slot, k]] -= took
        row = self._ring[slot]
        for seg in _DEVICE_SEGMENTS:
            row[_SEGMENT_FIELD[seg]] = max(device[seg], 0.0)
        if colls:
            row[FIELD["comm"]] = comm

    def vector(self, slot: int) -> np.ndarray | None:
        """The ``(world * WIDTH,)`` table this rank sends for ``slot`` (its own row in place, zeros
        elsewhere), or None when the ranks exchange nothing."""
        if self._vector is None:
            return None
        vector = self._vector
        vector[:] = 0.0
        vector[self.index] = self._ring[slot]
        return vector.reshape(-1)

    def timing(self, slot: int, exchanged: np.ndarray | None = None) -> StepTiming:
        """The record's :class:`StepTiming` of ``slot`` (``exchanged``: every rank's rows, ``(world, WIDTH)``,
        a host copy that may still be in flight)."""
        return StepTiming(int(self._ring_step[slot]), self.index, self._ring[slot].copy(), exchanged)

    def close(self) -> None:
        self.active = False
        self._watch_gc(False)


class TimesExchange:
    """Every rank's times where no all_ranks merge carries them: one asynchronous all-reduce a timed step on a
    gloo group of the monitor's own (CPU tensors: no accelerator takes part), issued at the step end and
    waited for by the writer thread, never by the training thread, at most ``timeout_s`` (the record's
    ``ready``). A rank that stopped stepping (hung, far behind) costs that wait once: past it this rank stops
    exchanging for good and says so once (its records keep its own times), and, the group not being used
    again, a peer that comes back times out on the same exchange and stops too. Create it on every rank at
    the same point (the group's creation is a collective)."""

    def __init__(self, world: int, index: int, timeout_s: float) -> None:
        import datetime

        import torch.distributed as dist

        self.world, self.index, self.timeout_s = world, index, float(timeout_s)
        self.broken: str | None = None
        self._group: Any = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.timeout_s))
        self._lock = threading.Lock()

    def start(self, vector: np.ndarray) -> tuple[np.ndarray, Any] | None:
        """Issue the exchange of ``vector`` (this rank's row in place); (the ``(world, WIDTH)`` rows, a
        callable that waits for them), or None once the exchange is broken. Until the callable returned the
        rows hold this rank's own only, and keep only it when the exchange fails."""
        if self.broken is not None:
            return None
        import torch

        sent = torch.from_numpy(vector.copy())
        try:
            work = self._group.allreduce([sent])
        except Exception as e:  # the group is gone (a peer failed an earlier exchange first)
            self._fail(e)
            return None
        rows = vector.reshape(self.world, WIDTH).copy()
        landed = [False]

        def wait() -> None:
            with self._lock:
                if landed[0]:
                    return
                landed[0] = True
                if self.broken is not None:
                    return
                try:
                    work.wait()  # the group's timeout bounds it
                except Exception as e:  # a timeout, a peer gone: gloo raises RuntimeError
                    self._fail(e)
                    return
                rows[:] = sent.numpy().reshape(self.world, WIDTH)

        return rows, wait

    def _fail(self, error: BaseException) -> None:
        if self.broken is not None:
            return
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        self.broken = first
        self._group = None
        logger.warning(
            "trainmon: rank %d: the other ranks did not exchange their step times within sync_timeout_s=%gs "
            "(a rank has stopped or is far behind: %s); each rank's times are recorded alone from now on, "
            "with no wait at collectives and no straggler rule",
            self.index,
            self.timeout_s,
            first[:300],
        )
