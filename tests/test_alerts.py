"""Alerts: their lines (each fact once, a NaN/Inf burst one line a step and rank), payload shapes,
signatures, rate limits, batching, failure handling, config, NaN action."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import socket
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.test_anomaly_e2e import XY, train
from trainmon.anomaly.alerts import (
    Alert,
    AlertDispatcher,
    CallbackSink,
    LogSink,
    NanAction,
    TrainingNaNError,
    WebhookSink,
    apply_nan_action,
    dispatcher_for,
)
from trainmon.config import ConfigError, load_config
from trainmon.run.anomaly_table import read_anomalies
from trainmon.run.records import Anomaly

pytestmark = pytest.mark.timeout(5)

T0 = 1_700_000_000.0  # 2023-11-14 22:13:20 UTC


class Clock:
    def __init__(self, t: float = T0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False


class Recorder:
    """A real HTTP server on 127.0.0.1 that records (path, json body) of each POST."""

    def __init__(self, delay: float = 0.0, reply: bytes = b"ok") -> None:
        self.requests: list[tuple[str, object]] = []
        self.delay = delay
        self.reply = reply
        self.got = threading.Event()
        rec = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                rec.requests.append((self.path, json.loads(body)))
                rec.got.set()
                if rec.delay:
                    time.sleep(rec.delay)
                try:
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(rec.reply)))
                    self.end_headers()
                    self.wfile.write(rec.reply)
                except OSError:
                    pass

            def log_message(self, *args: object) -> None:
                pass

        self.server = _Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch):
    for k in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(k, raising=False)


@pytest.fixture
def server():
    s = Recorder()
    yield s
    s.close()


def anomaly(step=120, rank=3, kind="actv", name="layers.0.mlp", stat="nans", value=4.0, rule="nan", **kw):
    return Anomaly(step=step, rank=rank, kind=kind, name=name, stat=stat, value=value, rule=rule, **kw)


L0 = "NaN at step 120 rank 3: actv layers.0.mlp (forward), 4 NaN"
L1 = "NaN at step 120 rank 3: grad_reduced w (forward), max nan"
ALERT = Alert(
    title="trainmon: NaN at step 120 on rank 3 (run exp1)",
    lines=(L0, L1),
    anomalies=(anomaly(), anomaly(kind="grad_reduced", name="w", stat="max", value=float("nan"), seq=5)),
    run="exp1",
    rank=3,
    step=120,
)


def send_one(sink: WebhookSink, server: Recorder) -> tuple[str, object]:
    sink.send(ALERT)
    assert len(server.requests) == 1
    return server.requests[0]


# ------------------------------------------------------------------------------------------ payloads


def test_generic_payload(server):
    path, body = send_one(WebhookSink(server.url), server)
    assert path == "/hook"
    a0 = {
        "step": 120,
        "rank": 3,
        "kind": "actv",
        "name": "layers.0.mlp",
        "stat": "nans",
        "value": 4.0,
        "rule": "nan",
        "seq": 0,
        "micro_step": 0,
        "vpp_stage": 0,
        "pp_stage": 0,
        "phase": "forward",
        "baseline": None,
        "origin": False,
        "propagated": False,
        "collectives": 0,
        "wall_time": 0.0,
        "dump": None,
        "message": "",
        "v": 1,
    }
    a1 = dict(a0, kind="grad_reduced", name="w", stat="max", value="nan", seq=5)
    assert body == {
        "title": "trainmon: NaN at step 120 on rank 3 (run exp1)",
        "text": f"{L0}\n{L1}",
        "run": "exp1",
        "rank": 3,
        "step": 120,
        "anomalies": [a0, a1],
    }


def test_slack_payload(server):
    _, body = send_one(WebhookSink(server.url, kind="slack"), server)
    assert body == {"text": f"*trainmon: NaN at step 120 on rank 3 (run exp1)*\n{L0}\n{L1}"}


def test_dingtalk_payload_unsigned(server):
    path, body = send_one(WebhookSink(server.url + "?access_token=abc", kind="dingtalk"), server)
    assert path == "/hook?access_token=abc"
    assert body == {
        "msgtype": "markdown",
        "markdown": {
            "title": "trainmon: NaN at step 120 on rank 3 (run exp1)",
            "text": f"### trainmon: NaN at step 120 on rank 3 (run exp1)\n\n- {L0}\n- {L1}",
        },
    }


def test_dingtalk_signature(server):
    sink = WebhookSink(server.url + "?access_token=abc", kind="dingtalk", secret="SECxyz", clock=Clock(T0))
    path, body = send_one(sink, server)
    ts = 1_700_000_000_000
    expected = base64.b64encode(
        hmac.new(b"SECxyz", f"{ts}\nSECxyz".encode(), hashlib.sha256).digest()
    ).decode()
    parsed = urllib.parse.urlsplit(path)
    q = urllib.parse.parse_qs(parsed.query)
    assert parsed.path == "/hook"
    assert q == {"access_token": ["abc"], "timestamp": [str(ts)], "sign": [expected]}
    assert path.endswith("sign=" + urllib.parse.quote_plus(expected))
    assert body["msgtype"] == "markdown"


def test_feishu_payload_unsigned(server):
    _, body = send_one(WebhookSink(server.url, kind="feishu"), server)
    assert body == {
        "msg_type": "text",
        "content": {"text": f"trainmon: NaN at step 120 on rank 3 (run exp1)\n{L0}\n{L1}"},
    }


def test_feishu_signature(server):
    sink = WebhookSink(server.url, kind="feishu", secret="s3cret", clock=Clock(T0))
    _, body = send_one(sink, server)
    expected = base64.b64encode(hmac.new(b"1700000000\ns3cret", b"", hashlib.sha256).digest()).decode()
    assert body["timestamp"] == "1700000000"
    assert body["sign"] == expected
    assert body["msg_type"] == "text"
    assert body["content"]["text"].startswith("trainmon: NaN at step 120")


def test_error_code_in_reply_is_logged(caplog):
    s = Recorder(reply=b'{"errcode": 310000, "errmsg": "sign not match"}')
    try:
        with caplog.at_level(logging.WARNING, logger="trainmon"):
            WebhookSink(s.url, kind="dingtalk").send(ALERT)
        assert "errcode=310000 sign not match" in caplog.text
    finally:
        s.close()


# ------------------------------------------------------------------------------- dispatcher behaviour


def test_batching_one_message_per_step_per_sink(server):
    got: list[Alert] = []
    d = AlertDispatcher([WebhookSink(server.url, kind="slack"), CallbackSink(got.append)], max_lines=3)
    spikes = [
        anomaly(rule="turbulence", name=f"layers.{i}.mlp", stat="norm", value=9.0, seq=10 - i,
                message=f"actv/layers.{i}.mlp norm 9 is above the bound 2")
        for i in range(5)
    ]  # fmt: skip
    d.notify([*spikes, anomaly(rule="inf", stat="infs", name="head", seq=20)], run="exp1", rank=3)
    assert d.close(3)
    assert len(server.requests) == 1 and len(got) == 1
    alert = got[0]
    assert alert.title == "trainmon: spike, Inf at step 120 on rank 3 (run exp1)"
    assert alert.step == 120 and alert.rank == 3 and alert.run == "exp1"
    assert len(alert.anomalies) == 6
    # hook order (seq) first, then at most max_lines lines and a "+M more" line
    assert alert.lines == (
        "spike at step 120 rank 3: actv layers.4.mlp (forward), norm 9 is above the bound 2",
        "spike at step 120 rank 3: actv layers.3.mlp (forward), norm 9 is above the bound 2",
        "spike at step 120 rank 3: actv layers.2.mlp (forward), norm 9 is above the bound 2",
        "+3 more alert lines at step 120 rank 3",
    )


def test_anomalies_of_two_steps_make_two_alerts():
    got: list[Alert] = []
    d = AlertDispatcher([CallbackSink(got.append)], rate_limit_s=0)
    d.notify([anomaly(step=1), anomaly(step=2, name="x")], run="r", rank=0)
    assert d.close(3)
    assert [a.step for a in got] == [1, 2]


def test_rate_limit_counts_suppressed_and_reports_them(server):
    clock = Clock()
    got: list[Alert] = []
    d = AlertDispatcher(
        [WebhookSink(server.url, kind="slack"), CallbackSink(got.append)], rate_limit_s=60, clock=clock
    )
    d.notify([anomaly(step=120)], run="exp1", rank=3)
    clock.t += 10
    d.notify([anomaly(step=121)], run="exp1", rank=3)  # same key, inside the window: suppressed
    clock.t += 10
    d.notify([anomaly(step=122)], run="exp1", rank=3)
    assert d.flush(3)
    assert len(server.requests) == 1
    assert d.suppressed == 2
    clock.t += 45  # 65 s after the first alert
    d.notify([anomaly(step=123)], run="exp1", rank=3)
    assert d.close(3)
    assert len(server.requests) == 2
    assert got[1].lines == (
        "NaN at step 123 rank 3: actv layers.0.mlp (forward), 4 NaN"
        " (and 2 more since step 120 at 22:13:20 UTC)",
    )
    assert server.requests[1][1] == {
        "text": "*trainmon: NaN at step 123 on rank 3 (run exp1)*\n" + got[1].lines[0]
    }


def test_rate_limit_is_per_rule_kind_name():
    got: list[Alert] = []
    d = AlertDispatcher([CallbackSink(got.append)], rate_limit_s=300, clock=Clock())
    d.notify([anomaly(step=1)], run="r", rank=0)
    d.notify(
        [
            anomaly(step=2),
            anomaly(step=2, rule="inf"),
            anomaly(step=2, kind="actv_grad"),
            anomaly(step=2, name="other"),
        ],
        run="r",
        rank=0,
    )
    assert d.close(3)
    assert len(got) == 2
    assert len(got[1].anomalies) == 3  # everything but the repeated (nan, actv, layers.0.mlp)


def test_every_alert_is_logged(caplog):
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        d = AlertDispatcher([])
        d.notify([anomaly()], run="exp1", rank=3)
        assert d.close(3)
    assert any(isinstance(s, LogSink) for s in d.sinks)
    assert "trainmon (run exp1): NaN at step 120 rank 3: actv layers.0.mlp (forward), 4 NaN\n" in caplog.text


def test_slow_server_does_not_block_notify(caplog):
    slow = Recorder(delay=1.5)
    try:
        with caplog.at_level(logging.WARNING, logger="trainmon"):
            d = AlertDispatcher([WebhookSink(slow.url, timeout_s=0.3)], rate_limit_s=0)
            t = time.perf_counter()
            for step in range(5):
                d.notify([anomaly(step=step)], run="r", rank=0)
            elapsed = time.perf_counter() - t
            assert elapsed < 0.05
            assert slow.got.wait(2)
            assert d.flush(4)
            d.close(1)
        assert "failed: " in caplog.text and "timed out" in caplog.text
        # failures of one sink are rate-limited: five timeouts, one log line
        assert caplog.text.count("alert to WebhookSink") == 1
    finally:
        slow.close()


def test_connection_refused_logged_not_raised(caplog):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sink = WebhookSink(f"http://127.0.0.1:{port}/hook", timeout_s=1)
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        sink.send(ALERT)  # no exception
        d = AlertDispatcher([sink])
        d.notify([anomaly()], run="r", rank=0)
        assert d.close(3)
    assert "alert to WebhookSink('http://127.0.0.1:" in caplog.text
    assert "refused" in caplog.text.lower()


def test_http_error_logged_not_raised(caplog):
    class H(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_error(500, "boom")

        def log_message(self, *args: object) -> None:
            pass

    srv = _Server(("127.0.0.1", 0), H)
    th = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    th.start()
    try:
        with caplog.at_level(logging.WARNING, logger="trainmon"):
            WebhookSink(f"http://127.0.0.1:{srv.server_address[1]}/x").send(ALERT)
        assert "HTTP 500" in caplog.text
    finally:
        srv.shutdown()
        srv.server_close()


def test_full_queue_drops_with_one_warning(caplog):
    release = threading.Event()
    started = threading.Event()

    def blocking(alert: Alert) -> None:
        started.set()
        release.wait(3)

    with caplog.at_level(logging.WARNING, logger="trainmon"):
        d = AlertDispatcher([CallbackSink(blocking)], rate_limit_s=0, max_queue=1)
        d.notify([anomaly(step=0)], run="r", rank=0)
        assert started.wait(2)  # the thread is busy with step 0
        t = time.perf_counter()
        for step in range(1, 20):
            d.notify([anomaly(step=step)], run="r", rank=0)
        assert time.perf_counter() - t < 0.05
        release.set()
        assert d.close(3)
    assert d.dropped == 18  # step 1 waits in the queue, 2..19 are dropped
    assert caplog.text.count("alert queue full") == 1


def test_callback_exception_logged(caplog):
    def bad(alert: Alert) -> None:
        raise KeyError("nope")

    got: list[Alert] = []
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        d = AlertDispatcher([CallbackSink(bad), CallbackSink(got.append)], rate_limit_s=0)
        d.notify([anomaly(step=1)], run="r", rank=0)
        d.notify([anomaly(step=2)], run="r", rank=0)
        assert d.close(3)
    assert len(got) == 2  # the failing sink does not stop the next one
    assert caplog.text.count("alert callback") == 1  # rate-limited
    assert "KeyError('nope')" in caplog.text


def test_raising_custom_sink_logged(caplog):
    class Broken:
        def send(self, alert: Alert) -> None:
            raise OSError("disk gone")

    with caplog.at_level(logging.WARNING, logger="trainmon"):
        d = AlertDispatcher([Broken()])
        d.notify([anomaly()], run="r", rank=0)
        assert d.close(3)
    assert "alert sink" in caplog.text and "disk gone" in caplog.text


def test_notify_after_close_and_empty_are_noops():
    got: list[Alert] = []
    d = AlertDispatcher([CallbackSink(got.append)])
    d.notify([], run="r", rank=0)
    assert d.close(2)
    d.notify([anomaly()], run="r", rank=0)
    assert d.close(2)
    assert got == []


# ----------------------------------------------------------------------------------------------- config


def _sinks(alert: dict) -> list:
    """The webhook sinks the monitor builds for an ``alert`` section (parsed once, by the config)."""
    d = dispatcher_for(load_config({"alert": alert}).alert)
    try:
        return [s for s in d.sinks if isinstance(s, WebhookSink)]
    finally:
        assert d.close(2)


def test_webhooks_from_the_alert_section():
    sinks = _sinks(
        {
            "webhooks": [
                {"url": "https://hooks.slack.com/services/T/B/X", "kind": "slack"},
                {
                    "url": "https://oapi.dingtalk.com/robot/send?access_token=t",
                    "kind": "dingtalk",
                    "secret": "S",
                },
                {"url": "http://127.0.0.1:9/x", "timeout_s": 2},
            ],
            "rate_limit_s": 60,
        }
    )
    assert [s.kind for s in sinks] == ["slack", "dingtalk", "generic"]
    assert sinks[1].secret == "S" and sinks[2].timeout_s == 2.0
    assert _sinks({}) == []
    # msprobe's alert block: its rule keys belong to the rules, not to delivery
    assert (
        len(
            _sinks(
                {"rules": [{"rule_name": "AnomalyNan"}], "dump": False, "webhooks": [{"url": "http://h/x"}]}
            )
        )
        == 1
    )


def test_webhook_url_and_secret_from_the_environment(monkeypatch):
    monkeypatch.setenv("TM_HOOK", "https://open.feishu.cn/open-apis/bot/v2/hook/abc")
    monkeypatch.setenv("TM_SECRET", "sss")
    hook = {"url_env": "TM_HOOK", "kind": "feishu", "secret_env": "TM_SECRET"}
    config = load_config({"alert": {"webhooks": [hook]}})
    assert config.alert.webhooks[0].to_dict() == hook  # the manifest keeps the variables' names, not tokens
    monkeypatch.setenv("TM_HOOK", "https://open.feishu.cn/open-apis/bot/v2/hook/def")  # read at build time
    (s,) = [s for s in dispatcher_for(config.alert).sinks if isinstance(s, WebhookSink)]
    assert s.url.endswith("/hook/def") and s.secret == "sss"


@pytest.mark.parametrize(
    ("alert", "message"),
    [
        ({"webhook": []}, "alert.webhook: unknown key 'webhook'; did you mean 'webhooks'?"),
        ({"webhooks": [{"url": "http://x/y", "kind": "teams"}]},
         "alert.webhooks[0].kind: unknown kind 'teams' (allowed: generic, slack, dingtalk, feishu)"),
        ({"webhooks": [{"url": "http://x/y"}, {"url": "http://x/y", "token": 1}]},
         "alert.webhooks[1].token: unknown key 'token' (allowed: kind, secret, secret_env, timeout_s, url, "
         "url_env)"),
        ({"webhooks": [{"kind": "slack"}]}, "alert.webhooks[0].url: required (or url_env)"),
        ({"webhooks": [{"url": "ftp://x/y"}]}, "alert.webhooks[0].url: must be an http:// or https:// URL"),
        ({"webhooks": [{"url": "http://x/y", "url_env": "X"}]},
         "alert.webhooks[0]: give url or url_env, not both"),
        ({"webhooks": "http://x/y"}, "alert.webhooks: expected a list"),
        ({"webhooks": [{"url": "http://x/y", "secret": "s"}]},
         "alert.webhooks[0].secret: only used by kinds dingtalk, feishu (kind is 'generic')"),
        ({"webhooks": [{"url_env": "TM_SURELY_UNSET_VAR"}]},
         "alert.webhooks[0].url_env: environment variable 'TM_SURELY_UNSET_VAR' is not set"),
        ({"webhooks": [{"url": "http://x/y", "timeout_s": 0}]},
         "alert.webhooks[0].timeout_s: must be >= 0.001"),
        ({"rate_limit_s": -1}, "alert.rate_limit_s: must be >= 0, got -1"),
        ({"max_queue": 0}, "alert.max_queue: must be >= 1, got 0"),
    ],
)  # fmt: skip
def test_webhook_errors_name_the_key(alert, message):
    with pytest.raises(ConfigError) as e:
        load_config({"alert": alert})
    assert str(e.value).startswith(message)


def test_dispatcher_for_the_alert_section():
    got: list[Alert] = []
    alert = load_config({"alert": {"rate_limit_s": 7, "max_queue": 3}}).alert
    d = dispatcher_for(alert, extra_sinks=[CallbackSink(got.append)])
    assert d.rate_limit_s == 7 and d._queue.maxsize == 3
    assert d.close(2)


# ------------------------------------------------------------------------------------------- NaN action


def test_nan_action_continue_does_nothing():
    calls = []
    apply_nan_action("continue", 3, "NaN at step 5", lambda: calls.append("before"))
    assert calls == []
    assert NanAction("continue") is NanAction.CONTINUE


def test_nan_action_raise_calls_before_then_raises():
    calls = []
    with pytest.raises(TrainingNaNError, match="NaN at step 5") as e:
        apply_nan_action(NanAction.RAISE, 3, "NaN at step 5", lambda: calls.append("before"))
    assert calls == ["before"]
    assert isinstance(e.value, RuntimeError)


def test_nan_action_raise_even_if_before_fails(caplog):
    def before() -> None:
        raise OSError("flush failed")

    with caplog.at_level(logging.ERROR, logger="trainmon"), pytest.raises(TrainingNaNError):
        apply_nan_action("raise", 3, "NaN", before)
    assert "flush failed" in caplog.text


def test_nan_action_exit_on_main_thread():
    calls = []
    assert threading.current_thread() is threading.main_thread()
    with pytest.raises(SystemExit) as e:
        apply_nan_action("exit", 7, "NaN", lambda: calls.append("before"))
    assert e.value.code == 7 and calls == ["before"]


def test_nan_action_exit_off_main_thread_raises():
    out: list[BaseException] = []

    def run() -> None:
        try:
            apply_nan_action("exit", 7, "NaN", lambda: None)
        except BaseException as e:  # record whatever it was
            out.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join(2)
    assert len(out) == 1 and isinstance(out[0], TrainingNaNError)


def test_nan_action_unknown():
    with pytest.raises(ValueError):
        apply_nan_action("explode", 1, "NaN", lambda: None)


# ------------------------------------------------------------------------------------------------ alert lines
# Each fact is said once, and a NaN/Inf burst is one line a step and rank:
# ``NaN at step 140 rank 0: actv layers.2.mlp.fc2.output (origin, forward), 32768 NaN; +50 more tensors``


def nan(name: str, seq: int, value: float = 8.0, **kw) -> Anomaly:
    return Anomaly(140, 0, "actv", name, "nans", value, "nan", seq=seq, **kw)


def alert_of(anomalies: list[Anomaly], **kw) -> Alert:
    got: list[Alert] = []
    d = AlertDispatcher([CallbackSink(got.append)], rate_limit_s=0, **kw)
    d.notify(anomalies, run="exp1", rank=0)
    assert d.close(3)
    assert len(got) == 1
    return got[0]


def test_a_burst_is_one_line_led_by_its_origin():
    burst = [
        nan("layers.2.mlp.fc2.output", 2, 32768.0, origin=True),  # mark() orders the origin first
        nan("layers.2.mlp.fc2.input", 3, 16.0),
        *(nan(f"layers.{i}.output", 8 + i) for i in range(3, 6)),
        Anomaly(140, 0, "actv", "layers.5.output", "infs", 4.0, "inf", seq=13),  # a tensor counted once
        Anomaly(140, 0, "actv_grad", "layers.5.output_grad", "nans", 8.0, "nan", seq=20, phase="backward"),
    ]
    alert = alert_of(burst)
    assert alert.lines == (
        "NaN and Inf at step 140 rank 0: actv layers.2.mlp.fc2.output (origin, forward), 32768 NaN; "
        "+5 more tensors",
    )
    assert alert.title == "trainmon: NaN, Inf at step 140 on rank 0 (run exp1)"
    assert len(alert.anomalies) == 7  # the webhook payload keeps every record


def test_burst_counts_the_capped_records_and_other_rules_keep_their_own_line():
    spike = Anomaly(
        140, 0, "scalar", "loss", "mean", 12.5, "max_ratio", seq=1,
        message="scalar/loss mean 12.5 is above 10 x its previous max 1.25",
    )  # fmt: skip
    capped = Anomaly(140, 0, "*", "*", "*", 120.0, "suppressed", seq=30, message="120 more anomalies ...")
    head = nan("layers.0.output", 5, 4.0, micro_step=1, dump="request:anomaly-step140-0")
    alert = alert_of([spike, head, nan("layers.1.output", 6, micro_step=1), capped])
    assert alert.lines == (
        "spike at step 140 rank 0: scalar loss (forward), mean 12.5 is above 10 x its previous max 1.25",
        "NaN at step 140 rank 0: actv layers.0.output (forward, micro-step 1), 4 NaN "
        "[dump: request:anomaly-step140-0]; +1 more tensor; 120 more anomalies not recorded (max_per_step)",
    )


@pytest.mark.timeout(120)  # a real training run: more than this module's 5 s
def test_a_nan_run_logs_one_alert_line_for_the_burst(tmp_path, caplog):
    run = tmp_path / "run"
    with caplog.at_level(logging.WARNING, "trainmon"):
        train(run, 4, {**XY, "alert": {"rate_limit_s": 0, "max_per_step": 1000}}, poison_step=3)
    step3 = [a for a in read_anomalies(run, 0) if a.step == 3]
    origin = next(a for a in step3 if a.origin)
    tensors = {(a.kind, a.name) for a in step3} - {(origin.kind, origin.name)}
    assert origin.name == "layers.1.mlp.fc2.output" and len(tensors) > 10
    logged = [line for r in caplog.records for line in r.getMessage().splitlines()]
    assert [line for line in logged if "at step 3 rank 0" in line] == [
        "trainmon (run run): NaN at step 3 rank 0: actv layers.1.mlp.fc2.output (origin, forward), "
        f"{int(origin.value)} NaN; +{len(tensors)} more tensors"
    ]
