"""Anomaly records mean one thing (issue 22, point 9).

* A NaN/Inf record is one micro-step's: its ``value`` is the count of the micro-step it names, as the CSV row
  of that micro-step says; its message adds the step's total. A value rule's record holds the step's value
  and says so.
* A module called twice in one forward pass writes its calls apart (``name``, ``name#1``; docs/output.md),
  so no two rows share (name, step, micro_step), and modules called once keep their names."""

from __future__ import annotations

import csv
import math

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

import trainmon
from trainmon.run.anomaly_table import read_anomalies


class OneNanPerMicroStep(nn.Module):
    """``lin(x)``, with one NaN written into its output in every micro-step of the poisoned step."""

    poisoned = False

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if self.poisoned:
            y = y.clone()
            y[0, 0] = math.nan
        return y


def csv_rows(path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_a_nan_record_holds_its_micro_steps_count_as_the_csv_does(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(OneNanPerMicroStep(), nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the NaN gradient changes nothing
    config = {"xy_distribution": True, "format": "csv", "targets": {"0": {}}}
    with trainmon.attach(model, optimizer, config=config, logdir=tmp_path / "run", grad_acc_steps=2):
        for step in range(2):
            model[0].poisoned = step == 1
            for _ in range(2):
                model(torch.randn(3, 4)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    rows = [r for r in csv_rows(tmp_path / "run" / "rank_0" / "actv.csv") if r["name"] == "0.output"]
    assert [(r["step"], r["micro_step"], r["nans"]) for r in rows if r["step"] == "1"] == [
        ("1", "0", "1"),
        ("1", "1", "1"),
    ]
    (record,) = [
        a for a in read_anomalies(tmp_path / "run", 0) if (a.step, a.name) == (1, "0.output")
    ]
    assert (record.micro_step, record.stat, record.value, record.origin) == (0, "nans", 1.0, True)
    assert record.message == (
        "actv/0.output has 1 NaN element(s) at micro-step 0 (2 in the step's 2 micro-steps)"
    )


class Shared(nn.Module):
    """``head(block(block(x)))``: ``block`` is called twice in every forward."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.block(torch.tanh(self.block(x)))))


def test_calls_of_a_module_called_twice_are_numbered_and_others_keep_their_names(tmp_path):
    torch.manual_seed(0)
    model = Shared()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    config = {"xy_distribution": True, "all_xy": True, "format": ["csv", "tensorboard"],
              "tensorboard_tensors": "all"}  # fmt: skip
    x = torch.randn(3, 4)
    with trainmon.attach(model, optimizer, config=config, logdir=tmp_path / "run", grad_acc_steps=2) as mon:
        for _ in range(2):
            model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        stats = mon.latest()
    rows = csv_rows(tmp_path / "run" / "rank_0" / "actv.csv")
    keys = [(r["name"], r["step"], r["micro_step"]) for r in rows]
    assert len(keys) == len(set(keys))  # one row per tensor, call and micro-step
    assert sorted({r["name"] for r in rows}) == [
        "block.input",
        "block.input#1",
        "block.output",
        "block.output#1",
        "head.input",
        "head.output",
    ]
    grads = {r["name"] for r in csv_rows(tmp_path / "run" / "rank_0" / "actv_grad.csv")}
    # x needs no gradient: only the second call's input has one
    assert grads == {"block.output_grad", "block.output_grad#1", "block.input_grad#1", "head.output_grad",
                     "head.input_grad"}  # fmt: skip
    # the second call's input is the first call's output, through tanh: exact statistics per call
    by_name = {(r["name"], r["micro_step"]): r for r in rows}
    second_in = float(by_name[("block.input#1", "0")]["max"])
    assert second_in == pytest.approx(math.tanh(float(by_name[("block.output", "0")]["max"])), rel=1e-6)
    # TensorBoard and Monitor.latest() show one tensor per call too
    assert {"actv/block.output", "actv/block.output#1", "actv/head.output"} <= set(stats)
    events = EventAccumulator(str(tmp_path / "run" / "rank_0"), size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"actv/block.output/max", "actv/block.output#1/max", "actv/head.output/max"} <= tags
    assert not any(t.startswith("actv/head.output#") for t in tags)
