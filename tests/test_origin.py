"""Overflow origin: the first module whose output went non-finite while its inputs were clean."""

from __future__ import annotations

import math

import numpy as np
import torch

import trainmon
from trainmon.anomaly.origin import bad_rows, locate_overflow, mark
from trainmon.demo import DemoSetup, build, lm_loss, synthetic_batch
from trainmon.run import records
from trainmon.run.records import Anomaly, Row, StepRecord


def record_of(rows_and_values: list[tuple[str, str, float, str]]) -> StepRecord:
    """Rows (kind, name, max value, dtype) with 4 elements each; a NaN/inf max makes the row non-finite."""
    rows, partials = [], []
    for kind, name, value, dtype in rows_and_values:
        rows.append(Row(kind, name, 0, 0, "forward" if kind == "actv" else "backward", (4,), dtype))
        p = np.array([4, 0, 0, 0, -1.0, 1.0, 0.0, 4.0])
        if math.isnan(value):
            p[records.NANS] = 1
        elif math.isinf(value):
            p[records.INFS] = 1
        else:
            p[records.MAX] = value
        partials.append(p)
    return StepRecord(0, 0, tuple(rows), np.array(partials), 0.0)


def test_first_call_with_clean_inputs_and_bad_output_is_the_origin():
    record = record_of([
        ("actv", "a.input", 1, "torch.float32"), ("actv", "a.output", 1, "torch.float32"),
        ("actv", "b.input", 1, "torch.float32"), ("actv", "b.output", math.nan, "torch.float32"),  # origin
        ("actv", "c.input", math.nan, "torch.float32"), ("actv", "c.output_0", math.inf, "torch.float32"),
        ("actv", "c.output_1", 1, "torch.float32"),
        ("actv", "parent.input", 1, "torch.float32"), ("actv", "parent.output", math.nan, "torch.float32"),
        ("actv_grad", "c.output_grad", math.nan, "torch.float32"),
        ("actv_grad", "c.input_grad", math.nan, "torch.float32"),
    ])  # fmt: skip
    overflow = locate_overflow(record, records.derive(record.partials))
    assert overflow.module == "b" and overflow.kind == "actv"
    assert overflow.origin_seqs == {3}
    # c's output and the parent's output (which fired after its children) propagate it; so does backward
    assert overflow.propagated_seqs == {5, 8, 10}
    anomalies = [Anomaly(0, 0, r.kind, r.name, "nans", 1.0, "nan", seq=i) for i, r in enumerate(record.rows)]
    marked = mark(anomalies, overflow)
    assert [a.seq for a in marked if a.origin] == [3]
    assert [a.seq for a in marked if a.propagated] == [5, 8, 10]


def test_backward_origin_and_clean_step():
    f32, inf = "torch.float32", math.inf
    record = record_of([
        ("actv", "a.input", 1, f32), ("actv", "a.output", 1, f32),
        ("actv_grad", "b.output_grad", 1, f32), ("actv_grad", "b.input_grad", inf, f32),  # the origin
        ("actv_grad", "a.output_grad", inf, f32), ("actv_grad", "a.input_grad", inf, f32),  # propagation
    ])  # fmt: skip
    overflow = locate_overflow(record, records.derive(record.partials))
    assert (overflow.module, overflow.kind, overflow.origin_seqs, overflow.propagated_seqs) == (
        "b", "actv_grad", {3}, {5})
    clean = record_of([("actv", "a.input", 1, "torch.float32"), ("actv", "a.output", 2, "torch.float32")])
    assert locate_overflow(clean, records.derive(clean.partials)) is None


def test_saturation_mode_flags_values_at_the_dtype_maximum():
    record = record_of([
        ("actv", "a.input", 1, "torch.float16"), ("actv", "a.output", 65504.0, "torch.float16"),
        ("actv", "b.input", 65504.0, "torch.float32"),  # not saturated for float32
        ("actv", "b.output", 1, "torch.float32"),
    ])  # fmt: skip
    derived = records.derive(record.partials)
    assert locate_overflow(record, derived) is None
    assert list(bad_rows(record, derived, saturation=True)) == [False, True, False, False]
    assert locate_overflow(record, derived, saturation=True).module == "a"


def test_origin_of_a_nan_weight_in_a_real_model(tmp_path):
    setup = DemoSetup()
    model, optimizer = build(setup)
    with torch.no_grad():
        model.layers[1].mlp.fc2.weight[0, 0] = float("nan")
    generator = torch.Generator().manual_seed(0)
    config = {"xy_distribution": True, "all_xy": True}
    with trainmon.attach(model, optimizer, config=config, logdir=tmp_path / "run") as mon:
        loss = lm_loss(model, synthetic_batch(setup, generator))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        record, ready = mon._latest  # the finished step's host record (what the writer thread receives)
    overflow = locate_overflow(record, records.derive(record.partials))
    assert (overflow.module, overflow.kind) == ("layers.1.mlp.fc2", "actv")
    names = {record.rows[i].name for i in overflow.propagated_seqs}
    assert {"layers.1.mlp.output", "layers.1.output", "layers.2.attn.qkv.output", "output.output"} <= names
    assert "layers.0.output" not in names and "layers.1.mlp.fc1.output" not in names
