"""The MindSpore run's files load in the TensorBoard plugin's routes, through TensorBoard's WSGI app (the
recipe of tests/test_plugin_routes.py); expected values come from the monitor's in-memory records."""

from __future__ import annotations

import argparse
import base64

import numpy as np
import pytest
from conftest import NAN_STEP, STEPS
from tensorboard.backend import application
from tensorboard.backend.event_processing import data_provider as dp
from tensorboard.backend.event_processing import plugin_event_multiplexer as pem
from tensorboard.plugins import base_plugin
from trainmon_tb import runs as runs_module
from trainmon_tb.loader import TrainmonLoader
from werkzeug.test import Client
from werkzeug.wrappers import Response

from trainmon.run.records import derive


@pytest.fixture(scope="module")
def client(nan_run) -> Client:
    run, _ = nan_run
    mux = pem.EventMultiplexer()
    provider = dp.MultiplexerDataProvider(mux, str(run.parent))
    parser = argparse.ArgumentParser()
    loader = TrainmonLoader()
    loader.define_flags(parser)
    parsed = parser.parse_args([])
    loader.fix_flags(parsed)
    context = base_plugin.TBContext(
        logdir=str(run.parent), data_provider=provider, multiplexer=mux, flags=parsed
    )
    plugin = loader.load(context)
    plugin.registry.stop()
    return Client(application.TensorBoardWSGI([plugin], data_provider=provider), Response)


@pytest.fixture(autouse=True)
def _refresh_on_every_request(monkeypatch):
    monkeypatch.setattr(runs_module, "MIN_REFRESH_SECS", 0.0)


def get(client: Client, route: str) -> dict:
    r = client.get(f"/data/plugin/trainmon/{route}")
    assert r.status_code == 200, r.get_data(as_text=True)
    return r.get_json()


def test_runs_route_lists_the_mindspore_run(client, nan_run):
    run, records = nan_run
    (got,) = get(client, "runs")["runs"]
    assert got["run"] == run.name and got["ranks"] == [0] and got["world_size"] == 1
    assert got["steps"] == [0, STEPS - 1]
    assert set(got["stat_kinds"]) == {p.stem for p in (run / "rank_0").glob("*.csv")}
    assert set(got["stat_kinds"]) == {r.kind for r in records[0].rows}


def test_heatmap_and_series_equal_the_records(client, nan_run):
    run, records = nan_run
    h = get(client, f"heatmap?run={run.name}&kind=grad_reduced&stat=norm&bins={STEPS}")
    names = [r.name for r in records[0].rows if r.kind == "grad_reduced"]
    assert h["names"] == names
    values = np.frombuffer(base64.b64decode(h["values"]), dtype="<f4").reshape(len(names), h["bins"])
    want = np.empty((len(names), STEPS))
    for step, rec in enumerate(records):
        norms = dict(zip([(r.kind, r.name) for r in rec.rows], derive(rec.partials)["norm"], strict=True))
        want[:, step] = [norms["grad_reduced", n] for n in names]
    finite = np.isfinite(want)
    assert np.array_equal(np.isfinite(values), finite)
    np.testing.assert_allclose(values[finite], want[finite], rtol=1e-6)
    s = get(client, f"series?run={run.name}&kind=actv&name=bad.output&stat=nans")
    assert s["steps"] == list(range(STEPS))
    nans = [
        dict(zip([(r.kind, r.name) for r in rec.rows], rec.partials[:, 1], strict=True)) for rec in records
    ]
    assert s["values"] == [float(n["actv", "bad.output"]) for n in nans]
    assert s["values"][NAN_STEP] == 1.0 and s["values"][NAN_STEP - 1] == 0.0


def test_timeline_names_the_origin(client, nan_run):
    run, _ = nan_run
    t = get(client, f"timeline?run={run.name}&axis=module")
    assert (t["first"]["step"], t["first"]["name"], t["first"]["origin"]) == (NAN_STEP, "bad.output", True)


def test_events_link_the_dumps_and_dump_meta_reads_them_without_torch(client, nan_run):
    """The anomaly table's dumps open in the dump view in a MindSpore-only environment: statistics by
    MindSpore's kernel equal those the monitor recorded for that tensor at that step."""
    import sys

    from safetensors.numpy import load_file

    run, records = nan_run
    events = get(client, f"events?run={run.name}&step={NAN_STEP}")["events"]
    origin = events[0]
    assert origin["name"] == "bad.output" and origin["origin"] is True
    linked = [d["path"] for d in origin["dumps"]]
    assert linked and all(p.endswith(".safetensors") for p in linked)
    record = records[NAN_STEP + 1]
    want = derive(record.partials)
    index = {(r.kind, r.name): i for i, r in enumerate(record.rows)}
    for path in linked:
        meta = get(client, f"dump_meta?run={run.name}&path={path}")
        i = index[meta["entry"]["kind"], meta["entry"]["name"]]
        tensor = load_file(str(run / path))["tensor"]
        assert meta["tensor"] == {"dtype": "float32", "shape": list(tensor.shape)}
        assert meta["stats"]["numel"] == tensor.size == record.partials[i][0]
        for stat in ("min", "max", "mean", "norm", "nans"):
            w = float(want[stat][i])  # the network is NaN after the NaN step: JSON spells it "nan"
            assert meta["stats"][stat] == ("nan" if np.isnan(w) else pytest.approx(w, rel=1e-6, abs=1e-7))
        assert sum(meta["histogram"]["counts"]) == int(np.isfinite(tensor).sum())
    assert "torch" not in sys.modules


def test_dump_show_prints_a_mindspore_dump_without_torch(nan_run):
    import subprocess
    import sys

    from trainmon.run.dumps import list_dumps

    run, _ = nan_run
    entry = next(e for e in list_dumps(run) if e.name == "bad.output")
    shown = subprocess.run(
        [sys.executable, "-m", "trainmon", "dump", "show", str(run / entry.path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shown.returncode == 0, shown.stderr
    assert f"tensor: float32 {list(entry.shape)}" in shown.stdout and "histogram of" in shown.stdout
