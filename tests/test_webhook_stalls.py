"""Webhooks that hang or trickle, against real HTTP servers on 127.0.0.1: alert lines are logged at once
whatever the webhooks do, and ``timeout_s`` bounds a whole request, not each socket read."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time

import pytest

from trainmon.anomaly.alerts import AlertDispatcher, WebhookSink
from trainmon.run.records import Anomaly


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch):
    for key in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(key, raising=False)


class RawServer:
    """A TCP server on 127.0.0.1 that reads each request's head and then runs ``answer(conn)``."""

    def __init__(self, answer) -> None:
        self.answer = answer
        self.stop = threading.Event()
        self.requests = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/hook"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(4096)
                if not chunk:
                    return
                data += chunk
            self.requests += 1
            with contextlib.suppress(OSError):  # the client gave up
                self.answer(conn, self.stop)

    def close(self) -> None:
        self.stop.set()
        self.sock.close()


def hang(conn: socket.socket, stop: threading.Event) -> None:
    stop.wait(60)


REPLY = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


def trickle(conn: socket.socket, stop: threading.Event) -> None:
    """One byte of a valid reply every 0.3 s: each read gets data well within the timeout."""
    for byte in REPLY:
        if stop.wait(0.3):
            return
        conn.sendall(bytes([byte]))


def anomaly(step: int) -> Anomaly:
    return Anomaly(step=step, rank=0, kind="actv", name="layers.0", stat="nans", value=4.0, rule="nan")


def test_alert_lines_are_logged_at_once_while_the_webhook_hangs(caplog):
    server = RawServer(hang)
    try:
        with caplog.at_level(logging.WARNING, logger="trainmon"):
            d = AlertDispatcher([WebhookSink(server.url, timeout_s=30)], rate_limit_s=0)
            for step in range(3):
                d.notify([anomaly(step)], run="r", rank=0)
            logged = [r.getMessage() for r in caplog.records if "NaN at step" in r.getMessage()]
            # every line is in the log already, though the first request is still hanging
            assert [line.split(": ", 1)[1][:13] for line in logged] == [f"NaN at step {s}" for s in range(3)]
            d.close(timeout=0.5)  # the webhook deliveries are given up; the log lines were never at stake
        assert "3 alerts not delivered to their sinks at close" in caplog.text
    finally:
        server.close()


def test_a_trickling_reply_ends_at_timeout_s(caplog):
    server = RawServer(trickle)
    try:
        sink = WebhookSink(server.url, timeout_s=1.0)
        alert = AlertDispatcher([], rate_limit_s=0)._format(0, [(anomaly(0), None)], "r", 0)
        with caplog.at_level(logging.WARNING, logger="trainmon"):
            start = time.monotonic()
            sink.send(alert)
            elapsed = time.monotonic() - start
        # the reply would take 24 s at this pace; the request ends at its deadline
        assert 0.9 < elapsed < 2.0, elapsed
        assert "timed out: no complete reply within timeout_s=1s" in caplog.text
        assert server.requests == 1
    finally:
        server.close()


def test_a_prompt_reply_is_still_a_success(caplog):
    def answer(conn: socket.socket, stop: threading.Event) -> None:
        conn.sendall(REPLY)

    server = RawServer(answer)
    try:
        sink = WebhookSink(server.url, timeout_s=1.0)
        alert = AlertDispatcher([], rate_limit_s=0)._format(0, [(anomaly(0), None)], "r", 0)
        with caplog.at_level(logging.WARNING, logger="trainmon"):
            sink.send(alert)
            time.sleep(1.2)  # past the deadline: a cancelled timer must not report anything
        assert "failed" not in caplog.text
    finally:
        server.close()
