"""Any module name is written (issue 21, point 6): a name holding a lone surrogate (what file systems and
``os.fsdecode`` give) or a NUL is written everywhere as its lossless backslash escape
(``trainmon.run.names``), and every reader (TensorBoard, pandas, the statistics store, ``analyze``,
``csv2tb``, the plugin) shows the same text."""

from __future__ import annotations

import json
import urllib.parse
from pathlib import Path

import pandas as pd
import pytest
import torch
from poison_model import Poisonable
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import trainmon
from tests.test_plugin_routes import get, make_client
from trainmon.cli import main
from trainmon.run.anomaly_table import read_anomalies
from trainmon.run.layout import rank_dir
from trainmon.run.manifest import read_manifest
from trainmon.run.names import decode_name
from trainmon.run.statstore import read_stats, stored_tensors

ODD = ["\udc80", "a\x00b", "back\\slash", "x\\udc80", "ü,\"q\nz", "\ud83d", "plain"]


def test_the_encoding_is_lossless_valid_utf8_and_leaves_plain_names_alone():
    from trainmon.run.names import decode_name, encode_name

    written = [encode_name(n) for n in ODD]
    assert written == ["\\udc80", "a\\u0000b", "back\\\\slash", "x\\\\udc80", "ü,\"q\nz", "\\ud83d", "plain"]
    assert [decode_name(w) for w in written] == ODD
    assert len(set(written)) == len(ODD)  # no two names written alike
    for w in written:
        w.encode("utf-8")  # never raises
        assert "\x00" not in w


def test_a_string_a_columnar_table_stores_decodes_losslessly():
    """Names reach the tables encoded; a string that was not (a message, a dump path holding a surrogate) is
    stored encoded the same way, never as a text another string could have."""
    from trainmon.run.columnar import utf8
    from trainmon.run.names import decode_name

    for text in ["x\\udc80\udc81", "\udc80", "back\\slash\udc80"]:  # UTF-8 cannot hold these
        assert decode_name(utf8(text)) == text
        utf8(text).encode("utf-8")
    assert utf8("x\\udc80\udc81") != utf8("x\udc80\udc81")
    assert utf8("plain back\\slash ü") == "plain back\\slash ü"  # valid UTF-8 is stored as it is


class Odd(torch.nn.Module):
    """Modules named with a lone surrogate, a NUL and a backslash; a NaN starts in the surrogate's output."""

    def __init__(self) -> None:
        super().__init__()
        self.add_module("\udc80", Poisonable(4, 8))
        self.add_module("a\x00b", torch.nn.Linear(8, 8))
        self.add_module("back\\slash", torch.nn.Linear(8, 2))

    def forward(self, x):
        h = getattr(self, "\udc80")(x)
        return getattr(self, "back\\slash")(torch.relu(getattr(self, "a\x00b")(h)))


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("names")
    run = root / "odd"
    torch.manual_seed(0)
    model = Odd()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    # every output: CSV and every tensor's scalars asked for (issue 33 made them a choice)
    config = {"xy_distribution": True, "wg_distribution": True, "alert": {"rate_limit_s": 0},
              "format": ["tensorboard", "csv"], "tensorboard_tensors": "all"}  # fmt: skip
    with trainmon.attach(model, optimizer, config=config, logdir=run) as mon:
        for step in range(4):
            getattr(model, "\udc80").poison = step == 2
            loss = model(torch.randn(3, 4)).square().mean()
            mon.track("loss\x00", loss)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return run


WANT = {"\\udc80.output", "a\\u0000b.output", "back\\\\slash.output"}


def test_every_output_holds_the_escaped_names(run):
    acc = EventAccumulator(str(rank_dir(run, 0)), size_guidance={"scalars": 0})
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert {f"actv/{n}/max" for n in WANT} <= set(tags) and "scalar/loss\\u0000/max" in tags
    assert [e.step for e in acc.Scalars("actv/\\udc80.output/max")] == [0, 1, 2, 3]
    csv = pd.read_csv(rank_dir(run, 0) / "actv.csv")
    assert set(csv["name"]) >= WANT and sorted(set(csv["step"])) == [0, 1, 2, 3]
    assert set(pd.read_csv(rank_dir(run, 0) / "grad_unreduced.csv")["name"]) >= {"\\udc80.weight"}
    stored = {name for kind, name in stored_tensors(run, 0) if kind == "actv"}  # the statistics store
    assert stored >= WANT
    assert {decode_name(n) for n in stored} >= {"\udc80.output", "a\x00b.output", "back\\slash.output"}
    frame = read_stats(run, 0, ("nans",), kinds=("actv",))  # every step, under the same names
    assert frame.steps.tolist() == [0, 1, 2, 3] and {name for _, name in frame.tensors} >= WANT
    assert set(read_manifest(run)["names"]["actv"]) >= WANT
    origins = [(a.step, a.name) for a in read_anomalies(run, 0) if a.origin]
    assert origins[0] == (2, "\\udc80.output")


def test_analyze_and_csv2tb_show_the_same_names(run, tmp_path, capsys):
    assert main(["analyze", str(run)]) in (0, 1)
    assert "\\udc80.output" in capsys.readouterr().out
    out = tmp_path / "tb"
    assert main(["csv2tb", str(run / "rank_0"), "--out", str(out)]) == 0
    capsys.readouterr()
    acc = EventAccumulator(str(next(p.parent for p in out.rglob("events.out.tfevents.*"))),
                           size_guidance={"scalars": 0})  # fmt: skip
    acc.Reload()
    assert {f"actv/{n}/max" for n in WANT} <= set(acc.Tags()["scalars"])


def test_export_writes_the_same_names_byte_for_byte(run, tmp_path):
    out = tmp_path / "csv"
    assert main(["export", str(run), "--format", "csv", "-o", str(out)]) == 0
    written = sorted(p.name for p in rank_dir(run, 0).glob("*.csv"))
    assert written == sorted(p.name for p in rank_dir(out, 0).glob("*.csv")) and "actv.csv" in written
    for name in written:
        assert (rank_dir(out, 0) / name).read_bytes() == (rank_dir(run, 0) / name).read_bytes(), name


def test_the_plugin_shows_the_same_names(run):
    client = make_client(run.parent)
    heat = get(client, "heatmap?run=odd&kind=actv&stat=nans&bins=4")
    assert set(heat["names"]) >= WANT
    name = urllib.parse.quote("\\udc80.output")
    series = get(client, f"series?run=odd&kind=actv&name={name}&stat=nans")
    assert series["steps"] == [0, 1, 2, 3] and series["values"][2] > 0
    events = get(client, "events?run=odd&limit=50")
    assert "\\udc80.output" in {e["name"] for e in events["events"]}
    assert json.dumps(events)  # what the browser gets is plain JSON
