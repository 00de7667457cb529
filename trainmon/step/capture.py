"""Tensor capture for dumps: which tensors of a step to copy out, and handing the copies to the writer.

Requests come from ``trainmon dump request`` (the run's request file, polled at step boundaries) and from
anomalies (``alert.dump``: the origin module and the flagged tensors at their next occurrence). During a
step with requests, the step buffer offers every collected tensor to :meth:`Capture.offer`; only matching
tensors are copied (one device-to-host copy each, non-blocking on accelerators). The copies travel to the
writer thread, which saves them with :class:`trainmon.writer.dumps.DumpWriter`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from trainmon.device import copy_to_host
from trainmon.run.dumps import DumpRequest
from trainmon.run.records import Derived, Row, StepRecord
from trainmon.writer.dumps import DumpBudget, DumpWriter, RequestPoller

logger = logging.getLogger("trainmon")


@dataclass(frozen=True)
class Captured:
    row: Row
    host: torch.Tensor
    ready: Callable[[], None] | None
    reason: str
    note: str = ""


class Capture:
    """Training-thread side: pending requests, and the copies taken during the current step."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        self._poller = RequestPoller(run_dir)
        self._rank = rank
        self._pending: list[DumpRequest] = []
        self._active: list[DumpRequest] = []
        self._step = 0
        self.taken: list[Captured] = []
        self._lock = threading.Lock()
        self._triggered: list[DumpRequest] = []
        self._budget = DumpBudget()  # the dump caps, applied before any copy is made

    def admit(self, row: Row, tensor: torch.Tensor) -> bool:
        """Whether a copy of ``tensor`` fits the dump caps of this step and run (counted if so); its size
        comes from its shape and dtype, so nothing is read from the device."""
        return self._budget.admit(self._step, row.kind, row.name, tensor.numel() * tensor.element_size())

    def trigger(self, request: DumpRequest) -> None:
        """A request from the writer thread (an anomaly); served from the next collected step."""
        with self._lock:
            self._triggered.append(request)

    def pop_fresh_triggers(self) -> list[DumpRequest]:
        """Requests raised by anomalies since the last call: the monitor dumps the tensors at hand for
        them at once, and they also wait for their next occurrence."""
        with self._lock:
            fresh, self._triggered = self._triggered, []
        self._pending.extend(fresh)
        return fresh

    def start_step(self, step: int, collecting: bool) -> bool:
        """Pick the requests for ``step``; True when some tensor of this step may be captured."""
        self._pending.extend(self._poller.poll())  # anomaly triggers join via pop_fresh_triggers()
        self._step = step
        self._active = [
            r for r in self._pending
            if collecting and (r.step is None or r.step == step) and (r.rank is None or r.rank == self._rank)
        ]  # fmt: skip
        return bool(self._active)

    def offer(self, row: Row, tensor: torch.Tensor) -> None:
        """Called by the step buffer for every collected tensor while requests are active."""
        for request in self._active:
            if request.matches(self._step, self._rank, row.kind, row.name):
                if self.admit(row, tensor):
                    host, ready = copy_to_host(tensor.detach())
                    self.taken.append(Captured(row, host, ready, f"request {request.id}"))
                return

    def finish_step(self) -> list[Captured]:
        """The copies of the step just ended; requests for it (or for "next") are served and dropped."""
        served = {id(r) for r in self._active}
        self._pending = [
            r for r in self._pending if id(r) not in served and (r.step is None or r.step > self._step)
        ]
        self._active = []
        taken, self.taken = self.taken, []
        return taken


class DumpSink:
    """Writer-thread side: saves the copies of each step after the step's record."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        self._writer = DumpWriter(run_dir, rank)
        self._by_step: dict[int, list[Captured]] = {}
        self._lock = threading.Lock()

    def add(self, step: int, taken: list[Captured]) -> None:
        """Called on the training thread before the step's record is submitted."""
        if taken:
            with self._lock:
                self._by_step.setdefault(step, []).extend(taken)

    def write(self, record: StepRecord, derived: Derived) -> None:
        with self._lock:  # with the copies of steps the writer dropped, which would stay in memory for ever
            steps = sorted(s for s in self._by_step if s <= record.step)
            taken = [(step, item) for step in steps for item in self._by_step.pop(step)]
        for step, item in taken:
            if item.ready is not None:
                item.ready()
            self._writer.write(
                step,
                item.row.micro_step,
                item.row.kind,
                item.row.name,
                item.host,
                item.reason,
                item.note,
            )

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self._writer.close()
