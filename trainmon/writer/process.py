"""The writer process, seen from the training process: the format outputs (TensorBoard events, CSV, the
statistics store, the manifest) and the rank's step log (steps table, timing tables, summary) are encoded and
written by a child process, so that their Python work never takes the GIL from the training loop.

:class:`WriterProcess` is that child (``python -m trainmon.writer.child``: the same interpreter, the same
trainmon), started at the first ``attach`` of the process and shared by its monitors, one :class:`Session`
each (a second ``attach`` in a notebook or a test does not wait for a new process to import numpy and
pyarrow); it ends by itself a while after its last session closed. A thread of its own reads its answers:
acknowledgements, and its log records, which are logged again here on the ``trainmon`` logger.
:class:`ProcessSink` is the writer thread's sink that hands each record over: one ``os.writev`` of the
record's arrays into the pipe, which releases the GIL; the training thread never touches the pipe.
:class:`RemoteStepLog` is the anomaly sink's step log: it hands each step's end and the records written over
the same pipe. The formats: :mod:`trainmon.writer.wire`.

When the writer process ends unexpectedly (killed, crashed), the writer thread says so once and the format
outputs are opened again in the writer thread (:class:`trainmon.writer.outputs.Outputs`), so training and its
outputs go on. A killed training process leaves the writer process to write everything it was handed (it
reads its pipe to the end, or until it finds its parent gone) and to exit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import itertools
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from trainmon.anomaly.steplog import StepEnd, StepLog
from trainmon.joblog import rank_note
from trainmon.run.append import claim_deleted, say_deleted
from trainmon.run.records import Anomaly, Derived, StepRecord
from trainmon.run.timing import StepTiming
from trainmon.writer import wire
from trainmon.writer.sinkplan import SinkSpec

__all__ = [
    "ACK_TIMEOUT_S",
    "CannotStart",
    "LINGER_S",
    "PIPE_BYTES",
    "ProcessSink",
    "RemoteStepLog",
    "START_TIMEOUT_S",
    "Session",
    "WriterGone",
    "WriterProcess",
    "WriterProcessError",
    "open_session",
]

logger = logging.getLogger("trainmon")

# The writer process has this long to start and open a session's files (its imports of numpy and pyarrow
# included: under a second on an idle two-core machine) before attach gives up on it.
START_TIMEOUT_S = 60.0
# A flush waits this long for the writer process to confirm that it has written everything handed to it;
# then it says so once and returns (storage stalled). close() waits CLOSE_TIMEOUT_S at most in any case.
ACK_TIMEOUT_S = 60.0
# The writer process ends by itself this long after its last session closed (passed to it when started).
LINGER_S = 60.0
# What the pipe to the writer process holds (where the system allows it; 64 KiB otherwise): steps the child
# has not read yet wait there before the writer thread has to wait for it.
PIPE_BYTES = 1 << 20
# Layouts of rows (and all_ranks tables) the writer process is told about and may be named by id.
LAYOUTS_KEPT = 8
_F_SETPIPE_SZ = 1031  # fcntl.F_SETPIPE_SZ, which Python names from 3.10 on Linux only
# the folder this trainmon was imported from (trainmon/writer/process.py -> the folder holding trainmon/)
_ROOT = Path(__file__).resolve().parents[2]


class CannotStart(Exception):
    """The writer process could not be started or did not open the outputs (the reason is the message)."""


class WriterGone(Exception):
    """The writer process is no longer there to write."""


class WriterProcessError(Exception):
    """An exception raised in the writer process, as its log record tells it (type name and text)."""


def _child_command() -> list[str]:
    if not sys.executable:
        raise CannotStart("there is no Python interpreter to start it with (sys.executable is empty)")
    # -P: the working folder does not come first on sys.path, so the child imports the trainmon given below
    flags = ["-P"] if sys.version_info >= (3, 11) else []
    expected = str(_ROOT / "trainmon" / "__init__.py")
    return [sys.executable, *flags, "-m", "trainmon.writer.child", str(os.getpid()), expected, repr(LINGER_S)]


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def _how_it_ended(returncode: int | None) -> str:
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit status {returncode}"


class WriterProcess:
    """The child process writing the format outputs of this process's monitors, and the thread reading its
    answers. One at a time per process (:meth:`shared`)."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._send_lock = threading.Lock()  # frames of several writer threads never interleave
        self._eof = False
        self._sessions: dict[int, Session] = {}
        self._ids = itertools.count(1)
        self.owner = os.getpid()
        self.retired = False  # it did not finish a close in time (storage stalled): no new session goes to it
        try:
            self._proc = subprocess.Popen(
                _child_command(),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=_child_env(),
                close_fds=True,
            )
        except OSError as e:  # no such interpreter, no memory to fork, ...
            raise CannotStart(f"cannot run {sys.executable} ({e})") from e
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self.pid = self._proc.pid
        self._fd: int | None = self._proc.stdin.fileno()
        with contextlib.suppress(OSError):  # larger than the default 64 KiB where permitted
            import fcntl

            fcntl.fcntl(self._fd, getattr(fcntl, "F_SETPIPE_SZ", _F_SETPIPE_SZ), PIPE_BYTES)
        self._reader = threading.Thread(
            target=self._read_replies, name="trainmon-writer-replies", daemon=True
        )
        self._reader.start()

    # -- the one of this process -----------------------------------------------------------------------------
    @staticmethod
    def shared() -> WriterProcess:
        """This process's writer process, started when there is none (or it has ended)."""
        global _shared
        with _shared_lock:
            found = _shared
            if found is None or found.gone or found.retired or found.owner != os.getpid():
                found = _shared = WriterProcess()
            return found

    # -- sessions --------------------------------------------------------------------------------------------
    def open(
        self,
        plan: Sequence[SinkSpec],
        manifest: Mapping[str, Any] | None,
        run_dir: Path,
        steps: int | None = None,
    ) -> Session:
        """A session writing ``plan`` (and the manifest of ``run_dir`` with ``manifest`` as its payload, and
        the step log of rank ``steps`` unless None), once the child has opened them (waited for at most
        :data:`START_TIMEOUT_S`). Raises the ``OSError`` met opening them (same errno and file),
        :class:`CannotStart`, or :class:`WriterGone` when the process ended meanwhile (it may have been ending
        as it was asked: ask a fresh one)."""
        session = Session(self, next(self._ids), plan, manifest, run_dir, steps)
        with self._cv:
            self._sessions[session.ident] = session
        try:
            session.send([wire.json_frame(wire.OPEN, session.ident, {
                "plan": [spec.to_json() for spec in session.plan],
                "run_dir": session.run_dir,
                "manifest": manifest,
                "steps": steps,
                "at": time.time(),
            })])  # fmt: skip
            opened = session.wait_opened(START_TIMEOUT_S)
        except CannotStart:  # it does not answer: no session of it can be trusted
            self.kill()
            raise
        except BaseException:
            self._forget(session)
            raise
        if opened.get("t") == "opened":
            return session
        self._forget(session)
        if opened.get("errno") is not None:  # the same OSError subclass, errno and file as in the child
            message = opened.get("strerror") or opened.get("message", "")
            raise OSError(opened["errno"], message, opened.get("filename"))
        self.kill()  # it is no writer process of this trainmon
        raise CannotStart(opened.get("message", "it failed"))

    def _forget(self, session: Session) -> None:
        with self._cv:
            self._sessions.pop(session.ident, None)

    # -- sending (writer threads) ----------------------------------------------------------------------------
    def send(self, buffers: list) -> None:
        """Hand whole frames over (blocks while the pipe is full); :class:`WriterGone` when nobody reads."""
        views = [memoryview(b).cast("B") for b in buffers]
        with self._send_lock:
            fd = self._fd
            if fd is None or self._eof:
                raise WriterGone
            try:
                while views:
                    done = os.writev(fd, views)
                    while views and done >= len(views[0]):
                        done -= len(views[0])
                        views.pop(0)
                    if done:
                        views[0] = views[0][done:]
            except OSError as e:
                if isinstance(e, BrokenPipeError) or e.errno in (errno.EPIPE, errno.EBADF):
                    raise WriterGone from e
                raise

    def wait(self, until: Callable[[], bool], timeout: float | None) -> bool:
        """Wait until ``until()`` (checked under the answers' lock) or the process is gone; whether
        ``until()`` held."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while not until():
                if self._eof:
                    return until()
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(left)
            return True

    # -- its life --------------------------------------------------------------------------------------------
    @property
    def gone(self) -> bool:
        """The child has closed its end of the answers (it exited, or is exiting)."""
        return self._eof

    def how_it_ended(self) -> str:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(5.0)
        return _how_it_ended(self._proc.poll())

    def kill(self) -> None:
        """End the child (one that does not answer, or is no writer process of this trainmon)."""
        with self._send_lock:
            fd, self._fd = self._fd, None
            if fd is not None:
                with contextlib.suppress(OSError):
                    assert self._proc.stdin is not None
                    self._proc.stdin.close()
        with contextlib.suppress(OSError):
            self._proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(5.0)

    # -- the answers (their own thread) ----------------------------------------------------------------------
    def _read_replies(self) -> None:
        assert self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        try:
            while True:
                head = _read_exact(fd, wire.REPLY.size)
                if head is None:
                    break
                body = _read_exact(fd, wire.REPLY.unpack(head)[0])
                if body is None:
                    break
                self._handle(json.loads(body))
        except Exception:  # never expected: the parent stops listening, and says why
            logger.exception("trainmon: reading the writer process's answers failed")
        finally:
            with self._cv:
                self._eof = True
                self._cv.notify_all()
            with contextlib.suppress(OSError):
                self._proc.stdout.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(5.0)  # reaped here: no zombie is left behind

    def _handle(self, msg: dict[str, Any]) -> None:
        if msg.get("t") == "log":
            _relog(msg, self.pid)
            return
        with self._cv:
            session = self._sessions.get(int(msg.get("s", 0)))
            if session is not None:
                session.answer(msg)
                if msg.get("t") == "closed":
                    self._sessions.pop(session.ident, None)
            self._cv.notify_all()


_shared: WriterProcess | None = None
_shared_lock = threading.Lock()


def _forget_shared() -> None:  # a forked child (a data loader worker) must never write into its parent's pipe
    global _shared, _shared_lock
    _shared, _shared_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_shared)


def open_session(
    plan: Sequence[SinkSpec], manifest: Mapping[str, Any] | None, run_dir: Path, steps: int | None = None
) -> Session:
    """A session of this process's writer process (started when needed) writing ``plan``, the manifest and
    the step log of rank ``steps``; see :meth:`WriterProcess.open`."""
    for _ in range(2):
        process = WriterProcess.shared()
        try:
            return process.open(plan, manifest, run_dir, steps)
        except WriterGone:  # it was ending (its last session closed a while ago): a fresh one
            continue
    raise CannotStart(f"it ended before it opened the outputs ({process.how_it_ended()})")


class Session:
    """One monitor's outputs in the writer process: its frames, and the answers to them."""

    def __init__(
        self,
        process: WriterProcess,
        ident: int,
        plan: Sequence[SinkSpec],
        manifest: Mapping[str, Any] | None,
        run_dir: Path,
        steps: int | None = None,
    ) -> None:
        self.process = process
        self.ident = ident
        # the child's working folder is that of the first attach: it is given absolute paths
        self.plan = absolute(plan)  # what the child writes now (a config edit it could open changes it)
        self.manifest = manifest  # the payload of the manifest it keeps, or None
        self.run_dir = os.path.abspath(run_dir)
        self.steps = steps  # the rank whose step log the child keeps, or None
        self.before_flush: list[Callable[[], object]] = []  # the writer thread's, before a flush or close
        self._opened: dict[str, Any] | None = None
        self._acked = 0
        self.closed = False  # the child said it closed every output of the session
        self._ids = itertools.count(1)
        self._follows: dict[int, tuple[SinkSpec, ...]] = {}

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def gone(self) -> bool:
        return self.process.gone

    def send(self, buffers: list) -> None:
        self.process.send(buffers)

    def answer(self, msg: dict[str, Any]) -> None:
        """The reader thread, under the answers' lock: a message for this session."""
        kind = msg.get("t")
        if kind in ("opened", "failed"):
            self._opened = msg
        elif kind == "ack":
            self._acked = max(self._acked, int(msg["id"]))
        elif kind == "followed":
            plan = self._follows.pop(int(msg["id"]), None)
            if plan is not None and msg.get("ok"):
                self.plan = plan
        elif kind == "closed":
            self.closed = True

    def wait_opened(self, timeout: float) -> dict[str, Any]:
        if not self.process.wait(lambda: self._opened is not None, timeout):
            if self.process.gone:
                raise WriterGone
            raise CannotStart(f"it did not open the outputs within {timeout:g} s")
        assert self._opened is not None
        return self._opened

    def flush(self, timeout: float) -> bool:
        """Ask for a flush and wait for it: True when confirmed, False when not within ``timeout``;
        :class:`WriterGone` when the process ended."""
        for hand_over in self.before_flush:
            hand_over()
        ident = next(self._ids)
        self.send([wire.json_frame(wire.FLUSH, self.ident, {"id": ident})])
        if self.process.wait(lambda: self._acked >= ident, timeout):
            return True
        if self.process.gone:
            raise WriterGone
        return False

    def follow(self, body: dict[str, Any], plan: Sequence[SinkSpec] | None) -> None:
        """A config edit's outputs, in order with the steps; :attr:`plan` becomes ``plan`` once the child has
        opened it."""
        ident = next(self._ids)
        if plan is not None:
            plan = absolute(plan)
            body = {**body, "plan": [spec.to_json() for spec in plan]}
            with self.process._cv:
                self._follows[ident] = plan
        self.send([wire.json_frame(wire.FOLLOW, self.ident, {**body, "id": ident, "at": time.time()})])

    def close(self) -> None:
        """Ask the child to write what it holds, close every output of the session and say so."""
        for hand_over in self.before_flush:
            hand_over()
        self.send([wire.json_frame(wire.CLOSE, self.ident, {"at": time.time()})])

    def wait_closed(self, timeout: float | None) -> bool:
        """After :meth:`close`: False when the child is still at it after ``timeout`` seconds."""
        return self.process.wait(lambda: self.closed, timeout) or self.process.gone


def absolute(plan: Sequence[SinkSpec]) -> tuple[SinkSpec, ...]:
    return tuple(dataclasses.replace(spec, folder=os.path.abspath(spec.folder)) for spec in plan)


def _read_exact(fd: int, n: int) -> bytes | None:
    data = bytearray()
    while len(data) < n:
        chunk = os.read(fd, n - len(data))
        if not chunk:
            return None
        data += chunk
    return bytes(data)


def _relog(msg: Mapping[str, Any], pid: int) -> None:
    """Log a record of the writer process again here, as if it had been logged here (handlers, levels and
    caplog see the same), its exception as its text."""
    name = str(msg.get("name") or "trainmon")
    level = int(msg.get("level", logging.WARNING))
    target = logging.getLogger(name)
    deleted = msg.get("deleted")
    if deleted is not None and not claim_deleted(Path(deleted)):
        return  # said here already: a run folder deleted under the job is said once, by either process
    if not target.isEnabledFor(level):
        return
    exc = msg.get("exc")
    exc_info = None
    if exc:
        error = WriterProcessError(f"{exc.get('type', 'Exception')}: {exc.get('message', '')}")
        exc_info = (WriterProcessError, error, None)
    record = target.makeRecord(
        name, level, "(trainmon writer process)", 0, str(msg.get("msg", "")), (), exc_info
    )
    record.process = pid
    if exc:
        record.exc_text = str(exc.get("text", "")).rstrip(
            "\n"
        )  # the child's traceback, as formatters print it
    target.handle(record)


class ProcessSink:
    """The writer thread's sink that hands every record to the writer process.

    Each layout of rows is sent once (the writer thread hands over one grouping object per layout, so it is
    recognised by identity); a step is then a small header and its arrays. Before a step goes, one ``stat``
    of the run folder: a run folder deleted under the job is said here, once, before either process writes
    there again. ``flush`` waits (at most :data:`ACK_TIMEOUT_S`) for the child to confirm that everything
    before it is written; ``close`` asks it to close the session's outputs, and :meth:`wait_closed` waits for
    that.

    When the writer process is gone, ``fall_back(record, derived)`` is called once on the writer
    thread (the outputs reopen there) and this sink does nothing more.
    """

    def __init__(
        self,
        session: Session,
        fall_back: Callable[[StepRecord | None, Derived | None], None],
    ) -> None:
        self.session = session
        self._fall_back = fall_back
        self._run_dir = Path(session.run_dir)
        self._watch_dir = self._run_dir.is_dir()
        self._ids = itertools.count()
        self._layouts: OrderedDict[object, int] = OrderedDict()  # grouping object -> layout id
        self._last: tuple[object, int] = (None, -1)
        self._keys: OrderedDict[int, tuple[object, int]] = OrderedDict()  # id(keys) -> (keys, keys id)
        self._gone = False
        self._said_stalled = False
        self.unconfirmed: tuple[int, int, int] | None = None  # (first, last, count) sent since the last ack
        self.last_step: int | None = None  # the last step handed over

    # -- RecordSink ------------------------------------------------------------------------------------------
    def write(self, record: StepRecord, derived: Derived) -> None:
        if self._gone:
            return
        if self._watch_dir and not self._run_dir.is_dir():
            say_deleted(self._run_dir)
        try:
            layout = self._layout(record, derived)
            keys = self._keys_id(record)
            self.session.send(wire.encode_step(record, self.session.ident, layout, keys))
        except WriterGone:
            self._lost(record, derived)
            return
        u = self.unconfirmed
        self.unconfirmed = (record.step, record.step, 1) if u is None else (u[0], record.step, u[2] + 1)
        self.last_step = record.step

    def flush(self) -> bool:
        if self._gone:
            return True
        try:
            done = self.session.flush(ACK_TIMEOUT_S)
        except WriterGone:
            self._lost(None, None)
            return True
        if done:
            self.unconfirmed = None
            self._said_stalled = False
        elif not self._said_stalled:
            self._said_stalled = True
            logger.warning(
                "trainmon: %sthe writer process (pid %d) has not confirmed a flush within %gs (storage "
                "stalled?); going on without waiting for it",
                rank_note(),
                self.session.pid,
                ACK_TIMEOUT_S,
            )
        return done

    def close(self) -> None:
        if self._gone:
            return
        try:
            self.session.close()
        except WriterGone:
            self._lost(None, None)

    def wait_closed(self, timeout: float | None) -> bool:
        """After :meth:`close`: wait (at most ``timeout`` seconds) for the writer process to have written
        everything handed to it and closed the outputs."""
        if self._gone:
            return True
        if not self.session.wait_closed(timeout):
            return False
        if not self.session.closed:
            logger.warning(
                "trainmon: %sthe writer process (pid %d) ended (%s) before it had closed the outputs; the "
                "last steps handed to it may be missing",
                rank_note(),
                self.session.pid,
                self.session.process.how_it_ended(),
            )
        return True

    def lost(self) -> None:
        """The writer process was found gone outside a write (a config edit): the outputs reopen here."""
        if not self._gone:
            self._lost(None, None)

    # -- internals -------------------------------------------------------------------------------------------
    def _layout(self, record: StepRecord, derived: Derived) -> int:
        groups = derived.groups
        last, layout = self._last
        if groups is last:
            return layout
        known = self._layouts.get(groups)
        if known is None:
            known = next(self._ids)
            self.session.send([wire.encode_rows(self.session.ident, known, tuple(record.rows))])
            self._layouts[groups] = known
            if len(self._layouts) > LAYOUTS_KEPT:
                self._layouts.popitem(last=False)
        else:
            self._layouts.move_to_end(groups)
        self._last = (groups, known)
        return known

    def _keys_id(self, record: StepRecord) -> int:
        agg = record.all_ranks
        if agg is None:
            return -1
        found = self._keys.get(id(agg.keys))
        if found is not None and found[0] is agg.keys:  # the table of tensors is one object until it grows
            self._keys.move_to_end(id(agg.keys))
            return found[1]
        ident = next(self._ids)
        self.session.send([wire.encode_keys(self.session.ident, ident, agg.keys)])
        self._keys[id(agg.keys)] = (agg.keys, ident)
        if len(self._keys) > LAYOUTS_KEPT:
            self._keys.popitem(last=False)
        return ident

    def _lost(self, record: StepRecord | None, derived: Derived | None) -> None:
        """The writer process is gone: say so once, and have the outputs reopened in the writer thread."""
        self._gone = True
        u = self.unconfirmed
        if u is None:
            missing = "every step handed to it was confirmed written"
        elif u[0] == u[1]:
            missing = f"step {u[0]}, handed to it since its last confirmed flush, may be missing"
        else:
            missing = (
                f"{u[2]} steps handed to it since its last confirmed flush (steps {u[0]}..{u[1]}) may be "
                "missing"
            )
        logger.warning(
            "trainmon: %sthe writer process (pid %d) ended unexpectedly (%s); %s. The outputs are written "
            "from the writer thread from %s on; training goes on",
            rank_note(),
            self.session.pid,
            self.session.process.how_it_ended(),
            missing,
            f"step {record.step}" if record is not None else "now",
        )
        self._fall_back(record, derived)


class RemoteStepLog:
    """The step log of a rank (:class:`~trainmon.anomaly.steplog.StepLog`) kept by the writer process: the
    anomaly sink's step ends and the records it wrote go over the session's pipe, in order with the steps
    (a step's end follows the step, whose times the child takes from it).

    Records may come from the writer's checking thread (a step the writer had no room for), which must
    never wait for the pipe (the writer process may be the stalled part): they wait here and go with the
    next step end, flush or close, all of which the writer thread sends.

    When the writer process is gone the step log opens here, in the writer thread, and goes on from the
    summary the child last wrote; the steps handed over but not written are said by :class:`ProcessSink`."""

    def __init__(self, session: Session) -> None:
        assert session.steps is not None
        self.session = session
        self._here: StepLog | None = None
        self._lock = threading.Lock()
        self._waiting: list[list[Anomaly]] = []  # records not handed over yet
        self._failed = False  # it could not be opened here either
        session.before_flush.append(self._hand_over)

    def records(self, recorded: list[Anomaly]) -> None:
        """Any thread; never waits for the writer process."""
        if recorded:
            with self._lock:
                self._waiting.append(list(recorded))

    def end_step(self, end: StepEnd, timing: StepTiming | None) -> None:
        """The writer thread."""
        log = self._hand_over(wire.encode_end(self.session.ident, end))
        if log is not None:
            log.end_step(end, timing)

    def flush(self) -> None:
        log = self._hand_over()
        if log is not None:
            log.flush()

    def close(self) -> None:  # the writer process closes it with the session
        log = self._hand_over()
        if log is not None:
            log.close()

    def _hand_over(self, *frames: bytes) -> StepLog | None:
        """Send the waiting records and ``frames``; the step log of this thread instead when the writer
        process is gone (the waiting records written to it)."""
        with self._lock:
            waiting, self._waiting = self._waiting, []
        log = self._here
        if log is None:
            ident = self.session.ident
            try:
                buffers = [*(wire.encode_records(ident, r) for r in waiting), *frames]
                if buffers:
                    self.session.send(buffers)
                return None
            except WriterGone:
                log = self._open_here()
        if log is not None:
            for recorded in waiting:
                log.records(recorded)
        return log

    def _open_here(self) -> StepLog | None:
        with self._lock:
            if self._here is None and not self._failed:
                try:
                    self._here = StepLog(self.session.run_dir, self.session.steps)
                except Exception:
                    self._failed = True
                    logger.exception(
                        "trainmon: the steps table and summary of rank %d cannot be opened in the writer "
                        "thread either; they are not written from now on (anomaly records and alerts go on)",
                        self.session.steps,
                    )
            return self._here
