"""Cross-framework grad_probe: the same model, weights and data trained in PyTorch (this venv) and in
MindSpore (.venv-ms, created by ``scripts/setup_mindspore.sh``) by
``integrations/mindspore/compare_frameworks.py``. ``trainmon compare`` with the shipped name map finds them
aligned at every step and parameter and names the step and parameter of an injected gradient difference;
without the map the renamed LayerNorm parameters stay unpaired."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from trainmon.cli import main

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "integrations" / "mindspore" / "compare_frameworks.py"
MAP = ROOT / "integrations" / "mindspore" / "torch_to_mindspore.yaml"
MS_PYTHON = ROOT / ".venv-ms" / "bin" / "python"
STEPS = 6
INJECT = 3
PARAMS_A = ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight", "norm.bias", "norm.weight"]
THRESHOLD = 0.97


def _run(python: Path | str, framework: str, out: Path, weights: Path, *extra: str) -> str:
    cmd = [str(python), str(SCRIPT), "--framework", framework, "--out", str(out), "--weights", str(weights)]
    done = subprocess.run(
        [*cmd, "--steps", str(STEPS), *extra], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def _compare(capsys, a: Path, b: Path, out: Path, *extra: str) -> tuple[int, dict, list[dict]]:
    rc = main(["compare", str(a), str(b), "--out", str(out), "--json", "--no-plots", *extra])
    summary = json.loads(capsys.readouterr().out)
    with open(out / "similarity.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    return rc, summary, rows


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_torch_and_mindspore_runs_align_and_an_injected_difference_is_found(tmp_path, capsys):
    setup = subprocess.run(
        ["bash", str(ROOT / "scripts" / "setup_mindspore.sh")], cwd=ROOT, capture_output=True, text=True
    )
    assert setup.returncode == 0, setup.stdout[-3000:] + setup.stderr[-3000:]
    weights = tmp_path / "weights.npz"
    out_pt = _run(sys.executable, "torch", tmp_path / "pt", weights)
    assert weights.exists()
    out_ms = _run(MS_PYTHON, "mindspore", tmp_path / "ms", weights)
    # same weights, data and optimizer: the same losses to float32 rounding (printed to 6 decimals)
    assert out_pt.split(": loss ")[1] == out_ms.split(": loss ")[1]
    _run(MS_PYTHON, "mindspore", tmp_path / "ms_inject", weights, "--inject-step", str(INJECT))

    # aligned: every step, every parameter paired through the map, samples at the same positions
    rc, summary, rows = _compare(
        capsys, tmp_path / "pt", tmp_path / "ms", tmp_path / "cmp", "--map", str(MAP)
    )
    assert rc == 0
    rank = summary["ranks"][0]
    assert summary["first_divergent_step"] is None and rank["first_divergent_step"] is None
    assert rank["steps_compared"] == STEPS and rank["params_compared"] == len(PARAMS_A)
    assert rank["only_in_a"] == [] and rank["only_in_b"] == [] and rank["unaligned_samples"] == []
    assert len(rows) == STEPS * len(PARAMS_A)
    assert {(int(r["step"]), r["name"]) for r in rows} == {(s, n) for s in range(STEPS) for n in PARAMS_A}
    pairs = {r["name"]: r["name_b"] for r in rows}
    assert pairs["norm.weight"] == "norm.gamma" and pairs["norm.bias"] == "norm.beta"
    assert pairs["fc2.weight"] == "fc2.weight"
    for r in rows:
        # every figure is there (L2, aligned samples) and close to identical gradients' values
        assert all(r[m] != "" for m in ("sign_agreement", "cosine", "norm_ratio", "bin_distance")), r
        assert float(r["similarity"]) > 0.9999 > THRESHOLD, r
        assert float(r["cosine"]) > 0.99999 and abs(float(r["norm_ratio"]) - 1) < 1e-4, r
        assert r["divergent"] == "0"

    # without the map the LayerNorm parameters are not paired: the map is what makes them comparable
    rc, summary, rows = _compare(capsys, tmp_path / "pt", tmp_path / "ms", tmp_path / "nomap")
    rank = summary["ranks"][0]
    assert rank["only_in_a"] == ["norm.bias", "norm.weight"]
    assert rank["only_in_b"] == ["norm.beta", "norm.gamma"]
    assert rank["params_compared"] == 4
    assert {r["name"] for r in rows} == {"fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"}
    assert rc == 0

    # the injected difference: first divergent step exactly INJECT, and only the perturbed parameter
    rc, summary, rows = _compare(
        capsys, tmp_path / "pt", tmp_path / "ms_inject", tmp_path / "inj", "--map", str(MAP)
    )
    assert rc == 1
    assert summary["first_divergent_step"] == INJECT
    assert summary["ranks"][0]["first_divergent_params"] == ["fc2.weight"]
    sim = {(int(r["step"]), r["name"]): float(r["similarity"]) for r in rows}
    assert all(sim[(s, n)] > 0.9999 for s in range(INJECT) for n in PARAMS_A)  # identical before
    assert sim[(INJECT, "fc2.weight")] < THRESHOLD
    assert all(sim[(INJECT, n)] > 0.9999 for n in PARAMS_A if n != "fc2.weight")
    # the text output names the step and the parameter
    argv = ["compare", str(tmp_path / "pt"), str(tmp_path / "ms_inject"), "--map", str(MAP)]
    assert main([*argv, "--out", str(tmp_path / "inj2"), "--no-plots"]) == 1
    assert f"first divergent step {INJECT}: fc2.weight" in capsys.readouterr().out


def _compare_stats(capsys, a: Path, b: Path) -> tuple[int, dict]:
    rc = main(["compare", str(a), str(b), "--json", "--no-report"])
    return rc, json.loads(capsys.readouterr().out)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_torch_and_mindspore_statistics_compare_and_an_injected_change_is_named(tmp_path, capsys):
    """The statistics mode (issue 30): the same network at full coverage in both frameworks agrees at every
    tensor without a map (LayerNorm's gamma/beta are weight/bias by their MindSpore spelling); a change in one
    module's forward, or in one weight gradient only, is named with its step, tensor and phase."""
    setup = subprocess.run(
        ["bash", str(ROOT / "scripts" / "setup_mindspore.sh")], cwd=ROOT, capture_output=True, text=True
    )
    assert setup.returncode == 0, setup.stdout[-3000:] + setup.stderr[-3000:]
    weights = tmp_path / "weights.npz"
    _run(sys.executable, "torch", tmp_path / "pt", weights, "--mode", "stats")
    _run(MS_PYTHON, "mindspore", tmp_path / "ms", weights, "--mode", "stats")
    for what in ("forward", "wgrad"):
        _run(MS_PYTHON, "mindspore", tmp_path / what, weights, "--mode", "stats", "--inject", what,
             "--inject-step", str(INJECT))  # fmt: skip

    rc, doc = _compare_stats(capsys, tmp_path / "pt", tmp_path / "ms")
    assert rc == 0 and doc["first_divergence"] is None and doc["steps_compared"] == STEPS
    # activations of 4 modules, their gradients (the input of fc1 has none), 6 parameters: the reduced
    # gradient and the parameter before and after; MindSpore has no gradient before reduction
    assert doc["tensors_compared"] == 8 + 7 + 3 * 6
    assert doc["unmatched"]["only_b"] == [] and doc["unmatched"]["kinds_only_a"] == ["grad_unreduced"]
    assert doc["unmatched"]["paired_by"] == {"exact": 8 + 7 + 3 * 4, "framework": 3 * 2}

    rc, doc = _compare_stats(capsys, tmp_path / "pt", tmp_path / "forward")
    first = doc["first_divergence"]
    assert rc == 1
    where = (first["step"], first["kind"], first["name"], first["phase"])
    assert where == (INJECT, "actv", "act.output", "forward")
    assert (first["cause"], first["module"]) == ("forward", "act")
    assert {e["name"]: e["agrees"] for e in first["evidence"]} == {"act.input": True, "act.output": False}

    rc, doc = _compare_stats(capsys, tmp_path / "pt", tmp_path / "wgrad")
    first = doc["first_divergence"]
    assert rc == 1
    where = (first["step"], first["kind"], first["name"], first["phase"])
    assert where == (INJECT, "grad_reduced", "fc2.weight", "optimizer")
    assert (first["cause"], first["stage"], first["module"]) == ("weight_gradient", "weight-gradient", "fc2")
    evidence = {e["name"]: e["agrees"] for e in first["evidence"]}
    assert evidence == {"fc2.input": True, "fc2.output_grad": True, "fc2.input_grad": True,
                        "fc2.weight": False}  # fmt: skip
