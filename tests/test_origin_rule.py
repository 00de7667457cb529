"""One rule for where a NaN/Inf started (docs/anomalies.md, trainmon/anomaly/origin.py), and every reader
agrees with it: the anomaly records, the alert line, ``trainmon analyze``, ``--explain`` and the plugin (its
"first nan" button and its origin badge; the browser side is in test_plugin_ui.py).

The runs (tests/origin_cases.py) make the NaN in a leaf or in a parent's own code, one, two and three levels
deep, in forward or in backward. In backward a parent whose output is a child's output (a Sequential, or a
block whose last child makes its result) records its ``output_grad`` right after the child's, between the
child's ``output_grad`` and ``input_grad``: the call pairing must not split the child's call there."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from origin_cases import CASES, NAN_STEP, Case, write_case_run
from test_origin import anomalies_of, record_of
from test_plugin_routes import get, make_client

from trainmon.anomaly.origin import locate_overflow, mark
from trainmon.cli import main
from trainmon.read.explain import explain
from trainmon.run import records
from trainmon.run.anomaly_table import read_anomalies
from trainmon.run.records import Anomaly

NAN, F32 = math.nan, "torch.float32"


def test_a_parents_output_grad_between_a_childs_rows_does_not_split_the_childs_call():
    """The issue's block ``x + f(mlp(x))`` with ``f``'s backward making the NaN: ``1.mlp``'s output is its
    last child's, so ``1.mlp.output_grad`` fires between ``1.mlp.2.output_grad`` and
    ``1.mlp.2.input_grad``."""
    record = record_of([
        ("actv", "1.input", 1, F32), ("actv", "1.output", 1, F32),
        ("actv_grad", "1.output_grad", 1, F32),  # flows into the block clean
        ("actv_grad", "1.mlp.2.output_grad", NAN, F32),
        ("actv_grad", "1.mlp.output_grad", NAN, F32),  # the parent's, between its child's two rows
        ("actv_grad", "1.mlp.2.input_grad", NAN, F32),
        ("actv_grad", "1.mlp.0.output_grad", NAN, F32), ("actv_grad", "1.mlp.0.input_grad", NAN, F32),
        ("actv_grad", "1.mlp.input_grad", NAN, F32),
        ("actv_grad", "1.input_grad", NAN, F32),  # the origin: the block's own backward
        ("actv_grad", "0.output_grad", NAN, F32), ("actv_grad", "0.input_grad", NAN, F32),
    ])  # fmt: skip
    overflow = locate_overflow(record, records.Derived(record))
    assert (overflow.module, overflow.kind, overflow.origin_seqs) == ("1", "actv_grad", {9})
    assert overflow.propagated_seqs == {5, 7, 8, 11}
    assert overflow.burst_start == 3  # the first bad row of the block's descendants
    marked = sorted(mark(anomalies_of(record), overflow), key=lambda a: a.seq)
    assert [(a.name, a.origin) for a in marked[:2]] == [
        ("1.input_grad", True),
        ("1.mlp.2.output_grad", False),
    ]


def test_three_levels_forward_and_backward():
    record = record_of([
        # forward: p.q's own code (between p.q.a and p.q.b) makes the NaN
        ("actv", "p.q.a.input", 1, F32), ("actv", "p.q.a.output", 1, F32),
        ("actv", "p.q.b.input", NAN, F32), ("actv", "p.q.b.output", NAN, F32),
        ("actv", "p.q.input", 1, F32), ("actv", "p.q.output", NAN, F32),
        ("actv", "p.input", 1, F32), ("actv", "p.output", NAN, F32),
    ])  # fmt: skip
    overflow = locate_overflow(record, records.Derived(record))
    assert (overflow.module, overflow.origin_seqs, overflow.propagated_seqs, overflow.burst_start) == (
        "p.q",
        {5},
        {3, 7},
        2,
    )
    backward = record_of([
        ("actv_grad", "p.output_grad", 1, F32), ("actv_grad", "p.q.output_grad", 1, F32),
        ("actv_grad", "p.q.b.output_grad", 1, F32),  # p.q.b is p.q's (and p's) last child
        ("actv_grad", "p.q.b.input_grad", 1, F32),
        ("actv_grad", "p.q.a.output_grad", NAN, F32),  # p.q's own backward made it
        ("actv_grad", "p.q.a.input_grad", NAN, F32),
        ("actv_grad", "p.q.input_grad", NAN, F32), ("actv_grad", "p.input_grad", NAN, F32),
    ])  # fmt: skip
    overflow = locate_overflow(backward, records.Derived(backward))
    assert (overflow.module, overflow.origin_seqs, overflow.propagated_seqs, overflow.burst_start) == (
        "p.q",
        {6},
        {5, 7},
        4,
    )


def test_call_numbers_keep_two_calls_of_one_module_apart():
    record = record_of([
        ("actv", "m.input", 1, F32), ("actv", "m.output", 1, F32),
        ("actv", "m.input#1", 1, F32), ("actv", "m.output#1", NAN, F32),  # the second call makes it
        ("actv_grad", "m.output_grad#1", NAN, F32), ("actv_grad", "m.input_grad#1", NAN, F32),
        ("actv_grad", "m.output_grad", NAN, F32), ("actv_grad", "m.input_grad", NAN, F32),
    ])  # fmt: skip
    overflow = locate_overflow(record, records.Derived(record))
    assert (overflow.module, overflow.call, overflow.origin_seqs, overflow.propagated_seqs) == (
        "m",
        1,
        {3},
        {5, 7},
    )


@pytest.fixture(scope="module")
def case_runs(tmp_path_factory) -> tuple[Path, dict[Case, list]]:
    logdir = tmp_path_factory.mktemp("origin_cases")
    return logdir, {case: write_case_run(logdir / case.run, case) for case in CASES}


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", CASES, ids=[c.run for c in CASES])
def test_every_reader_names_the_origin_of_the_rule(case_runs, case, capsys):
    logdir, alerts = case_runs
    run = logdir / case.run
    written = [a for a in read_anomalies(run, 0) if a.step == NAN_STEP]
    origins = [a for a in written if a.origin]
    assert [(a.kind, a.name) for a in origins] == [(case.kind, case.origin)]
    assert min(written, key=Anomaly.order_key).name == case.origin  # the origin comes first
    # the alert line
    (alert,) = [a for a in alerts[case] if a.step == NAN_STEP]
    assert alert.lines[0].startswith(f"NaN at step {NAN_STEP} rank 0: {case.kind} {case.origin} (origin, ")
    # trainmon analyze
    capsys.readouterr()
    assert main(["analyze", str(run), "--json"]) == 0
    first = json.loads(capsys.readouterr().out)["first"]
    assert (first["kind"], first["name"], first["origin"]) == (case.kind, case.origin, True)
    # --explain: the module's inflow was finite, its outflow not
    e = explain(run)
    assert (e.origin.name, e.module) == (case.origin, case.module)
    assert e.verdict.startswith(f"the inputs of {case.module} were finite")
    assert [(t.name, t.finite) for t in e.tensors if t.role != "param"] == [
        (f"{case.module}.{'input' if case.phase == 'forward' else 'output_grad'}", True),
        (case.origin, False),
    ]
    # the plugin: the "first nan" button (the timeline's first) and the origin badge (the first event)
    client = make_client(logdir)
    first = get(client, f"timeline?run={case.run}")["first"]
    assert (first["kind"], first["name"], first["rule"], first["origin"]) == (
        case.kind,
        case.origin,
        "nan",
        True,
    )
    events = get(client, f"events?run={case.run}&step_lo={NAN_STEP}&step_hi={NAN_STEP}")["events"]
    assert [(ev["name"], ev["origin"]) for ev in events if ev["origin"]] == [(case.origin, True)]
    assert events[0]["name"] == case.origin
