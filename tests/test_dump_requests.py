"""Dump requests that would never be served are said so (issue 21, point 13): a folder that is not a run is
an error (exit 2) naming the run meant; a name no tensor has, or a rank the run does not have, is a warning
naming the closest names. The job's poller serves a request once, even from a replaced request file, and
skips an over-long line instead of reading it again at every step. Dump files are 0644 like every output."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

import trainmon
from trainmon.cli import main
from trainmon.run.dumps import DumpRequest, append_request, json_line, list_dumps
from trainmon.run.layout import requests_file
from trainmon.writer import dumps as writer_dumps
from trainmon.writer.dumps import RequestPoller

XY = {"xy_distribution": True, "wg_distribution": True}


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _train(run: Path, steps: int, request: DumpRequest | None = None) -> None:
    torch.manual_seed(0)
    model = Tiny()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with trainmon.attach(model, optimizer, config=XY, logdir=run):
        for step in range(steps):
            if step == 1 and request is not None:
                append_request(run, request)
            loss = model(torch.randn(4, 8)).square().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("runs") / "run"
    _train(run, 2)
    return run


def _request(capsys, folder: Path, *args: str) -> tuple[int, str]:
    code = main(["dump", "request", str(folder), *args])
    return code, capsys.readouterr().err


def test_a_folder_that_is_not_a_run_is_an_error_naming_the_run_meant(run, tmp_path, capsys):
    code, err = _request(capsys, run / "rank_0", "--name", "fc1.*")
    assert code == 2
    assert err == (f"trainmon dump: error: {run / 'rank_0'} is the folder of rank 0 in the run {run}: pass "
                   f"{run} (with --rank 0 for this rank only)\n")  # fmt: skip
    code, err = _request(capsys, run.parent, "--name", "fc1.*")
    assert code == 2 and f"{run.parent} holds runs but is none itself: pass one of {run}\n" in err
    code, err = _request(capsys, tmp_path, "--name", "fc1.*")
    assert code == 2 and f"{tmp_path} is not a trainmon run: it has no plugins/trainmon/ folder" in err
    for folder in (run / "rank_0", run.parent, tmp_path):
        assert not requests_file(folder).exists()
    code, err = _request(capsys, run, "--name", "fc1.*", "--kind", "actv")  # the run itself: it can serve it
    assert code == 0 and err.count("warning") == 1 and "has ended" in err


@pytest.mark.parametrize(
    "args, warning",
    [
        (["--name", "fc1"], "no tensor of {run} is named like 'fc1' (--name is a glob matched against whole "
         "names); did you mean 'fc1.*'? The request is kept, and served only if such a tensor appears."),
        (["--name", "fc3.weight"], "no tensor of {run} is named like 'fc3.weight' (--name is a glob matched "
         "against whole names); closest names: 'fc2.weight', 'fc1.weight', 'fc2.input', 'fc1.input', "
         "'fc2.bias'. The request is kept"),
        (["--name", "fc2.*", "--kind", "exp_avg"], "--kind exp_avg: the run records no exp_avg tensors (its "
         "kinds: actv, actv_grad, grad_unreduced"),
        (["--name", "fc1.*", "--rank", "3"], "--rank 3: the run has 1 rank (0..0), so no rank will serve "
         "this request"),
    ],
)  # fmt: skip
def test_a_request_nothing_will_serve_is_kept_with_a_warning(run, capsys, args, warning):
    code, err = _request(capsys, run, *args)
    assert code == 0
    assert f"trainmon dump: warning: {warning.format(run=run)}" in err


def test_a_replaced_request_file_serves_no_request_twice(tmp_path):
    first, second = DumpRequest.new("fc1.*"), DumpRequest.new("fc2.*")
    append_request(tmp_path, first)
    poller = RequestPoller(tmp_path)
    assert poller.poll() == [first]
    path = requests_file(tmp_path)
    replacement = path.with_name("new.jsonl")
    replacement.write_bytes(json_line(first.to_dict()) + json_line(second.to_dict()))
    os.replace(replacement, path)  # an editor, or a copy put back
    assert poller.poll() == [second]
    assert poller.poll() == []


def test_an_over_long_line_is_skipped_once_not_read_at_every_poll(tmp_path, monkeypatch, caplog):
    request = DumpRequest.new("fc1.*")
    path = requests_file(tmp_path)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"x" * (50 << 20))  # 50 MB and no newline
    read: list[int] = []
    real_open = open

    def counting_open(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        real_read = f.read

        def read_counted(n=-1):
            data = real_read(n)
            read.append(len(data))
            return data

        f.read = read_counted
        return f

    monkeypatch.setattr(writer_dumps, "open", counting_open, raising=False)
    poller = RequestPoller(tmp_path)
    for _ in range(80):  # 80 steps: each byte of the line is read once, a bounded piece a step
        assert poller.poll() == []
    assert max(read) <= 1 << 20 and sum(read) == 50 << 20  # not 80 x 50 MB
    with open(path, "ab") as f:
        f.write(b"\n" + json_line(request.to_dict()))
    assert poller.poll() == [request]  # what follows the over-long line is served
    said = [r.getMessage() for r in caplog.records if "without a newline" in r.getMessage()]
    assert len(said) == 1 and "is no request; skipped" in said[0]


def test_dump_files_are_0644_like_every_other_output(tmp_path):
    old = os.umask(0o022)
    try:
        run = tmp_path / "run"
        _train(run, 4, DumpRequest.new("fc1.*", step=2))
    finally:
        os.umask(old)
    dumps = list_dumps(run)
    assert dumps
    modes = {stat.S_IMODE((run / d.path).stat().st_mode) for d in dumps}
    events = next((run / "rank_0").glob("events.out.tfevents.*"))  # an output every run writes
    assert modes == {0o644} == {stat.S_IMODE(events.stat().st_mode)}
