"""The statistics of a tensor with no finite element (all NaN, all Inf, empty): ``min``, ``max``, ``mean`` and
``norm`` are NaN, never 0, in memory, in the statistics store, in TensorBoard, in the CSV the run writes and
in the CSV ``trainmon export`` writes (as ``torch.linalg.norm`` of an all-NaN tensor is NaN, and as msprobe's
CSV shows ``nan``); ``zeros`` is 0 and ``nans``/``infs`` count the elements. The docs say the same."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

import trainmon
from trainmon.cli import main
from trainmon.run.layout import rank_dir
from trainmon.run.records import derive
from trainmon.run.statstore import read_stats
from trainmon.stats import partials

DOCS = Path(__file__).resolve().parents[1] / "docs"
NAN, INF = float("nan"), float("inf")
UNDEFINED = ("min", "max", "mean", "norm")  # over the finite elements: NaN when there is none


@pytest.mark.parametrize(
    "tensor",
    [torch.full((6,), NAN), torch.tensor([INF, -INF, NAN]), torch.zeros(0)],
    ids=["all NaN", "NaN and Inf", "empty"],
)
def test_the_statistics_of_a_tensor_without_a_finite_element_are_nan(tensor):
    got = derive(partials(tensor).double().numpy())
    for stat in UNDEFINED:
        assert math.isnan(got[stat][0]), (stat, got[stat])
    assert got["zeros"][0] == 0.0
    assert (got["nans"][0], got["infs"][0]) == (int(tensor.isnan().sum()), int(tensor.isinf().sum()))
    if tensor.numel():  # as torch says for the whole tensor
        assert math.isnan(torch.linalg.norm(tensor).item())


def test_a_finite_element_among_nans_gives_their_statistics():
    got = derive(partials(torch.tensor([NAN, 3.0, NAN, -4.0])).double().numpy())
    assert [got[s][0] for s in ("min", "max", "mean", "norm", "nans")] == [-4.0, 3.0, -0.5, 5.0, 2.0]


@pytest.mark.timeout(120)
def test_an_all_nan_activation_is_nan_in_every_output(tmp_path):
    run, out = tmp_path / "run", tmp_path / "exported"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model[0].register_forward_hook(lambda m, a, output: torch.full_like(output, NAN))
    config = {"xy_distribution": True, "all_xy": True, "format": ["tensorboard", "csv"],
              "tensorboard_tensors": "all"}  # fmt: skip
    with trainmon.attach(model, optimizer, config=config, logdir=run) as monitor:
        for _ in range(2):
            model(torch.randn(3, 4)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        latest = monitor.latest()["actv/0.output"]
    assert all(math.isnan(latest[s]) for s in UNDEFINED) and latest["nans"] == 12 and latest["zeros"] == 0

    frame = read_stats(run, 0, ("norm", "min", "zeros", "nans"), kinds=["actv"])
    j = frame.column("actv", "0.output")
    assert np.isnan(frame.values["norm"][:, j]).all() and np.isnan(frame.values["min"][:, j]).all()
    assert (frame.values["zeros"][:, j] == 0).all() and (frame.values["nans"][:, j] == 12).all()

    events = EventAccumulator(str(rank_dir(run, 0)))
    events.Reload()
    assert all(math.isnan(e.value) for e in events.Scalars("actv/0.output/norm"))

    assert main(["export", str(run), "--format", "csv", "-o", str(out)]) == 0
    for written in (rank_dir(run, 0) / "actv.csv", out / "rank_0" / "actv.csv"):
        rows = [r for r in csv.DictReader(written.open()) if r["name"] == "0.output"]
        assert len(rows) == 2, written
        assert all([r[s] for s in UNDEFINED] == ["nan"] * 4 and r["nans"] == "12" for r in rows), rows


def test_the_docs_say_nan_for_a_tensor_without_a_finite_element():
    output = (DOCS / "output.md").read_text()
    norm = next(line for line in output.splitlines() if line.startswith("| `norm` |"))
    assert "NaN when there is none" in norm and "never 0" in norm
    plugin = " ".join((DOCS / "plugin.md").read_text().split())
    assert "its finite elements only, NaN when none is" in plugin and "a norm of 0" not in plugin
    config = " ".join((DOCS / "config.md").read_text().split())
    assert "A tensor with no finite element gives NaN for these four." in config
