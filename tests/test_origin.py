"""Overflow origin: the first module whose output went non-finite while its inputs were clean, and its place
first among a step's anomalies.

A parent module's hook fires after its children's; when the NaN is born in the parent's own code, the
children it reaches were recorded first. ``trainmon analyze``, the alert's first line and the plugin's
"first" anomaly must still name the parent's output (the origin)."""

from __future__ import annotations

import json
import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import trainmon
from tests.test_plugin_routes import get, make_client
from trainmon.anomaly.origin import bad_rows, locate_overflow, mark
from trainmon.cli import main
from trainmon.demo import DemoSetup, build, lm_loss, synthetic_batch
from trainmon.run import records
from trainmon.run.anomaly_table import read_anomalies
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
    overflow = locate_overflow(record, records.Derived(record))
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
    overflow = locate_overflow(record, records.Derived(record))
    assert (overflow.module, overflow.kind, overflow.origin_seqs, overflow.propagated_seqs) == (
        "b", "actv_grad", {3}, {5})
    clean = record_of([("actv", "a.input", 1, "torch.float32"), ("actv", "a.output", 2, "torch.float32")])
    assert locate_overflow(clean, records.Derived(clean)) is None


def test_saturation_mode_flags_values_at_the_dtype_maximum():
    record = record_of([
        ("actv", "a.input", 1, "torch.float16"), ("actv", "a.output", 65504.0, "torch.float16"),
        ("actv", "b.input", 65504.0, "torch.float32"),  # not saturated for float32
        ("actv", "b.output", 1, "torch.float32"),
    ])  # fmt: skip
    derived = records.Derived(record)
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
    overflow = locate_overflow(record, records.Derived(record))
    assert (overflow.module, overflow.kind) == ("layers.1.mlp.fc2", "actv")
    names = {record.rows[i].name for i in overflow.propagated_seqs}
    assert {"layers.1.mlp.output", "layers.1.output", "layers.2.attn.qkv.output", "output.output"} <= names
    assert "layers.0.output" not in names and "layers.1.mlp.fc1.output" not in names


# ---------------------------------------------------------- the origin comes first, for parents as for leaves
NAN, F32 = math.nan, "torch.float32"


def anomalies_of(record, collectives=None) -> list[Anomaly]:
    """One nan anomaly per bad row, as the sink has them before ``mark`` (collectives per row set)."""
    bad = records.derive(record.partials)["nans"] > 0
    counts = collectives if collectives is not None else np.zeros(len(record.rows), dtype=int)
    return [
        Anomaly(0, 0, r.kind, r.name, "nans", 1.0, "nan", seq=i, collectives=int(counts[i]))
        for i, r in enumerate(record.rows)
        if bad[i]
    ]


def test_parent_origin_moves_before_the_children_it_made_bad():
    record = record_of([
        ("actv", "p.a.input", 1, F32), ("actv", "p.a.output", 1, F32),
        ("actv", "p.b.input", NAN, F32), ("actv", "p.b.output", NAN, F32),  # p's own code between a and b
        ("actv", "p.input", 1, F32), ("actv", "p.output", NAN, F32),  # the origin, recorded last
        ("actv", "q.input", NAN, F32), ("actv", "q.output", NAN, F32),
    ])  # fmt: skip
    overflow = locate_overflow(record, records.Derived(record))
    assert (overflow.module, overflow.origin_seqs, overflow.burst_start) == ("p", {5}, 2)
    collectives = np.array([0, 0, 1, 1, 1, 2, 2, 2])  # p.b issued a collective after its input went bad
    marked = mark(anomalies_of(record, collectives), overflow, collectives)
    by_seq = sorted(marked, key=lambda a: a.seq)
    assert [(a.name, a.seq) for a in by_seq] == [
        ("p.output", 2), ("p.b.input", 3), ("p.b.output", 4), ("q.input", 6), ("q.output", 7)
    ]  # fmt: skip
    assert by_seq[0].origin and by_seq[0].collectives == 1  # as early as the first row it made bad
    assert [a.name for a in by_seq if a.propagated] == ["p.b.output", "q.output"]
    assert min(marked, key=Anomaly.order_key).name == "p.output"


def test_leaf_origin_and_parent_whose_children_stayed_clean_keep_their_seq():
    leaf = record_of([
        ("actv", "p.a.input", 1, F32), ("actv", "p.a.output", NAN, F32),
        ("actv", "p.input", 1, F32), ("actv", "p.output", NAN, F32),
    ])  # fmt: skip
    overflow = locate_overflow(leaf, records.Derived(leaf))
    assert (overflow.module, overflow.burst_start) == ("p.a", 1)
    assert [(a.name, a.seq, a.origin) for a in mark(anomalies_of(leaf), overflow)] == [
        ("p.a.output", 1, True), ("p.output", 3, False)
    ]  # fmt: skip
    late = record_of([  # the NaN was made after p's last child
        ("actv", "p.a.input", 1, F32), ("actv", "p.a.output", 1, F32),
        ("actv", "p.input", 1, F32), ("actv", "p.output", NAN, F32),
    ])  # fmt: skip
    overflow = locate_overflow(late, records.Derived(late))
    assert (overflow.module, overflow.burst_start) == ("p", 3)
    assert [(a.seq, a.origin) for a in mark(anomalies_of(late), overflow)] == [(3, True)]


def test_backward_parent_origin_moves_before_its_children_grads():
    record = record_of([
        ("actv", "p.input", 1, F32), ("actv", "p.output", 1, F32),
        ("actv_grad", "p.output_grad", 1, F32),  # flows in clean
        ("actv_grad", "p.b.output_grad", NAN, F32), ("actv_grad", "p.b.input_grad", NAN, F32),
        ("actv_grad", "p.input_grad", NAN, F32),  # the origin: p's own backward made the NaN
    ])  # fmt: skip
    overflow = locate_overflow(record, records.Derived(record))
    assert (overflow.module, overflow.kind, overflow.burst_start) == ("p", "actv_grad", 3)
    marked = sorted(mark(anomalies_of(record), overflow), key=lambda a: a.seq)
    assert [(a.name, a.seq) for a in marked] == [
        ("p.input_grad", 3), ("p.b.output_grad", 4), ("p.b.input_grad", 5)
    ]  # fmt: skip


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(8, 8)
        self.register_buffer("gate", torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the block's own code between two children: where the NaN is born
        return x + self.fc2(self.act(self.fc(x) * self.gate))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


NAN_STEP = 2
ORIGIN = "layers.1.output"


def test_analyze_alert_and_plugin_name_the_parent_origin_first(tmp_path, capsys):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    alerts = []
    config = {"xy_distribution": True, "all_xy": True, "alert": {"rate_limit_s": 0}}
    run = tmp_path / "logs" / "run"
    with trainmon.attach(model, opt, config=config, logdir=run, on_alert=alerts.append):
        for step in range(NAN_STEP + 1):
            if step == NAN_STEP:
                model.layers[1].gate[3] = float("nan")
            F.mse_loss(model(torch.randn(4, 8)), torch.zeros(4, 2)).backward()
            opt.step()
            opt.zero_grad()
    written = list(read_anomalies(run, 0))
    # the children's rows were recorded before the block's: without reordering they would come first
    assert "layers.1.act.input" in {a.name for a in written}
    assert written[0].name == ORIGIN and written[0].origin
    # trainmon analyze
    capsys.readouterr()
    assert main(["analyze", str(run), "--json"]) == 0
    first = json.loads(capsys.readouterr().out)["first"]
    assert (first["name"], first["step"], first["origin"]) == (ORIGIN, NAN_STEP, True)
    # the alert: its first line is the origin's
    (alert,) = [a for a in alerts if a.step == NAN_STEP]
    assert alert.anomalies[0].name == ORIGIN and ORIGIN in alert.lines[0]
    # the plugin: the timeline's "first" and the first event of the step
    client = make_client(tmp_path / "logs")
    t = get(client, "timeline?run=run&axis=module")
    assert (t["first"]["name"], t["first"]["origin"]) == (ORIGIN, True)
    assert t["rows"][0] == ORIGIN  # the module axis lists tensors by first anomaly too
    events = get(client, f"events?run=run&step_lo={NAN_STEP}&step_hi={NAN_STEP}")["events"]
    assert events[0]["name"] == ORIGIN
