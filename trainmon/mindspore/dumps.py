"""Tensor dumps of the MindSpore monitor, requested as in PyTorch runs: by ``trainmon dump request`` (the
run's request file, polled at each step start) and by anomalies with ``alert.dump`` (the Cell or parameter
where a NaN started); the tensors are saved at their next occurrence in a collected step.

Host copies are taken only for requested tensors (``asnumpy``, an extra read on those steps only) and
written on the writer thread by :class:`trainmon.writer.dumps.DumpWriter`, in the same files and index as the
PyTorch monitor's (safetensors holding the numpy array).
"""

from __future__ import annotations

import threading
from pathlib import Path

import mindspore as ms
import numpy as np

from trainmon.run.dumps import DumpRequest
from trainmon.run.records import Row, StepRecord
from trainmon.writer.dumps import DumpBudget, DumpWriter, RequestPoller


class MindSporeDumps:
    """Requests in (:meth:`trigger`, any thread), copies taken on the training thread, files written as a
    writer-thread sink."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        self._writer = DumpWriter(run_dir, rank)
        self._budget = DumpBudget()  # the caps, before a copy is made
        self._poller = RequestPoller(run_dir)
        self._rank = rank
        self._lock = threading.Lock()
        self._pending: list[DumpRequest] = []
        self._active: list[DumpRequest] = []
        self._served: set[str] = set()
        self._taken: dict[int, list[tuple[Row, np.ndarray, str]]] = {}
        self._step = 0
        self._collecting = False
        self._fresh = False

    def trigger(self, request: DumpRequest) -> None:
        """A request from the writer thread (an anomaly); served from the next tensor it covers."""
        with self._lock:
            self._pending.append(request)
            self._fresh = True

    def start_step(self, step: int, collecting: bool) -> None:
        requested = self._poller.poll()
        with self._lock:
            self._pending.extend(requested)
        self._step, self._collecting = step, collecting
        self._refresh()

    def _refresh(self) -> None:
        """Pick the requests the current step may serve (again when a request arrived during the step)."""
        with self._lock:
            self._fresh = False
            self._pending = [
                r
                for r in self._pending
                if r.id not in self._served and (r.step is None or r.step >= self._step)
            ]
            self._active = [
                r
                for r in self._pending
                if self._collecting and r.step in (None, self._step) and r.rank in (None, self._rank)
            ]

    def offer(self, row: Row, tensor: ms.Tensor) -> None:
        if self._fresh:
            self._refresh()
        for request in self._active:
            if request.matches(self._step, self._rank, row.kind, row.name):
                self._served.add(request.id)  # served at this step; other tensors it covers still count
                if not self._budget.admit(self._step, row.kind, row.name, int(tensor.size) * tensor.itemsize):
                    return
                reason = f"request {request.id}"
                # a copy: on a CPU asnumpy() may share the tensor's memory, which the optimizer updates
                host = np.array(tensor.asnumpy(), copy=True)
                self._taken.setdefault(self._step, []).append((row, host, reason))
                return

    # ------------------------------------------------------------------ writer-thread sink
    def write(self, record: StepRecord, derived: dict[str, np.ndarray]) -> None:
        for row, host, reason in self._taken.pop(record.step, []):
            self._writer.write(record.step, row.micro_step, row.kind, row.name, host, reason)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self._writer.close()
