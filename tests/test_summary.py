"""Per-rank summaries and the per-step table: what the writer keeps at each step end, that the file is always
whole, and that ``analyze`` answers from summaries (reading records only where they are not enough) with the
same answer as reading every record."""

from __future__ import annotations

import json
import math
import random
import threading

import numpy as np
import pytest

from trainmon.anomaly.log import AnomalyLog
from trainmon.anomaly.sink import AnomalySink
from trainmon.anomaly.steplog import StepEnd, StepLog
from trainmon.cli import main
from trainmon.config import AlertConfig
from trainmon.read import scan as scan_module
from trainmon.read.scan import scan
from trainmon.read.summaries import first_non_finite, overview, read_summaries
from trainmon.run import damage
from trainmon.run import summary as summary_module
from trainmon.run.anomaly_table import read_anomalies
from trainmon.run.layout import summary_file
from trainmon.run.records import SUMSQ, Anomaly, Derived, Row, StepRecord
from trainmon.run.steptable import read_steps
from trainmon.run.summary import RankSummary, read_summary, summary_key
from trainmon.run.timing import FIELD, WIDTH, StepTiming

ROWS = (
    Row("actv", "fc1.output", 0, 0, "forward", (4,), "float32"),
    Row("actv", "fc2.output", 0, 0, "forward", (4,), "float32"),
    Row("grad_reduced", "fc1.weight", 0, 0, "optimizer", (4,), "float32"),
    Row("grad_reduced", "fc2.weight", 0, 0, "optimizer", (4,), "float32"),
)


def _partials(step: int, nan_from: int | None) -> np.ndarray:
    p = np.tile(np.array([4.0, 0, 0, 0, -1.0, 1.0, 0.5, 0.0]), (4, 1))
    p[:, SUMSQ] = [1.0, 2.0, 9.0 * step, 16.0]  # the gradients' norm: sqrt(9 step + 16)
    if nan_from is not None and step >= nan_from:
        p[1, 1] = 2.0  # fc2.output holds 2 NaN ...
        p[3, 1] = 1.0  # ... and so does fc2.weight's gradient, one
    return p


def _run_sink(run, rank: int, steps: int, nan_from: int | None) -> None:
    sink = AnomalySink(AlertConfig(), rank, "run", run)
    for step in range(steps):
        rec = StepRecord(step, rank, ROWS, _partials(step, nan_from), 1000.0 + step, skipped=step == 4)
        sink.write(rec, Derived(rec))
    sink.close()


def test_the_sink_keeps_the_summary_and_the_steps_table(tmp_path):
    _run_sink(tmp_path, 3, 6, nan_from=2)
    s = read_summary(summary_file(tmp_path, 3))
    assert (s.rank, s.steps, s.first_step, s.last_step, s.wall_time) == (3, 6, 0, 5, 1005.0)
    assert s.grad_norm == math.sqrt(9 * 5 + 16)
    # NaN from step 2 on, in fc2.output and fc2.weight's gradient; the loss-scaler skip of step 4 relabels it
    assert s.counts == {"nan": 6, "loss_scale_overflow": 2} and s.kinds == {"actv": 4, "grad_reduced": 4}
    assert (s.anomalies, s.anomaly_steps, s.suppressed) == (8, (2, 5), 0)
    assert (s.first["nan"].step, s.first["nan"].name) == (2, "fc2.output")
    assert s.first["loss_scale_overflow"].step == 4
    assert [(a.step, a.name) for a in s.earliest] == [
        (2, "fc2.output"), (2, "fc2.weight"), (3, "fc2.output"), (3, "fc2.weight"),
        (4, "fc2.output"), (4, "fc2.weight"), (5, "fc2.output"), (5, "fc2.weight"),
    ]  # fmt: skip
    steps = read_steps(tmp_path, 3).to_pydict()
    assert steps["step"] == list(range(6)) and steps["wall_time"] == [1000.0 + i for i in range(6)]
    assert steps["grad_norm"] == [math.sqrt(9 * i + 16) for i in range(6)]
    assert steps["grad_nonfinite"] == [0.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    assert steps["anomalies"] == [0, 0, 2, 2, 2, 2] and steps["tensors"] == [4] * 6
    assert steps["skipped"] == [False] * 4 + [True, False]


def test_a_resumed_job_continues_the_summary(tmp_path):
    _run_sink(tmp_path, 0, 3, nan_from=2)
    sink = AnomalySink(AlertConfig(), 0, "run", tmp_path)
    for step in (3, 4):
        rec = StepRecord(step, 0, ROWS, _partials(step, 2), 2000.0)
        sink.write(rec, Derived(rec))
    sink.close()
    s = read_summary(summary_file(tmp_path, 0))
    assert (s.steps, s.last_step, s.counts) == (5, 4, {"nan": 6})
    assert s.first["nan"].step == 2


def test_no_gradient_no_norm(tmp_path):
    sink = AnomalySink(AlertConfig(), 0, "run", tmp_path)
    rec = StepRecord(0, 0, ROWS[:2], _partials(0, None)[:2], 1.0)
    sink.write(rec, Derived(rec))
    sink.close()
    assert read_summary(summary_file(tmp_path, 0)).grad_norm is None
    assert math.isnan(read_steps(tmp_path, 0).column("grad_norm")[0].as_py())


def test_the_summary_is_always_a_whole_document(tmp_path):
    """A reader polling the file while the writer rewrites it at every step never sees a torn document."""
    log = AnomalyLog(tmp_path, rank=0)
    log.end_step(0, 0.0)
    stop = threading.Event()
    seen: list[int] = []
    errors: list[Exception] = []

    def poll() -> None:
        while not stop.is_set():
            try:
                seen.append(read_summary(summary_file(tmp_path, 0)).last_step)
            except Exception as e:  # a torn or missing document
                errors.append(e)

    reader = threading.Thread(target=poll)
    reader.start()
    for step in range(1, 300):
        log.write_step(step, [Anomaly(step=step, rank=0, kind="actv", name="x", stat="nans", value=1.0,
                                      rule="nan", message="m" * 500)])  # fmt: skip
        log.end_step(step, float(step))
    stop.set()
    reader.join()
    log.close()
    assert not errors and len(seen) > 10 and seen == sorted(seen)
    left = [p.name for p in summary_file(tmp_path, 0).parent.iterdir()]
    assert left == ["rank_0.json"]  # no temporary file left


def test_a_reader_never_sees_the_run_go_back_in_time(tmp_path, monkeypatch):
    """The race a polling reader once lost under load (it saw last_step 21, then 20), made to happen: the
    reader finds the summary missing while the writer is between removing step 20's document and renaming
    the new one in place; before it opens the temporary file, the writer puts that document (20) in place and
    writes step 21's into the temporary file. Reading it then showed step 21, and the next read the document
    in place, step 20."""
    path = summary_file(tmp_path, 0)
    temporary = path.with_name(f".{path.name}.tmp")

    def document(step: int) -> str:
        return json.dumps(RankSummary(0).with_step(step, float(step), None).to_dict())

    summary_module.write_summary(tmp_path, RankSummary(0).with_step(19, 19.0, None))
    temporary.write_text(document(20))  # the writer has written step 20's document ...
    path.unlink()  # ... and removed step 19's: the reader's open of the summary finds nothing
    real_open = open
    raced = []

    def racing_open(file, *args, **kwargs):
        if str(file) == str(path) and not raced:
            raced.append(True)
            temporary.rename(path)  # meanwhile, step 20's is put in place, and step 21's written
            temporary.write_text(document(21))
            raise FileNotFoundError(file)
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(summary_module, "open", racing_open, raising=False)
    seen = [read_summary(path).last_step, read_summary(path).last_step]
    path.unlink()
    temporary.rename(path)  # the writer puts step 21's in place
    seen.append(read_summary(path).last_step)
    assert raced and seen == [20, 20, 21]


def test_summary_json_is_strict_and_round_trips(tmp_path):
    a = Anomaly(
        step=1, rank=0, kind="actv", name="x", stat="max", value=math.nan, rule="nan", baseline=math.inf
    )
    s = RankSummary(0).with_records([a]).with_step(1, 5.0, math.inf)
    d = s.to_dict()
    text = json.dumps(d, allow_nan=False)
    assert RankSummary.from_dict(json.loads(text)).to_dict() == d
    assert d["grad_norm"] == "inf" and d["first"]["nan"]["value"] == "nan"
    with pytest.raises(ValueError, match="not a rank summary"):
        RankSummary.from_dict({"earliest": []})


# -- analyze from summaries ----------------------------------------------------------------------------------


def _random_run(run, seed: int, ranks: int = 12) -> list[Anomaly]:
    """Records of random steps and ordering keys on several ranks, some steps over the per-step cap."""
    rng = random.Random(seed)
    every: list[Anomaly] = []
    rules = ("nan", "inf", "zscore", "threshold")
    for rank in range(ranks):
        with AnomalyLog(run, rank, max_per_step=4) as log:
            for step in sorted(rng.sample(range(30), rng.randint(0, 6))):
                found = [
                    Anomaly(step=step, rank=rank, kind=rng.choice(("actv", "grad_reduced")), name=f"t{i}",
                            stat=rng.choice(("max", "nans")), value=1.0, rule=rng.choice(rules),
                            seq=rng.randint(0, 9), collectives=rng.randint(0, 3),
                            phase=rng.choice(("forward", "backward", "optimizer")),
                            micro_step=rng.randint(0, 1), pp_stage=rng.randint(0, 2))
                    for i in range(rng.randint(1, 6))
                ]  # fmt: skip
                every += [a for a in log.write_step(step, found) if a.rule != "suppressed"]
                log.end_step(step, 0.0)
    return every


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_merge_of_summaries_equals_sorting_every_record(tmp_path, monkeypatch, seed):
    monkeypatch.setattr(summary_module, "EARLIEST", 3)  # summaries hold 3 records: the merge reads the rest
    every = _random_run(tmp_path, seed)
    for top in (1, 3, 7, 40, 500):
        for rules in (None, frozenset({"nan", "inf"}), frozenset({"zscore"})):
            want = sorted((a for a in every if rules is None or a.rule in rules), key=summary_key)[:top]
            got = scan(tmp_path, top=top, rules=rules)
            assert got.top == want
            assert got.anomalies == sum(1 for a in every if rules is None or a.rule in rules)
        for step in (0, 7, 29):
            want = sorted((a for a in every if a.step == step), key=summary_key)[:top]
            assert scan(tmp_path, top=top, step=step).top == want


def test_analyze_reads_no_record_when_the_summaries_answer(tmp_path, monkeypatch):
    every = _random_run(tmp_path, 5, ranks=30)
    calls: list[int] = []
    real = scan_module._records

    def spy(run, rank, lo, hi):
        calls.append(rank)
        return real(run, rank, lo, hi)

    monkeypatch.setattr(scan_module, "_records", spy)
    found = scan(tmp_path, top=8)
    assert found.top == sorted(every, key=summary_key)[:8] and found.records_read == 0 and calls == []
    assert scan(tmp_path, top=1, rules=frozenset({"nan", "inf"})).records_read <= 1  # the first rank only
    first = first_non_finite(read_summaries(tmp_path))
    assert first == min((a for a in every if a.rule in ("nan", "inf")), key=summary_key)


def test_overview_of_a_run(tmp_path):
    _run_sink(tmp_path, 0, 3, nan_from=None)
    _run_sink(tmp_path, 1, 5, nan_from=3)
    o = overview(tmp_path)
    assert (o.ranks, o.steps, o.anomalies, o.suppressed) == ((0, 1), (0, 4), 4, 0)
    assert o.rules == {"loss_scale_overflow": 2, "nan": 2} and o.kinds == {"actv": 2, "grad_reduced": 2}
    assert (o.first.rank, o.first.step, o.first_non_finite.step) == (1, 3, 3)


def test_analyze_cli_answers_from_summaries_alone(tmp_path, capsys):
    """The records may be gone: the default answer comes from the summaries."""
    import shutil

    from trainmon.run.layout import anomalies_dir

    _run_sink(tmp_path, 0, 6, nan_from=2)
    assert main(["analyze", str(tmp_path), "--json"]) == 0
    want = json.loads(capsys.readouterr().out)
    shutil.rmtree(anomalies_dir(tmp_path))
    assert main(["analyze", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == want
    assert want["first"]["name"] == "fc2.output" and want["anomalies"] == 8
    assert read_anomalies(tmp_path, 0) == []


def test_a_kill_between_removal_and_rename_leaves_the_new_document(tmp_path):
    """The writer removes the old document before renaming the new one into place (a rename over it makes
    ext4 write the data out: 1-2 ms a step): killed between the two, the new one is read from its
    temporary name."""
    log = AnomalyLog(tmp_path, rank=0)
    log.end_step(0, 0.0)
    log.end_step(1, 1.0)
    path = summary_file(tmp_path, 0)
    path.rename(path.with_name(f".{path.name}.tmp"))  # as if killed right after the removal
    assert read_summary(path).last_step == 1
    log.close()
    assert AnomalyLog(tmp_path, rank=0).summary.last_step == 1  # a resumed job continues it


def test_a_damaged_record_in_a_summary_is_replaced_by_the_records(tmp_path, caplog):
    _run_sink(tmp_path, 0, 4, nan_from=2)
    want = scan(tmp_path, top=3).top
    doc = json.loads(summary_file(tmp_path, 0).read_text())
    doc["earliest"][0]["step"] = "two"  # valid JSON, not an anomaly
    summary_file(tmp_path, 0).write_text(json.dumps(doc))
    assert scan(tmp_path, top=3).top == want
    [found] = damage.damaged(tmp_path)
    assert found.path == summary_file(tmp_path, 0) and "a record of the summary is damaged" in found.why


def _timing(step: int) -> StepTiming:
    own = np.zeros(WIDTH)
    own[[FIELD["step"], FIELD["forward"], FIELD["present"]]] = (0.5 + step, 0.25, 1.0)
    return StepTiming(step, 0, own)


@pytest.mark.parametrize("summaries_lost", [1, 4])
def test_a_log_opened_after_a_kill_counts_what_the_tables_hold(tmp_path, summaries_lost):
    """A step's row and times are appended before the summary is rewritten with them: a writer killed in
    between (the writer process, whose step log the writer thread then opens) leaves the tables ahead of the
    summary. The next step log counts what the tables hold."""
    log = StepLog(tmp_path, 0)
    kept = None
    for step in range(6):
        if step == 6 - summaries_lost:
            kept = summary_file(tmp_path, 0).read_bytes()  # the summary as the kill left it
        log.end_step(StepEnd(step, 1000.0 + step, grad_norm=float(step)), _timing(step))
    log.close()
    summary_file(tmp_path, 0).write_bytes(kept)
    assert read_summary(summary_file(tmp_path, 0)).steps == 6 - summaries_lost
    log = StepLog(tmp_path, 0)
    log.end_step(StepEnd(6, 1006.0, grad_norm=math.nan), _timing(6))
    log.close()
    s = read_summary(summary_file(tmp_path, 0))
    assert read_steps(tmp_path, 0)["step"].to_pylist() == list(range(7))
    assert (s.steps, s.first_step, s.last_step, s.wall_time, s.grad_norm) == (7, 0, 6, 1006.0, None)
    assert s.timed == 7
    assert s.time["step"] == sum(0.5 + step for step in range(7)) and s.time["forward"] == 7 * 0.25
