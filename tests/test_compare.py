"""``trainmon compare`` on the statistics of pairs of real training runs (issue 30): the same run twice (no
divergence, deterministic and with reduction-order noise), and one change each: a module's forward, a
module's backward only, one weight gradient only, a gradient only after reduction (2 gloo ranks), an
optimizer hyper-parameter, the data. Each comparison must name the right step, tensor, phase and cause, and
nothing downstream as a cause. Then names (wrappers, MindSpore spellings, call order, --map), different
parallel layouts, the report folder, the dump requests served by a rerun, and bad input.

The runs: tests/compare_runs.py (a 4-module network, 4 steps, full coverage); the 2-rank runs:
tests/compare_worker.py under torch.distributed.run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import compare_runs
import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from trainmon.cli import main
from trainmon.read.compare.output import SUMMARY_FILE, TENSORS_FILE
from trainmon.run.dumps import list_dumps
from trainmon.run.layout import requests_file
from trainmon.run.statstore import read_stats

HERE = Path(__file__).resolve().parent
WORKER = HERE / "compare_worker.py"
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Every variant of tests/compare_runs.py trained once, and the base twice."""
    root = tmp_path_factory.mktemp("runs")
    out = {}
    for variant in (*compare_runs.VARIANTS, "base2"):
        out[variant] = root / variant
        compare_runs.train(out[variant], "base" if variant == "base2" else variant)
    return out


def compare_json(capsys, a: Path, b: Path, *extra: str) -> tuple[int, dict]:
    rc = main(["compare", str(a), str(b), "--json", "--no-report", *extra])
    captured = capsys.readouterr()
    assert rc in (0, 1), captured.err
    return rc, json.loads(captured.out)


def order(run: Path, rank: int = 0) -> list[tuple[str, str]]:
    return list(read_stats(run, rank, ("norm",)).tensors)


# ------------------------------------------------------------------------------------------- no divergence


def test_the_same_run_twice_agrees_exactly(runs, capsys):
    a, b = read_stats(runs["base"], 0), read_stats(runs["base2"], 0)
    assert a.tensors == b.tensors and len(a.tensors) == 51
    for stat in a.values:  # a deterministic run: bitwise the same statistics
        assert np.array_equal(a.values[stat], b.values[stat], equal_nan=True), stat
    rc, doc = compare_json(capsys, runs["base"], runs["base2"])
    assert rc == 0 and doc["diverged"] is False and doc["first_divergence"] is None
    assert doc["steps_compared"] == compare_runs.STEPS and doc["tensors_compared"] == 51
    assert doc["unmatched"]["only_a"] == [] and doc["unmatched"]["only_b"] == []
    assert doc["unmatched"]["paired_by"] == {"exact": 51}


def test_reduction_order_noise_is_no_divergence(runs, capsys, tmp_path):
    rc = main(["compare", str(runs["base"]), str(runs["noise"]), "--out", str(tmp_path / "rep")])
    assert rc == 0
    assert "no divergence" in capsys.readouterr().out
    diffs = pq.read_table(tmp_path / "rep" / "diffs").to_pandas()
    assert len(diffs) == compare_runs.STEPS * 51
    # the noise is there (most tensors differ in their last bits), and well inside the tolerance
    assert (diffs["rel"] > 0).mean() > 0.5
    assert 0 < diffs["score"].max() < 0.5 and not diffs["divergent"].any()
    assert set(diffs.loc[diffs["rel"] > 0, "kind"]) >= {"actv", "actv_grad", "grad_unreduced", "exp_avg"}


# ------------------------------------------------------------------------------------------- one change each

# variant -> (step, kind, name, phase, cause, stage, module, {evidence name: agrees})
CASES = {
    "forward": (0, "actv", "act.output", "forward", "forward", "forward", "act",
                {"act.input": True, "act.output": False}),
    "backward": (0, "actv_grad", "act.input_grad", "backward", "backward", "backward", "act",
                 {"act.output_grad": True, "act.input_grad": False}),
    "wgrad": (0, "grad_unreduced", "fc2.weight", "backward", "weight_gradient", "weight-gradient", "fc2",
              {"fc2.input": True, "fc2.output_grad": True, "fc2.input_grad": True, "fc2.weight": False}),
    "optimizer": (0, "exp_avg", "fc1.weight", "optimizer", "update", "update", "fc1",
                  {"fc1.weight": None}),
    "data": (compare_runs.DATA_STEP, "actv", "fc1.input", "forward", "data", "forward", "fc1",
             {"fc1.input": False}),
}  # fmt: skip


@pytest.mark.parametrize("variant", list(CASES))
def test_one_change_is_named_with_its_step_tensor_phase_and_cause(runs, capsys, variant):
    step, kind, name, phase, cause, stage, module, evidence = CASES[variant]
    rc, doc = compare_json(capsys, runs["base"], runs[variant])
    assert rc == 1 and doc["diverged"] is True
    first = doc["first_divergence"]
    found = (first["step"], first["rank"], first["kind"], first["name"], first["phase"])
    assert found == (step, 0, kind, name, phase)
    assert (first["cause"], first["stage"], first["module"]) == (cause, stage, module)
    assert first["score"] == "inf" or first["score"] > 1
    found = {e["name"]: e["agrees"] for e in first["evidence"] if e["kind"] != "exp_avg_sq"}
    for tensor, agrees in evidence.items():
        if agrees is not None:
            assert found[tensor] is agrees, (tensor, first["evidence"])
    # nothing before it diverges: every tensor earlier in the step's order agrees; everything after it is
    # downstream, counted and listed by its first divergent step, never named as a cause
    tensors = order(runs["base"])
    position = tensors.index((kind, name))
    listed = {(d["kind"], d["name"]): d["first_step"] for d in doc["divergent_tensors"]}
    assert listed[(kind, name)] == step
    assert all(s >= step for s in listed.values())
    earlier = {t for t in tensors[:position]}
    assert not any(t in earlier and s == step for t, s in listed.items())
    assert doc["downstream"]["tensors"] >= 1
    assert sum(1 for k in ("cause",) if k in first) == 1 and "cause" not in doc["downstream"]


def test_the_optimizer_case_says_which_hyper_parameter(runs, capsys):
    _, doc = compare_json(capsys, runs["base"], runs["optimizer"])
    first = doc["first_divergence"]
    assert "beta1" in first["summary"]
    roles = {e["kind"]: e["agrees"] for e in first["evidence"]}
    # Adam's bias correction makes step 0's update independent of beta1: only the first moment differs
    assert roles == {"grad_reduced": True, "param_updated": True, "exp_avg": False, "exp_avg_sq": True}


def test_the_text_report_names_the_divergence_in_one_screen(runs, capsys):
    assert main(["compare", str(runs["base"]), str(runs["wgrad"]), "--no-report"]) == 1
    out = capsys.readouterr().out
    assert "DIVERGED at step 0, rank 0, phase backward: grad_unreduced fc2.weight" in out
    assert "cause [weight-gradient]: the weight-gradient computation of fc2" in out
    assert "agrees  input of fc2" in out and "DIFFERS weight gradient" in out
    assert "downstream (not causes):" in out
    assert len(out.splitlines()) <= 24


@pytest.mark.slow
def test_a_gradient_changed_only_after_reduction_on_two_ranks(tmp_path, capsys):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for variant in ("base", "reduction"):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(WORKER), str(tmp_path / variant), variant]  # fmt: skip
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rc, doc = compare_json(capsys, tmp_path / "base", tmp_path / "reduction")
    assert rc == 1 and doc["ranks"] == [0, 1]
    first = doc["first_divergence"]
    where = (first["step"], first["rank"], first["kind"], first["name"])
    assert where == (0, 0, "grad_reduced", "fc1.weight")
    assert (first["cause"], first["stage"], first["phase"]) == ("reduction", "reduction", "optimizer")
    evidence = {e["kind"]: e["agrees"] for e in first["evidence"]}
    assert evidence == {"grad_unreduced": True, "grad_reduced": False}
    # both ranks diverge there (the reduced gradient is the same on both): rank 1 is downstream, not a cause
    assert {(d["rank"], d["name"], d["first_step"]) for d in doc["divergent_tensors"]} >= {
        (0, "fc1.weight", 0), (1, "fc1.weight", 0)}  # fmt: skip
    # the same training on one rank (the two batches as one) compares on the whole-tensor statistics
    compare_runs.train(tmp_path / "one", "concat")
    rc, doc = compare_json(capsys, tmp_path / "one", tmp_path / "base")
    assert rc == 0 and doc["layout"] == "whole"
    assert doc["not_compared"]["kinds"] == ["actv", "actv_grad", "grad_unreduced"]
    assert doc["tensors_compared"] == 30  # 6 parameters x (grad_reduced, param_origin/updated, exp_avg/_sq)
    assert (doc["not_compared"]["world_size_a"], doc["not_compared"]["world_size_b"]) == (1, 2)
    rc, doc = compare_json(capsys, tmp_path / "one", tmp_path / "reduction")
    first = doc["first_divergence"]
    assert rc == 1 and (first["step"], first["kind"], first["name"]) == (0, "grad_reduced", "fc1.weight")


def _train_micro(run: Path, changed: bool) -> None:
    """Two micro-batches a step, CSV beside the store; ``changed``: micro-batch 1 of step 2 holds another
    sample."""
    import trainmon

    net, opt = compare_runs.build("base")
    config = {**compare_runs.CONFIG, "format": ["tensorboard", "csv"]}
    other = torch.Generator().manual_seed(99)
    with trainmon.attach(net, opt, config=config, logdir=run, grad_acc_steps=2):
        for step, (x, y) in enumerate(compare_runs.batches()):
            opt.zero_grad()
            for micro in range(2):
                xm, ym = x[16 * micro : 16 * (micro + 1)].clone(), y[16 * micro : 16 * (micro + 1)]
                if changed and step == 2 and micro == 1:
                    xm[3] = torch.randn(8, generator=other)
                torch.nn.functional.mse_loss(net(xm), ym).backward()
            opt.step()


def test_the_micro_step_comes_from_the_csv_files(tmp_path, capsys):
    _train_micro(tmp_path / "a", False)
    _train_micro(tmp_path / "b", True)
    rc, doc = compare_json(capsys, tmp_path / "a", tmp_path / "b")
    first = doc["first_divergence"]
    assert rc == 1 and (first["step"], first["micro_step"], first["name"], first["cause"]) == (
        2, 1, "fc1.input", "data")  # fmt: skip
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--no-report"]) == 1
    out = capsys.readouterr().out
    assert "DIVERGED at step 2, micro-step 1, rank 0, phase forward: actv fc1.input" in out


# ------------------------------------------------------------------------------------------- names


def test_wrapper_prefixes_are_aligned_and_the_wrappers_own_rows_listed(runs, capsys):
    rc, doc = compare_json(capsys, runs["base"], runs["wrapped"])
    assert rc == 0 and doc["tensors_compared"] == 51
    assert doc["unmatched"]["paired_by"] == {"wrapper": 51}
    assert doc["unmatched"]["only_a"] == []
    assert sorted(doc["unmatched"]["only_b"]) == [["actv", "module.input"], ["actv", "module.output"],
                                                  ["actv_grad", "module.output_grad"]]  # fmt: skip


def test_mindspore_spellings_are_aligned(runs, capsys):
    rc, doc = compare_json(capsys, runs["base"], runs["spelled"])
    assert rc == 0 and doc["unmatched"]["paired_by"] == {"exact": 39, "framework": 12}
    _, doc = compare_json(capsys, runs["spelled"], runs["wgrad"])  # and the other way round
    assert doc["first_divergence"]["name"] == "fc2.weight"


def test_renamed_modules_pair_by_call_order_and_shape_or_through_a_map(runs, capsys, tmp_path):
    rc, doc = compare_json(capsys, runs["base"], runs["renamed"])
    assert rc == 0 and doc["unmatched"]["paired_by"] == {"order": 51}
    assert ["actv", "fc1.input", "enc.input"] in doc["unmatched"]["paired_by_order"]
    # a map settles it: trainmon's own form, module names, written either way round
    names = tmp_path / "map.yaml"
    names.write_text("".join(f"{b}: {a}\n" for a, b in compare_runs.RENAMED.items()))
    rc, doc = compare_json(capsys, runs["base"], runs["renamed"], "--map", str(names))
    assert rc == 0 and doc["unmatched"]["paired_by"] == {"map": 51}
    # msprobe's cell/module mapping form: its dump names stand for the module paths
    msprobe = tmp_path / "msprobe.yaml"
    lines = [f"Module.{b}.X.forward.0: Module.{a}.X.forward.0\n" for a, b in compare_runs.RENAMED.items()]
    msprobe.write_text("".join(lines) + "Functional.gelu.0.forward: Torch.gelu.0.forward\n")
    rc, doc = compare_json(capsys, runs["base"], runs["renamed"], "--map", str(msprobe))
    assert rc == 0 and doc["unmatched"]["paired_by"] == {"map": 51}
    # a partial map: what it names pairs through it, the rest by order; renamed and changed is found
    partial = tmp_path / "partial.yaml"
    partial.write_text("fc2: head\nnot.a.module: nothing.either\n")
    rc, doc = compare_json(capsys, runs["renamed"], runs["wgrad"], "--map", str(partial))
    assert rc == 1 and doc["first_divergence"]["name"] == "head.weight"
    assert doc["first_divergence"]["name_b"] == "fc2.weight"
    assert doc["unmatched"]["unused_map"] == ["not.a.module: nothing.either"]


def test_tensors_only_one_run_has_are_listed(runs, capsys, tmp_path):
    run = tmp_path / "no_moments"
    net, opt = compare_runs.build("base")
    import trainmon

    config = {**compare_runs.CONFIG, "mv_distribution": False}
    with trainmon.attach(net, opt, config=config, logdir=run):
        for x, y in compare_runs.batches():
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(x), y).backward()
            opt.step()
    rc, doc = compare_json(capsys, runs["base"], run)
    assert rc == 0 and doc["tensors_compared"] == 39
    assert doc["unmatched"]["kinds_only_a"] == ["exp_avg", "exp_avg_sq"]
    assert len(doc["unmatched"]["only_a"]) == 12 and doc["unmatched"]["only_b"] == []


# ------------------------------------------------------------------------------------------- output


def test_the_report_folder_holds_the_summary_the_tensors_and_every_difference(runs, capsys, tmp_path):
    out = tmp_path / "report"
    assert main(["compare", str(runs["base"]), str(runs["forward"]), "--out", str(out), "--json"]) == 1
    printed = json.loads(capsys.readouterr().out)
    assert json.loads((out / SUMMARY_FILE).read_text()) == printed
    diffs = pq.read_table(out / "diffs").to_pandas()
    assert len(diffs) == compare_runs.STEPS * 51 and set(diffs["rank"]) == {0}
    assert list(diffs.columns) == ["step", "kind", "name", "rel", "score", "divergent", "rank"]
    first = diffs[(diffs.step == 0) & (diffs.kind == "actv") & (diffs.name == "act.output")].iloc[0]
    assert first.divergent and abs(first.rel - printed["first_divergence"]["rel"]) < 1e-9
    assert (diffs["divergent"] == (diffs["score"] > 1)).all()
    # the relative difference is the statistics' own: recomputed here from the two stores
    a, b = read_stats(runs["base"], 0), read_stats(runs["forward"], 0)
    j = a.tensors.index(("actv", "act.output"))
    na, nb = float(a.values["norm"][0, j]), float(b.values["norm"][0, j])
    assert first.rel >= abs(na - nb) / max(na, nb) > 0
    rows = (out / TENSORS_FILE).read_text().splitlines()
    assert rows[0].startswith("rank,kind,name,name_b,paired_by") and len(rows) == 52
    assert any(r.startswith("0,actv,act.output,act.output,exact,forward,float32,") for r in rows)


def test_dump_requests_for_the_divergence_are_served_by_a_rerun(runs, capsys, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    compare_runs.train(a, "base")
    compare_runs.train(b, "forward")
    assert main(["compare", str(a), str(b), "--no-report", "--request-dumps"]) == 1
    assert "dump requests:" in capsys.readouterr().out
    for run in (a, b):
        lines = [json.loads(x) for x in requests_file(run).read_text().splitlines()]
        assert {(r["name"], r["kind"], r["step"], r["rank"]) for r in lines} == {
            ("act.output", "actv", 0, 0), ("act.*", "actv", 0, 0)}  # fmt: skip
    # the jobs run again in their folders: the monitor serves the requests at step 0
    compare_runs.train(a, "base")
    compare_runs.train(b, "forward")
    from trainmon.read.dump_contents import load_dump

    dumped = {}
    for run in (a, b):
        entries = [e for e in list_dumps(run) if e.step == 0]
        assert {e.name for e in entries} == {"act.input", "act.output"}, entries
        dumped[run] = {e.name: load_dump(run / e.path)[0].numpy() for e in entries}
    assert np.array_equal(dumped[a]["act.input"], dumped[b]["act.input"])
    difference = np.abs(dumped[a]["act.output"] - dumped[b]["act.output"]).max()
    assert 1e-6 < difference < 1e-2  # GELU against its tanh approximation


# ------------------------------------------------------------------------------------------- bad input


def test_bad_input_gets_a_clear_message_and_exit_2(runs, capsys, tmp_path):
    base = str(runs["base"])

    def fails(*argv: str) -> str:
        assert main(["compare", *argv, "--no-report"]) == 2
        return capsys.readouterr().err

    assert "run directory not found" in fails(base, str(tmp_path / "nope"))
    (tmp_path / "plain").mkdir()
    assert "is not a trainmon run" in fails(base, str(tmp_path / "plain"))
    csv_only = tmp_path / "csv_only"
    net, opt = compare_runs.build("base")
    import trainmon

    with trainmon.attach(net, opt, config={**compare_runs.CONFIG, "format": ["csv"]}, logdir=csv_only):
        pass
    assert "holds no statistics store" in fails(base, str(csv_only), "--source", "stats")
    assert "no collected step in common within --steps 10:20" in fails(base, base, "--steps", "10:20")
    assert "rank 3 has no statistics in" in fails(base, base, "--rank", "3")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a\n- b\n")
    assert f"{bad}: expected a mapping" in fails(base, base, "--map", str(bad))
    bad.write_text("fc1: [1, 2]\n")
    assert f"{bad}:1: 'fc1': names must be strings" in fails(base, base, "--map", str(bad))
    bad.write_text("nothing: here\n")
    assert f"{bad}: no entry names a tensor or module of either run" in fails(base, base, "--map", str(bad))
    tol = tmp_path / "tol.yaml"
    tol.write_text("rules:\n  - {kind: actv, rtol: -1}\n")
    message = fails(base, base, "--tolerance", str(tol))
    assert f"{tol}: rules[0].rtol: expected a positive number, got -1" in message
    # disjoint names: another network altogether
    other = tmp_path / "other"
    model = torch.nn.Sequential(torch.nn.Linear(3, 5))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with trainmon.attach(model, opt, config=compare_runs.CONFIG, logdir=other):
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(2, 3)).sum().backward()
            opt.step()
    assert "pairs with a tensor of" in fails(base, str(other))


def test_a_damaged_segment_or_an_unwritable_report_is_an_error_not_a_verdict(runs, capsys, tmp_path):
    import shutil

    from trainmon.run.columnar import segments
    from trainmon.run.layout import stats_rank_dir

    broken = tmp_path / "broken"
    shutil.copytree(runs["base"], broken)
    segment = segments(stats_rank_dir(broken, 0))[0].path
    segment.write_bytes(segment.read_bytes()[:100])  # a truncated Parquet file
    # the run's only segment: nothing of it can be compared (exit 2), and the damaged file is named
    # (tests/test_damaged_files.py compares the rest of a run whose damaged segment is one of several)
    assert main(["compare", str(runs["base"]), str(broken), "--no-report"]) == 2
    err = capsys.readouterr().err
    assert f"trainmon: warning: damaged file {segment}: Parquet magic bytes not found" in err
    assert "trainmon compare: error: no tensor of base pairs with a tensor of broken" in err
    (tmp_path / "file").write_text("not a folder")
    assert main(["compare", str(runs["base"]), str(runs["base2"]), "--out", str(tmp_path / "file")]) == 2
    assert f"the report folder {tmp_path / 'file'} cannot be written" in capsys.readouterr().err
