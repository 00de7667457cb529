"""Alert delivery: anomalies -> rate-limited, batched alerts -> log, webhooks, callbacks.

The monitor's writer thread calls :meth:`AlertDispatcher.notify` with the anomalies of a step. ``notify``
never blocks and never raises: it applies the rate limit, formats one :class:`Alert` per step, logs it at
once (logger ``"trainmon"``, WARNING) and hands it to the dispatcher's own daemon thread through a bounded
queue; that thread sends it to each other sink (webhooks, callbacks). A slow or dead webhook delays only
that thread, never the log line, and a webhook request never outlives its ``timeout_s``: it is a deadline
for the whole request, whatever the server trickles.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import hashlib
import hmac
import json
import logging
import math
import queue
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol, runtime_checkable

from trainmon.config.alert import WEBHOOK_KINDS, AlertConfig
from trainmon.run.records import (
    INF_RULE,
    MAX_RATIO_RULE,
    NAN_RULE,
    NON_FINITE_RULES,
    SUPPRESSED_RULE,
    THRESHOLD_RULE,
    TURBULENCE_RULE,
    ZSCORE_RULE,
    Anomaly,
)

logger = logging.getLogger("trainmon")
_DEFAULTS = {d.name: d.default for d in AlertConfig.declared()}

__all__ = [
    "Alert",
    "AlertDispatcher",
    "CallbackSink",
    "LogSink",
    "NanAction",
    "AlertSink",
    "TrainingNaNError",
    "WebhookSink",
    "WEBHOOK_KINDS",
    "apply_nan_action",
    "dispatcher_for",
]

# Delivery defaults: the alert section's (trainmon.config.alert declares them)
DEFAULT_RATE_LIMIT_S: float = _DEFAULTS["rate_limit_s"]  # an alert line per (rule, kind, tensor) per this
DEFAULT_MAX_QUEUE: int = _DEFAULTS["max_queue"]  # alerts waiting for the delivery thread
DEFAULT_MAX_LINES: int = _DEFAULTS["max_lines"]  # lines an alert shows before "+N more"

# How a rule is named in alert titles and lines; other rules show their own name.
RULE_LABELS = {
    NAN_RULE: "NaN",
    INF_RULE: "Inf",
    TURBULENCE_RULE: "spike",
    ZSCORE_RULE: "spike",
    MAX_RATIO_RULE: "spike",
    THRESHOLD_RULE: "threshold",
}


# --------------------------------------------------------------------------------------------- alert


@dataclass(frozen=True)
class Alert:
    """One message: the (rate-limited) anomalies of one step of one rank."""

    title: str
    lines: tuple[str, ...]
    anomalies: tuple[Anomaly, ...]
    run: str
    rank: int
    step: int

    @property
    def text(self) -> str:
        """The body: ``lines`` joined by newlines."""
        return "\n".join(self.lines)


def _label(rule: str) -> str:
    return RULE_LABELS.get(rule, rule)


def _fmt_value(v: float) -> str:
    try:
        return f"{float(v):.6g}"
    except (TypeError, ValueError):
        return str(v)


def _utc(t: float) -> str:
    return time.strftime("%H:%M:%S UTC", time.gmtime(t))


def _json_safe(v: Any) -> Any:
    """JSON has no NaN/Infinity: non-finite floats become the strings "nan", "inf", "-inf"."""
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    if isinstance(v, dict):
        return {k: _json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json_safe(x) for x in v]
    return v


def anomaly_dict(a: Anomaly) -> dict[str, Any]:
    """An anomaly as a JSON-safe dict (the record's fields; non-finite floats as strings)."""
    return _json_safe(dataclasses.asdict(a))


# --------------------------------------------------------------------------------------------- sinks


@runtime_checkable
class AlertSink(Protocol):
    """Anything with ``send(alert)``. Called on the dispatcher's thread, one alert at a time."""

    def send(self, alert: Alert) -> None: ...


class _LogLimiter:
    """At most one log line per key per ``interval_s``; counts what it held back."""

    def __init__(self, interval_s: float = 60.0, clock: Callable[[], float] = time.time) -> None:
        self.interval_s = interval_s
        self.clock = clock
        self._last: dict[object, float] = {}
        self._held: dict[object, int] = {}
        self._lock = threading.Lock()

    def check(self, key: object) -> tuple[bool, int]:
        """(log now?, how many were held back since the last line of this key)."""
        now = self.clock()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self.interval_s:
                self._held[key] = self._held.get(key, 0) + 1
                return False, 0
            self._last[key] = now
            return True, self._held.pop(key, 0)


class LogSink:
    """Logs every alert on logger ``"trainmon"`` at WARNING, one log line per alert line (``trainmon (run
    RUN): NaN at step S rank R: ...``). Always part of an :class:`AlertDispatcher`."""

    def __init__(self, log: logging.Logger | None = None, level: int = logging.WARNING) -> None:
        self.log = log or logger
        self.level = level

    def send(self, alert: Alert) -> None:
        # the lines carry step, rank and kind already: the title would only repeat them in the log
        prefix = f"trainmon (run {alert.run}): "
        self.log.log(self.level, "%s", "\n".join(prefix + line for line in alert.lines))


class CallbackSink:
    """Calls ``fn(alert)``; an exception is logged (rate-limited), never raised."""

    def __init__(self, fn: Callable[[Alert], Any], *, clock: Callable[[], float] = time.time) -> None:
        if not callable(fn):
            raise TypeError(f"CallbackSink needs a callable, got {type(fn).__name__}")
        self.fn = fn
        self._limiter = _LogLimiter(60.0, clock)

    def __repr__(self) -> str:
        return f"CallbackSink({getattr(self.fn, '__qualname__', self.fn)!r})"

    def send(self, alert: Alert) -> None:
        try:
            self.fn(alert)
        except Exception as e:  # a user callback must not kill alerting
            ok, held = self._limiter.check("error")
            if ok:
                more = f" ({held} more failures not logged)" if held else ""
                logger.warning("trainmon alert callback %r failed: %r%s", self, e, more, exc_info=True)


def _redact(url: str) -> str:
    """scheme://host/path without the query: webhook tokens live in paths or queries, keep logs short."""
    p = urllib.parse.urlsplit(url)
    path = p.path
    if len(path) > 16:
        path = path[:12] + "..."
    return f"{p.scheme}://{p.netloc}{path}"


def dingtalk_sign(secret: str, timestamp_ms: int) -> str:
    """DingTalk robot signature: base64(HMAC-SHA256(key=secret, msg="{timestamp}\\n{secret}"))."""
    msg = f"{timestamp_ms}\n{secret}".encode()
    return base64.b64encode(hmac.new(secret.encode(), msg, hashlib.sha256).digest()).decode()


def feishu_sign(secret: str, timestamp_s: int) -> str:
    """Feishu/Lark bot signature: base64(HMAC-SHA256(key="{timestamp}\\n{secret}", msg=b""))."""
    key = f"{timestamp_s}\n{secret}".encode()
    return base64.b64encode(hmac.new(key, b"", hashlib.sha256).digest()).decode()


class WebhookSink:
    """POSTs an alert as JSON to ``url`` in the payload shape of ``kind``.

    - ``generic``: ``{"title", "text", "run", "rank", "step", "anomalies": [...]}``
    - ``slack`` (incoming webhook): ``{"text": ...}``
    - ``dingtalk`` (custom robot): ``{"msgtype": "markdown", "markdown": {"title", "text"}}``; with
      ``secret``, ``timestamp`` (ms) and ``sign`` query parameters are added to the URL.
    - ``feishu`` (Feishu/Lark custom bot): ``{"msg_type": "text", "content": {"text": ...}}``; with
      ``secret``, ``timestamp`` (s) and ``sign`` fields are added to the body.

    Any failure (connection refused, HTTP error, timeout, an error code in the reply) is logged,
    at most once a minute per sink, and never raised.
    """

    def __init__(
        self,
        url: str,
        *,
        kind: str = "generic",
        timeout_s: float = 5.0,
        secret: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if kind not in WEBHOOK_KINDS:
            raise ValueError(f"unknown webhook kind {kind!r}; allowed: {', '.join(WEBHOOK_KINDS)}")
        scheme = urllib.parse.urlsplit(url).scheme
        if scheme not in ("http", "https"):
            raise ValueError(f"webhook url must be http:// or https://, got {_redact(url)!r}")
        if not timeout_s > 0:
            raise ValueError(f"webhook timeout_s must be > 0, got {timeout_s!r}")
        self.url = url
        self.kind = kind
        self.timeout_s = float(timeout_s)
        self.secret = secret or None
        self.clock = clock
        self._limiter = _LogLimiter(60.0, clock)

    def __repr__(self) -> str:
        return f"WebhookSink({_redact(self.url)!r}, kind={self.kind!r})"

    def request(self, alert: Alert) -> tuple[str, dict[str, Any]]:
        """The (url, payload) this sink POSTs for ``alert``."""
        url = self.url
        if self.kind == "slack":
            payload: dict[str, Any] = {"text": f"*{alert.title}*\n{alert.text}"}
        elif self.kind == "dingtalk":
            body = "\n".join(f"- {line}" for line in alert.lines)
            markdown = {"title": alert.title, "text": f"### {alert.title}\n\n{body}"}
            payload = {"msgtype": "markdown", "markdown": markdown}
            if self.secret:
                ts = int(self.clock() * 1000)
                sign = urllib.parse.quote_plus(dingtalk_sign(self.secret, ts))
                url += ("&" if "?" in url else "?") + f"timestamp={ts}&sign={sign}"
        elif self.kind == "feishu":
            payload = {"msg_type": "text", "content": {"text": f"{alert.title}\n{alert.text}"}}
            if self.secret:
                ts = int(self.clock())
                payload = {"timestamp": str(ts), "sign": feishu_sign(self.secret, ts), **payload}
        else:
            payload = {
                "title": alert.title,
                "text": alert.text,
                "run": alert.run,
                "rank": alert.rank,
                "step": alert.step,
                "anomalies": [anomaly_dict(a) for a in alert.anomalies],
            }
        return url, payload

    def send(self, alert: Alert) -> None:
        deadline = _Deadline(self.timeout_s)
        try:
            url, payload = self.request(alert)
            data = json.dumps(_json_safe(payload), allow_nan=False).encode("utf-8")
            req = urllib.request.Request(
                url, data=data, method="POST", headers={"Content-Type": "application/json; charset=utf-8"}
            )
            opener = urllib.request.build_opener(_DeadlineHTTP(deadline), _DeadlineHTTPS(deadline))
            deadline.start()
            with opener.open(req, timeout=self.timeout_s) as resp:
                reply = resp.read(65536)
            if deadline.expired:
                raise TimeoutError
            error = _reply_error(reply)
            if error:
                self._fail(f"rejected: {error}")
        except urllib.error.HTTPError as e:
            self._fail(f"HTTP {e.code} {e.reason}")
        except Exception as e:  # URLError, timeout, anything: alerting must never raise
            if deadline.expired:
                self._fail(f"timed out: no complete reply within timeout_s={self.timeout_s:g}s")
            else:
                reason = getattr(e, "reason", None) or e
                self._fail(f"{type(e).__name__}: {reason}")
        finally:
            deadline.cancel()

    def _fail(self, what: str) -> None:
        ok, held = self._limiter.check("fail")
        if ok:
            more = f" ({held} more failures not logged)" if held else ""
            logger.warning("trainmon alert to %r failed: %s%s", self, what, more)


class _Deadline:
    """The end of one webhook request. A socket timeout bounds each read, not the request: a reply that
    trickles in a byte at a time would keep it alive for ever. At the deadline the connection's socket is
    shut down, which ends whatever read or write is waiting on it."""

    def __init__(self, seconds: float) -> None:
        self.expired = False
        self._lock = threading.Lock()
        self._connections: list[Any] = []
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True

    def start(self) -> None:
        self._timer.start()

    def cancel(self) -> None:
        self._timer.cancel()

    def connection(self, http_class: Any) -> Callable[..., Any]:
        """A stand-in for ``http_class`` that remembers the connections it makes."""

        def make(*args: Any, **kwargs: Any) -> Any:
            conn = http_class(*args, **kwargs)
            connect = conn.connect

            def connect_by_deadline() -> None:
                connect()
                with self._lock:
                    late = self.expired  # connected after the deadline: end it now
                if late:
                    self._shutdown(conn)

            conn.connect = connect_by_deadline
            with self._lock:
                self._connections.append(conn)
            return conn

        return make

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            connections = list(self._connections)
        for conn in connections:
            self._shutdown(conn)

    @staticmethod
    def _shutdown(conn: Any) -> None:
        sock = getattr(conn, "sock", None)
        if sock is not None:
            with contextlib.suppress(OSError):  # not connected (yet, or any more)
                sock.shutdown(socket.SHUT_RDWR)


class _DeadlineHTTP(urllib.request.HTTPHandler):
    def __init__(self, deadline: _Deadline) -> None:
        super().__init__()
        self._deadline = deadline

    def do_open(self, http_class: Any, req: Any, **kwargs: Any) -> Any:
        return super().do_open(self._deadline.connection(http_class), req, **kwargs)


class _DeadlineHTTPS(urllib.request.HTTPSHandler):
    def __init__(self, deadline: _Deadline) -> None:
        super().__init__()
        self._deadline = deadline

    def do_open(self, http_class: Any, req: Any, **kwargs: Any) -> Any:
        return super().do_open(self._deadline.connection(http_class), req, **kwargs)


def _reply_error(reply: bytes) -> str | None:
    """DingTalk and Feishu answer HTTP 200 with an error code in the body; report it."""
    try:
        obj = json.loads(reply.decode("utf-8"))
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(obj, dict):
        return None
    for code_key, msg_key in (("errcode", "errmsg"), ("code", "msg"), ("StatusCode", "StatusMessage")):
        code = obj.get(code_key)
        if isinstance(code, int) and code != 0:
            return f"{code_key}={code} {obj.get(msg_key, '')}".strip()
    return None


# ------------------------------------------------------------------------------------------ alert lines

_COUNTS = {"nans": "NaN", "infs": "Inf"}


def _in_burst(a: Anomaly) -> bool:
    """A NaN/Inf element count: the anomalies a non-finite burst is made of."""
    return a.rule in NON_FINITE_RULES and a.stat in _COUNTS


def _where(a: Anomaly) -> str:
    """Kind and name once, then what places the tensor in the step: origin, phase, micro-batch."""
    flags = (
        (["origin"] if a.origin else [])
        + [a.phase]
        + ([f"micro-step {a.micro_step}"] if a.micro_step else [])
    )
    return f"{a.kind} {a.name} ({', '.join(flags)})"


def _tail(a: Anomaly, note: str | None) -> str:
    return (f" [dump: {a.dump}]" if a.dump else "") + (f" ({note})" if note else "")


def _burst_line(step: int, rank: int, burst: list[tuple[Anomaly, str | None]], capped: int) -> str:
    """One line for a step's NaN/Inf burst: its first tensor (the origin, when known, comes first in
    ``order_key``), its counts, and how many other tensors went bad with it."""
    head, note = burst[0]
    key = (head.kind, head.vpp_stage, head.name)
    counts = [f"{int(a.value)} {_COUNTS[a.stat]}" for a, _ in burst if (a.kind, a.vpp_stage, a.name) == key]
    others = {(a.kind, a.vpp_stage, a.name) for a, _ in burst} - {key}
    which = " and ".join(sorted({_COUNTS[a.stat] for a, _ in burst}, key=list(_COUNTS.values()).index))
    line = f"{which} at step {step} rank {rank}: {_where(head)}, {', '.join(counts)}{_tail(head, note)}"
    if others:
        line += f"; +{len(others)} more tensor{'s' if len(others) != 1 else ''}"
    if capped:
        line += f"; {capped} more anomalies not recorded (max_per_step)"
    return line


def _line(step: int, rank: int, a: Anomaly, note: str | None) -> str:
    # rule messages open with "kind/name " (for the JSONL reader); the line names the tensor already
    what = a.message.removeprefix(f"{a.kind}/{a.name} ") if a.message else f"{a.stat} {_fmt_value(a.value)}"
    return f"{_label(a.rule)} at step {step} rank {rank}: {_where(a)}, {what}{_tail(a, note)}"


def _lines(step: int, rank: int, items: list[tuple[Anomaly, str | None]]) -> list[str]:
    """The lines of one step and rank, in ``order_key`` order: a NaN/Inf burst is one line, at the place of
    its first anomaly; every other anomaly (spike, threshold, ...) is a line of its own."""
    burst = [(a, n) for a, n in items if _in_burst(a)]
    capped = sum(int(a.value) for a, _ in items if a.rule == SUPPRESSED_RULE)
    lines: list[str] = []
    for a, note in items:
        if _in_burst(a):
            if a is burst[0][0]:
                lines.append(_burst_line(step, rank, burst, capped))
        elif a.rule == SUPPRESSED_RULE:
            if not burst:
                lines.append(
                    f"{capped} more anomalies at step {step} rank {rank} not recorded (max_per_step)"
                )
        else:
            lines.append(_line(step, rank, a, note))
    return lines


# ------------------------------------------------------------------------------------------ dispatcher

_STOP = object()


class AlertDispatcher:
    """Rate-limits and batches anomalies into alerts and delivers them on its own daemon thread.

    - ``notify`` never blocks: it formats at most one alert per step and puts it on a queue of
      ``max_queue`` alerts; when the queue is full the alert is dropped (one warning per overflow).
    - At most one alert line per (rule, kind, name) per ``rate_limit_s`` seconds (0 disables the limit);
      suppressed anomalies are counted and mentioned in the next line for that key.
    - Every alert is logged (:class:`LogSink`, logger ``"trainmon"``, WARNING) by ``notify`` itself, at
      once, and sent to every other sink on the dispatcher's thread; a sink that raises is logged, never
      propagated.
    """

    def __init__(
        self,
        sinks: Iterable[AlertSink] = (),
        *,
        rate_limit_s: float = DEFAULT_RATE_LIMIT_S,
        max_queue: int = DEFAULT_MAX_QUEUE,
        max_lines: int = DEFAULT_MAX_LINES,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if rate_limit_s < 0:
            raise ValueError(f"rate_limit_s must be >= 0, got {rate_limit_s!r}")
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue!r}")
        if max_lines < 1:
            raise ValueError(f"max_lines must be >= 1, got {max_lines!r}")
        sinks = list(sinks)
        if not any(isinstance(s, LogSink) for s in sinks):
            sinks.insert(0, LogSink())
        self.sinks: tuple[AlertSink, ...] = tuple(sinks)
        # log lines are written by notify itself: a webhook that hangs must not hold them back, or lose them
        self._at_once = tuple(s for s in sinks if isinstance(s, LogSink))
        self._queued = tuple(s for s in sinks if not isinstance(s, LogSink))
        self.rate_limit_s = float(rate_limit_s)
        self.max_lines = int(max_lines)
        self.clock = clock
        self.dropped = 0  # alerts dropped because the queue was full
        self.suppressed = 0  # anomalies held back by the rate limit
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._lock = threading.Lock()
        # key -> [time of last alert line, step of it, suppressed since]
        self._keys: dict[tuple[str, str, str], list] = {}
        self._overflowing = False
        self._pending = 0
        self._idle = threading.Condition()
        self._closed = False
        self._retiring = False
        self._stop = threading.Event()
        self._sink_errors = _LogLimiter(60.0, clock)
        self._thread = threading.Thread(target=self._run, name="trainmon-alerts", daemon=True)
        self._thread.start()

    # -- producer side (writer thread) --------------------------------------------------------------

    def notify(self, anomalies: Sequence[Anomaly], *, run: str, rank: int, note: str = "") -> None:
        """Queue alerts for ``anomalies`` (one alert per step), ``note`` (if any) as their last line. Never
        blocks, never raises."""
        if not anomalies or self._closed:
            return
        try:
            for alert in self._build(anomalies, run, rank):
                if note:
                    alert = dataclasses.replace(alert, lines=(*alert.lines, note))
                for sink in self._at_once:
                    self._send(sink, alert)
                if self._queued:
                    self._put(alert)
        except Exception:
            logger.exception("trainmon: building alerts failed")

    def _build(self, anomalies: Sequence[Anomaly], run: str, rank: int) -> list[Alert]:
        now = self.clock()
        by_step: dict[int, list[tuple[Anomaly, str | None]]] = {}
        held_origins: dict[int, Anomaly] = {}  # per step, the origin the rate limit held back
        with self._lock:
            for a in sorted(anomalies, key=lambda a: a.order_key()):
                key = (a.rule, a.kind, a.name)
                state = self._keys.get(key)
                if state is not None and self.rate_limit_s > 0 and now - state[0] < self.rate_limit_s:
                    state[2] += 1
                    self.suppressed += 1
                    if a.origin and _in_burst(a):
                        held_origins.setdefault(a.step, a)
                    continue
                note = None
                if state is not None and state[2]:
                    note = f"and {state[2]} more since step {state[1]} at {_utc(state[0])}"
                self._keys[key] = [now, a.step, 0]
                by_step.setdefault(a.step, []).append((a, note))
            for step, origin in held_origins.items():
                # a burst line goes out (a tensor of it is new): it names the burst's origin, not the first
                # tensor the rate limit let through; that origin is not held back then
                items = by_step.get(step, [])
                if any(_in_burst(a) for a, _ in items):
                    self._keys[(origin.rule, origin.kind, origin.name)][2] -= 1
                    self.suppressed -= 1
                    items.append((origin, None))
                    items.sort(key=lambda item: item[0].order_key())
        return [self._format(step, items, run, rank) for step, items in by_step.items()]

    def _format(self, step: int, items: list[tuple[Anomaly, str | None]], run: str, rank: int) -> Alert:
        labels: list[str] = []
        for a, _ in items:
            label = _label(a.rule)
            # the burst-cap summary is no kind of anomaly
            if a.rule != SUPPRESSED_RULE and label not in labels:
                labels.append(label)
        title = f"trainmon: {', '.join(labels)} at step {step} on rank {rank} (run {run})"
        lines = _lines(step, rank, items)
        if len(lines) > self.max_lines:
            more = len(lines) - self.max_lines
            lines = [*lines[: self.max_lines], f"+{more} more alert lines at step {step} rank {rank}"]
        return Alert(title, tuple(lines), tuple(a for a, _ in items), run, rank, step)

    def _put(self, alert: Alert) -> None:
        with self._idle:
            self._pending += 1
        try:
            self._queue.put_nowait(alert)
        except queue.Full:
            with self._idle:
                self._pending -= 1
                self._idle.notify_all()
            self.dropped += 1
            if not self._overflowing:
                self._overflowing = True
                logger.warning(
                    "trainmon: alert queue full (%d); dropping alerts until the sinks catch up "
                    "(latest dropped: %s)",
                    self._queue.maxsize,
                    alert.title,
                )
            return
        if self._overflowing:
            self._overflowing = False
            logger.warning("trainmon: alert queue has room again; %d alerts dropped so far", self.dropped)

    # -- consumer side (own thread) -----------------------------------------------------------------

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            try:
                if not self._stop.is_set():
                    self._deliver(item)
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()
            if self._retiring and self._queue.empty():
                return

    def _deliver(self, alert: Alert) -> None:
        for sink in self._queued:
            self._send(sink, alert)

    def _send(self, sink: AlertSink, alert: Alert) -> None:
        try:
            sink.send(alert)
        except Exception as e:  # a misbehaving sink must not stop the others
            ok, held = self._sink_errors.check(id(sink))
            if ok:
                more = f" ({held} more failures not logged)" if held else ""
                logger.warning("trainmon: alert sink %r failed: %r%s", sink, e, more)

    def retire(self) -> None:
        """Take no more alerts, deliver those queued (each request bounded by its sink's timeout), then
        stop; never waits. For a dispatcher replaced while the run goes on (an edited ``alert`` section):
        its queued alerts are still sent, and training does not wait for a hung endpoint."""
        if self._closed:
            return
        self._closed = self._retiring = True
        # behind what is queued; when the queue is full, _run stops once it has emptied it
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(_STOP)

    @property
    def busy(self) -> bool:
        """Alerts are waiting for (or in) delivery."""
        return self._pending > 0

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued alert went through every sink; False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending <= 0, timeout)

    def close(self, timeout: float | None = 10.0) -> bool:
        """Deliver what is queued (up to ``timeout`` seconds), then stop the thread. Idempotent.

        Returns False if undelivered alerts remained (they are dropped and counted in the log)."""
        if self._closed:
            return not self._thread.is_alive()
        self._closed = True
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        done = self.flush(timeout)
        if not done:
            self._stop.set()  # skip the rest of the queue
            logger.warning(
                "trainmon: %d alerts not delivered to their sinks at close (sinks too slow; every alert was "
                "logged)",
                self._pending,
            )
        try:
            self._queue.put(_STOP, timeout=left())
        except queue.Full:
            return False
        self._thread.join(left())
        return done and not self._thread.is_alive()

    def __enter__(self) -> AlertDispatcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------- config


def dispatcher_for(
    alert: AlertConfig, *, extra_sinks: Iterable[AlertSink] = (), **kwargs: Any
) -> AlertDispatcher:
    """An :class:`AlertDispatcher` for the ``alert`` section: a :class:`WebhookSink` per webhook (URL and
    secret read from the environment where the config names variables) plus ``extra_sinks``, with the
    section's rate limit, queue and line limits; ``kwargs`` go to the dispatcher (``clock``)."""
    sinks: list[AlertSink] = []
    for hook in alert.webhooks:
        url, secret = hook.resolved()
        sinks.append(WebhookSink(url, kind=hook.kind, timeout_s=hook.timeout_s, secret=secret))
    return AlertDispatcher(
        [*sinks, *extra_sinks],
        rate_limit_s=alert.rate_limit_s,
        max_queue=alert.max_queue,
        max_lines=alert.max_lines,
        **kwargs,
    )


# -------------------------------------------------------------------------------------------- NaN action


class TrainingNaNError(RuntimeError):
    """Raised on the training thread when ``alert.on_nan: raise`` and a step produced NaN/Inf."""

    reaches_training = True  # the monitor's hook guards let it through to the training loop


class NanAction(str, Enum):
    """What the monitor does at the step boundary after a NaN/Inf step."""

    CONTINUE = "continue"
    RAISE = "raise"
    EXIT = "exit"
    SKIP = "skip"  # decided before the update (trainmon.step.boundary); nothing left to do after the step


def nan_message(
    found: Anomaly | None,
    run_dir: object,
    *,
    update_applied: bool = True,
    reason: str = "",
    step: int = -1,
    rank: int = -1,
) -> str:
    """What ``on_nan: raise/exit`` says about the step's first NaN/Inf anomaly ``found`` (None: the NaN/Inf
    was on another rank, ``reason`` says so), and whether the step's update landed."""
    if found is not None:
        count = found.stat in ("nans", "infs") and -math.inf < found.value < math.inf
        value = int(found.value) if count else found.value  # nans=32, not nans=32.0
        what = f"{found.rule} in {found.kind} {found.name} ({found.stat}={value})"
        step, rank = found.step, found.rank
    else:
        what = reason or "a NaN/Inf"
    update = (
        f"; the update of step {step} was applied"
        if update_applied
        else f"; the update of step {step} was not applied (parameters and optimizer state are as before it)"
    )
    return f"{what} at step {step} on rank {rank}{update}; anomalies in {run_dir}"


def apply_nan_action(
    action: NanAction | str, exit_code: int, message: str, before: Callable[[], None]
) -> None:
    """Carry out ``action``. Called by the monitor on the training thread at the step boundary.

    - ``continue``: nothing.
    - ``raise``: ``before()`` (flush writers and alerts), then raise :class:`TrainingNaNError`.
    - ``exit``: ``before()``, then ``sys.exit(exit_code)`` (raises SystemExit, so ``finally`` blocks and
      atexit handlers run). Only the main thread can end the process this way; on another thread
      :class:`TrainingNaNError` is raised instead.

    An exception from ``before`` is logged; the action still happens.
    """
    action = NanAction(action)
    if action in (NanAction.CONTINUE, NanAction.SKIP):
        return
    try:
        before()
    except Exception:
        logger.exception("trainmon: flushing before alert.on_nan: %s failed", action.value)
    if action is NanAction.EXIT:
        if threading.current_thread() is threading.main_thread():
            logger.error("trainmon: %s; exiting with code %d (alert.on_nan: exit)", message, exit_code)
            raise SystemExit(exit_code)
        logger.error("trainmon: alert.on_nan: exit needs the main thread; raising TrainingNaNError instead")
    raise TrainingNaNError(message)
