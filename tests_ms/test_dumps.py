"""``alert.dump``: the tensors of the Cell where the NaN started are saved at their next occurrence, in the
PyTorch monitor's dump files and index, and hold exactly the values the step's statistics describe."""

from __future__ import annotations

import numpy as np
from conftest import NAN_STEP
from safetensors.numpy import load_file
from test_stats import assert_partials, reference

from trainmon.run.anomaly_table import read_anomalies
from trainmon.run.dumps import list_dumps


def test_origin_cell_is_dumped_at_its_next_occurrence(nan_run):
    run, records = nan_run
    entries = list_dumps(run)
    dumped = {(e.step, e.kind, e.name) for e in entries}
    origin = {
        (NAN_STEP + 1, "actv", "bad.input"),
        (NAN_STEP + 1, "actv", "bad.output"),
        (NAN_STEP + 1, "actv_grad", "bad.output_grad"),
        (NAN_STEP + 1, "actv_grad", "bad.input_grad"),
    }
    assert origin <= dumped  # the origin Cell's request ("bad.*"), then the flagged tensors' own
    assert {e.step for e in entries} == {NAN_STEP + 1}
    # the anomalies of the NaN step link to the requests that produced the dumps
    linked = {a.dump.removeprefix("request:") for a in read_anomalies(run, 0) if a.dump}
    assert {e.reason.removeprefix("request ") for e in entries} <= linked
    record = records[NAN_STEP + 1]
    partials = {(r.kind, r.name): p for r, p in zip(record.rows, record.partials, strict=True)}
    for e in entries:
        assert e.reason.startswith(f"request anomaly-step{NAN_STEP}-") and e.dtype == "float32"
        tensor = load_file(str(run / e.path))["tensor"]
        assert tensor.dtype == np.float32 and tuple(tensor.shape) == e.shape
        assert_partials(partials[e.kind, e.name], reference(tensor, 1e-8))
