"""A NaN injected in one Cell of a MindSpore network is named by ``trainmon analyze`` as the origin."""

from __future__ import annotations

import contextlib
import io
import json

from conftest import NAN_STEP

from trainmon.cli import main
from trainmon.run.anomaly_table import read_anomalies


def analyze(*args: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["analyze", *args])
    return code, out.getvalue()


def test_analyze_names_the_poisoned_cell(nan_run):
    run, records = nan_run
    code, text = analyze(str(run), "--json")
    assert code == 0
    report = json.loads(text)
    first = report["first"]
    assert (first["step"], first["name"], first["kind"], first["rule"]) == (
        NAN_STEP,
        "bad.output",
        "actv",
        "nan",
    )
    assert first["origin"] is True and first["value"] == 1.0 and first["phase"] == "forward"
    # the anomalies on disk are exactly the non-finite rows of the records, from the NaN step on
    written = list(read_anomalies(run, 0))
    expected = {
        (rec.step, row.kind, row.name)
        for rec in records
        for row, (nans, infs) in zip(rec.rows, rec.partials[:, 1:3], strict=True)
        if nans or infs
    }
    assert {(a.step, a.kind, a.name) for a in written if a.rule == "nan"} == expected
    assert min(step for step, _, _ in expected) == NAN_STEP
    assert report["anomalies"] == len(written)
    code, text = analyze(str(run))
    assert code == 0 and "actv bad.output nans = 1 [nan]" in text and "origin       yes" in text
