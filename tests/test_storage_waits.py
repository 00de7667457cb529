"""Training never waits on storage for long: another process holds the run's manifest lock (``flock``) for
the whole run. attach, every step (with ``on_nan: raise``, which waits for the writer each step) and close
take their usual time, no step is dropped, and the monitor says once that it writes without the lock. And
storage that never answers holds up close() for CLOSE_TIMEOUT_S at most."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

import trainmon
from tests.test_monitor import make_toy
from trainmon.run.layout import manifest_lock_path, manifest_path

HOLD = """
import fcntl, sys, time
f = open(sys.argv[1], "a")
fcntl.flock(f.fileno(), fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(float(sys.argv[2]))
"""


@pytest.fixture
def held_lock(tmp_path):
    """The run folder ``tmp_path / "run"``, whose manifest lock another process holds for 60 s."""
    run = tmp_path / "run"
    lock = manifest_lock_path(run)
    lock.parent.mkdir(parents=True)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(lock), "60"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        yield run
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.timeout(60)
def test_a_held_manifest_lock_costs_one_short_wait_and_one_warning(held_lock, caplog):
    run = held_lock
    model, optimizer = make_toy()
    config = {"wg_distribution": True, "format": ["csv"], "alert": {"on_nan": "raise"}}
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        start = time.monotonic()
        mon = trainmon.attach(model, optimizer, config=config, logdir=run)
        attach_s = time.monotonic() - start
        start = time.monotonic()
        for _ in range(80):
            loss = F.mse_loss(model(torch.randn(4, 4)), torch.randn(4, 2))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        steps_s = time.monotonic() - start
        start = time.monotonic()
        mon.close()
        close_s = time.monotonic() - start
    # bounds with room for a loaded machine: the lock alone would cost 60 s each
    assert attach_s < 5.0, attach_s
    assert steps_s < 20.0, steps_s
    assert close_s < 5.0, close_s
    assert mon.writer.dropped == 0
    assert set(pd.read_csv(run / "rank_0" / "grad_reduced.csv")["step"]) == set(range(80))
    said = [r.getMessage() for r in caplog.records if "held by another process" in r.getMessage()]
    assert len(said) == 1 and str(manifest_lock_path(run)) in said[0]
    # written without the lock: whole, with the names and the end of the run
    manifest = json.loads(manifest_path(run).read_text())
    assert set(manifest["names"]["grad_reduced"]) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    assert manifest["last_step"] == 79


@pytest.mark.timeout(60)
def test_close_gives_up_on_storage_that_never_answers(tmp_path, monkeypatch, caplog):
    """The rank's CSV file is a FIFO nobody writes: opening it blocks the writer for good (as a hung network
    file system would). close() returns after CLOSE_TIMEOUT_S and says steps may be missing. Then the storage
    answers again, so that the writer (a process) does not outlive the test."""
    import trainmon.writer.lifecycle as lifecycle

    monkeypatch.setattr(lifecycle, "CLOSE_TIMEOUT_S", 1.0)
    run = tmp_path / "run"
    (run / "rank_0").mkdir(parents=True)
    fifo = run / "rank_0" / "grad_reduced.csv"
    os.mkfifo(fifo)
    model, optimizer = make_toy()
    mon = trainmon.attach(model, optimizer, config={"wg_distribution": True, "format": ["csv"]}, logdir=run)
    for _ in range(3):
        loss = F.mse_loss(model(torch.randn(4, 4)), torch.randn(4, 2))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    closer = threading.Thread(target=mon.close, daemon=True)
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        start = time.monotonic()
        closer.start()
        closer.join(5.0)
        returned = not closer.is_alive()
        elapsed = time.monotonic() - start
    try:
        assert returned and elapsed < 3.0, elapsed
        assert "did not finish within 1s" in caplog.text
    finally:  # a writer comes and goes (the blocked open returns) and the FIFO is replaced by a plain file
        released = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        fifo.unlink()
        os.close(released)
        closer.join(10)
