"""What ``trainmon compare`` reads of a run (issue 45, "Comparisons" 4 and 16): runs that hold only grad_probe
fingerprints are compared on them without ``--source``; opening a run reads no rows (a stream still being
written: its step column, once; an old store: its records, once), and a whole comparison reads each file of
the store at most twice (its steps when opened, its rows once)."""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from pathlib import Path

import compare_runs
import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
from old_layout import old_names_line

import trainmon
from trainmon.cli import main
from trainmon.read.compare.source import open_run
from trainmon.run.layout import stats_dir, stats_names_file, stats_records_file
from trainmon.run.statstore import STAT_RECORD, step_span

pytestmark = pytest.mark.timeout(300)

# ------------------------------------------------------------------------------------------ what is opened

_OPENED: list[str] | None = None  # the files opened while a test counts (an audit hook cannot be removed)


def _audit(event: str, args: tuple) -> None:
    if _OPENED is not None and event == "open" and isinstance(args[0], (str, Path)):
        _OPENED.append(str(args[0]))


sys.addaudithook(_audit)


class _Counting:
    """Counts every file of ``root``'s statistics stores opened: through Python (streams, the old store's
    records) and as Parquet (pyarrow opens those in C++: counted at ``pq.ParquetFile``)."""

    def __init__(self, monkeypatch, *roots: Path) -> None:
        self.roots = [str(stats_dir(r)) for r in roots]
        original = pq.ParquetFile

        def parquet(source, *args, **kwargs):
            if _OPENED is not None:
                _OPENED.append(str(source))
            return original(source, *args, **kwargs)

        monkeypatch.setattr(pq, "ParquetFile", parquet)

    def __enter__(self) -> Counter:
        global _OPENED
        _OPENED = []
        self.found: Counter = Counter()
        return self.found

    def __exit__(self, *exc) -> None:
        global _OPENED
        opened, _OPENED = _OPENED, None
        self.found.update(p for p in opened or [] if any(p.startswith(root) for root in self.roots))


def _train_open(run: Path, variant: str = "base"):
    """A job that has written its steps and is still running: its store is a stream, not yet sealed."""
    net, opt = compare_runs.build(variant)
    monitor = trainmon.attach(net, opt, config=compare_runs.CONFIG, logdir=run)
    for x, y in compare_runs.batches(variant):
        opt.zero_grad()
        F.mse_loss(net(x), y).backward()
        opt.step()
    deadline = time.monotonic() + 30
    while step_span(run, 0) != (0, compare_runs.STEPS - 1):  # the writer appends off the training thread
        assert time.monotonic() < deadline, step_span(run, 0)
        time.sleep(0.05)
    return monitor


def test_opening_a_run_being_written_reads_its_stream_once_and_no_rows(tmp_path, monkeypatch, capsys):
    monitors = [_train_open(tmp_path / "a"), _train_open(tmp_path / "b", "forward")]
    try:
        streams = sorted(str(p) for p in stats_dir(tmp_path / "a").rglob("*.arrows"))
        assert streams, "the store should still be a stream while the job runs"
        with _Counting(monkeypatch, tmp_path / "a") as opened:
            run = open_run(tmp_path / "a")
        assert (run.first_step, run.last_step) == ({0: 0}, {0: compare_runs.STEPS - 1})
        assert dict(opened) == dict.fromkeys(streams, 1)
        # the whole comparison: each stream read for its steps, then for its rows, once each
        with _Counting(monkeypatch, tmp_path / "a", tmp_path / "b") as opened:
            rc = main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--no-report", "--json"])
        doc = json.loads(capsys.readouterr().out)
        assert rc == 1 and doc["first_divergence"]["name"] == "act.output"
        assert opened and max(opened.values()) == 2, opened
    finally:
        for monitor in monitors:
            monitor.close()


def test_opening_an_old_store_reads_its_records_once(tmp_path, monkeypatch):
    run = tmp_path / "old"
    stats_dir(run).mkdir(parents=True)
    stats_names_file(run, 0).write_bytes(old_names_line(0, "actv", "fc1.output"))
    records = np.zeros(5, dtype=STAT_RECORD)
    records["step"] = [3, 4, 5, 6, 7]
    stats_records_file(run, 0).write_bytes(records.tobytes())
    with _Counting(monkeypatch, run) as opened:
        found = open_run(run)
    assert (found.ranks, found.first_step, found.last_step) == ((0,), {0: 3}, {0: 7})
    assert dict(opened) == {str(stats_records_file(run, 0)): 1}


def test_a_sealed_store_is_opened_from_its_file_names(tmp_path, monkeypatch):
    compare_runs.train(tmp_path / "a")
    with _Counting(monkeypatch, tmp_path / "a") as opened:
        run = open_run(tmp_path / "a")
    assert run.last_step == {0: compare_runs.STEPS - 1} and not opened


# ------------------------------------------------------------------------------------------ the source


def _train_probe_only(run: Path, variant: str) -> None:
    net, opt = compare_runs.build(variant)
    with trainmon.attach(net, opt, logdir=run, grad_probe={"enable": True}):
        for x, y in compare_runs.batches(variant):
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(x), y).backward()
            opt.step()


def test_runs_holding_only_fingerprints_are_compared_on_them_without_source(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    _train_probe_only(a, "base")
    _train_probe_only(b, "data")
    assert stats_dir(a).is_dir() and step_span(a, 0) is None  # a store folder, without a row
    answers = []
    for extra in ([], ["--source", "gradprobe"]):
        rc = main(["compare", str(a), str(b), "--json", "--no-report", *extra])
        captured = capsys.readouterr()
        assert rc == 1, captured.err
        answers.append(json.loads(captured.out))
    assert answers[0] == answers[1]
    assert answers[0]["first_divergent_step"] == compare_runs.DATA_STEP
    assert answers[0]["ranks"][0]["params_compared"] == 6
    assert not any(p.name.startswith("compare-") for p in Path.cwd().iterdir())  # --no-report: no folder
