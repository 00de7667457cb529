"""``trainmon demo``: trains, writes TensorBoard's summary and the statistics store, shows the injected spike,
prints how to view it."""

from __future__ import annotations

import json
import logging

import pandas as pd
import pytest
import torch

from trainmon.cli import main
from trainmon.csvtb.tb2csv import read_scalars
from trainmon.read.dump_contents import load_dump
from trainmon.run.dumps import list_dumps
from trainmon.run.statstore import read_stats


@pytest.mark.slow
def test_demo_writes_a_run_with_a_visible_loss_spike(tmp_path, capsys):
    logdir = tmp_path / "demo"
    assert (
        main(["demo", "--logdir", str(logdir), "--steps", "30", "--spike-step", "20", "--nan-step", "-1"])
        == 0
    )
    out = capsys.readouterr().out
    assert f"tensorboard --logdir {logdir}" in out
    assert "injected a learning-rate spike" in out
    rank_dir = logdir / "rank_0"
    assert list(rank_dir.glob("events.out.tfevents.*"))
    assert f"trainmon export {logdir} --format csv" in out
    # every kind in the statistics store (no CSV by default since issue 33), the summary in TensorBoard
    kinds = ["actv", "actv_grad", "grad_unreduced", "grad_reduced", "param_origin", "param_updated",
             "exp_avg", "exp_avg_sq", "update", "ratio", "scalar"]  # fmt: skip
    frame = read_stats(logdir, 0, ("mean",))
    assert sorted({k for k, _ in frame.tensors}) == sorted(kinds)
    scalars = read_scalars(rank_dir)
    assert {f"{k}/*/norm" for k in kinds if k != "scalar"} < set(scalars) and "step/grad_norm" in scalars
    loss = pd.Series(scalars["scalar/loss/mean"])
    stored = frame.values["mean"][:, frame.tensors.index(("scalar", "loss"))]
    assert loss.tolist() == stored.tolist()
    assert list(loss.index) == list(range(30))
    assert loss[19] < loss[0]  # it learns before the spike
    assert loss[21] > 2 * loss[19]  # the spike shows right after the blown-up step
    assert (logdir / "plugins" / "trainmon" / "manifest.json").exists()

    # a second demo into the same directory replaces the first run instead of mixing two event files
    assert main(["demo", "--logdir", str(logdir), "--steps", "3"]) == 0
    assert len(list(rank_dir.glob("events.out.tfevents.*"))) == 1


@pytest.mark.slow
def test_demo_nan_is_found_by_analyze_alerted_and_dumped(tmp_path, capsys, caplog):
    logdir = tmp_path / "demo"
    with caplog.at_level(logging.WARNING, "trainmon"):
        assert (
            main(["demo", "--logdir", str(logdir), "--steps", "60", "--spike-step", "40", "--nan-step", "52"])
            == 0
        )
    out = capsys.readouterr().out
    assert "injected a NaN into the forward output of layers.2.mlp.fc2 at step 52" in out
    assert (
        "trainmon found where the NaN started: step 52, rank 0, forward, actv layers.2.mlp.fc2.output" in out
    )
    assert "trainmon flagged the loss at steps 41" in out  # the spike, one step after the blown-up rate
    # an alert line names the step and the origin
    assert "NaN at step 52 rank 0: actv layers.2.mlp.fc2.output (origin, forward), " in caplog.text
    # analyze names exactly that module and step
    assert main(["analyze", str(logdir), "--rule", "nan,inf", "--json"]) == 0
    first = json.loads(capsys.readouterr().out)["first"]
    assert (first["step"], first["name"], first["phase"], first["origin"]) == (
        52,
        "layers.2.mlp.fc2.output",
        "forward",
        True,
    )
    # dumped at that very step (alert.capture: exact): the module's input was finite, its output NaN
    assert "[dump: plugins/trainmon/dumps/step_52/rank_0]" in caplog.text
    fc2 = {e.name: e for e in list_dumps(logdir) if e.name.startswith("layers.2.mlp.fc2.")}
    assert {e.step for e in fc2.values()} == {52}  # no later dump of NaN weights
    x, _ = load_dump(logdir / fc2["layers.2.mlp.fc2.input"].path)
    y, _ = load_dump(logdir / fc2["layers.2.mlp.fc2.output"].path)
    assert torch.isfinite(x).all() and torch.isnan(y).all()
    assert "layers.2.mlp.fc2.input       all finite" in out
    assert f"layers.2.mlp.fc2.output      {y.numel()} of {y.numel()} values NaN/Inf" in out
    # the poisoned update was skipped (alert.on_nan: skip): training went on with finite losses
    assert "the update of step 52 was skipped (alert.on_nan: skip)" in out
    loss = pd.Series(read_scalars(logdir / "rank_0")["scalar/loss/mean"])  # the summary view has the loss
    assert loss[52] != loss[52] and loss.drop(52).notna().all() and loss[59] < loss[0]
    assert "trainmon analyze " + str(logdir) + " --explain" in out


def test_demo_refuses_to_clobber_a_foreign_directory(tmp_path):
    (tmp_path / "precious.txt").write_text("keep me")
    with pytest.raises(SystemExit, match="not a trainmon run"):
        main(["demo", "--logdir", str(tmp_path), "--steps", "1"])
    assert (tmp_path / "precious.txt").read_text() == "keep me"
