"""``trainmon compare`` on pairs of real runs in different precisions (issue 45, "Comparisons" 1, 2 and 5): a
float32 run against the same training under bfloat16 autocast, with and without a 3% data bug or initial
weights 30% apart. Each tensor is judged at the rounding of the precision it is computed in: the data and
the parameters a step starts from at float32's, the matmuls and everything after them at bfloat16's; the
report says which and why; a data bug is the data at its step, different initial weights are the
parameters, the headline, with a score that says so.

The runs: tests/compare_runs.py (``PRECISION_VARIANTS``; 4 steps of a 4-module network, full coverage)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import compare_runs
import pyarrow.parquet as pq
import pytest

from trainmon.cli import main
from trainmon.read.compare.output import TENSORS_FILE
from trainmon.read.compare.tolerance import PARAM_FACTOR, default_rtol
from trainmon.run.statstore import read_meta, read_stats

pytestmark = pytest.mark.timeout(300)
STEP = compare_runs.DATA_STEP


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("precision")
    out = {}
    for variant in ("base", *compare_runs.PRECISION_VARIANTS):
        out[variant] = root / variant
        compare_runs.train(out[variant], variant)
    return out


def compare(capsys, a: Path, b: Path, *extra: str) -> tuple[int, dict]:
    rc = main(["compare", str(a), str(b), "--json", "--no-report", *extra])
    captured = capsys.readouterr()
    assert rc in (0, 1), captured.err
    return rc, json.loads(captured.out)


def test_the_store_records_the_dtype_each_tensor_was_computed_in(runs):
    meta = read_meta(runs["bf16"], 0)
    dtypes = dict(zip(meta.tensors, meta.dtypes, strict=True))
    # autocast: the data float32, the Linears' outputs bfloat16 (and their gradients); the parameters,
    # their gradients as the optimizer gets them and Adam's state float32
    assert dtypes[("actv", "fc1.input")] == "float32"
    assert dtypes[("actv", "fc1.output")] == dtypes[("actv", "fc2.output")] == "bfloat16"
    assert dtypes[("actv_grad", "fc2.output_grad")] == "bfloat16"
    for kind in ("grad_unreduced", "grad_reduced", "param_origin", "param_updated", "exp_avg", "exp_avg_sq"):
        assert dtypes[(kind, "fc1.weight")] == "float32", kind
    assert set(read_meta(runs["base"], 0).dtypes) == {"float32"}


def test_float32_against_bfloat16_autocast_agrees_and_says_which_tolerance_each_tensor_got(
    runs, capsys, tmp_path
):
    rc = main(["compare", str(runs["base"]), str(runs["bf16"]), "--out", str(tmp_path / "rep")])
    out = capsys.readouterr().out
    assert rc == 0 and "no divergence" in out
    assert "tolerances by the precision each tensor is computed in" in out
    with open(tmp_path / "rep" / TENSORS_FILE, newline="") as f:
        rows = {(r["kind"], r["name"]): r for r in csv.DictReader(f)}
    data, matmul, norm = (
        rows[("actv", "fc1.input")],
        rows[("actv", "fc1.output")],
        rows[("actv", "norm.output")],
    )
    assert (data["dtype"], data["dtype_b"], data["precision"]) == ("float32", "float32", "float32")
    assert float(data["rtol"]) == pytest.approx(default_rtol("float32", 32 * 8), rel=1e-3)
    assert (matmul["dtype"], matmul["dtype_b"], matmul["precision"]) == ("float32", "bfloat16", "bfloat16")
    assert matmul["tolerance_why"] == "bfloat16: B computes it in bfloat16"
    assert float(matmul["rtol"]) == pytest.approx(default_rtol("bfloat16", 32 * 16), rel=1e-3)
    assert norm["precision"] == "bfloat16"
    # float32 as stored, computed in bfloat16 by autocast (the weight gradient), or from it (the update)
    for key in (("grad_unreduced", "fc1.weight"), ("exp_avg", "fc1.weight"), ("param_updated", "fc2.bias")):
        assert (rows[key]["dtype_b"], rows[key]["precision"]) == ("float32", "bfloat16"), key
        assert rows[key]["tolerance_why"].startswith("bfloat16: B computes it after its bfloat16 actv "), key
    origin = rows[("param_origin", "fc1.weight")]
    assert (
        origin["precision"] == "float32" and "the parameters the step starts from" in origin["tolerance_why"]
    )
    assert float(origin["rtol"]) == pytest.approx(default_rtol("float32", 128, kind="param_origin"), rel=1e-3)
    doc = json.loads((tmp_path / "rep" / "summary.json").read_text())
    groups = {(t["precision"], t["tensors"]) for t in doc["tolerances"]}
    assert sum(n for _, n in groups) == 51 and {p for p, _ in groups} == {"float32", "bfloat16"}
    # the rounding is really there: bfloat16's, far beyond float32's tolerance, inside bfloat16's
    diffs = pq.read_table(tmp_path / "rep" / "diffs").to_pandas()
    worst = diffs[(diffs.kind == "actv") & (diffs.name == "fc1.output")]["rel"].max()
    assert 100 * default_rtol("float32", 512) < worst < default_rtol("bfloat16", 512)


@pytest.mark.parametrize("a, b", [("base", "data3"), ("base", "bf16_data3"), ("bf16", "bf16_data3")])
def test_a_3_percent_data_bug_is_the_data_at_its_step_in_any_precision(runs, capsys, a, b):
    rc, doc = compare(capsys, runs[a], runs[b])
    first = doc["first_divergence"]
    assert rc == 1, doc
    where = (first["step"], first["kind"], first["name"], first["phase"], first["cause"])
    assert where == (STEP, "actv", "fc1.input", "forward", "data")
    # judged at float32's rounding, in both runs, with no state slack (the data depends on no parameter)
    assert (first["precision"], first["dtype_a"], first["dtype_b"]) == ("float32", "float32", "float32")
    assert first["tolerance"] == pytest.approx(default_rtol("float32", 32 * 8), rel=1e-6)
    assert first["slack"] == 0
    a_stats, b_stats = read_stats(runs[a], 0), read_stats(runs[b], 0)
    j = a_stats.tensors.index(("actv", "fc1.input"))
    norm_a, norm_b = float(a_stats.values["norm"][STEP, j]), float(b_stats.values["norm"][STEP, j])
    assert norm_b / norm_a == pytest.approx(compare_runs.DATA_ERROR, rel=1e-6)
    assert first["rel"] == pytest.approx(0.03 / 1.03, rel=0.05) and first["score"] > 100


@pytest.mark.parametrize("a, b", [("base", "weights30"), ("base", "bf16_weights30")])
def test_initial_weights_apart_are_the_parameters_headline_with_a_clear_score(runs, capsys, a, b):
    rc, doc = compare(capsys, runs[a], runs[b])
    first = doc["first_divergence"]
    assert rc == 1
    where = (first["step"], first["kind"], first["name"], first["phase"], first["cause"], first["stage"])
    assert where == (0, "param_origin", "fc1.weight", "start", "parameters", "parameters")
    assert "the initial weights" in first["summary"]
    # the score: the weights' own difference over float32's parameter tolerance, no slack (nothing before it)
    assert first["slack"] == 0 and first["precision"] == "float32"
    assert first["rel"] == pytest.approx(0.3 / 1.3, rel=1e-3)
    rtol = default_rtol("float32", 128, kind="param_origin")
    assert rtol == pytest.approx(PARAM_FACTOR * 512 * 2.0**-24 + 4 * 2.0**-24 * 7)
    assert first["score"] == pytest.approx(first["rel"] / rtol, rel=1e-4) and first["score"] > 400
    assert [e["name"] for e in first["evidence"]] == ["fc1.weight"]


def test_the_text_names_the_tolerance_and_counts_as_the_json_does(runs, capsys):
    rc, doc = compare(capsys, runs["base"], runs["weights30"])
    down = doc["downstream"]
    assert main(["compare", str(runs["base"]), str(runs["weights30"]), "--no-report"]) == 1
    out = capsys.readouterr().out
    assert "DIVERGED at step 0, rank 0, phase start: param_origin fc1.weight" in out
    assert "tolerance of float32: the parameters the step starts from, stored in float32 in both runs" in out
    assert (f"{down['tensors']} divergent tensors, {down['cells']} divergent cells over {down['steps']} steps"
            in out)  # fmt: skip
    assert "add --request-dumps" in out


def test_downstream_steps_are_the_steps_holding_the_other_divergent_cells(runs, capsys, tmp_path):
    out = tmp_path / "rep"
    assert main(["compare", str(runs["base"]), str(runs["weights30"]), "--out", str(out), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    diffs = pq.read_table(out / "diffs").to_pandas()
    divergent = diffs[diffs.divergent]
    first = doc["first_divergence"]
    others = divergent[~((divergent.step == first["step"]) & (divergent.kind == first["kind"])
                         & (divergent.name == first["name"]))]  # fmt: skip
    assert doc["downstream"]["cells"] == len(others) > 0
    assert doc["downstream"]["steps"] == others.step.nunique()
    assert doc["downstream"]["at_first_step"] == int((others.step == first["step"]).sum())


def test_no_next_hint_for_dumps_once_they_were_requested(runs, capsys, tmp_path):
    import shutil

    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(runs["base"], a)
    shutil.copytree(runs["data3"], b)
    assert main(["compare", str(a), str(b), "--no-report", "--request-dumps"]) == 1
    out = capsys.readouterr().out
    assert "dump requests:" in out and "written to both runs' requests.jsonl" in out
    assert "add --request-dumps" not in out
