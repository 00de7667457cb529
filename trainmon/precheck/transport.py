"""Captured calls over a socket: the rank side encodes each call as one frame (``frames``) and sends it from
a thread through a bounded queue; the benchmark side reads frames, refuses the bad ones with one log line
each, re-runs and judges the calls, and keeps every verdict. A full queue drops calls (counted) instead of
blocking the training; a benchmark side that is gone is said once, with the count of calls not checked."""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from trainmon.precheck import frames
from trainmon.precheck.capture import CapturedCall
from trainmon.precheck.rerun import Judged, judge_call

logger = logging.getLogger("trainmon")


class Unsendable(ValueError):
    """A call argument that has no data-only form."""


def _pack(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return {"$t": len(tensors) - 1}
    if isinstance(value, torch.dtype):
        return {"$dtype": str(value).removeprefix("torch.")}
    if isinstance(value, slice):
        return {
            "$slice": [_pack(value.start, tensors), _pack(value.stop, tensors), _pack(value.step, tensors)]
        }
    if value is Ellipsis:
        return {"$ellipsis": True}
    if isinstance(value, tuple):
        return {"$tuple": [_pack(v, tensors) for v in value]}
    if isinstance(value, list):
        return [_pack(v, tensors) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) and not k.startswith("$") for k in value):
        return {k: _pack(v, tensors) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise Unsendable(f"{type(value).__name__} argument")


def _unpack(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, list):
        return [_unpack(v, tensors) for v in value]
    if isinstance(value, dict):
        if "$t" in value:
            index = value["$t"]
            if not isinstance(index, int) or not 0 <= index < len(tensors):
                raise frames.FrameError(f"tensor reference {index!r} out of range")
            return tensors[index]
        if "$dtype" in value:
            dtype = frames.DTYPES.get(value["$dtype"])
            if dtype is None:
                raise frames.FrameError(f"unknown dtype {value['$dtype']!r}")
            return dtype
        if "$slice" in value:
            parts = value["$slice"]
            if not (
                isinstance(parts, list)
                and len(parts) == 3
                and all(p is None or type(p) is int for p in parts)
            ):
                raise frames.FrameError("a slice is malformed")
            return slice(*parts)
        if "$ellipsis" in value:
            return Ellipsis
        if "$tuple" in value:
            return (
                tuple(_unpack(v, tensors) for v in value["$tuple"])
                if isinstance(value["$tuple"], list)
                else ()
            )
        return {k: _unpack(v, tensors) for k, v in value.items()}
    return value


def call_message(call: CapturedCall) -> tuple[dict, list[torch.Tensor]]:
    """A call as data: a JSON-able message whose tensors are references into the returned list."""
    tensors: list[torch.Tensor] = []
    message = {
        "kind": "call", "name": call.name, "api": call.api, "module": call.module,
        "args": _pack(call.args, tensors), "kwargs": _pack(call.kwargs, tensors),
        "outputs": _pack(call.outputs, tensors),
    }  # fmt: skip
    return message, tensors


def encode_call(call: CapturedCall, key: bytes) -> bytes:
    return frames.encode(*call_message(call), key)


def decode_call(message: dict, tensors: list[torch.Tensor]) -> CapturedCall:
    fields = ("name", "api", "module")
    if message.get("kind") != "call" or not all(isinstance(message.get(f), str) for f in fields):
        raise frames.FrameError("not a call")
    args, kwargs = _unpack(message.get("args"), tensors), _unpack(message.get("kwargs"), tensors)
    outputs = _unpack(message.get("outputs"), tensors)
    if not isinstance(args, tuple) or not isinstance(kwargs, dict) or not isinstance(outputs, tuple):
        raise frames.FrameError("a call's arguments or outputs are malformed")
    if not all(isinstance(o, torch.Tensor) for o in outputs):
        raise frames.FrameError("a call's outputs are not tensors")
    return CapturedCall(message["name"], message["api"], message["module"], args, kwargs, outputs)


@dataclass
class BenchmarkServer:
    """``trainmon precheck serve``'s core: accepts connections on ``host:port`` (127.0.0.1 by default), one
    thread a connection; every frame authenticated with ``key``."""

    key: bytes
    host: str = "127.0.0.1"
    port: int = 0
    limits: frames.Limits = frames.Limits()
    results: list[Judged] = field(default_factory=list)
    refused: int = 0
    failed: int = 0

    def start(self) -> int:
        self._socket = socket.create_server((self.host, self.port))
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept, name="trainmon-precheck-server", daemon=True)
        self._thread.start()
        return self._socket.getsockname()[1]

    def stop(self) -> None:
        self._socket.close()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self._socket.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(connection,), daemon=True).start()

    def _serve(self, connection: socket.socket) -> None:
        with connection, connection.makefile("rb") as stream:
            while True:
                try:
                    got = frames.read(stream, self.key, self.limits)
                    if got is None:
                        return
                    call = decode_call(*got)
                except (frames.FrameError, OSError, RecursionError) as error:
                    with self._lock:
                        self.refused += 1
                    logger.warning("trainmon precheck: a frame refused and its connection closed: %s", error)
                    return
                try:
                    judged = judge_call(call)
                except Exception as error:  # a call the benchmark cannot re-run: counted, the server goes on
                    with self._lock:
                        self.failed += 1
                    logger.warning("trainmon precheck: %s could not be re-run: %s", call.name, error)
                    continue
                with self._lock:
                    self.results.extend(judged)


class Sender:
    """The rank side: ``offer(call)`` never blocks; a thread sends what the queue holds."""

    def __init__(self, host: str, port: int, key: bytes, queue_size: int = 256, timeout: float = 5.0) -> None:
        self._key, self._address, self._timeout = key, (host, port), timeout
        self._queue: queue.Queue[CapturedCall | None] = queue.Queue(queue_size)
        self.sent = self.dropped = self.unsendable = self.not_checked = 0
        self._said = False
        self._thread = threading.Thread(target=self._run, name="trainmon-precheck-sender", daemon=True)
        self._thread.start()

    def offer(self, call: CapturedCall) -> None:
        try:
            self._queue.put_nowait(call)
        except queue.Full:
            self.dropped += 1

    def close(self, timeout: float = 10.0) -> None:
        with contextlib.suppress(queue.Full):  # a sender stuck on a slow peer: the thread is a daemon
            self._queue.put(None, timeout=timeout)
        self._thread.join(timeout)

    def _run(self) -> None:
        connection = None
        while True:
            call = self._queue.get()
            if call is None:
                break
            try:
                data = encode_call(call, self._key)
            except (Unsendable, frames.FrameError):
                self.unsendable += 1
                continue
            try:
                if connection is None:
                    connection = socket.create_connection(self._address, timeout=self._timeout)
                connection.sendall(data)
                self.sent += 1
            except OSError as error:
                self.not_checked += 1
                if not self._said:
                    self._said = True
                    logger.warning(
                        "trainmon precheck: the benchmark side is gone (%s); training goes on", error
                    )
                connection = None
        if connection is not None:
            connection.close()
        if self.not_checked or self.dropped:
            logger.warning(
                "trainmon precheck: %d calls not checked (%d dropped by a full queue)",
                self.not_checked + self.dropped,
                self.dropped,
            )
