"""The plugin's routes on a real exact-capture run, end to end: a tiny torch run with ``alert.capture: exact``
whose module ``layers.1`` makes a NaN and an Inf from clean inputs at step 4; the origin's anomaly row links
to the step-4 dumps, and the dump of its output comes with the module call (two finite inputs next to the bad
output) and the places of the bad values.

``write_exact_torch_run`` is shared with the browser test (test_plugin_ui.py) and the ``--explain`` tests
(test_explain.py)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from test_plugin_routes import get, make_client
from torch import nn
from trainmon_tb import runs as runs_module

import trainmon
from trainmon.read.dump_contents import load_dump
from trainmon.run.dumps import list_dumps

RUN = "exact"
NAN_STEP = 4
STEPS = 6  # the NaN reaches the weights through the update at step 4: step 5 has a second origin
ORIGIN_MODULE = "layers.1"
ORIGIN = f"{ORIGIN_MODULE}.output"
INPUTS = (f"{ORIGIN_MODULE}.input_0", f"{ORIGIN_MODULE}.input_1")  # two positional inputs
REASON = f"exact: nan in actv {ORIGIN}"
BAD = {(1, 2): "nan", (3, 0): "inf"}  # where layers.1 puts its bad values at NAN_STEP
CONFIG = {
    "xy_distribution": True,
    "all_xy": True,
    "wg_distribution": True,
    "mv_distribution": True,
    "param_distribution": True,
    "format": "csv",
    "alert": {"capture": "exact"},
}


class Gated(nn.Module):
    """``lin(x) * gate``; when ``poisoned``, its own code writes a NaN and an Inf into its output."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.poisoned = False

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        y = self.lin(x) * gate
        if self.poisoned:
            y = y.clone()
            for (i, j), value in BAD.items():
                y[i, j] = float(value)
        return y


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 6), Gated(6), nn.Linear(6, 3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.layers[0](x))
        h = self.layers[1](h, torch.sigmoid(h))
        return self.layers[2](h)


def write_exact_torch_run(run_dir: Path, steps: int = STEPS, **track: float) -> None:
    """Trains ``Net`` for ``steps`` steps (batch 5) with the monitor attached, the loss tracked, and any
    ``track`` scalars (name -> value; a value changes to twice itself at NAN_STEP)."""
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with trainmon.attach(model, optimizer, config=CONFIG, logdir=run_dir) as mon:
        for step in range(steps):
            model.layers[1].poisoned = step == NAN_STEP
            x = torch.randn(5, 8, generator=torch.Generator().manual_seed(step))
            loss = model(x).pow(2).mean()
            mon.track("loss", loss)
            for name, value in track.items():
                mon.track(name, torch.tensor(value * (2.0 if step >= NAN_STEP else 1.0)))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()


@pytest.fixture(scope="module")
def logdir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("exact_run")
    write_exact_torch_run(root / RUN)
    return root


@pytest.fixture(autouse=True)
def _refresh_on_every_request(monkeypatch):
    monkeypatch.setattr(runs_module, "MIN_REFRESH_SECS", 0.0)


def test_the_run_has_the_exact_dumps_this_file_relies_on(logdir):
    at_step = {(e.kind, e.name): e for e in list_dumps(logdir / RUN) if e.step == NAN_STEP}
    for name in (*INPUTS, ORIGIN):
        assert at_step[("actv", name)].reason == REASON
    x, _ = load_dump(logdir / RUN / at_step[("actv", INPUTS[0])].path)
    y, _ = load_dump(logdir / RUN / at_step[("actv", ORIGIN)].path)
    assert torch.isfinite(x).all() and x.shape == (5, 6)
    assert [tuple(i) for i in (~torch.isfinite(y)).nonzero().tolist()] == sorted(BAD)


@pytest.mark.timeout(120)
def test_the_origin_row_opens_its_step_dump_with_the_module_call(logdir):
    client = make_client(logdir)
    events = get(client, f"events?run={RUN}&step_lo={NAN_STEP}&step_hi={NAN_STEP}&limit=5000")["events"]
    first = events[0]
    assert (first["kind"], first["name"], first["origin"], first["rule"]) == ("actv", ORIGIN, True, "nan")
    assert first["dump_step"] == NAN_STEP
    own = first["dumps"][0]
    assert (own["step"], own["kind"], own["name"], own["same_step"], own["own"]) == (
        NAN_STEP,
        "actv",
        ORIGIN,
        True,
        True,
    )
    # the module's inputs and the loss of that step follow, every one of them from step 4
    assert [(d["kind"], d["name"]) for d in first["dumps"][1:]] == [
        ("actv", INPUTS[0]),
        ("actv", INPUTS[1]),
        ("scalar", "loss"),
    ]
    assert all(d["step"] == NAN_STEP and d["reason"] == REASON for d in first["dumps"])

    meta = get(client, f"dump_meta?run={RUN}&path={own['path']}")
    assert meta["nonfinite"] == {
        "count": 2,
        "first": [{"index": list(i), "value": v} for i, v in sorted(BAD.items())],
        "rows": {"shape": [5, 6], "flattened": False, "with_non_finite": 2, "counts": [[1, 1], [3, 1]]},
    }
    assert meta["stats"]["nans"] == 1 and meta["stats"]["infs"] == 1
    call = meta["module"]
    assert (call["module"], call["step"], call["micro_step"]) == (ORIGIN_MODULE, NAN_STEP, 0)
    assert [(t["name"], t["side"]) for t in call["tensors"]] == [
        (INPUTS[0], "input"),
        (INPUTS[1], "input"),
        (ORIGIN, "output"),
    ]
    for t in call["tensors"][:2]:
        inp = get(client, f"dump_meta?run={RUN}&path={t['path']}")
        assert inp["stats"]["nans"] == inp["stats"]["infs"] == 0 and inp["nonfinite"]["count"] == 0
        # the statistics are those of the file: the sigmoid gate lies in (0, 1)
        x, _ = load_dump(logdir / RUN / t["path"])
        assert inp["stats"]["max"] == pytest.approx(x.max().item(), rel=1e-6)
    gate, _ = load_dump(logdir / RUN / call["tensors"][1]["path"])
    assert gate.min().item() > 0 and gate.max().item() < 1 and not math.isnan(gate.sum().item())
