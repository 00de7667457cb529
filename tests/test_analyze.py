"""``trainmon analyze``: the first anomaly of a run across ranks, streamed from the rank files."""

from __future__ import annotations

import json
import math

import pytest

from trainmon.anomaly.log import AnomalyLog
from trainmon.cli import main
from trainmon.run.anomalies import anomaly_to_json
from trainmon.run.layout import anomalies_dir, summary_file
from trainmon.run.records import Anomaly


def _a(name: str, rank: int, step: int = 5, **kw) -> Anomaly:
    base = dict(step=step, rank=rank, kind="actv", name=name, stat="max", value=math.nan, rule="nan")
    base.update(kw)
    return Anomaly(**base)


# The earliest anomalies of the run, in order; each one differs from the next in one tie-breaker of
# Anomaly.order_key (noted on the right), chosen so that the later fields would order them the other way.
EXPECTED = [
    # rank 2 is first: fewer collectives issued, although its seq and rank are the largest
    _a("A", 2, collectives=3, phase="forward", seq=10, origin=True, pp_stage=1),
    _a("B", 0, collectives=4, phase="forward", pp_stage=0, seq=2),  # collectives
    _a("B2", 1, collectives=4, phase="forward", pp_stage=1, seq=0),  # pp stage ascending in forward
    _a("C", 1, collectives=4, phase="backward", pp_stage=3, seq=0, propagated=True),  # phase
    _a("D", 0, collectives=4, phase="backward", pp_stage=1, seq=0),  # pp stage descending in backward
    _a("E", 2, collectives=4, phase="backward", micro_step=1, pp_stage=3, seq=0),  # micro-step
    _a("G", 0, collectives=4, phase="backward", micro_step=1, pp_stage=3, seq=1, kind="grad_reduced"),  # seq
    _a("F", 1, collectives=4, phase="backward", micro_step=1, pp_stage=3, seq=1, value=math.inf),  # rank
    _a("H", 1, collectives=4, phase="comm", micro_step=0, seq=0, rule="zscore", value=12.5, baseline=1.0),
    _a("I", 2, collectives=4, phase="optimizer", micro_step=0, seq=0, stat="norm"),  # comm before optimizer
    _a("J", 2, step=6, collectives=0, phase="forward", seq=0),  # step
]
SUPPRESSED_LINE = Anomaly(step=1, rank=1, kind="*", name="*", stat="*", value=7.0, rule="suppressed")


def _write_run(run):
    """Three ranks; each rank's anomalies written in an order unlike the expected one, step by step."""
    by_rank: dict[int, dict[int, list[Anomaly]]] = {}
    for a in reversed(EXPECTED):
        by_rank.setdefault(a.rank, {}).setdefault(a.step, []).append(a)
    for r in (0, 1, 2):
        with AnomalyLog(run, r) as log:
            for step in sorted(by_rank[r], reverse=True):
                log.write_step(step, by_rank[r][step])
            if r == 1:  # a summary line of the burst cap would order first, but is only counted
                log.write_step(SUPPRESSED_LINE.step, [SUPPRESSED_LINE])


def _analyze(capsys, *args):
    code = main(["analyze", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def _names(items):
    return [d["name"] for d in items]


def _as_json(a: Anomaly) -> dict:
    return json.loads(anomaly_to_json(a))


def test_json_first_and_top_order(tmp_path, capsys):
    _write_run(tmp_path)
    code, out, err = _analyze(capsys, tmp_path, "--json", "--top", "20")
    assert code == 0
    doc = json.loads(out)
    assert set(doc) == {"first", "first_non_finite", "top", "ranks", "anomalies", "suppressed", "left_out",
                        "damaged"}  # fmt: skip
    assert doc["damaged"] == []
    assert doc["first"] == _as_json(EXPECTED[0])
    assert (doc["first"]["rank"], doc["first"]["name"], doc["first"]["origin"]) == (2, "A", True)
    assert doc["top"] == [_as_json(a) for a in EXPECTED]
    assert (doc["ranks"], doc["anomalies"], doc["suppressed"]) == (3, len(EXPECTED), 7)
    assert err == ""


def test_default_top_is_8(tmp_path, capsys):
    _write_run(tmp_path)
    code, out, _ = _analyze(capsys, tmp_path, "--json")
    assert code == 0
    doc = json.loads(out)
    assert _names(doc["top"]) == ["A", "B", "B2", "C", "D", "E", "G", "F"]
    assert doc["anomalies"] == len(EXPECTED)


def test_top_k_smaller(tmp_path, capsys):
    _write_run(tmp_path)
    doc = json.loads(_analyze(capsys, tmp_path, "--json", "--top", "3")[1])
    assert _names(doc["top"]) == ["A", "B", "B2"]
    assert doc["first"]["name"] == "A"


def test_json_is_strict_with_non_finite_values(tmp_path, capsys):
    _write_run(tmp_path)
    out = _analyze(capsys, tmp_path, "--json", "--top", "20")[1]
    doc = json.loads(out, parse_constant=lambda c: pytest.fail(f"non-strict constant {c}"))
    values = {d["name"]: d["value"] for d in doc["top"]}
    assert (values["A"], values["F"], values["H"]) == ("nan", "inf", 12.5)


def test_text_output(tmp_path, capsys):
    _write_run(tmp_path)
    code, out, _ = _analyze(capsys, tmp_path)
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == f"{tmp_path}: 11 anomalies on 3 ranks, 7 more dropped by the per-step cap"
    assert lines[2] == "FIRST ANOMALY"
    assert lines[3] == "  step 5, rank 2: actv A max = nan [nan]"
    first = "\n".join(lines[4:18])
    for expected in (
        "step         5",
        "rank         2",
        "phase        forward",
        "micro-step   0",
        "pp stage     1 (vpp 0)",
        "collectives  3",
        "origin       yes",
    ):
        assert expected in first
    header = next(i for i, line in enumerate(lines) if line.startswith("EARLIEST 8"))
    table = lines[header + 1 :]
    assert table[0].split() == [
        "#",
        "step",
        "rank",
        "kind",
        "name",
        "stat",
        "value",
        "rule",
        "phase",
        "mb",
        "pp",
        "coll",
        "seq",
        "flags",
    ]
    assert [row.split()[4] for row in table[1:]] == ["A", "B", "B2", "C", "D", "E", "G", "F"]
    assert table[1].split() == [
        "1",
        "5",
        "2",
        "actv",
        "A",
        "max",
        "nan",
        "nan",
        "forward",
        "0",
        "1",
        "3",
        "10",
        "origin",
    ]
    assert table[4].split()[-1] == "propagated"


def test_step_filter(tmp_path, capsys):
    _write_run(tmp_path)
    doc = json.loads(_analyze(capsys, tmp_path, "--json", "--step", "6")[1])
    assert doc["first"] == _as_json(EXPECTED[-1])
    assert _names(doc["top"]) == ["J"]
    assert (doc["anomalies"], doc["suppressed"], doc["ranks"]) == (1, 0, 3)
    doc = json.loads(_analyze(capsys, tmp_path, "--json", "--step", "1")[1])
    assert (doc["first"], doc["top"], doc["anomalies"], doc["suppressed"]) == (None, [], 0, 7)


def test_no_anomalies(tmp_path, capsys):
    anomalies_dir(tmp_path).mkdir(parents=True)
    code, out, _ = _analyze(capsys, tmp_path)
    assert (code, out.strip()) == (0, f"no anomalies recorded in {tmp_path}")
    _write_run(tmp_path)
    code, out, _ = _analyze(capsys, tmp_path, "--step", "99")
    assert (code, out.strip()) == (0, f"no anomalies recorded in {tmp_path} at step 99")
    code, out, err = _analyze(capsys, tmp_path, "--step", "99", "--json")
    assert code == 0
    assert json.loads(out) == {
        "first": None,
        "first_non_finite": None,
        "top": [],
        "ranks": 3,
        "anomalies": 0,
        "suppressed": 0,
        "left_out": {},
        "damaged": [],
    }
    assert "no anomalies recorded" in err


def test_missing_run_is_an_error(tmp_path, capsys):
    missing = tmp_path / "nope"
    code, out, err = _analyze(capsys, missing)
    assert (code, out) == (2, "")
    assert str(missing) in err and "does not exist" in err


def test_run_without_anomalies_dir_is_an_error(tmp_path, capsys):
    (tmp_path / "rank_0").mkdir()
    code, out, err = _analyze(capsys, tmp_path, "--json")
    assert (code, out) == (2, "")
    assert str(anomalies_dir(tmp_path)) in err


def test_bad_top_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["analyze", str(tmp_path), "--top", "0"])
    assert e.value.code == 2
    capsys.readouterr()


def _write_old_run(run):
    """The run of ``_write_run`` in the old layout: one JSON line a record, no summaries."""
    d = anomalies_dir(run)
    d.mkdir(parents=True)
    for r in (0, 1, 2):
        lines = [a for a in EXPECTED if a.rank == r] + ([SUPPRESSED_LINE] if r == 1 else [])
        (d / f"rank_{r}.jsonl").write_text("".join(anomaly_to_json(a) + "\n" for a in lines))


def test_a_run_of_the_old_layout_gives_the_same_answer(tmp_path, capsys):
    _write_run(tmp_path / "new")
    _write_old_run(tmp_path / "old")
    new = json.loads(_analyze(capsys, tmp_path / "new", "--json", "--top", "20")[1])
    assert json.loads(_analyze(capsys, tmp_path / "old", "--json", "--top", "20")[1]) == new
    for args in (("--top", "3"), ("--rule", "zscore"), ("--step", "6")):
        new = json.loads(_analyze(capsys, tmp_path / "new", "--json", *args)[1])
        assert json.loads(_analyze(capsys, tmp_path / "old", "--json", *args)[1]) == new


def test_bad_lines_and_other_files_do_not_stop_analyze(tmp_path, capsys, caplog):
    _write_old_run(tmp_path)
    d = anomalies_dir(tmp_path)
    with open(d / "rank_0.jsonl", "a") as f:
        f.write("{oops\n")
        f.write(anomaly_to_json(_a("partial", 0, step=0)))  # no newline: a write in progress
    (d / "notes.txt").write_text("not an anomaly file\n")
    (d / "rank_x.jsonl").write_text("{}\n")
    (d / "rank=x").mkdir()
    (tmp_path / "plugins" / "trainmon" / "summary").mkdir()
    (tmp_path / "plugins" / "trainmon" / "summary" / "rank_x.json").write_text("{}")
    _, out, err = _analyze(capsys, tmp_path, "--json")
    doc = json.loads(out)
    assert doc["first"]["name"] == "A"
    assert (doc["ranks"], doc["anomalies"]) == (3, len(EXPECTED))
    [warning] = err.splitlines()  # one line for the one damaged file
    # rank 0 has B, D, G, then the bad line
    assert warning.startswith(f"trainmon: warning: damaged file {d / 'rank_0.jsonl'}: line 4: malformed")
    [damaged] = doc["damaged"]
    assert damaged["path"] == str(d / "rank_0.jsonl") and damaged["why"].startswith("line 4: malformed")


def test_a_damaged_summary_is_replaced_by_the_records(tmp_path, capsys, caplog):
    _write_run(tmp_path)
    want = json.loads(_analyze(capsys, tmp_path, "--json", "--top", "20")[1])
    summary_file(tmp_path, 2).write_text('{"rank": 2, "earli')  # torn by hand (the writer renames)
    code, out, err = _analyze(capsys, tmp_path, "--json", "--top", "20")
    got = json.loads(out)
    [damaged] = got.pop("damaged")
    assert want.pop("damaged") == [] and got == want
    assert damaged["path"] == str(summary_file(tmp_path, 2)) and "not a rank summary" in damaged["why"]
    assert f"trainmon: warning: damaged file {summary_file(tmp_path, 2)}: not a rank summary" in err


def test_thousands_of_rank_files_of_the_old_layout(tmp_path, capsys):
    n = 2000
    d = anomalies_dir(tmp_path)
    d.mkdir(parents=True)
    for r in range(n):
        lines = [
            _a(f"r{r}.fwd", r, step=3, collectives=r % 7 + 1, seq=r),
            _a(f"r{r}.bwd", r, step=3, collectives=9, phase="backward", pp_stage=r % 4),
            _a(f"r{r}.next", r, step=4),
        ]
        if r == 1234:  # the one that went first
            lines.append(_a("culprit", r, step=3, collectives=0, seq=99))
        (d / f"rank_{r}.jsonl").write_text("".join(anomaly_to_json(a) + "\n" for a in lines))
    code, out, err = _analyze(capsys, tmp_path, "--json", "--top", "4")
    assert code == 0
    doc = json.loads(out)
    assert (doc["ranks"], doc["anomalies"], doc["suppressed"]) == (n, 3 * n + 1, 0)
    assert doc["first"]["name"] == "culprit"
    # then collectives 1 (ranks 0, 7, 14, ...) in seq order
    assert _names(doc["top"]) == ["culprit", "r0.fwd", "r7.fwd", "r14.fwd"]
    assert f"{n}/{n}" in err  # progress counter on stderr: summaries computed from the records


def test_a_dump_at_a_later_step_says_why_and_how_to_get_one_at_the_step(tmp_path, capsys):
    """A loss spike at step 101 dumped by its request at step 103 (issue 32): analyze says where the dump
    is, why it is late and how to get one at the step; a dump at the step itself is just named."""
    import torch

    from trainmon.writer.dumps import DumpWriter

    with AnomalyLog(tmp_path, 0) as log:
        log.write_step(101, [Anomaly(101, 0, "scalar", "loss", "mean", 6.6, "turbulence", baseline=0.26,
                                     dump="request:anomaly-step101-0")])  # fmt: skip
    with DumpWriter(tmp_path, 0) as w:
        later = w.write(103, 0, "scalar", "loss", torch.tensor(6.0), "request anomaly-step101-0")
    _, out, err = _analyze(capsys, tmp_path)
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.strip().startswith("dump "))
    assert lines[at].split(None, 1)[1] == (
        f"request:anomaly-step101-0: at step 103 only, 2 after: {tmp_path / later.path}"
    )
    assert lines[at + 1].strip() == (
        "a dump request is served at the next collected step once the job has read it; with alert.capture: "
        "exact the monitor dumps at step 101 itself"
    )
    assert err == ""
    with DumpWriter(tmp_path, 0) as w:  # one at the step: named, no explanation needed
        same = w.write(101, 0, "scalar", "loss", torch.tensor(6.6), "request anomaly-step101-0")
    _, out, _ = _analyze(capsys, tmp_path)
    assert f"    dump         request:anomaly-step101-0: {tmp_path / same.path}\n" in out
    assert "alert.capture" not in out


def test_where_the_nan_started_is_said_whatever_rule_fired_first(tmp_path, capsys):
    """A loss spike at step 101 fires before the NaN of step 140 (the demo's story): plain ``analyze`` shows
    the spike first and says where the NaN started all the same, in text and in JSON."""
    spike = Anomaly(
        101, 0, "scalar", "loss", "mean", 6.6, "turbulence", baseline=0.26, phase="forward", seq=80
    )
    origin = _a("layers.2.mlp.fc2.output", 0, step=140, stat="nans", value=32768.0, phase="forward", seq=7,
                origin=True)  # fmt: skip
    after = _a(
        "layers.3.output", 0, step=140, stat="nans", value=32768.0, phase="forward", seq=9, propagated=True
    )
    with AnomalyLog(tmp_path, 0) as log:
        log.write_step(101, [spike])
        log.write_step(140, [origin, after])
    code, out, _ = _analyze(capsys, tmp_path)
    assert code == 0
    assert "FIRST ANOMALY\n  step 101, rank 0: scalar loss mean = 6.6 [turbulence]" in out
    said = ("WHERE THE NaN STARTED (after the first anomaly above: turbulence, step 101)\n"
            "  step 140, rank 0, forward: actv layers.2.mlp.fc2.output nans = 32768 [nan] (origin)\n"
            f"  explain it: trainmon analyze {tmp_path} --explain")  # fmt: skip
    assert said in out
    code, out, _ = _analyze(capsys, tmp_path, "--json")
    doc = json.loads(out)
    assert doc["first"]["rule"] == "turbulence"
    assert doc["first_non_finite"] == _as_json(origin)
    # asked for the spikes only: no NaN to mention; a run whose first anomaly is the NaN: said once
    code, out, _ = _analyze(capsys, tmp_path, "--rule", "turbulence")
    assert "NaN STARTED" not in out
    code, out, _ = _analyze(capsys, tmp_path, "--rule", "nan")
    assert "NaN STARTED" not in out and "FIRST ANOMALY\n  step 140, rank 0" in out
