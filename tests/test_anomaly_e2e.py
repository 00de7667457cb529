"""The anomaly pipeline inside a real monitored training run: rules, origin, records, analyze, alerts,
and the action on NaN."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

import trainmon
from trainmon.anomaly.alerts import TrainingNaNError
from trainmon.cli import main
from trainmon.demo import DemoSetup, build, learning_rate, lm_loss, synthetic_batch
from trainmon.run.anomaly_table import read_anomalies
from trainmon.run.statstore import read_stats

XY = {"xy_distribution": True, "all_xy": True, "wg_distribution": True}


def train(
    run_dir, steps: int, config: dict, poison_step: int | None = None, setup=None, **attach
) -> list[float]:
    setup = setup or DemoSetup()
    model, optimizer = build(setup)
    generator = torch.Generator().manual_seed(0)
    losses = []
    with trainmon.attach(model, optimizer, config=config, logdir=run_dir, **attach) as mon:
        for step in range(steps):
            if step == poison_step:
                with torch.no_grad():
                    model.layers[1].mlp.fc2.weight[0, 0] = float("nan")
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(setup, step)
            loss = lm_loss(model, synthetic_batch(setup, generator))
            mon.track("loss", loss)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    return losses


def test_nan_is_recorded_with_its_origin_and_analyze_names_it(tmp_path, capsys):
    run = tmp_path / "run"
    train(run, 5, XY, poison_step=3)
    anomalies = list(read_anomalies(run, 0))
    assert anomalies and {a.step for a in anomalies} == {3, 4}
    origins = {(a.step, a.kind, a.name, a.rule) for a in anomalies if a.origin}
    assert (3, "actv", "layers.1.mlp.fc2.output", "nan") in origins
    downstream = ("layers.1", "layers.2", "layers.3", "final_norm", "output")
    assert all(a.kind != "actv" or a.name.startswith(downstream) for a in anomalies if a.step == 3)
    # a NaN that spreads to every module is bounded per step: the first K plus one summary line
    assert sum(1 for a in anomalies if a.step == 3) <= 51

    assert main(["analyze", str(run), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["first"]["step"], report["first"]["name"], report["first"]["origin"]) == (
        3,
        "layers.1.mlp.fc2.output",
        True,
    )


def test_loss_spike_is_caught_by_a_max_ratio_rule(tmp_path):
    run = tmp_path / "run"
    setup = DemoSetup(spike_step=12, spike_lr_factor=300.0)  # a spike above the loss of step 0
    spike_rule = {"rule": "max_ratio", "kinds": ["scalar"], "threshold": 1.5}
    config = {"alert": {"rules": [{"rule": "nan"}, spike_rule]}}
    losses = train(run, 16, config, setup=setup)
    spikes = [a for a in read_anomalies(run, 0) if a.rule == "max_ratio"]
    assert spikes and spikes[0].step == 13 and spikes[0].name == "loss"
    assert spikes[0].value == pytest.approx(losses[13], rel=1e-6)


def test_on_nan_raise_stops_training_with_a_clear_error_after_writing(tmp_path):
    run = tmp_path / "run"
    with pytest.raises(TrainingNaNError, match=r"at step 3 on rank 0"):
        train(run, 6, {**XY, "alert": {"on_nan": "raise"}}, poison_step=3)
    assert {a.step for a in read_anomalies(run, 0)} == {3}
    # written before the raise: every step up to the NaN step (the statistics store: no CSV by default)
    frame = read_stats(run, 0, ("nans",), kinds=["actv"])
    assert frame.steps.tolist() == [0, 1, 2, 3] and (frame.values["nans"][3] > 0).any()


class _Recorder(BaseHTTPRequestHandler):
    bodies: list = []

    def do_POST(self):  # noqa: N802 - the http.server API
        length = int(self.headers["Content-Length"])
        type(self).bodies.append(json.loads(self.rfile.read(length)))
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args):
        pass


@pytest.mark.timeout(60)
def test_nan_alert_reaches_a_webhook(tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/hook"
        train(tmp_path / "run", 4, {**XY, "alert": {"webhooks": [{"url": url}]}}, poison_step=2)
    finally:
        server.shutdown()
    assert _Recorder.bodies, "no alert was posted"
    first = _Recorder.bodies[0]
    assert first["step"] == 2 and first["rank"] == 0 and "step 2" in first["title"]
    assert any(a["name"] == "layers.1.mlp.fc2.output" and a["origin"] for a in first["anomalies"])


class _NaNGrad(torch.autograd.Function):
    """Identity forward; its backward returns NaN while ``enabled`` (a fault born in a gradient)."""

    enabled = False

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan") if _NaNGrad.enabled else grad


class GradPoison(torch.nn.Module):
    def forward(self, x):
        return _NaNGrad.apply(x)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(4, 8)
        self.poison = GradPoison()
        self.out = torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.out(torch.tanh(self.poison(self.inp(x))))


def test_nan_born_in_a_backward_gradient_is_located_in_backward(tmp_path, capsys):
    torch.manual_seed(0)
    net = Net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    run = tmp_path / "run"
    with trainmon.attach(net, optimizer, config=XY, logdir=run):
        for step in range(4):
            _NaNGrad.enabled = step == 2
            loss = torch.nn.functional.mse_loss(net(torch.randn(3, 4)), torch.zeros(3, 2))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    _NaNGrad.enabled = False
    assert main(["analyze", str(run), "--json"]) == 0
    first = json.loads(capsys.readouterr().out)["first"]
    assert (first["step"], first["phase"], first["kind"], first["name"], first["origin"]) == (
        2,
        "backward",
        "actv_grad",
        "poison.input_grad",
        True,
    )


EXIT_SCRIPT = """
import sys, torch, trainmon
from trainmon.demo import DemoSetup, build, lm_loss, synthetic_batch
setup = DemoSetup(); model, optimizer = build(setup); g = torch.Generator().manual_seed(0)
mon = trainmon.attach(model, optimizer, logdir=sys.argv[1], xy_distribution=True, all_xy=True,
                      alert={"on_nan": "exit", "exit_code": 7})
for step in range(10):
    if step == 3:
        with torch.no_grad():
            model.layers[1].mlp.fc2.weight[0, 0] = float("nan")
    loss = lm_loss(model, synthetic_batch(setup, g))
    optimizer.zero_grad(); loss.backward(); optimizer.step()
    print("finished step", step, flush=True)
"""


@pytest.mark.timeout(120)
def test_on_nan_exit_ends_the_process_with_the_configured_code_after_writing(tmp_path):
    import subprocess
    import sys

    run = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-c", EXIT_SCRIPT, str(run)], capture_output=True, text=True, timeout=100
    )
    assert proc.returncode == 7, proc.stderr[-2000:]
    assert "finished step 2" in proc.stdout and "finished step 3" not in proc.stdout
    assert "exiting with code 7" in proc.stderr
    assert {a.step for a in read_anomalies(run, 0)} == {3}


class _Hanging(BaseHTTPRequestHandler):
    release = threading.Event()
    received = threading.Event()

    def do_POST(self):  # noqa: N802 - the http.server API
        type(self).received.set()
        type(self).release.wait(30)  # an endpoint that does not answer while training runs
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.mark.timeout(60)
def test_a_hanging_webhook_does_not_hold_up_training(tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hanging)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/hook"
    try:
        config = {**XY, "alert": {"webhooks": [{"url": url, "timeout_s": 20}], "rate_limit_s": 0}}
        train(tmp_path / "run", 8, config, poison_step=2)
        # training finished all 8 steps while the endpoint still held the first alert's request open
        assert _Hanging.received.is_set() and not _Hanging.release.is_set()
    finally:
        _Hanging.release.set()
        server.shutdown()


def test_python_callback_receives_the_alert(tmp_path):
    received = []
    train(tmp_path / "run", 4, XY, poison_step=2, on_alert=received.append)
    assert received and isinstance(received[0], trainmon.Alert)
    assert received[0].step == 2 and "NaN at step 2" in received[0].title
    assert any(a.origin and a.name == "layers.1.mlp.fc2.output" for a in received[0].anomalies)
