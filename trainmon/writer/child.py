"""The writer process: ``python -m trainmon.writer.child PARENT_PID TRAINMON_INIT LINGER_S``, started by
:class:`trainmon.writer.process.WriterProcess`. For each session (one monitor's outputs) it opens the format
outputs and the rank's step log (its steps table, timing tables and summary: :mod:`trainmon.anomaly.steplog`),
writes every step the training process hands it (the frames: :mod:`trainmon.writer.wire`) and closes them
when told. It exits when its pipe ends or when it finds its parent gone, after writing everything it was
handed (so a training process killed with SIGKILL leaves every step it had handed over on disk), and by itself
``LINGER_S`` after its last session closed. Imports no torch.

Its log records go to the parent, which logs them again; its stdout carries only its answers (anything else
printed goes to stderr). Ctrl-C in a terminal reaches the whole foreground process group: the writer process
ignores it and finishes with its parent; SIGTERM makes it write what it holds and exit.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import sys
import threading
import time
import traceback
from collections import OrderedDict
from typing import Any

from trainmon.anomaly.steplog import StepLog
from trainmon.run.records import Derived, Row, TensorGroups
from trainmon.run.timing import StepTiming
from trainmon.writer import wire
from trainmon.writer.sinkplan import SinkSpec, follow_failed, open_sinks
from trainmon.writer.thread import RecordSink, SinkErrors

logger = logging.getLogger("trainmon")

# how often a writer process blocked on its pipe looks whether its parent is still there
PARENT_CHECK_S = 1.0
# layouts (and all_ranks tables) kept by id, the most recently used: twice as many as the parent keeps
# (process.LAYOUTS_KEPT) over the same uses, so every one it names is here
LAYOUTS_KEPT = 16

_stopping = False  # SIGTERM: write what is readable now, then exit


class _Replies:
    """The answers to the parent, one whole frame per write (the log handler may call from any thread)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._lock = threading.Lock()
        self.broken = False

    def send(self, body: dict[str, Any]) -> None:
        data = memoryview(wire.reply(body))
        with self._lock:
            if self.broken:
                return
            try:
                while data:
                    data = data[os.write(self.fd, data) :]
            except OSError:  # the parent is gone: what is left is written all the same
                self.broken = True


class _Relay(logging.Handler):
    """Every record of the ``trainmon`` logger, sent to the parent to be logged there."""

    def __init__(self, replies: _Replies) -> None:
        super().__init__(logging.DEBUG)
        self.replies = replies

    def emit(self, record: logging.LogRecord) -> None:
        try:
            exc = None
            if record.exc_info and record.exc_info[1] is not None:
                error = record.exc_info[1]
                exc = {
                    "type": type(error).__name__,
                    "message": str(error),
                    "text": "".join(traceback.format_exception(*record.exc_info)),
                }
            self.replies.send({
                "t": "log",
                "name": record.name,
                "level": record.levelno,
                "msg": record.getMessage(),
                "exc": exc,
                "deleted": getattr(record, "trainmon_deleted", None),
            })  # fmt: skip
        except Exception:
            self.handleError(record)


class _Frames:
    """The parent's frames, read from ``fd``. The end is its end of the pipe closing, or the parent gone
    (a process that inherited the pipe, such as a forked data loader worker, may keep it open), or, between
    frames, :attr:`idle_until` passing."""

    def __init__(self, fd: int, parent: int) -> None:
        self.fd = fd
        self.parent = parent
        self.orphan = False
        self.idle_until: float | None = None  # no session is open: the process ends at this time.monotonic()

    def _readable(self, between: bool) -> bool:
        while True:
            if self.orphan or _stopping:
                return bool(select.select([self.fd], [], [], 0)[0])
            if select.select([self.fd], [], [], PARENT_CHECK_S)[0]:
                return True
            if os.getppid() != self.parent:
                self.orphan = True
            elif between and self.idle_until is not None and time.monotonic() >= self.idle_until:
                return False

    def _exact(self, n: int) -> bytearray | None:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            if not self._readable(between=got == 0 and n == wire.FRAME.size):
                return None
            read = os.readv(self.fd, [view[got:]])
            if not read:
                return None
            got += read
        return buf

    def next(self) -> tuple[bytes, int, bytearray] | None:
        """The next whole frame (kind, session, body); None at the end (a frame cut short by the parent's
        death included: it was not handed over whole)."""
        head = self._exact(wire.FRAME.size)
        if head is None:
            return None
        kind, session, size = wire.FRAME.unpack(head)
        body = self._exact(size)
        return None if body is None else (kind, session, body)


class _ParentClock:
    """The parent's clock while one of its messages is handled (the times the outputs record: an event file's
    creation, the manifest's), this process's otherwise."""

    def __init__(self) -> None:
        self.at: float | None = None

    def __call__(self) -> float:
        return self.at if self.at is not None else time.time()


class _Writer:
    """The outputs of one session (a monitor's rank), fed in turn as the writer thread feeds its sinks."""

    def __init__(self, replies: _Replies, session: int) -> None:
        self.replies = replies
        self.session = session
        self.clock = _ParentClock()
        self.errors = SinkErrors()
        self.sinks: list[RecordSink] = []
        self.manifest: RecordSink | None = None
        self.steps: StepLog | None = None  # the rank's step log, when the session keeps it
        self._timed: tuple[int, StepTiming | None] = (-1, None)  # the last step's times, for its end
        self.run_dir = ""
        self.layouts: OrderedDict[int, tuple[tuple[Row, ...], TensorGroups]] = OrderedDict()
        self.keys: OrderedDict[int, tuple] = OrderedDict()

    def all(self) -> list[RecordSink]:
        return [*self.sinks, *([self.manifest] if self.manifest is not None else [])]

    def open(self, body: dict[str, Any]) -> None:
        from trainmon.writer.manifest import ManifestSink

        self.clock.at = body.get("at")
        try:
            self.run_dir = str(body["run_dir"])
            self.sinks = open_sinks([SinkSpec.from_json(d) for d in body["plan"]], self.clock)
            try:
                manifest = body.get("manifest")
                if manifest is not None:
                    self.manifest = ManifestSink(self.run_dir, manifest, clock=self.clock)
                if body.get("steps") is not None:
                    self.steps = StepLog(self.run_dir, int(body["steps"]))
            except BaseException:
                self.errors.flush(self.all(), close=True)
                raise
        finally:
            self.clock.at = None

    def layout(self, body: dict[str, Any]) -> None:
        ident, rows = wire.decode_rows(body)
        self.layouts[ident] = (rows, TensorGroups(rows))
        if len(self.layouts) > LAYOUTS_KEPT:
            self.layouts.popitem(last=False)

    def table(self, body: dict[str, Any]) -> None:
        ident, keys = wire.decode_keys(body)
        self.keys[ident] = keys
        if len(self.keys) > LAYOUTS_KEPT:
            self.keys.popitem(last=False)

    def step(self, body: bytearray) -> None:
        record, layout = wire.decode_step(body, self._rows, self._keys)
        derived = Derived(record, self.layouts[layout][1])
        self._timed = (record.step, record.timing)
        self.errors.write(self.all(), record, derived)

    def end(self, body: bytearray) -> None:
        end = wire.decode_end(body)
        step, timing = self._timed
        self._timed = (-1, None)
        if self.steps is not None:
            self.steps.end_step(end, timing if step == end.step else None)

    def records(self, body: dict[str, Any]) -> None:
        if self.steps is not None:
            self.steps.records(wire.decode_records(body))

    def flush(self) -> None:
        self.errors.flush(self.all())
        if self.steps is not None:
            self.steps.flush()

    def _rows(self, layout: int) -> tuple[Row, ...]:
        self.layouts.move_to_end(layout)  # kept as the parent keeps them: the most recently used
        return self.layouts[layout][0]

    def _keys(self, ident: int) -> tuple:
        self.keys.move_to_end(ident)
        return self.keys[ident]

    def follow(self, body: dict[str, Any]) -> None:
        """A config edit: the new outputs are opened before the old ones are closed; when they cannot be, the
        old ones go on (said once)."""
        from trainmon.writer.manifest import ManifestSink

        self.clock.at = body.get("at")
        try:
            plan = body.get("plan")
            if plan is not None:
                try:
                    fresh = open_sinks([SinkSpec.from_json(d) for d in plan], self.clock)
                except Exception as e:
                    follow_failed(self.run_dir, body.get("new", ""), body.get("old", ""), e)
                    self.answer({"t": "followed", "id": body.get("id"), "ok": False})
                else:
                    old, self.sinks = self.sinks, fresh
                    self.errors.flush(old, close=True)
                    self.answer({"t": "followed", "id": body.get("id"), "ok": True})
            payload = body.get("manifest")
            if payload is None:
                return
            try:
                if self.manifest is not None:
                    self.manifest.manifest.update(**payload)  # type: ignore[attr-defined]
                elif body.get("create_manifest"):
                    self.manifest = ManifestSink(self.run_dir, payload, clock=self.clock)
            except Exception as exc:
                self.errors.report("call", "applying a config edit in the writer process", exc)
        finally:
            self.clock.at = None

    def close(self, at: float | None) -> None:
        self.clock.at = at
        try:
            self.errors.flush(self.all(), close=True)
            if self.steps is not None:
                try:
                    self.steps.close()
                except Exception as exc:  # the outputs' answer still goes back
                    self.errors.report(self.steps, "closing the steps table", exc)
        finally:
            self.clock.at = None

    def answer(self, body: dict[str, Any]) -> None:
        self.replies.send({**body, "s": self.session})


def _handle(writer: _Writer, kind: bytes, body: bytearray) -> None:
    if kind == wire.STEP:
        writer.step(body)
    elif kind == wire.END:
        writer.end(body)
    elif kind == wire.RECORDS:
        writer.records(wire_json(body))
    elif kind == wire.LAYOUT:
        writer.layout(wire_json(body))
    elif kind == wire.KEYS:
        writer.table(wire_json(body))
    elif kind == wire.FLUSH:
        writer.flush()
        writer.answer({"t": "ack", "id": wire_json(body)["id"]})
    elif kind == wire.FOLLOW:
        writer.follow(wire_json(body))


def _stop(signum: int, frame: object) -> None:
    global _stopping
    _stopping = True


def _open(replies: _Replies, session: int, body: bytearray) -> _Writer | None:
    writer = _Writer(replies, session)
    try:
        writer.open(wire_json(body))
    except OSError as e:
        writer.answer({"t": "failed", "errno": e.errno, "strerror": e.strerror, "filename": _name(e.filename),
                       "message": str(e)})  # fmt: skip
        return None
    except Exception as e:
        writer.answer({"t": "failed", "message": f"{type(e).__name__}: {e}"})
        return None
    writer.answer({"t": "opened"})
    return writer


def main(argv: list[str]) -> int:
    parent, expected, linger = int(argv[0]), argv[1], float(argv[2])
    replies = _Replies(os.dup(1))
    os.dup2(2, 1)  # stdout carries the answers only: whatever else is printed goes to stderr
    sys.stdout = sys.stderr
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _stop)
    logger.addHandler(_Relay(replies))
    logger.setLevel(logging.DEBUG)  # the parent's logger decides what it shows
    logger.propagate = False

    # this module's own package: the trainmon the parent imported, or not
    found = os.path.realpath(os.path.join(os.path.dirname(__file__), os.pardir, "__init__.py"))
    frames = _Frames(0, parent)
    sessions: dict[int, _Writer] = {}
    frames.idle_until = time.monotonic() + linger
    while True:
        frame = frames.next()
        if frame is None:
            break
        kind, session, body = frame
        if kind == wire.OPEN:
            if found != os.path.realpath(expected):
                replies.send({"t": "failed", "s": session,
                              "message": f"it imported trainmon from {found}, not {expected}"})  # fmt: skip
                break
            opened = _open(replies, session, body)
            if opened is not None:
                sessions[session] = opened
        elif (writer := sessions.get(session)) is None:
            continue  # a session that could not be opened: its frames have nowhere to go
        elif kind == wire.CLOSE:
            del sessions[session]
            writer.close(wire_json(body).get("at"))
            writer.answer({"t": "closed"})
        else:
            try:
                _handle(writer, kind, body)
            except Exception as exc:  # one message this process cannot use costs that message only
                writer.errors.report(
                    kind, f"handling a message of kind {kind!r} from the training process", exc
                )
        frames.idle_until = None if sessions else time.monotonic() + linger
    for writer in sessions.values():  # the parent is gone: what it handed over is written, then closed
        writer.close(None)
    return 0


def wire_json(body: bytearray) -> dict[str, Any]:
    return json.loads(body)


def _name(filename: object) -> str | None:
    return (
        None if filename is None else os.fsdecode(filename) if isinstance(filename, bytes) else str(filename)
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
