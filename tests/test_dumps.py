"""Tensor dumps: requests, the writer, the index, loading, and the ``trainmon dump`` CLI (``dump request`` on
a run that has ended, or for a step that has passed, warns and says what will happen; the manifest records
when rank 0's monitor closed)."""

from __future__ import annotations

import json
import logging
import os
import re
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import trainmon.cli.dump as cli_dump
import trainmon.run.dumps as dumps
from trainmon.cli import main
from trainmon.read.dump_contents import load_dump
from trainmon.read.runstate import run_state
from trainmon.run import records
from trainmon.run.dumps import DumpEntry, DumpError, DumpRequest, append_request, dump_file_name, list_dumps
from trainmon.run.layout import plugin_dir, requests_file
from trainmon.run.manifest import read_manifest
from trainmon.run.records import Row, StepRecord
from trainmon.writer.csv import CsvSink
from trainmon.writer.dumps import DumpWriter, RequestPoller
from trainmon.writer.manifest import ManifestSink
from trainmon.writer.statstore import StatStoreSink

NAN = float("nan")


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor, for bit-for-bit comparisons (NaN payloads, -0.0)."""
    return t.contiguous().view(torch.uint8) if t.element_size() > 0 else t


# ------------------------------------------------------------------------------------------------ requests


def test_request_append_and_incremental_poll(tmp_path: Path) -> None:
    poller = RequestPoller(tmp_path)
    assert poller.poll() == []  # no file yet

    r1 = DumpRequest(name="layers.3.*", step=7, rank=0, kind="actv", id="a1", created=1.5)
    r2 = DumpRequest(name="*", step=None, rank=None, kind=None, id="a2", created=2.0)
    append_request(tmp_path, r1)
    assert poller.poll() == [r1]
    assert poller.poll() == []  # nothing new

    append_request(tmp_path, r2)
    line3 = json.dumps(DumpRequest(name="x.*", id="a3", created=3.0).to_dict()) + "\n"
    path = requests_file(tmp_path)
    with open(path, "ab") as f:  # a writer caught mid-line
        f.write(line3[:10].encode())
    assert poller.poll() == [r2]  # the partial line is left for later
    assert poller.poll() == []
    with open(path, "ab") as f:
        f.write(line3[10:].encode())
    assert poller.poll() == [DumpRequest(name="x.*", step=None, rank=None, kind=None, id="a3", created=3.0)]

    # a fresh poller sees everything; the file is strict JSON Lines
    assert [r.id for r in RequestPoller(tmp_path).poll()] == ["a1", "a2", "a3"]
    assert [json.loads(s)["id"] for s in path.read_text().splitlines()] == ["a1", "a2", "a3"]


def test_request_new_and_matches(tmp_path: Path) -> None:
    a, b = DumpRequest.new("layers.3.*", kind="actv"), DumpRequest.new("layers.3.*")
    assert a.id != b.id and len(a.id) == 32 and a.created > 0
    assert a.matches(5, 1, "actv", "layers.3.mlp")
    assert not a.matches(5, 1, "grad_reduced", "layers.3.mlp")
    assert not a.matches(5, 1, "actv", "layers.4.mlp")
    r = DumpRequest(name="*", step=2, rank=1, id="x")
    assert r.matches(2, 1, "comm", "a")
    assert not r.matches(3, 1, "comm", "a") and not r.matches(2, 0, "comm", "a")
    for blank in ("", " "):  # matches no tensor: no job would ever serve it
        with pytest.raises(ValueError, match="must not be empty"):
            DumpRequest.new(blank)


def test_poller_skips_malformed_lines(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = requests_file(tmp_path)
    path.parent.mkdir(parents=True)
    good = DumpRequest(name="a", id="ok", created=1.0)
    path.write_text('{"name": 3}\nnot json\n' + json.dumps(good.to_dict()) + "\n")
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        assert RequestPoller(tmp_path).poll() == [good]
    assert sum("malformed dump request" in r.getMessage() for r in caplog.records) == 2


# --------------------------------------------------------------------------------------------------- writer


@pytest.mark.parametrize(
    "tensor",
    [
        torch.tensor([[1.5, -0.0, NAN], [float("inf"), 3.25e-20, -7.0]], dtype=torch.float32),
        torch.tensor([1.0, -2.5, NAN, 65280.0], dtype=torch.bfloat16),
        torch.tensor([-(2**62), 0, 2**62 + 3], dtype=torch.int64),
    ],
    ids=["fp32", "bf16", "int64"],
)
def test_writer_roundtrip_bit_exact(tmp_path: Path, tensor: torch.Tensor) -> None:
    w = DumpWriter(tmp_path, rank=3)
    entry = w.write(12, 1, "actv", "layers.3.mlp/out", tensor, "nan")
    w.close()
    assert entry is not None
    dtype = str(tensor.dtype).removeprefix("torch.")
    assert entry.path == "plugins/trainmon/dumps/step_12/rank_3/actv__layers.3.mlp_out__m1.safetensors"
    assert entry.bytes == (tmp_path / entry.path).stat().st_size
    assert (entry.shape, entry.dtype, entry.step, entry.rank, entry.kind, entry.name, entry.micro_step,
            entry.reason) == (tuple(tensor.shape), dtype, 12, 3, "actv", "layers.3.mlp/out", 1, "nan")

    loaded, meta = load_dump(tmp_path / entry.path)
    assert loaded.dtype == tensor.dtype and loaded.shape == tensor.shape
    assert torch.equal(_bits(loaded), _bits(tensor))
    assert meta == {
        "step": "12", "rank": "3", "name": "layers.3.mlp/out", "kind": "actv", "micro_step": "1",
        "reason": "nan", "dtype": dtype, "shape": json.dumps(list(tensor.shape)),
    }
    assert list_dumps(tmp_path) == [entry]
    assert not [p for p in (tmp_path / entry.path).parent.iterdir() if p.name.endswith(".tmp")]


def test_writer_non_contiguous_and_views(tmp_path: Path) -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    view = base.t()[1:4]  # non-contiguous, offset into a larger storage
    w = DumpWriter(tmp_path, rank=0)
    entry = w.write(0, 0, "param_origin", "w", view, "request abc")
    assert entry is not None and entry.shape == (3, 4)
    loaded, _ = load_dump(tmp_path / entry.path)
    assert torch.equal(loaded, view)


def test_writer_same_tensor_twice_keeps_both(tmp_path: Path) -> None:
    w = DumpWriter(tmp_path, rank=0)
    a = w.write(1, 0, "actv", "a/b", torch.zeros(2), "r1")
    b = w.write(1, 0, "actv", "a_b", torch.ones(2), "r2")  # sanitised to the same file name
    assert a is not None and b is not None
    assert a.path.endswith("actv__a_b__m0.safetensors") and b.path.endswith("actv__a_b__m0__1.safetensors")
    assert torch.equal(load_dump(tmp_path / b.path)[0], torch.ones(2))


def test_dump_file_name_sanitises() -> None:
    assert dump_file_name("actv", "model.layers.0/attn:q", 2) == "actv__model.layers.0_attn_q__m2.safetensors"
    long = dump_file_name("grad_reduced", "x" * 300, 0)
    assert len(long) < 200 and long.startswith("grad_reduced__" + "x" * 120 + "-")
    assert ".." not in dump_file_name("actv", "../../etc", 0).removesuffix(".safetensors").strip("_")


def test_caps_per_step_and_per_run(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    t = torch.zeros(25)  # 100 data bytes
    w = DumpWriter(tmp_path, rank=0, max_bytes_per_step=250, max_bytes_per_run=500)
    written = []
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        for step in range(4):
            for i in range(3):
                e = w.write(step, 0, "actv", f"t{i}", t, "test")
                written.append((step, i, e is not None))
    kept = [(s, i) for s, i, ok in written if ok]
    # step cap: 2 tensors a step (300 > 250); run cap: 5 tensors in all (600 > 500)
    assert kept == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0)]
    assert w.run_bytes == 500
    assert [(e.step, e.name) for e in list_dumps(tmp_path)] == [(s, f"t{i}") for s, i in kept]
    msgs = [r.getMessage() for r in caplog.records]
    # one warning per step with a skip: steps 0, 1 (step cap), 2 (run cap), 3 (run cap)
    assert len(msgs) == 4
    assert ["step cap" in m for m in msgs] == [True, True, False, False]
    assert ["run cap" in m for m in msgs] == [False, False, True, True]


def test_io_error_is_logged_not_raised(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # a regular file where the dumps directory should be: mkdir fails (also when running as root,
    # which a read-only directory would not stop)
    blocker = tmp_path / "plugins" / "trainmon" / "dumps"
    blocker.parent.mkdir(parents=True)
    blocker.write_text("not a directory")
    w = DumpWriter(tmp_path, rank=0)
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        assert w.write(0, 0, "actv", "a", torch.ones(3), "r") is None
    assert any("failed" in r.getMessage() for r in caplog.records)
    assert w.run_bytes == 0
    assert list_dumps(tmp_path) == []


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root ignores directory permissions")
def test_read_only_dir_is_logged_not_raised(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    tmp_path.chmod(0o500)
    try:
        with caplog.at_level(logging.WARNING, logger="trainmon"):
            assert DumpWriter(tmp_path, rank=0).write(0, 0, "actv", "a", torch.ones(3), "r") is None
    finally:
        tmp_path.chmod(0o700)
    assert caplog.records


def test_list_dumps_merges_ranks_and_skips_partial_lines(tmp_path: Path) -> None:
    w0, w1 = DumpWriter(tmp_path, rank=0), DumpWriter(tmp_path, rank=1)
    e1 = w1.write(5, 0, "actv", "a", torch.ones(1), "r")
    e0 = w0.write(5, 0, "actv", "a", torch.ones(1), "r")
    e0b = w0.write(4, 0, "grad_reduced", "b", torch.ones(1), "r")
    w0.close()
    w1.close()
    with open(tmp_path / "plugins/trainmon/dumps/rank_1.jsonl", "ab") as f:
        f.write(b'{"path": "partial')
    (tmp_path / "plugins/trainmon/dumps/rank_x.jsonl").write_text("ignored\n")
    assert list_dumps(tmp_path) == [e0b, e0, e1]
    assert list_dumps(tmp_path / "nowhere") == []
    assert DumpEntry.from_dict(json.loads(json.dumps(e0.to_dict()))) == e0


def test_load_dump_rejects_non_safetensors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x80\x04K\x01.")  # a pickle, not safetensors
    with pytest.raises(DumpError, match="bad.safetensors"):
        load_dump(bad)


def test_sources_never_use_pickle() -> None:
    for mod in (dumps, cli_dump):
        src = Path(mod.__file__).read_text()
        assert not re.search(r"\btorch\.load\b", src), mod.__name__  # safetensors.torch.load_file is fine
        assert "pickle" not in src.lower(), mod.__name__


# ------------------------------------------------------------------------------------------------------ CLI


def test_cli_request(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plugin_dir(tmp_path).mkdir(parents=True)  # a run (no job has written names yet: nothing to check them by)
    assert main(["dump", "request", str(tmp_path), "--name", "layers.3.*", "--step", "9", "--rank", "2",
                 "--kind", "grad_reduced"]) == 0
    rid = capsys.readouterr().out.strip()
    assert main(["dump", "request", str(tmp_path), "--name", "*"]) == 0
    rid2 = capsys.readouterr().out.strip()
    reqs = RequestPoller(tmp_path).poll()
    assert [(r.id, r.name, r.step, r.rank, r.kind) for r in reqs] == [
        (rid, "layers.3.*", 9, 2, "grad_reduced"), (rid2, "*", None, None, None)]
    assert main(["dump", "request", str(tmp_path), "--name", "*", "--step", "next"]) == 0
    assert RequestPoller(tmp_path).poll()[-1].step is None


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--kind", "weights"], "unknown kind 'weights'; allowed: actv, actv_grad, grad_unreduced"),
        (["--step", "-1"], "expected an integer >= 0 or 'next', got '-1'"),
        (["--step", "later"], "expected an integer >= 0 or 'next', got 'later'"),
        (["--name", ""], "argument --name: an empty glob matches no tensor, got ''"),  # issue 32
        (["--name", "  "], "argument --name: an empty glob matches no tensor, got '  '"),
    ],
)
def test_cli_request_bad_args(tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str],
                              needle: str) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["dump", "request", str(tmp_path), "--name", "*", *extra])
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err
    assert not requests_file(tmp_path).exists()


def test_cli_request_and_ls_refuse_a_folder_that_is_not_a_run(tmp_path, capsys):
    """A request there would be read by no job, and "no dumps" would be a wrong answer (issue 22, 7)."""
    run = tmp_path / "logs" / "run"
    DumpWriter(run, rank=0).write(3, 0, "actv", "m.output", torch.ones(2), "nan")
    (run / "rank_0").mkdir()
    (tmp_path / "empty").mkdir()
    cases = {
        run / "rank_0": f"{run / 'rank_0'} is the folder of rank 0 in the run {run}: pass {run} "
        "(with --rank 0 for this rank only)",
        tmp_path / "logs": f"{tmp_path / 'logs'} holds runs but is none itself: pass one of {run}",
        tmp_path / "empty": f"{tmp_path / 'empty'} is not a trainmon run: it has no plugins/trainmon/ folder "
        "(a run is the logdir given to trainmon.attach, and gets that folder when the job attaches)",
    }
    for folder, reason in cases.items():
        assert main(["dump", "ls", str(folder)]) == 2
        assert capsys.readouterr() == ("", f"trainmon dump: error: {reason}\n")
        assert main(["dump", "request", str(folder), "--name", "*"]) == 2
        assert capsys.readouterr() == ("", f"trainmon dump: error: {reason}\n")
        assert not requests_file(folder).exists()
    assert main(["dump", "ls", str(run)]) == 0 and "m.output" in capsys.readouterr().out


def test_cli_request_missing_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope"
    assert main(["dump", "request", str(missing), "--name", "*"]) == 2
    assert capsys.readouterr().err == f"trainmon dump: error: run directory not found: {missing}\n"
    assert not missing.exists()
    assert main(["dump", "ls", str(missing)]) == 2


def test_cli_ls(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plugin_dir(tmp_path).mkdir(parents=True)
    assert main(["dump", "ls", str(tmp_path)]) == 0
    assert capsys.readouterr().out == f"no dumps in {tmp_path}\n"
    w = DumpWriter(tmp_path, rank=1)
    e = w.write(3, 0, "actv", "layers.0.mlp", torch.ones(2, 3), "nan")
    w.write(4, 2, "grad_reduced", "w", torch.ones((), dtype=torch.bfloat16), "request 1")
    assert e is not None
    assert main(["dump", "ls", str(tmp_path), "--step", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "step  rank  kind  name          micro  shape  dtype    size   reason  path",
        f"3     1     actv  layers.0.mlp  0      2x3    float32  {e.bytes} B  nan     {e.path}",
    ]
    assert main(["dump", "ls", str(tmp_path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["kind"], r["shape"], r["dtype"]) for r in rows] == [
        (3, "actv", [2, 3], "float32"), (4, "grad_reduced", [], "bfloat16")]
    assert main(["dump", "ls", str(tmp_path)]) == 0
    assert "scalar  bfloat16" in capsys.readouterr().out


def test_cli_show(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    t = torch.tensor([1.0, -2.0, NAN, 0.0, 4.0])
    e = DumpWriter(tmp_path, rank=0).write(3, 0, "actv", "layers.3.mlp", t, "nan")
    assert e is not None
    path = tmp_path / e.path
    assert main(["dump", "show", str(path), "--bins", "4"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"file: {path}",
        "metadata:",
        "  dtype       float32",
        "  kind        actv",
        "  micro_step  0",
        "  name        layers.3.mlp",
        "  rank        0",
        "  reason      nan",
        "  shape       [5]",
        "  step        3",
        "tensor: float32 [5] (5 elements)",
        "stats:",
        "  min    -2",
        "  max    4",
        "  mean   0.75",
        "  norm   4.58258",
        "  zeros  0.2",
        "  nans   1",
        "  infs   0",
        "histogram of 4 finite values (4 bins):",
        "  [  -2, -0.5) " + "#" * 40 + " 1",
        "  [-0.5,    1) " + "#" * 40 + " 1",
        "  [   1,  2.5) " + "#" * 40 + " 1",
        "  [ 2.5,    4] " + "#" * 40 + " 1",
    ]
    # default bins: 20 lines, bars scaled to the fullest bin
    assert main(["dump", "show", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    hist = lines[lines.index("histogram of 4 finite values (20 bins):") + 1:]
    assert len(hist) == 20 and sum(int(h.split()[-1]) for h in hist) == 4


def test_cli_show_histogram_scaling_and_no_finite(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    w = DumpWriter(tmp_path, rank=0)
    e = w.write(0, 0, "actv", "a", torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0]), "r")
    assert e is not None
    assert main(["dump", "show", str(tmp_path / e.path), "--bins", "2"]) == 0
    hist = capsys.readouterr().out.splitlines()[-2:]
    assert hist == ["  [  0, 0.5) " + "#" * 40 + " 4", "  [0.5,   1] " + "#" * 10 + " " * 30 + " 1"]
    e = w.write(0, 0, "actv", "b", torch.tensor([NAN, float("inf")]), "r")
    assert e is not None
    assert main(["dump", "show", str(tmp_path / e.path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "histogram: no finite values"
    assert "  min    nan" in out and "  nans   1" in out and "  infs   1" in out


def test_cli_show_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "corrupt.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    assert main(["dump", "show", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"trainmon dump: error: {bad}: not a readable safetensors dump")
    missing = tmp_path / "missing.safetensors"
    assert main(["dump", "show", str(missing)]) == 2
    assert capsys.readouterr().err == f"trainmon dump: error: dump file not found: {missing}\n"
    with pytest.raises(SystemExit) as exc:
        main(["dump", "show", str(bad), "--bins", "0"])
    assert exc.value.code == 2


# --------------------------------------------------------- CLI: dump request on an ended run or a passed step


def _record(step: int) -> StepRecord:
    rows = (Row("actv", "layers.0.output", 0, 0, "forward", torch.Size([2]), torch.float32),)
    p = np.array([[2, 0, 0, 0, -1.0, 1.0, 0.0, 2.0]])
    return StepRecord(step, 0, rows, p, time.time())


def _write_steps(sink, steps) -> None:
    for s in steps:
        rec = _record(s)
        sink.write(rec, records.Derived(rec))


def _request(capsys, run: Path, *extra: str) -> tuple[str, str]:
    assert main(["dump", "request", str(run), "--name", "layers.*", *extra]) == 0
    out, err = capsys.readouterr()
    assert len(out.strip()) == 32  # the request id is printed (and the request kept) in every case
    return out.strip(), err


def test_running_job_future_and_next_steps_are_quiet(tmp_path, capsys):
    store = StatStoreSink(tmp_path, 0)
    _write_steps(store, range(0, 8))
    manifest = ManifestSink(tmp_path, {"world_size": 1})
    _write_steps(manifest, range(0, 8))
    assert run_state(tmp_path).closed is None and run_state(tmp_path).last_step == 7
    assert _request(capsys, tmp_path, "--step", "8")[1] == ""
    assert _request(capsys, tmp_path)[1] == ""  # next
    store.close()


@pytest.mark.parametrize("output", ["statstore", "csv"])
def test_passed_step_warns(tmp_path, capsys, output):
    plugin_dir(tmp_path).mkdir(parents=True, exist_ok=True)  # every run has it, CSV-only ones too
    sink = StatStoreSink(tmp_path, 1) if output == "statstore" else CsvSink(tmp_path / "rank_1", ["max"])
    plugin_dir(tmp_path).mkdir(parents=True, exist_ok=True)  # what a CSV-only job's anomaly log creates
    _write_steps(sink, range(3, 41))
    sink.close()
    assert run_state(tmp_path).last_step == 40
    rid, err = _request(capsys, tmp_path, "--step", "12")
    assert err == (
        f"trainmon dump: warning: step 12 has already passed in {tmp_path} (the latest step written is 40): "
        "the running job drops requests for steps behind it, so this one will not be served unless a job "
        f"attaches to {tmp_path} again and runs step 12 (resumed from an earlier checkpoint). "
        "Use --step next for the next collected step.\n"
    )
    assert [(r.id, r.step) for r in RequestPoller(tmp_path).poll()] == [(rid, 12)]
    assert "already passed" in _request(capsys, tmp_path, "--step", "40")[1]
    assert _request(capsys, tmp_path, "--step", "41")[1] == ""


def test_ended_run_warns(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    try:
        sink = ManifestSink(tmp_path, {"world_size": 2})
        _write_steps(sink, range(0, 150))
        before = time.time()
        sink.close()
        doc = read_manifest(tmp_path)
        assert doc["last_step"] == 149 and before <= doc["closed"] <= time.time()
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(doc["closed"]))
        cases = ((["--step", "200"], "when it reaches step 200"), ([], "at its first collected step"))
        for extra, at in cases:
            _, err = _request(capsys, tmp_path, *extra)
            assert err == (
                f"trainmon dump: warning: the run in {tmp_path} has ended (its monitor closed at {when}, "
                "last step 149): no job reads its requests now. The request is kept and is served only if a "
                f"job attaches to {tmp_path} again (resumed training), {at}.\n"
            )
        # a job that attaches to the run again rewrites the manifest without the mark
        ManifestSink(tmp_path, {"world_size": 2})
        assert "closed" not in read_manifest(tmp_path)
        assert _request(capsys, tmp_path, "--step", "200")[1] == ""
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()
