"""Damaged run files (issue 32): a sealed Parquet segment cut short, an open Arrow stream overwritten in the
middle, a summary, a manifest and a dump index that are not what they should be. Every reader (``trainmon
analyze`` with ``--rule``, ``--step`` and ``--explain``, ``trainmon dump ls``, ``trainmon compare``, the
plugin's routes: the run list, the timeline, the anomaly list, the heatmap, the series, a dump) reads what
is readable, names each damaged file it met once (the CLI: one warning line; the plugin: in its answers,
which the tab shows as a notice) and keeps the rest of the run.

The run is written here with the run's own encoders and writers (:mod:`trainmon.run`, the dump writer): 3
ranks, 30 steps, segments of 10 steps (steps 20-29 still in open streams, as while a job runs), 4 tensors;
rank 1's NaN starts at step 12 in ``layers.1.output`` (origin) and stays, every other rank's at step 13."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from test_plugin_routes import make_client
from trainmon_tb import runs as runs_module

from trainmon.cli import main
from trainmon.run import damage
from trainmon.run.anomaly_table import ANOMALY_OPTIONS, ANOMALY_SCHEMA, AnomalyEncoder
from trainmon.run.columnar import SegmentWriter, segments
from trainmon.run.layout import (
    anomalies_rank_dir,
    dump_index_file,
    manifest_path,
    stats_rank_dir,
    summary_file,
)
from trainmon.run.manifest import write_manifest
from trainmon.run.records import Anomaly
from trainmon.run.statstore import STATS_OPTIONS, STATS_SCHEMA, StatEncoder
from trainmon.run.summary import RankSummary, write_summary
from trainmon.writer.dumps import DumpWriter

RANKS, STEPS, SEGMENT = 3, 30, 10
NAN_RANK, NAN_STEP = 1, 12
TENSORS = (("actv", "layers.0.output"), ("actv", "layers.1.output"), ("actv", "layers.2.output"),
           ("grad_reduced", "layers.1.weight"))  # fmt: skip
NUMEL = 64


def _first_nan(rank: int) -> int:
    return NAN_STEP + (rank != NAN_RANK)


def _values(rank: int, step: int) -> dict[str, np.ndarray]:
    """The statistics of the 4 tensors: from the first NaN step on, every tensor from layers.1 on is NaN."""
    rng = np.random.default_rng((rank, step))
    scale = 1.0 + rng.random(len(TENSORS))
    bad = np.array([i >= 1 for i in range(len(TENSORS))]) & (step >= _first_nan(rank))
    nan = np.where(bad, np.nan, 1.0)
    return {"min": -scale * nan, "max": scale * nan, "mean": 0.01 * scale * nan, "norm": 8 * scale * nan,
            "zeros": np.zeros(len(TENSORS)), "nans": np.where(bad, NUMEL, 0.0),
            "infs": np.zeros(len(TENSORS))}  # fmt: skip


def _records(rank: int, step: int) -> list[Anomaly]:
    if step == 2:  # a loss spike on every rank, dumped at a later step by its request
        return [Anomaly(2, rank, "scalar", "loss", "mean", 9.0, "turbulence", dump=f"request:spike-{rank}")]
    if step < _first_nan(rank):
        return []
    nan = {"stat": "nans", "value": float(NUMEL), "rule": "nan"}
    return [
        Anomaly(step, rank, "actv", "layers.1.output", seq=1, origin=True, **nan),
        Anomaly(step, rank, "actv", "layers.2.output", seq=2, propagated=True, **nan),
        Anomaly(step, rank, "grad_reduced", "layers.1.weight", seq=9, phase="optimizer", **nan),
    ]


def write_run(run: Path) -> None:
    kinds = ["actv", "grad_reduced"]
    write_manifest(run, {"world_size": RANKS, "config": {"step_interval": 1}, "kinds": kinds})
    for rank in range(RANKS):
        encoder, anomalies = StatEncoder(), AnomalyEncoder()
        kinds, names = encoder.indices(list(TENSORS))
        meta = encoder.meta_indices(["bfloat16"] * 3 + ["float32"], ["[8, 8]"] * len(TENSORS))
        summary = RankSummary(rank)
        open_writers = []
        for lo, hi, close in ((0, 19, True), (20, STEPS - 1, False)):  # the last segment stays open
            stats = SegmentWriter(stats_rank_dir(run, rank), STATS_SCHEMA, STATS_OPTIONS,
                                  segment_steps=SEGMENT)  # fmt: skip
            records = SegmentWriter(anomalies_rank_dir(run, rank), ANOMALY_SCHEMA, ANOMALY_OPTIONS,
                                    segment_steps=SEGMENT)  # fmt: skip
            for step in range(lo, hi + 1):
                numel = np.full(len(TENSORS), NUMEL)
                stats.append(encoder.encode(step, kinds, names, _values(rank, step), numel, meta), step)
                found = _records(rank, step)
                if found:
                    records.append(anomalies.encode(found), step)
                summary = summary.with_records(found).with_step(step, 1e9 + step, 1.0)
            if close:
                assert stats.close() and records.close()
            else:
                open_writers += [stats, records]
        write_summary(run, summary)
        with DumpWriter(run, rank) as dumps:
            dumps.write(4, 0, "scalar", "loss", torch.tensor(9.0), f"request spike-{rank}")
            nan = torch.full((8, 8), float("nan"), dtype=torch.bfloat16)
            dumps.write(_first_nan(rank), 0, "actv", "layers.1.output", nan, "exact: nan")
        for w in open_writers:  # as a job still running: the streams stay (their descriptors closed)
            w._close_stream()


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("pristine") / "run"
    write_run(run)
    return run


def _cut(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _overwrite_middle(path: Path) -> None:
    data = bytearray(path.read_bytes())
    at = len(data) // 2
    data[at : at + 64] = b"\x00" * 64
    path.write_bytes(bytes(data))


def _segment(table_dir: Path, lo: int) -> Path:
    """The segment of steps ``lo`` .. ``lo + SEGMENT - 1`` (named by its first step with rows)."""
    return next(s.path for s in segments(table_dir) if lo <= s.lo < lo + SEGMENT)


# What each case damages, and which readers meet the file (the others answer from files they need).
CASES = {
    "anomaly segment": (lambda run: _segment(anomalies_rank_dir(run, NAN_RANK), 10), _cut),
    "stats segment": (lambda run: _segment(stats_rank_dir(run, NAN_RANK), 10), _cut),
    "open stream": (lambda run: _segment(stats_rank_dir(run, 0), 20), _overwrite_middle),
    "summary": (lambda run: summary_file(run, NAN_RANK), lambda p: p.write_text('{"rank": 1, "steps": [')),
    "manifest": (lambda run: manifest_path(run), lambda p: p.write_bytes(b"\x00\x01 not json")),
    "dump index": (lambda run: dump_index_file(run, NAN_RANK),
                   lambda p: p.write_bytes(p.read_bytes().replace(b"\n", b"\n{broken\n", 1))),  # fmt: skip
}
MEETS = {  # reader -> the cases whose file it reads
    "analyze": {"summary", "dump index"},  # the first anomaly (a spike) has a dump: the index is read
    "analyze --rule nan,inf": {"summary", "anomaly segment"},
    "analyze --step 12": {"summary", "anomaly segment"},
    "analyze --explain": {"summary", "anomaly segment", "stats segment", "dump index"},
    "dump ls": {"dump index"},
    "compare": {"stats segment", "open stream", "manifest"},
    "plugin": set(CASES),
}


@pytest.fixture(autouse=True)
def _forget_damage():
    damage.forget()
    yield
    damage.forget()


@pytest.fixture(params=sorted(CASES))
def damaged_run(request, pristine, tmp_path) -> tuple[str, Path, Path]:
    run = tmp_path / "logs" / "run"
    shutil.copytree(pristine, run)
    where, how = CASES[request.param]
    path = where(run)
    how(path)
    return request.param, run, path


def _cli(capsys, *args: str) -> tuple[int, str, list[str]]:
    code = main([*args])
    out, err = capsys.readouterr()
    return code, out, err.splitlines()


def _warned(lines: list[str], path: Path) -> list[str]:
    return [line for line in lines if line.startswith(f"trainmon: warning: damaged file {path}: ")]


def test_every_cli_reader_reads_the_rest_and_names_the_damaged_file_once(damaged_run, capsys):
    case, run, path = damaged_run
    for reader, args in (
        ("analyze", ["analyze", str(run)]),
        ("analyze --rule nan,inf", ["analyze", str(run), "--rule", "nan,inf"]),
        ("analyze --step 12", ["analyze", str(run), "--step", str(NAN_STEP)]),
        ("analyze --explain", ["analyze", str(run), "--explain"]),
        ("dump ls", ["dump", "ls", str(run)]),
    ):
        damage.forget()
        code, out, err = _cli(capsys, *args)
        assert code == 0, (reader, err)
        warned = _warned(err, path)
        assert len(warned) == (case in MEETS[reader]), (reader, err)
        assert len(err) == len(warned), (reader, err)  # nothing else on stderr: no traceback, no other file
        if reader == "analyze":  # the summaries' answer: every record counted, the spike first
            assert "step 2, rank 0: scalar loss mean = 9 [turbulence]" in out
        elif reader == "analyze --rule nan,inf":  # the first NaN, also where its segment is damaged
            assert f"step {NAN_STEP}, rank {NAN_RANK}: actv layers.1.output nans = 64 [nan]" in out
        elif reader == "analyze --step 12":
            assert f"step {NAN_STEP}, rank {NAN_RANK}: actv layers.1.output" in out
        elif reader == "analyze --explain":
            first = f"FIRST NaN/Inf in {run}: step {NAN_STEP}, rank {NAN_RANK}: actv layers.1.output"
            assert out.startswith(first)
            if case != "stats segment":  # its statistics from the store: counts as integers, the dtype known
                assert "output  layers.1.output  bfloat16  NO      64    0" in out
        else:
            listed = [line for line in out.splitlines()[1:] if line.strip()]
            assert len(listed) == 2 * RANKS  # every dump: the bad line of the index is no entry
    # the JSON answer names the damaged files too
    damage.forget()
    code, out, _ = _cli(capsys, "analyze", str(run), "--json", "--rule", "nan,inf")
    doc = json.loads(out)
    met = case in MEETS["analyze --rule nan,inf"]
    assert [d["path"] for d in doc["damaged"]] == ([str(path)] if met else [])
    assert (doc["first"]["rank"], doc["first"]["step"]) == (NAN_RANK, NAN_STEP)


def test_compare_compares_the_rest_and_names_the_damaged_file(damaged_run, pristine, capsys):
    case, run, path = damaged_run
    code, out, err = _cli(capsys, "compare", str(pristine), str(run), "--no-report")
    warned = _warned(err, path)
    assert len(warned) == (case in MEETS["compare"]), err
    if case in ("stats segment", "open stream"):  # steps left out: not "the same"
        assert code == 2
        assert "no divergence in what could be read: 1 damaged file(s) of statistics were left out" in out
    else:
        assert code == 0 and "no divergence: every compared tensor agrees" in out
    assert "Traceback" not in "\n".join(err)


def test_every_plugin_route_answers_with_the_rest_and_names_the_damaged_file(damaged_run, monkeypatch):
    case, run, path = damaged_run
    monkeypatch.setattr(runs_module, "MIN_REFRESH_SECS", 0.0)
    client = make_client(run.parent)
    relative = path.relative_to(run).as_posix()

    def get(route: str) -> dict:
        r = client.get(f"/data/plugin/trainmon/{route}")
        assert r.status_code == 200, (route, r.get_data(as_text=True))
        return json.loads(r.get_data())

    timeline = get("timeline?run=run&bins=30")
    heatmaps = [get(f"heatmap?run=run&rank={rank}&kind=actv&stat=norm") for rank in range(RANKS)]
    series = get(f"series?run=run&rank={NAN_RANK}&kind=actv&name=layers.0.output&stat=norm")
    events = get(f"events?run=run&step_lo={NAN_STEP + 1}&step_hi={NAN_STEP + 1}")
    dump = get(f"dump_meta?run=run&path={events['events'][0]['dumps'][0]['path']}")
    runs = get("runs")["runs"]  # after the other routes: every file they met is named
    (listed,) = runs
    named = [d for d in listed["damaged"] if d["path"] == relative]
    assert len(named) == 1 and len(listed["damaged"]) == 1, listed["damaged"]
    assert named[0]["why"]
    # the rest of the run is there
    lost = {"anomaly segment": 3 * (20 - NAN_STEP)}.get(case, 0)  # rank 1's NaN records of steps 12-19
    recorded = RANKS + 3 * sum(STEPS - _first_nan(r) for r in range(RANKS))
    assert timeline["anomalies"] == recorded - lost  # what can be read
    assert listed["anomalies"] == recorded  # the run's count, as analyze says it: also where records are lost
    assert listed["dumps"] == 2 * RANKS
    first = timeline["first"]
    # the first NaN, but where its records are in the damaged segment: then the next one readable
    want = (0, NAN_STEP + 1) if case == "anomaly segment" else (NAN_RANK, NAN_STEP)
    assert (first["rank"], first["step"]) == want
    steps = [len(h["edges"]) - 1 for h in heatmaps]
    if case == "stats segment":  # rank 1 without steps 10-19
        assert steps[NAN_RANK] == STEPS and heatmaps[NAN_RANK]["step_lo"] == 0
        assert len(series["steps"]) == STEPS - SEGMENT
    elif case == "open stream":  # rank 0 up to the damage in its stream
        assert heatmaps[0]["step_hi"] < STEPS - 1
    else:
        assert steps == [STEPS] * RANKS and len(series["steps"]) == STEPS
    assert events["total"] == 3 * RANKS - 3 * (case == "anomaly segment")  # rank 1's step 13 is in it
    assert dump["tensor"]["shape"] == [8, 8]
    # the answers of the routes that met the file name it too (the tab gathers them into its notice)
    met = [a for a in (timeline, *heatmaps, series) if any(d["path"] == relative for d in a["damaged"])]
    assert met, case
