"""Config edits that land while something else is wrong: the run folder cannot take new files, a NaN on the
very step the edit lands, a webhook that hangs. A failed edit never turns the monitor off, an edit never
hides a NaN from ``on_nan``, and an edit never makes training wait for a webhook or drops its alerts."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import trainmon
import trainmon.config.watch as watch
from tests.test_monitor import make_toy
from trainmon.anomaly.alerts import TrainingNaNError
from trainmon.config.watch import SETTLE_S

BASE = {"wg_distribution": True, "format": ["csv"], "alert": {"on_nan": "raise"}}


def write_config(path, config: dict) -> None:
    aside = path.with_suffix(".tmp")
    aside.write_text(json.dumps(config))
    os.replace(aside, path)


def step(model, optimizer, nan: bool = False) -> None:
    loss = F.mse_loss(model(torch.randn(4, 4)), torch.randn(4, 2))
    if nan:
        loss = loss * float("nan")
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def csv_steps(path) -> set[int]:
    return set(pd.read_csv(path)["step"])


@pytest.fixture
def read_only(tmp_path):
    """``make(folder)``: no new file can be created in ``folder`` from now on (a read-only bind mount over
    it; files open already stay writable, as on a disk that filled up). Unmounted at teardown."""
    probe = tmp_path / "probe"
    probe.mkdir()
    tried = subprocess.run(["mount", "--bind", probe, probe], capture_output=True, text=True)
    if tried.returncode != 0:
        pytest.skip(f"a read-only bind mount needs mount permission here: {tried.stderr.strip()}")
    subprocess.run(["umount", probe], check=True)
    mounted = []

    def make(folder) -> None:
        subprocess.run(["mount", "--bind", folder, folder], check=True)
        mounted.append(folder)
        for _ in range(20):  # "mount point is busy" while another test's mount call runs: try again
            if (
                subprocess.run(["mount", "-o", "remount,ro,bind", folder], capture_output=True).returncode
                == 0
            ):
                return
            time.sleep(0.1)
        raise AssertionError(f"{folder} could not be made read-only")

    yield make
    for folder in reversed(mounted):
        if subprocess.run(["umount", folder], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", folder], check=True)  # detached once nothing uses it


def test_an_edit_whose_outputs_cannot_be_opened_keeps_the_previous_ones(tmp_path, caplog, read_only):
    """Point 4: the run folder is read-only when an edit asking for a new output (TensorBoard) lands: the
    monitor goes on writing its CSV with the previous config, says so once, and a NaN at step 35 still
    raises (on_nan: raise)."""
    config, run = tmp_path / "mon.json", tmp_path / "run"
    write_config(config, BASE)
    model, optimizer = make_toy()
    mon = trainmon.attach(model, optimizer, config=str(config), logdir=run)
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        for _ in range(5):
            step(model, optimizer)
        read_only(run)
        write_config(config, {**BASE, "format": ["csv", "tensorboard"]})
        for i in range(5, 35):
            step(model, optimizer)
            if i == 6:
                time.sleep(SETTLE_S * 1.5)  # the edit lands at the end of step 7 at the latest
        with pytest.raises(TrainingNaNError, match="at step 35"):
            step(model, optimizer, nan=True)
        mon.close()
    assert "reloaded" in caplog.text  # the edit did land
    cannot = [r for r in caplog.records if "cannot be opened" in r.getMessage()]
    assert len(cannot) == 1 and "writing on with the previous ones (format csv" in cannot[0].getMessage()
    assert csv_steps(run / "rank_0" / "grad_reduced.csv") == set(range(36))
    # the folder is read-only: the NaN's records wait in memory (a table's file is opened at its first
    # record), and the alert said so
    assert any("kept in memory" in r.getMessage() for r in caplog.records)
    assert not list((run / "rank_0").glob("events.out.tfevents.*"))


EDITS = {
    "format": {"format": ["csv", "tensorboard"]},
    "ops": {"ops": ["min", "max", "norm"]},
    "ndigits": {"ndigits": 6},
    "alert": {"alert": {"on_nan": "raise", "rate_limit_s": 1}},
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_on_nan_raise_holds_on_the_step_an_edit_lands(tmp_path, monkeypatch, edit):
    """Point 5: the NaN of the step at whose end an edit of format/ops/ndigits/alert is applied raises, at
    that step (the edit is read at the first look here, so it lands at the end of the step after it)."""
    monkeypatch.setattr(watch, "SETTLE_S", 0.0, raising=False)
    config, run = tmp_path / "mon.json", tmp_path / "run"
    write_config(config, BASE)
    model, optimizer = make_toy()
    with trainmon.attach(model, optimizer, config=str(config), logdir=run) as mon:
        for _ in range(3):
            step(model, optimizer)
        write_config(config, {**BASE, **EDITS[edit]})
        with pytest.raises(TrainingNaNError, match="at step 3"):
            step(model, optimizer, nan=True)
        assert mon.config != trainmon.load_config(BASE)  # the edit landed at that step too


# ------------------------------------------------------------------------------------------ webhooks


class HangingWebhook:
    """A real HTTP server on 127.0.0.1 that records each alert's step and holds every reply until
    ``release()``."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.released = threading.Event()
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                hook.steps.append(body["step"])
                hook.released.wait(30)
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        ).start()

    def release(self) -> None:
        self.released.set()

    def close(self) -> None:
        self.release()
        self.server.shutdown()
        self.server.server_close()


class Poison(nn.Module):
    """Identity, or one NaN in its output when ``armed``."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.armed:
            return x
        mask = torch.zeros_like(x, dtype=torch.bool)
        mask[:, 0] = True
        return x.masked_fill(mask, float("nan"))


class Toy(nn.Module):
    """An alert at each step whose ``poison`` is armed, while gradients and weights stay finite (the NaN is
    masked right after the module that shows it)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)
        self.poison = Poison()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nan_to_num(self.poison(self.fc(x)), nan=0.0)


def test_a_reload_while_a_webhook_hangs_neither_stalls_training_nor_drops_alerts(
    tmp_path, monkeypatch, caplog
):
    """Point 7: three alerts wait behind a hung webhook when an edit of the alert section lands: no step
    waits for the webhook, and once the endpoint answers every alert reaches it."""
    for key in ("http_proxy", "HTTP_PROXY", "no_proxy", "NO_PROXY"):
        monkeypatch.delenv(key, raising=False)
    hook = HangingWebhook()
    try:
        alert = {"webhooks": [{"url": hook.url, "timeout_s": 20}], "rate_limit_s": 0}
        base = {"xy_distribution": True, "format": ["csv"], "alert": alert}
        config, run = tmp_path / "mon.json", tmp_path / "run"
        write_config(config, base)
        torch.manual_seed(0)
        model = Toy()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        times = []
        with (
            caplog.at_level(logging.WARNING, "trainmon"),
            trainmon.attach(model, optimizer, config=str(config), logdir=run),
        ):
            for i in range(12):
                model.poison.armed = i in (1, 2, 3, 9)
                if i == 4:  # three alerts are queued or on the wire by now
                    write_config(config, {**base, "alert": {**alert, "max_lines": 5}})
                start = time.perf_counter()
                loss = model(torch.randn(4, 4)).square().mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                times.append(time.perf_counter() - start)
                if i == 5:
                    time.sleep(SETTLE_S * 1.5)  # the edit lands by the end of step 6
            assert max(times) < 2.0, times  # the old code stalled one step for 3 s
            assert "reloaded" in caplog.text
            hook.release()
        deadline = time.monotonic() + 10
        while sorted(set(hook.steps)) != [1, 2, 3, 9] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sorted(hook.steps) == [1, 2, 3, 9]
    finally:
        hook.close()
