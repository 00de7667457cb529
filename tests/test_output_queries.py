"""The queries of docs/output.md and docs/anomalies.md, run as written on a run of 12 ranks (issue 32):
DuckDB, pandas, Polars and pyarrow give ``rank`` (the ``rank=<r>`` folders of the columnar tables) as an
integer, so ranks sort as numbers (0, 1, 2, ..., 10, 11), not as the folders' text (0, 1, 10, 11, 2, ...)."""

from __future__ import annotations

import re
from pathlib import Path

import duckdb
import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from trainmon.anomaly.log import AnomalyLog
from trainmon.run.columnar import SegmentWriter
from trainmon.run.layout import stats_rank_dir
from trainmon.run.records import Anomaly
from trainmon.run.statstore import STATS_OPTIONS, STATS_SCHEMA, StatEncoder

DOCS = Path(__file__).resolve().parents[1] / "docs"
RANKS, STEPS = 12, 160
TENSORS = (("actv", "layers.3.output"), ("grad_reduced", "layers.3.mlp.weight"),
           ("grad_reduced", "layers.0.mlp.fc1.weight"))  # fmt: skip


def _first_bad(rank: int) -> int:
    return 100 + (RANKS - 1 - rank) * 3  # rank 11 first, rank 0 last: the answer's order is not the folders'


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("queries") / "run"
    for rank in range(RANKS):
        encoder = StatEncoder()
        kinds, names = encoder.indices(list(TENSORS))
        store = SegmentWriter(stats_rank_dir(run, rank), STATS_SCHEMA, STATS_OPTIONS)
        with AnomalyLog(run, rank) as log:
            for step in range(STEPS):
                bad = step >= _first_bad(rank)
                nans = np.array([0.0, 4.0 if bad else 0.0, 0.0])
                top = np.array([1.0 + rank + step / 1000, 2.0, 3.0])
                values = {"min": -top, "max": top, "mean": top / 10, "norm": top * 4, "zeros": np.zeros(3),
                          "nans": nans, "infs": np.zeros(3)}  # fmt: skip
                store.append(encoder.encode(step, kinds, names, values), step)
                if bad:
                    log.write_step(step, [Anomaly(step, rank, "grad_reduced", "layers.3.mlp.weight", "nans",
                                                  4.0, "nan", collectives=rank % 3)])  # fmt: skip
                log.end_step(step, 1e9 + step, grad_norm=float(rank))
        assert store.close()
    return run


def _blocks(doc: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", (DOCS / doc).read_text(), flags=re.S)


def _statements(doc: str) -> list[str]:
    sql = "\n".join(_blocks(doc, "sql"))
    sql = "\n".join(line.split("--", 1)[0] for line in sql.splitlines())
    return [s.strip() for s in sql.split(";") if s.strip()]


@pytest.mark.parametrize("doc", ["output.md", "anomalies.md"])
def test_the_docs_duckdb_queries_give_ranks_as_integers_in_numeric_order(run, doc):
    statements = _statements(doc)
    assert statements
    for sql in statements:
        result = duckdb.sql(sql.replace("RUN/", f"{run}/"))
        columns = dict(zip(result.columns, map(str, result.types), strict=True))
        ranks = [c for c in columns if c in ("rank", "on_rank")]
        assert ranks, sql
        for c in ranks:
            assert columns[c] == "INTEGER", (sql, columns)
        rows = result.fetchall()
        if "ORDER BY first_step, rank" in sql:  # ranks 11, 10, ..., 0: numbers, not text
            assert [r[0] for r in rows] == list(range(RANKS - 1, RANKS - 11, -1)), rows
            assert [r[1] for r in rows] == [_first_bad(r) for r in range(RANKS - 1, RANKS - 11, -1)]
        elif "arg_max(rank, max)" in sql:
            assert {r[2] for r in rows} == {RANKS - 1}  # the largest activation: the last rank's
        elif "ORDER BY rank, step" in sql:
            assert [r[0] for r in rows] == sorted(r[0] for r in rows) and len(rows) == RANKS * STEPS
            assert rows[STEPS * 10][0] == 10  # rank 10 after rank 9
        elif "step = 150" in sql:  # every rank's NaN record at step 150, by rank
            at = result.columns.index("rank")
            assert [r[at] for r in rows] == list(range(RANKS))
        elif "rule IN ('nan', 'inf')" in sql:
            assert rows[0][:2] == (RANKS - 1, _first_bad(RANKS - 1))


def test_the_docs_python_reads_give_ranks_as_integers(run, monkeypatch):
    [code] = [b for b in _blocks("output.md", "python") if "pd.read_parquet" in b and "pl.scan_parquet" in b]
    monkeypatch.chdir(run.parent)
    scope: dict = {}
    exec(code.replace('"RUN/', f'"{run.name}/'), scope)  # noqa: S102 - the docs' own code
    stats, norms, table = scope["stats"], scope["norms"], scope["table"]
    assert pd.api.types.is_integer_dtype(stats["rank"])
    assert stats.groupby("rank").size().index.tolist() == list(range(RANKS))  # numeric order
    assert norms["rank"].dtype.is_integer() and sorted(norms["rank"].unique().to_list()) == list(range(RANKS))
    assert table.num_rows == STEPS * len(TENSORS) and pa.types.is_integer(table.schema.field("step").type)
