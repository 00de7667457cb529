"""``trainmon migrate RUN``: a run of the old layout (statistics store ``stats/rank_<r>.bin`` + names,
anomaly records ``anomalies/rank_<r>.jsonl``) converted to the columnar tables and summaries: the same
statistics and records read back, the same ``analyze`` answer, readable by DuckDB, old files removed."""

from __future__ import annotations

import json
import math

import duckdb
import numpy as np
from old_layout import old_names_line

from trainmon.cli import main
from trainmon.run.anomalies import anomaly_to_json
from trainmon.run.anomaly_table import read_anomalies
from trainmon.run.layout import (
    anomalies_file,
    stats_dir,
    stats_names_file,
    stats_records_file,
    summary_file,
)
from trainmon.run.records import Anomaly
from trainmon.run.statstore import STAT_RECORD, read_stats
from trainmon.run.summary import read_summary


def _old_run(run, ranks=(0, 1), steps=12) -> None:
    """What the previous release wrote: per rank a names file, fixed-width records and JSON lines."""
    stats_dir(run).mkdir(parents=True)
    for rank in ranks:
        names = [(0, "actv", "fc1.output"), (1, "grad_reduced", "fc1.weight")]
        stats_names_file(run, rank).write_bytes(b"".join(old_names_line(*n) for n in names))
        recs = np.zeros(steps * 2, dtype=STAT_RECORD)
        for step in range(steps):
            for i in (0, 1):
                nan = 3.0 if (rank, step, i) == (1, 7, 0) else 0.0
                recs[2 * step + i] = (step, i, [-1.0, step + 10 * rank + i, 0.5, 2.0, 0.0, nan, 0.0])
        stats_records_file(run, rank).write_bytes(recs.tobytes())
        lines = []
        for step in range(7 if rank == 1 else 8, steps):
            lines.append(Anomaly(step=step, rank=rank, kind="actv", name="fc1.output", stat="nans",
                                 value=3.0, rule="nan", origin=step == 7, phase="forward"))  # fmt: skip
        anomalies_file(run, rank).parent.mkdir(parents=True, exist_ok=True)
        anomalies_file(run, rank).write_text("".join(anomaly_to_json(a) + "\n" for a in lines))


def _analyze(capsys, run) -> dict:
    assert main(["analyze", str(run), "--json", "--top", "20"]) == 0
    return json.loads(capsys.readouterr().out)


def test_migrate_converts_and_every_reader_gives_the_same_answers(tmp_path, capsys):
    run = tmp_path / "run"
    _old_run(run)
    before = {r: read_stats(run, r) for r in (0, 1)}
    records_before = {r: read_anomalies(run, r) for r in (0, 1)}
    answer = _analyze(capsys, run)
    assert answer["first"]["rank"] == 1 and answer["first"]["step"] == 7 and answer["anomalies"] == 9

    assert main(["migrate", str(run)]) == 0
    out = capsys.readouterr().out
    assert "statistics store: 48 rows of 2 rank(s)" in out and "anomaly records: 9 of 2 rank(s)" in out
    assert "summaries written: 2 rank(s)" in out and "old files removed: 6" in out
    assert not any(p.exists() for r in (0, 1) for p in (stats_records_file(run, r), stats_names_file(run, r),
                                                          anomalies_file(run, r)))  # fmt: skip
    for r in (0, 1):
        after = read_stats(run, r)
        assert after.tensors == before[r].tensors and after.steps.tolist() == before[r].steps.tolist()
        for stat, values in before[r].values.items():
            np.testing.assert_array_equal(after.values[stat], values)
        assert read_anomalies(run, r) == records_before[r]
    assert _analyze(capsys, run) == answer
    s = read_summary(summary_file(run, 1))
    assert (s.steps, s.first_step, s.last_step, s.counts, s.first["nan"].step) == (12, 0, 11, {"nan": 5}, 7)
    assert s.grad_norm is None  # not recorded by the old layout
    table = f"read_parquet('{stats_dir(run)}/*/*.parquet', hive_partitioning = true)"
    query = f"SELECT rank, max(nans) FROM {table} GROUP BY rank ORDER BY rank"
    assert duckdb.sql(query).fetchall() == [(0, 0.0), (1, 3.0)]

    assert main(["migrate", str(run)]) == 0  # nothing left to do
    assert "nothing to migrate" in capsys.readouterr().out


def test_migrate_keep_old_and_refusals(tmp_path, capsys):
    run = tmp_path / "run"
    _old_run(run, ranks=(0,))
    assert main(["migrate", str(run), "--keep-old"]) == 0
    assert "old files kept (--keep-old): 3" in capsys.readouterr().out
    assert stats_records_file(run, 0).exists() and anomalies_file(run, 0).exists()
    assert main(["migrate", str(tmp_path / "missing")]) == 2
    assert "not a trainmon run" in capsys.readouterr().err
    assert not math.isnan(read_stats(run, 0).values["max"][0, 0])
