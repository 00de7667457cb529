"""The background writer: everything after the host copy runs here, off the training thread.

The training thread only calls :meth:`WriterThread.submit`, which never blocks on disk: when the
bounded queue is full the step's statistics are not written (said in the log once per burst of drops, with
totals), but its NaN/Inf counters are still checked: a second thread, which never touches the disk, hands
each such record to ``check_dropped`` (the anomaly sink's NaN/Inf check). The writer thread derives the
statistics once per record (:class:`~trainmon.run.records.Derived`: per row and per tensor) and hands them to
every sink in turn; a sink that raises is logged (rate-limited) and kept, and the training thread never sees
the exception.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import signal
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from trainmon.run.records import Derived, StepRecord, TensorGroups
from trainmon.writer.layouts import LayoutCache

__all__ = ["RecordSink", "SinkErrors", "WriterThread"]

logger = logging.getLogger("trainmon")

# After a failure has been logged with its traceback, further failures of the same source are
# summarised at most once per this many seconds.
ERROR_LOG_INTERVAL_S = 60.0
# Dropped records waiting for their NaN/Inf check; the check is fast and touches no disk, so this is reached
# only when the host copies themselves stall
MAX_UNCHECKED = 1024


@runtime_checkable
class RecordSink(Protocol):
    """Anything the writer thread feeds. Called from the writer thread only.

    ``flush`` may return False to say that what it was handed is not all on disk yet (the writer process did
    not confirm it in time); :meth:`WriterThread.flush` then returns False. A sink that hands its work to
    someone else may also have ``wait_closed(timeout) -> bool``, which :meth:`WriterThread.close` calls after
    closing it, with the time left, to wait for that work to end (the writer process to exit)."""

    def write(self, record: StepRecord, derived: Derived) -> None: ...

    def flush(self) -> bool | None: ...

    def close(self) -> None: ...


class _Marker:
    """A flush (or close) request travelling through the queue behind the records before it."""

    __slots__ = ("done", "close", "flushed")

    def __init__(self, close: bool = False) -> None:
        self.done = threading.Event()
        self.close = close
        self.flushed = True  # every sink's flush finished


class _Call:
    """Work for the writer thread, run in order with the records before and after it (a config edit)."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn = fn


class _ErrorLog:
    """Rate-limited error reporting for one failure source (a sink, the ready callback, ...)."""

    __slots__ = ("count", "suppressed", "last_logged")

    def __init__(self) -> None:
        self.count = 0
        self.suppressed = 0
        self.last_logged = 0.0

    def report(self, what: str, exc: BaseException) -> None:
        self.count += 1
        now = time.monotonic()
        if self.count == 1:
            logger.error("trainmon: %s failed; training continues", what, exc_info=exc)
            self.last_logged = now
        elif now - self.last_logged >= ERROR_LOG_INTERVAL_S:
            logger.error(
                "trainmon: %s failed again (%d failures so far, %d not logged): %r",
                what,
                self.count,
                self.suppressed,
                exc,
            )
            self.suppressed = 0
            self.last_logged = now
        else:
            self.suppressed += 1


class SinkErrors:
    """Feeds sinks in turn and keeps each one's failures to itself: logged (with its traceback once, then at
    most once a minute per source) and never raised. The writer thread's, and the writer process's
    (:mod:`trainmon.writer.child`), so that both say the same about the same failure."""

    def __init__(self) -> None:
        self._logs: dict[object, _ErrorLog] = {}

    def report(self, source: object, what: str, exc: BaseException) -> None:
        key = id(source) if not isinstance(source, str) else source
        log = self._logs.get(key)
        if log is None:
            log = self._logs[key] = _ErrorLog()
        log.report(what, exc)

    def write(self, sinks: Sequence[RecordSink], record: StepRecord, derived: Derived) -> None:
        for sink in sinks:
            try:
                sink.write(record, derived)
            except Exception as exc:
                self.report(sink, f"{_describe(sink)} writing step {record.step}", exc)

    def flush(self, sinks: Sequence[RecordSink], close: bool = False) -> bool:
        """Flush (and close) every sink; False when one of them says its flush did not finish."""
        done = True
        for sink in sinks:
            try:
                done = sink.flush() is not False and done
            except Exception as exc:
                self.report(sink, f"{_describe(sink)} flush", exc)
            if close:
                try:
                    sink.close()
                except Exception as exc:
                    self.report(sink, f"{_describe(sink)} close", exc)
        return done


_live: weakref.WeakSet[WriterThread] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:  # write what is pending when the program ends without close()
    for w in list(_live):
        with contextlib.suppress(Exception):  # best effort at interpreter exit
            w.close(timeout=10.0)


def _left(timeout: float | None, start: float) -> float | None:
    return None if timeout is None else max(0.0, timeout - (time.monotonic() - start))


def _describe(sink: object) -> str:
    return f"sink {type(sink).__name__}"


class WriterThread:
    """A daemon thread feeding step records to sinks, in submission order.

    ``max_pending`` bounds the records accepted but not yet fully written (the one being written
    included); :meth:`submit` drops a record rather than wait when that many are pending.
    """

    def __init__(
        self,
        sinks: Sequence[RecordSink],
        max_pending: int = 32,
        name: str = "trainmon-writer",
        check_dropped: Callable[[StepRecord], None] | None = None,
    ) -> None:
        self.sinks = list(sinks)
        self._check_dropped = check_dropped
        self._unchecked: deque[tuple[StepRecord, Callable[[], None] | None]] = deque()
        self._checking = 0  # dropped records queued or being checked
        self._checker: threading.Thread | None = None  # started at the first drop
        self.unchecked = 0  # dropped records that could not even be checked (MAX_UNCHECKED reached)
        self._groups = LayoutCache(TensorGroups)  # the rows' grouping into tensors, once per layout
        self.max_pending = max(1, int(max_pending))
        self.submitted = 0  # records accepted
        self.written = 0  # records handed to every sink
        self.dropped = 0  # records refused because the queue was full
        self._cv = threading.Condition()
        self._check_cv = threading.Condition(self._cv)  # the same lock; wakes the checking thread only
        self._queue: deque[tuple[StepRecord, Callable[[], None] | None] | _Marker | _Call] = deque()
        self._pending = 0
        self._close_marker: _Marker | None = None
        self._burst: list[int] | None = None  # [first dropped step, last dropped step, count]
        self.errors = SinkErrors()
        self._closed_sinks: list[RecordSink] = []  # the sinks the close marker closed
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        _live.add(self)

    # -- training-thread side --------------------------------------------------------------------
    def submit(self, record: StepRecord, ready: Callable[[], None] | None = None) -> bool:
        """Queue ``record`` for writing; never blocks. Returns False if it was dropped (queue full or
        writer closed). ``ready`` is called on the writer thread before ``record.partials`` is read
        (e.g. a CUDA event's ``synchronize`` for a non-blocking host copy)."""
        accepted = first_drop = False
        ended = None
        with self._cv:
            pending = self._pending
            closed = self._close_marker is not None
            if closed:
                pass
            elif pending >= self.max_pending:
                self.dropped += 1
                self._queue_check(record, ready)
                burst = self._burst
                first_drop = burst is None
                if burst is None:
                    self._burst = [record.step, record.step, 1]
                else:
                    burst[1] = record.step
                    burst[2] += 1
            else:
                ended, self._burst = self._burst, None
                self._queue.append((record, ready))
                self._pending += 1
                self.submitted += 1
                self._cv.notify()
                accepted = True
        if accepted:
            if ended is not None:
                logger.warning(
                    "trainmon: writer caught up; %d step(s) were dropped (steps %d..%d), %d of %d so far%s",
                    ended[2],
                    ended[0],
                    ended[1],
                    self.dropped,
                    self.dropped + self.submitted,
                    self._checked_note,
                )
        elif first_drop:
            logger.warning(
                "trainmon: writer is behind (%d steps pending); dropped step %d of rank %d and the next ones "
                "until it catches up (then their count is logged). Training is not slowed down%s.",
                pending,
                record.step,
                record.rank,
                self._checked_note,
            )
        elif closed:
            logger.debug("trainmon: step %d submitted after the writer was closed; ignored", record.step)
        return accepted

    def call(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` on the writer thread after the records submitted so far and before later ones; never
        waits. What it raises is logged. Ignored once the writer is closed."""
        with self._cv:
            if self._close_marker is None:
                self._queue.append(_Call(fn))
                self._cv.notify()

    def replace(self, old: Sequence[RecordSink], new: Sequence[RecordSink]) -> None:
        """Writer thread only (from a :meth:`call`): ``new`` take the place of ``old`` (the first of them, or
        the front), whose sinks are flushed and closed; the records after this one reach ``new``."""
        at = next((i for i, sink in enumerate(self.sinks) if any(sink is o for o in old)), 0)
        kept = [sink for sink in self.sinks if not any(sink is o for o in old)]
        self.sinks = kept[:at] + list(new) + kept[at:]
        self.errors.flush(old, close=True)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every record submitted so far is written and every sink flushed, and every dropped
        record is checked. Returns False on timeout."""
        if threading.current_thread() is self._thread:  # a sink asking from inside: flush in place
            return self.errors.flush(self.sinks)
        start = time.monotonic()
        with self._cv:
            marker = self._close_marker
            if marker is None:
                marker = _Marker()
                self._queue.append(marker)
                self._cv.notify()
        return self._checked(timeout) and marker.done.wait(_left(timeout, start)) and marker.flushed

    def _checked(self, timeout: float | None) -> bool:
        """Wait until the dropped records are checked (at once when none were dropped)."""
        with self._cv:
            return self._check_cv.wait_for(lambda: self._checking == 0, timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Write what is pending, flush and close every sink, and stop the thread. Idempotent.
        Returns False if that did not finish within ``timeout`` seconds."""
        start = time.monotonic()
        inside = threading.current_thread() is self._thread
        if not inside:  # the checks of dropped records use the sinks the close marker closes
            self._checked(timeout)
        with self._cv:
            marker = self._close_marker
            if marker is None:
                marker = self._close_marker = _Marker(close=True)
                self._queue.append(marker)
                self._cv.notify()
        if inside:
            return False  # cannot wait for ourselves; the marker closes everything after this record
        if not marker.done.wait(_left(timeout, start)):
            return False
        self._thread.join(_left(timeout, start))
        for sink in self._closed_sinks:  # work a sink handed on (the writer process) ends in the time left
            wait_closed = getattr(sink, "wait_closed", None)
            if wait_closed is not None and not wait_closed(_left(timeout, start)):
                return False
        if self.dropped:
            logger.warning(
                "trainmon: %d of %d steps were dropped because the writer was behind%s",
                self.dropped,
                self.dropped + self.submitted,
                self._checked_note if not self.unchecked else f"; {self.unchecked} were not even checked",
            )
        return not self._thread.is_alive()

    @property
    def pending(self) -> int:
        """Records accepted and not yet fully written."""
        return self._pending

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def __enter__(self) -> WriterThread:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- the check of dropped records (its own thread: never waits on the disk) -------------------
    @property
    def _checked_note(self) -> str:
        return "; their NaN/Inf counters are checked all the same" if self._check_dropped else ""

    def _queue_check(self, record: StepRecord, ready: Callable[[], None] | None) -> None:
        """Under ``self._cv``: hand a record the queue had no room for to the checking thread."""
        if self._check_dropped is None:
            return
        if self._checking >= MAX_UNCHECKED:
            self.unchecked += 1
            if self.unchecked == 1:
                logger.error(
                    "trainmon: %d dropped steps wait for their NaN/Inf check already (host copies stalled?); "
                    "step %d and further ones are not checked",
                    MAX_UNCHECKED,
                    record.step,
                )
            return
        self._unchecked.append((record, ready))
        self._checking += 1
        if self._checker is None:
            self._checker = threading.Thread(target=self._check_loop, name="trainmon-check", daemon=True)
            self._checker.start()
        self._check_cv.notify_all()

    def _check_loop(self) -> None:
        while True:
            with self._cv:
                self._check_cv.wait_for(lambda: self._unchecked)
                record, ready = self._unchecked.popleft()
            try:
                if ready is not None:
                    ready()
                self._check_dropped(record)
            except Exception as exc:
                self._error("check", f"checking dropped step {record.step} for NaN/Inf", exc)
            finally:
                with self._cv:
                    self._checking -= 1
                    self._check_cv.notify_all()

    # -- writer-thread side ----------------------------------------------------------------------
    def _run(self) -> None:
        if hasattr(signal, "pthread_sigmask"):
            # a write to a pipe whose reader is gone (the writer process, a FIFO) fails with EPIPE here
            # instead of killing the training process, whatever the program made of SIGPIPE
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGPIPE})
        while True:
            with self._cv:
                while not self._queue:
                    self._cv.wait()
                item = self._queue.popleft()
            if isinstance(item, _Call):
                try:
                    item.fn()
                except Exception as exc:
                    self._error("call", "applying a config edit on the writer thread", exc)
                continue
            if isinstance(item, _Marker):
                item.flushed = self._close_sinks() if item.close else self.errors.flush(self.sinks)
                item.done.set()
                if item.close:
                    _live.discard(self)
                    return
                continue
            try:
                self._write(*item)
            finally:
                with self._cv:
                    self._pending -= 1

    def _write(self, record: StepRecord, ready: Callable[[], None] | None) -> None:
        if ready is not None:
            try:
                ready()
            except Exception as exc:
                self._error("ready", f"waiting for the host copy of step {record.step}", exc)
                return
        try:
            derived = Derived(record, self._groups.get(tuple(record.rows)))
        except Exception as exc:
            self._error("derive", f"deriving statistics of step {record.step}", exc)
            return
        self.errors.write(self.sinks, record, derived)
        self.written += 1

    def _close_sinks(self) -> bool:
        """Flush and close every sink, those a sink put in its place while it was flushed or closed included
        (the writer process's sink, finding the process gone, hands its outputs back to this thread)."""
        closed: list[RecordSink] = []
        flushed = True
        while pending := [sink for sink in self.sinks if not any(sink is c for c in closed)]:
            closed += pending
            flushed = self.errors.flush(pending, close=True) and flushed
        self._closed_sinks = closed
        return flushed

    def _error(self, source: object, what: str, exc: BaseException) -> None:
        self.errors.report(source, what, exc)
