"""Captured calls judged on the far side of a loopback socket (issue 52): the same verdicts as in-process;
a wrong key, garbage and authenticated nonsense are refused (counted, one log line each) while the server
goes on serving; a benchmark side that is not there costs the training nothing but a count and one line."""

from __future__ import annotations

import os
import socket
import time

from tests.test_precheck_capture import faulty_bf16_gelu, make, step  # noqa: F401 - the fixture
from trainmon.precheck.judge import Status
from trainmon.precheck.rerun import judge_call
from trainmon.precheck.transport import BenchmarkServer, Sender

KEY = os.urandom(32)


def wait_for(condition, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_verdicts_over_the_socket_equal_the_in_process_ones(faulty_bf16_gelu):  # noqa: F811
    model, tokens = make()
    _, captured = step(model, tokens, capture=True)
    expected = [(j.name, j.output, j.status) for call in captured.calls for j in judge_call(call)]
    server = BenchmarkServer(KEY)
    port = server.start()
    sender = Sender("127.0.0.1", port, KEY)
    for call in captured.calls:
        sender.offer(call)
    sender.close()
    wait_for(lambda: len(server.results) == len(expected))
    server.stop()
    assert sorted((j.name, j.output, j.status) for j in server.results) == sorted(expected)
    assert {j.name for j in server.results if j.status is Status.ERROR} == {
        "torch.nn.functional.gelu.0.forward",
        "torch.nn.functional.gelu.1.forward",
    }
    assert (sender.sent, sender.dropped, sender.not_checked, server.refused) == (len(captured.calls), 0, 0, 0)


def test_bad_peers_are_refused_and_the_server_goes_on(caplog):
    model, tokens = make()
    _, captured = step(model, tokens, capture=True)
    call = next(c for c in captured.calls if c.outputs[0].dtype.is_floating_point)  # one judged output
    server = BenchmarkServer(KEY)
    port = server.start()
    with socket.create_connection(("127.0.0.1", port)) as garbage:
        garbage.sendall(os.urandom(4096))
    intruder = Sender("127.0.0.1", port, b"not the key")
    intruder.offer(call)
    intruder.close()
    wait_for(lambda: server.refused == 2)
    sender = Sender("127.0.0.1", port, KEY)
    sender.offer(call)
    sender.close()
    wait_for(lambda: len(server.results) == 1)
    server.stop()
    refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refusals) == 2 and any("not authenticated" in m for m in refusals)


def test_no_benchmark_side_costs_a_count_and_one_line(caplog):
    model, tokens = make()
    _, captured = step(model, tokens, capture=True)
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sender = Sender("127.0.0.1", port, KEY, timeout=1.0)
    start = time.monotonic()
    for call in captured.calls:
        sender.offer(call)
    assert time.monotonic() - start < 0.5  # offering never waits for the network
    sender.close()
    assert sender.not_checked == len(captured.calls) and sender.sent == 0
    gone = [r for r in caplog.records if "benchmark side is gone" in r.getMessage()]
    assert len(gone) == 1
