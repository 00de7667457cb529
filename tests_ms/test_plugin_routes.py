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

from trainmon.records import derive


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
