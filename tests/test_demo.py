"""``trainmon demo``: trains, writes TB + CSV, shows the injected spike, prints how to view it."""

from __future__ import annotations

import pandas as pd
import pytest

from trainmon.cli import main


@pytest.mark.slow
def test_demo_writes_a_run_with_a_visible_loss_spike(tmp_path, capsys):
    logdir = tmp_path / "demo"
    assert main(["demo", "--logdir", str(logdir), "--steps", "30", "--spike-step", "20"]) == 0
    out = capsys.readouterr().out
    assert f"tensorboard --logdir {logdir}" in out
    assert "injected a learning-rate spike" in out
    rank_dir = logdir / "rank_0"
    assert list(rank_dir.glob("events.out.tfevents.*"))
    for kind in (
        "actv",
        "actv_grad",
        "grad_unreduced",
        "grad_reduced",
        "param_origin",
        "param_updated",
        "exp_avg",
        "exp_avg_sq",
        "update",
        "ratio",
        "scalar",
    ):
        assert (rank_dir / f"{kind}.csv").exists(), kind
    loss = pd.read_csv(rank_dir / "scalar.csv").set_index("step")["mean"]
    assert list(loss.index) == list(range(30))
    assert loss[19] < loss[0]  # it learns before the spike
    assert loss[21] > 2 * loss[19]  # the spike shows right after the blown-up step
    assert (logdir / "plugins" / "trainmon" / "manifest.json").exists()

    # a second demo into the same directory replaces the first run instead of mixing two event files
    assert main(["demo", "--logdir", str(logdir), "--steps", "3"]) == 0
    assert len(list(rank_dir.glob("events.out.tfevents.*"))) == 1


def test_demo_refuses_to_clobber_a_foreign_directory(tmp_path):
    (tmp_path / "precious.txt").write_text("keep me")
    with pytest.raises(SystemExit, match="not a trainmon run"):
        main(["demo", "--logdir", str(tmp_path), "--steps", "1"])
    assert (tmp_path / "precious.txt").read_text() == "keep me"
