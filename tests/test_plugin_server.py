"""The plugin inside a real ``tensorboard`` process on 127.0.0.1, in both ``--load_fast`` modes, reading a run
made by ``trainmon demo``; new records appear while it runs; ``--path_prefix`` works."""

from __future__ import annotations

import shutil
import time
import urllib.request

import pytest
from tbserver import get_json, tensorboard_server

from trainmon.anomaly.log import AnomalyLog
from trainmon.cli import main
from trainmon.cli.demo import NAN_MODULE
from trainmon.run.anomaly_table import read_anomalies
from trainmon.run.layout import anomalies_rank_dir, steps_rank_dir, summary_file
from trainmon.run.records import Anomaly

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def logdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("tbserver")
    assert main(["demo", "--logdir", str(root / "demo"), "--steps", "40"]) == 0
    return root


def wait_for(fn, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.2)


@pytest.mark.parametrize("load_fast", ["true", "false"])
def test_tensorboard_serves_the_plugin_on_the_demo_run(logdir, tmp_path, load_fast):
    items = list(read_anomalies(logdir / "demo", 0))
    nan_step = 30  # the demo's NaN comes 10 steps before the end
    with tensorboard_server(logdir, tmp_path, load_fast, ["--trainmon_poll_secs", "0.5"]) as base:
        listing = wait_for(
            lambda: get_json(f"{base}/data/plugins_listing").get("trainmon", {}).get("enabled")
        )
        assert listing is True
        entry = get_json(f"{base}/data/plugins_listing")["trainmon"]
        assert entry["loading_mechanism"]["module_path"] == "/data/plugin/trainmon/static/index.js"
        with urllib.request.urlopen(f"{base}/data/plugin_entry.html?name=trainmon", timeout=10) as r:
            assert "script-src" in r.headers["Content-Security-Policy"]
        with urllib.request.urlopen(f"{base}/data/plugin/trainmon/static/index.js", timeout=10) as r:
            assert r.headers["Content-Type"].startswith("text/javascript") and b"render" in r.read()
        runs = get_json(f"{base}/data/plugin/trainmon/runs")["runs"]
        # the count analyze gives: the per-step cap's summary lines are no anomaly of their own
        anomalies = [a for a in items if a.rule != "suppressed"]
        assert [(r["run"], r["anomalies"]) for r in runs] == [("demo", len(anomalies))]
        t = get_json(f"{base}/data/plugin/trainmon/timeline?run=demo&axis=module")
        assert t["first"]["step"] == nan_step and t["first"]["name"] == f"{NAN_MODULE}.output"
        origin_rows = {t["rows"][r] for r in t["origins"]["row"]}
        assert f"{NAN_MODULE}.output" in origin_rows
        ev = get_json(f"{base}/data/plugin/trainmon/events?run=demo&step_lo={nan_step}")
        assert ev["events"][0]["name"] == f"{NAN_MODULE}.output" and ev["events"][0]["origin"] is True
        assert ev["events"][0]["dumps"], "the origin's dump is linked"

        # live: a record appended while TensorBoard runs shows up without a restart
        log = AnomalyLog(logdir / "demo", rank=1)
        log.write_step(
            45,
            [Anomaly(step=45, rank=1, kind="actv", name="late.output", stat="nans", value=1.0, rule="nan")],
        )
        log.close()
        try:
            fresh = wait_for(
                lambda: get_json(f"{base}/data/plugin/trainmon/timeline?run=demo&ranks=1")["total"] == 1
            )
            assert fresh
            assert get_json(f"{base}/data/plugin/trainmon/runs")["runs"][0]["ranks"] == [0, 1]
        finally:
            shutil.rmtree(anomalies_rank_dir(logdir / "demo", 1))
            summary_file(logdir / "demo", 1).unlink()
            shutil.rmtree(steps_rank_dir(logdir / "demo", 1))


def test_path_prefix(logdir, tmp_path):
    with tensorboard_server(logdir, tmp_path, "false", ["--path_prefix", "/tb"]) as base:
        runs = wait_for(lambda: get_json(f"{base}/tb/data/plugin/trainmon/runs")["runs"])
        assert [r["run"] for r in runs] == ["demo"]
        with urllib.request.urlopen(f"{base}/tb/data/plugin/trainmon/static/style.css", timeout=10) as r:
            assert r.status == 200
