"""``trainmon compare`` of runs whose gradients before reduction hold different things (issue 50, point 4).

FSDP2's ``grad_unreduced`` is each micro-batch's own gradient, one stored row per micro-step, which the
statistics store merges (element counts add up); every other framework's is the step's accumulated gradient,
one row a step. Such a pair is left out of the comparison and said once in the report, never called a
divergence; everything else compares as before. The pairing on hand-made metadata, the report on hand-made
stores, and a real pair: the same network on 2 gloo ranks with 2 micro-batches a step under DDP and under
FSDP2 (tests/compare_fsdp_worker.py), with and without a planted change."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import compare_fsdp_worker as worker
import numpy as np
import pytest
from launch import free_port, run_ranks

from trainmon.cli import main
from trainmon.read.compare.engine import RankTally, Result, StepRow
from trainmon.read.compare.microbatch import LeftOut, describe, micro_batches, per_row
from trainmon.read.compare.plan import make_plan
from trainmon.read.compare.report import summary, text
from trainmon.read.compare.source import RunInfo
from trainmon.read.compare.tensors import phase_of
from trainmon.read.compare.tolerance import Tolerance
from trainmon.read.compare.verdict import judge
from trainmon.run.records import (
    MAX,
    MIN,
    N_PARTIALS,
    NUMEL,
    SUM,
    SUMSQ,
    Derived,
    Row,
    StepRecord,
    TensorGroups,
)
from trainmon.run.statstore import TensorMeta, read_meta
from trainmon.writer.statstore import StatStoreSink

pytestmark = pytest.mark.timeout(300)

WORKER = Path(worker.__file__)
JOBS = ("ddp", "fsdp", "fsdp:eps", "fsdp:lr")
PARAMS = 14  # two blocks of (fc1, norm, fc2) weights and biases, and the head's
# every parameter's reduced gradient, parameters before and after the update and Adam moments; the input,
# output and output gradient of 11 modules (the blocks, their layers, the head), and the input gradient of
# all but the two whose input is the data
COMPARED = 5 * PARAMS + 3 * 11 + 9


def _meta(rows: list[tuple[str, str, str, int]]) -> TensorMeta:
    """(kind, name, shape, numel) per tensor, float32."""
    return TensorMeta(
        tuple((k, n) for k, n, _, _ in rows),
        ("float32",) * len(rows),
        tuple(s for _, _, s, _ in rows),
        tuple(c for *_, c in rows),
    )


# a DDP-like rank (the step's accumulated gradient) and an FSDP2-like one (each micro-batch's own), 2
# micro-batches a step: the activations of both hold 2 micro-batches a row
DDP = [("actv", "fc.input", "[4, 8]", 64), ("grad_unreduced", "fc.weight", "[16, 8]", 128),
       ("grad_unreduced", "fc.bias", "[16]", 16), ("grad_reduced", "fc.weight", "[16, 8]", 128),
       ("grad_reduced", "fc.bias", "[16]", 16)]  # fmt: skip
FSDP = [("actv", "fc.input", "[4, 8]", 64), ("grad_unreduced", "fc.weight", "[16, 8]", 256),
        ("grad_unreduced", "fc.bias", "[16]", 32), ("grad_reduced", "fc.weight", "[16, 8]", 128),
        ("grad_reduced", "fc.bias", "[16]", 16)]  # fmt: skip


# ------------------------------------------------------------------------------------------- the pairing


def test_a_row_holds_numel_over_the_shapes_elements_when_both_are_known_and_it_is_whole():
    assert per_row("[16, 8]", 256) == 2 and per_row("(16, 8)", 128) == 1 and per_row("[]", 3) == 3
    assert per_row(None, 128) is None and per_row("[16, 8]", -1) is None  # a store without metadata
    assert per_row("[16, 8]", 200) is None  # micro-batches of other shapes: no whole count
    assert per_row("[0, 8]", 0) is None and per_row("[a]", 4) is None
    assert micro_batches(_meta(DDP)) == 2 and micro_batches(_meta(DDP[1:])) is None


def test_the_pairing_leaves_out_unreduced_gradients_whose_rows_hold_other_micro_batch_counts():
    a, b = _meta(DDP), _meta(FSDP)
    plan = make_plan(0, a.tensors, b.tensors, a, b, Tolerance())
    assert [(p.kind, p.name) for p in plan.pairs] == [("actv", "fc.input"), ("grad_reduced", "fc.weight"),
                                                      ("grad_reduced", "fc.bias")]  # fmt: skip
    assert plan.ia.tolist() == [0, 3, 4] and plan.ib.tolist() == [0, 3, 4] and len(plan.rtol) == 3
    assert plan.left_out == (
        LeftOut("grad_unreduced", "fc.weight", "fc.weight", 1, 2, 2, 2),
        LeftOut("grad_unreduced", "fc.bias", "fc.bias", 1, 2, 2, 2),
    )
    assert plan.alignment.only_a == plan.alignment.only_b == ()  # paired, not unmatched
    # the same run twice, counts unknown on one side, or no whole count: compared as before
    for other in (DDP, [(k, n, s, -1) for k, n, s, _ in FSDP], [(k, n, None, c) for k, n, _, c in FSDP],
                  [(k, n, s, c + 1 if k == "grad_unreduced" else c) for k, n, s, c in FSDP]):  # fmt: skip
        b = _meta(other)
        plan = make_plan(0, a.tensors, b.tensors, a, b, Tolerance())
        assert len(plan.pairs) == 5 and plan.left_out == ()
    # another kind whose counts differ is a real difference (another batch): compared, and it diverges
    b = _meta([("actv", "fc.input", "[4, 8]", 32), *FSDP[1:]])
    plan = make_plan(0, a.tensors, b.tensors, a, b, Tolerance())
    assert ("actv", "fc.input") in [(p.kind, p.name) for p in plan.pairs] and len(plan.left_out) == 2


def test_what_a_run_holds_in_words():
    assert describe(1, 2, False) == "each rank's gradient summed over the step's 2 micro-batches"
    assert describe(1, None, None) == "each rank's gradient accumulated over the step's micro-batches"
    assert describe(2, 2, False) == "each micro-batch's own gradient (FSDP2), 2 a step"
    assert "the running sum otherwise: monitor_mbs_grad" in describe(2, 2, True)


# ------------------------------------------------------------------------------------------- the report


def _info(path: Path, world: int = 2) -> RunInfo:
    return RunInfo(path, (0,), world, "pytorch", {0: 0}, {0: 0}, False)


def test_the_report_says_once_what_was_left_out_with_a_count_and_an_example(tmp_path):
    a, b = _meta(DDP), _meta(FSDP)
    plans = [make_plan(r, a.tensors, b.tensors, a, b, Tolerance()) for r in (0, 1)]
    result = Result([RankTally(r, plan=plans[r], steps=1, step_lo=0, step_hi=0) for r in (0, 1)], 1, 1, False)
    doc = summary(result, None, _info(tmp_path / "a"), _info(tmp_path / "b"))
    assert doc["tensors_compared"] == 3 and doc["diverged"] is False
    assert doc["left_out"] == [
        {
            "kind": "grad_unreduced",
            "tensors": 2,  # both ranks' pairs: the same two tensors
            "why": "the runs' rows hold a different number of micro-batches' gradients",
            "rows_a": 1,
            "rows_b": 2,
            "a": "each rank's gradient summed over the step's 2 micro-batches",
            "b": "each micro-batch's own gradient (FSDP2), 2 a step",
            "names": [["fc.weight", "fc.weight"], ["fc.bias", "fc.bias"]],
            "compared_instead": "grad_reduced",
        }
    ]
    lines = [line for line in text(doc).splitlines() if line.startswith("not compared")]
    assert lines == [
        "not compared: grad_unreduced of 2 tensors (e.g. fc.weight), whose runs hold different things: A "
        "each rank's gradient summed over the step's 2 micro-batches, B each micro-batch's own gradient "
        "(FSDP2), 2 a step; grad_reduced is compared"
    ]
    json.dumps(doc)  # plain JSON


def test_a_reduced_gradient_diverging_says_the_unreduced_one_was_not_comparable(tmp_path):
    a, b = _meta(DDP), _meta(FSDP)
    plan = make_plan(0, a.tensors, b.tensors, a, b, Tolerance())
    score = np.asarray([0.0, 5.0, 0.0])  # the reduced fc.weight
    stats = {s: np.ones(3) for s in ("min", "max", "mean", "norm", "zeros", "nans", "infs", "numel")}
    row = StepRow(0, 0, plan, score / 1e4, score, np.zeros(3), stats, stats, float("nan"))
    result = Result([RankTally(0, plan=plan, steps=1, step_lo=0, step_hi=0, first=row)], 1, 1, False)
    verdict = judge(result, _info(tmp_path / "a"), _info(tmp_path / "b"))
    assert (verdict.cause, verdict.stage) == ("reduction", "reduction")
    assert "not comparable between the runs" in verdict.summary
    assert any("hold different things in the two runs" in note for note in verdict.notes)


def _write(
    run: Path, per_micro: bool, changed: bool = False, steps: int = 3, only: str | None = None
) -> None:
    """A one-rank store of fc's input (2 micro-batches a row), its gradients before and after reduction:
    the one before as one row a step (``per_micro``: two), every value the same at each step; ``only``:
    that kind alone."""
    tensors = [("actv", "fc.input", (4, 8), 64), ("grad_unreduced", "fc.weight", (16, 8), 256 if per_micro
               else 128), ("grad_reduced", "fc.weight", (16, 8), 128)]  # fmt: skip
    tensors = [t for t in tensors if only in (None, t[0])]
    sink = StatStoreSink(run, 0)
    layout = tuple(Row(k, n, 0, 0, phase_of(k), s, "torch.float32") for k, n, s, _ in tensors)
    groups = TensorGroups(layout)
    for step in range(steps):
        p = np.zeros((len(layout), N_PARTIALS))
        p[:, NUMEL] = [c for *_, c in tensors]
        p[:, MIN], p[:, MAX], p[:, SUM], p[:, SUMSQ] = -1.0, 1.0, 0.1, p[:, NUMEL] * 0.3
        kinds = [k for k, *_ in tensors]
        if "grad_unreduced" in kinds and per_micro:  # a concatenation's norm is not the sum's
            p[kinds.index("grad_unreduced"), SUMSQ] *= 0.7
        if changed and step == 1:
            p[kinds.index("grad_reduced"), MAX] = 1.5  # the reduced gradient of step 1
        record = StepRecord(step, 0, layout, p, 0.0)
        sink.write(record, Derived(record, groups))
    sink.close()


def test_the_command_line_leaves_the_pair_out_and_still_finds_a_change(tmp_path, capsys):
    _write(tmp_path / "ddp", False)
    _write(tmp_path / "fsdp", True)
    _write(tmp_path / "fsdp_changed", True, changed=True)
    assert main(["compare", str(tmp_path / "ddp"), str(tmp_path / "fsdp"), "--no-report"]) == 0
    out = capsys.readouterr().out
    assert (
        "no divergence" in out and out.count("not compared: grad_unreduced of 1 tensor (e.g. fc.weight)") == 1
    )
    assert (
        main(["compare", str(tmp_path / "ddp"), str(tmp_path / "fsdp_changed"), "--no-report", "--json"]) == 1
    )
    doc = json.loads(capsys.readouterr().out)
    first = doc["first_divergence"]
    assert (first["step"], first["kind"], first["name"], first["cause"]) == (1, "grad_reduced", "fc.weight",
                                                                             "reduction")  # fmt: skip
    assert doc["left_out"][0]["tensors"] == 1 and doc["tensors_compared"] == 2
    # nothing but such pairs: nothing to compare, said as what it is (exit status 2)
    _write(tmp_path / "ddp_only", False, only="grad_unreduced")
    _write(tmp_path / "fsdp_only", True, only="grad_unreduced")
    assert main(["compare", str(tmp_path / "ddp_only"), str(tmp_path / "fsdp_only"), "--no-report"]) == 2
    err = capsys.readouterr().err
    assert "every tensor that pairs up on rank 0 is a grad_unreduced" in err and "(A 1, B 2 a step" in err


# ------------------------------------------------------------------------------------------- real runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Every job of :data:`JOBS` on 2 gloo ranks, in one launch."""
    out = tmp_path_factory.mktemp("fsdp_runs")
    run_ranks(
        [sys.executable, str(WORKER), str(out), str(free_port()), *JOBS], 2, env={"OMP_NUM_THREADS": "1"}
    )
    return {job: out / job.replace(":", "_") for job in JOBS}


def _compare(capsys, a: Path, b: Path) -> tuple[int, dict]:
    rc = main(["compare", str(a), str(b), "--json", "--no-report"])
    captured = capsys.readouterr()
    assert rc in (0, 1), captured.err
    return rc, json.loads(captured.out)


def test_the_stores_hold_one_gradient_a_step_under_ddp_and_one_a_micro_batch_under_fsdp2(runs):
    for job, rows in (("ddp", 1), ("fsdp", worker.MICRO)):
        for rank in (0, 1):
            meta = read_meta(runs[job], rank)
            found = {per_row(s, n) for (k, _), s, n in zip(meta.tensors, meta.shapes, meta.numel, strict=True)
                     if k == "grad_unreduced"}  # fmt: skip
            assert found == {rows}, (job, rank)
            assert sum(k == "grad_unreduced" for k, _ in meta.tensors) == PARAMS
            assert micro_batches(meta) == worker.MICRO


def test_ddp_against_fsdp2_agrees_and_says_the_unreduced_gradients_were_not_compared(runs, capsys):
    rc = main(["compare", str(runs["ddp"]), str(runs["fsdp"]), "--no-report"])
    out = capsys.readouterr().out
    assert rc == 0 and "no divergence" in out, out
    said = [line for line in out.splitlines() if line.startswith("not compared:")]
    assert len(said) == 1 and said[0].startswith(f"not compared: grad_unreduced of {PARAMS} tensors")
    assert "A each rank's gradient summed over the step's 2 micro-batches" in said[0]
    assert "B each micro-batch's own gradient (FSDP2), 2 a step; grad_reduced is compared" in said[0]
    rc, doc = _compare(capsys, runs["ddp"], runs["fsdp"])
    assert rc == 0 and doc["diverged"] is False and doc["ranks"] == [0, 1]
    (group,) = doc["left_out"]
    assert (group["kind"], group["tensors"], group["rows_a"], group["rows_b"]) == (
        "grad_unreduced", PARAMS, 1, 2)  # fmt: skip
    assert doc["divergent_tensors"] == [] and doc["tensors_compared"] == COMPARED
    # the other way round: the same, each run's rows described as its own
    rc, doc = _compare(capsys, runs["fsdp"], runs["ddp"])
    assert rc == 0 and doc["left_out"][0]["a"].startswith("each micro-batch's own gradient")
    # two FSDP2 runs hold the same things: their gradients before reduction are compared
    rc, doc = _compare(capsys, runs["fsdp"], runs["fsdp"])
    assert rc == 0 and doc["left_out"] == [] and doc["tensors_compared"] == COMPARED + PARAMS


@pytest.mark.parametrize(
    ("job", "where"),
    [
        ("fsdp:eps", ("actv", "module.blocks.1.norm.output", "blocks.1.norm.output", "forward")),
        ("fsdp:lr", ("param_updated", "module.blocks.0.fc1.weight", "blocks.0.fc1.weight", "update")),
    ],
)
def test_a_planted_change_between_ddp_and_fsdp2_is_still_found(runs, capsys, job, where):
    rc, doc = _compare(capsys, runs["ddp"], runs[job])
    assert rc == 1 and doc["left_out"][0]["kind"] == "grad_unreduced"
    first = doc["first_divergence"]
    assert (first["step"], first["rank"]) == (0, 0)
    assert (first["kind"], first["name"], first["name_b"], first["cause"]) == where
    if job == "fsdp:lr":  # the gradient the optimizer used agrees: the update alone differs
        assert {e["kind"]: e["agrees"] for e in first["evidence"]}["grad_reduced"] is True


def test_the_tabs_comparison_says_what_was_left_out(runs):
    from test_plugin_routes import make_client

    client = make_client(runs["ddp"].parent)
    response = client.get("/data/plugin/trainmon/compare?run_a=ddp&run_b=fsdp&bins=3")
    answer = json.loads(response.get_data(as_text=True))
    assert response.status_code == 200, answer
    assert answer["diverged"] is False and len(answer["pairs"]) == COMPARED
    assert [(g["kind"], g["tensors"]) for g in answer["left_out"]] == [("grad_unreduced", PARAMS)]
