"""The TensorBoard plugin's routes, in process, through TensorBoard's real WSGI application (its middleware:
error handling, the security validator, path prefix), on a run made by ``trainmon demo``. Expected values
are computed here from the run's own files (anomaly JSONL, CSV, dump files), independently of the plugin.

Then the plugin side of exact capture (``alert.capture: exact``), on a run written by hand: an anomaly links
to the dump of its own step before any later one (and says when only a later one exists), and a dump of a
module's input or output comes with the other tensors of that module call and the places of its non-finite
values."""

from __future__ import annotations

import argparse
import base64
import fnmatch
import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from acc_runs import NAN_STEP as ACC_NAN_STEP
from acc_runs import write_acc_run
from old_layout import old_names_line
from safetensors.torch import load_file
from tensorboard.backend import application
from tensorboard.backend.event_processing import data_provider as dp
from tensorboard.backend.event_processing import plugin_event_multiplexer as pem
from tensorboard.plugins import base_plugin
from trainmon_tb import runs as runs_module
from trainmon_tb import shape_index
from trainmon_tb.anomaly_index import bin_edges
from trainmon_tb.dump_index import module_role
from trainmon_tb.dump_view import FIRST_NON_FINITE, MAX_BAD_ROWS, locate_non_finite
from trainmon_tb.loader import TrainmonLoader
from werkzeug.test import Client
from werkzeug.wrappers import Response

from trainmon.anomaly.log import AnomalyLog
from trainmon.cli import demo as demo_cli
from trainmon.cli import main
from trainmon.cli.demo import NAN_MODULE
from trainmon.demo import DemoSetup, build, synthetic_batch
from trainmon.run.anomaly_table import read_anomalies
from trainmon.run.dumps import DumpRequest, list_dumps
from trainmon.run.layout import requests_file, stats_names_file, stats_records_file
from trainmon.run.records import Anomaly, Derived, Kind, Row, StepRecord, derive
from trainmon.run.statstore import STAT_RECORD
from trainmon.stats import partials
from trainmon.writer.dumps import DumpWriter
from trainmon.writer.statstore import StatStoreSink

ORIGIN = f"{NAN_MODULE}.output"
NAN_STEP = 140


@pytest.fixture(scope="module")
def logdir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("plugin")
    # with CSV (no longer written by default since issue 33): the routes are checked against it, what the
    # writer wrote from each step's own values, not against the statistics store they read
    with pytest.MonkeyPatch.context() as m:
        m.setattr(demo_cli, "DEMO_CONFIG", {**demo_cli.DEMO_CONFIG, "format": ["tensorboard", "csv"]})
        assert main(["demo", "--logdir", str(root / "demo")]) == 0
    return root


def make_client(logdir: Path, *flags: str) -> Client:
    # the plugin reads its own files, not the event files: an empty multiplexer keeps these tests fast
    mux = pem.EventMultiplexer()
    provider = dp.MultiplexerDataProvider(mux, str(logdir))
    parser = argparse.ArgumentParser()
    loader = TrainmonLoader()
    loader.define_flags(parser)
    parsed = parser.parse_args(list(flags))
    loader.fix_flags(parsed)
    context = base_plugin.TBContext(logdir=str(logdir), data_provider=provider, multiplexer=mux, flags=parsed)
    plugin = loader.load(context)
    assert plugin is not None
    plugin.registry.stop()  # the tests refresh on request; no background polling
    app = application.TensorBoardWSGI([plugin], data_provider=provider)
    return Client(app, Response)


@pytest.fixture(scope="module")
def client(logdir) -> Client:
    return make_client(logdir)


@pytest.fixture(autouse=True)
def _refresh_on_every_request(monkeypatch):
    monkeypatch.setattr(runs_module, "MIN_REFRESH_SECS", 0.0)


def get(client: Client, route: str, status: int = 200) -> dict:
    r = client.get(f"/data/plugin/trainmon/{route}")
    assert r.headers.get("X-Content-Type-Options") == "nosniff"
    assert r.status_code == status, r.get_data(as_text=True)
    return json.loads(r.get_data())


def anomalies(logdir: Path) -> list:
    return list(read_anomalies(logdir / "demo", 0))


def reference_cells(items, rows_of, step_lo, step_hi, bins):
    """(row, bin, kind) -> count, computed from the records with the documented edges."""
    bins, edges = bin_edges(step_lo, step_hi, bins)
    out: dict[tuple, int] = {}
    for a in items:
        if not step_lo <= a.step <= step_hi:
            continue
        b = max(i for i in range(bins) if edges[i] <= a.step)
        key = (rows_of(a), b, a.kind)
        out[key] = out.get(key, 0) + 1
    return out


def expand_cells(t: dict) -> list[tuple[int, int, int, int]]:
    """(row, bin, kind, count) of every bin of the timeline's cells: a cell is a run of ``span`` bins from
    ``bin``, each bin holding ``count`` records of ``kind``."""
    c = t["cells"]
    out = []
    for r, b, k, n, span in zip(c["row"], c["bin"], c["kind"], c["count"], c["span"], strict=True):
        out.extend((r, b + i, k, n) for i in range(span))
    return out


def cells_of(t: dict) -> dict[tuple, int]:
    return {(t["rows"][r], b, t["kinds"][k]): n for r, b, k, n in expand_cells(t)}


def test_plugin_is_listed_and_enabled(client):
    r = client.get("/data/plugins_listing")
    listing = json.loads(r.get_data())
    entry = listing["trainmon"]
    assert entry["enabled"] is True
    assert entry["loading_mechanism"] == {
        "type": "IFRAME",
        "module_path": "/data/plugin/trainmon/static/index.js",
    }
    r = client.get("/data/plugin/trainmon/static/index.js")
    assert r.status_code == 200 and "export" in r.get_data(as_text=True)
    assert r.mimetype == "text/javascript"


def test_runs_summarise_the_demo_run(client, logdir, capsys):
    got = get(client, "runs")
    assert got["allow_dump_requests"] is False
    assert got["stats"] == ["min", "max", "mean", "norm", "zeros", "nans", "infs"]
    (run,) = got["runs"]
    items = anomalies(logdir)
    assert run["run"] == "demo"
    assert run["ranks"] == [0] and run["world_size"] == 1
    assert run["steps"] == [0, 149]
    # one count, as analyze says it: the per-step cap's summary lines are no anomaly, counted apart
    lines = [a for a in items if a.rule == "suppressed"]
    assert lines and run["anomalies"] == len(items) - len(lines)
    assert run["suppressed"] == sum(int(a.value) for a in lines) > 0
    assert main(["analyze", str(logdir / "demo"), "--json"]) == 0
    said = json.loads(capsys.readouterr().out)
    assert (run["anomalies"], run["suppressed"]) == (said["anomalies"], said["suppressed"])
    assert run["damaged"] == []
    assert run["rules"] == sorted({a.rule for a in items})
    assert run["kinds"] == sorted({a.kind for a in items})
    assert run["dumps"] == len(list_dumps(logdir / "demo"))
    csv_kinds = {p.stem for p in (logdir / "demo" / "rank_0").glob("*.csv")}
    assert set(run["stat_kinds"]) == csv_kinds


@pytest.mark.parametrize(
    ("axis", "bins", "step_lo", "step_hi", "filters"),
    [
        ("rank", 400, None, None, {}),
        ("rank", 7, 95, 145, {}),
        ("module", 13, 0, 149, {"rules": "nan"}),
        ("module", 150, 100, 149, {"kinds": "actv,actv_grad", "name": "layers.[23].*"}),
    ],
)
def test_timeline_bins_exactly_like_the_records(client, logdir, axis, bins, step_lo, step_hi, filters):
    items = anomalies(logdir)
    query = f"timeline?run=demo&axis={axis}&bins={bins}"
    if step_lo is not None:
        query += f"&step_lo={step_lo}&step_hi={step_hi}"
    for key, value in filters.items():
        query += f"&{key}={value}"
    t = get(client, query)
    lo, hi = (0, 149) if step_lo is None else (step_lo, step_hi)
    assert (t["step_lo"], t["step_hi"]) == (lo, hi)
    wanted = [
        a
        for a in items
        if ("rules" not in filters or a.rule in filters["rules"].split(","))
        and ("kinds" not in filters or a.kind in filters["kinds"].split(","))
        and ("name" not in filters or fnmatch.fnmatchcase(a.name, filters["name"]))
    ]
    rows_of = (lambda a: str(a.rank)) if axis == "rank" else (lambda a: a.name)
    assert cells_of(t) == reference_cells(wanted, rows_of, lo, hi, bins)
    assert t["total"] == sum(1 for a in wanted if lo <= a.step <= hi)
    assert t["bins"] == min(bins, hi - lo + 1) and len(t["edges"]) == t["bins"] + 1
    if axis == "module":  # rows in order of each name's first anomaly
        in_range = sorted((a for a in wanted if lo <= a.step <= hi), key=lambda a: a.order_key())
        assert t["rows"] == list(dict.fromkeys(a.name for a in in_range))
    origins = {(t["rows"][r], b) for r, b in zip(t["origins"]["row"], t["origins"]["bin"], strict=True)}
    origin_cells = reference_cells(reference_onsets(wanted), rows_of, lo, hi, bins)
    assert origins == {(row, b) for (row, b, _kind) in origin_cells}


def reference_onsets(items, interval: int = 1) -> list:
    """Where a NaN/Inf started: on each rank, its first step with a non-finite record and each one more than
    ``interval`` steps after the previous; the origin records of those steps, else their first record."""
    bad = sorted((a for a in items if a.rule in ("nan", "inf")), key=lambda a: a.order_key())
    out = []
    for rank in {a.rank for a in bad}:
        steps = sorted({a.step for a in bad if a.rank == rank})
        starts = [s for i, s in enumerate(steps) if i == 0 or s - steps[i - 1] > interval]
        for step in starts:
            at = [a for a in bad if (a.rank, a.step) == (rank, step)]
            out.extend([a for a in at if a.origin] or at[:1])
    return out


def test_timeline_names_the_first_nan_and_its_origin(client):
    t = get(client, "timeline?run=demo&axis=module")
    assert t["first"]["step"] == NAN_STEP and t["first"]["name"] == ORIGIN
    assert t["first"]["origin"] is True and t["first"]["rule"] == "nan"
    # without non-finite anomalies in the filter, the first anomaly of any rule: the loss spike
    t = get(client, "timeline?run=demo&rules=turbulence")
    assert t["first"]["rule"] == "turbulence" and t["first"]["name"] == "loss"
    assert get(client, "timeline?run=demo&ranks=5")["total"] == 0


def test_events_are_origin_first_then_in_collection_order_with_their_dumps(client, logdir):
    got = get(client, f"events?run=demo&step_lo={NAN_STEP}&step_hi={NAN_STEP}&limit=5000")
    at_step = [a for a in anomalies(logdir) if a.step == NAN_STEP]
    expected = sorted(at_step, key=lambda a: (not a.origin, a.order_key()))
    assert got["total"] == len(at_step)
    assert [(e["kind"], e["name"], e["rule"]) for e in got["events"]] == [
        (a.kind, a.name, a.rule) for a in expected
    ]
    first = got["events"][0]
    assert first["name"] == ORIGIN and first["origin"] is True
    paths = [d["path"] for d in first["dumps"]]
    own = [d for d in first["dumps"] if d["name"] == ORIGIN and d["kind"] == "actv"]
    assert own and paths[0] == own[0]["path"]  # the tensor's own dump comes first
    for path in paths:
        assert (logdir / "demo" / path).is_file()
    # one step only, paging
    page = get(client, f"events?run=demo&step_lo={NAN_STEP}&limit=2&offset=1")
    assert [e["name"] for e in page["events"]] == [e["name"] for e in got["events"][1:3]]
    one = get(client, f"events?run=demo&step_lo={NAN_STEP}&name={ORIGIN}&kinds=actv")
    assert [e["name"] for e in one["events"]] == [ORIGIN]


def decode(h: dict) -> tuple[np.ndarray, np.ndarray]:
    shape = (len(h["names"]), h["bins"])
    values = np.frombuffer(base64.b64decode(h["values"]), dtype="<f4").reshape(shape)
    flags = np.frombuffer(base64.b64decode(h["flags"]), dtype="u1").reshape(shape)
    return values, flags


def test_heatmap_matches_the_csv(client, logdir):
    csv = pd.read_csv(logdir / "demo" / "rank_0" / "grad_reduced.csv")
    h = get(client, "heatmap?run=demo&kind=grad_reduced&stat=norm&bins=4000")
    assert h["names"] == list(dict.fromkeys(csv["name"]))
    values, flags = decode(h)
    assert h["bins"] == 150 and h["edges"] == list(range(151))
    pivot = csv.pivot(index="name", columns="step", values="norm").loc[h["names"]].to_numpy()
    finite = np.isfinite(pivot)
    np.testing.assert_allclose(values[finite], pivot[finite], rtol=2e-6, atol=1e-6)  # CSV: 6 decimals
    assert (flags & 1).all()
    # a cell is marked when its tensor held any NaN, also where the norm of the other elements is finite
    nans = csv.pivot(index="name", columns="step", values="nans").loc[h["names"]].to_numpy()
    assert np.array_equal((flags & 2) > 0, nans > 0)
    partly = (nans > 0) & finite
    assert partly.any()  # after the NaN step, gradients with some NaN elements and a finite norm
    assert np.array_equal(np.isnan(pivot), (nans > 0) & ~finite)
    # each marked cell comes with its tensor's NaN count (bins of one step: that step's)
    bad = h["nonfinite"]
    assert bad["cells"] == np.flatnonzero(nans.ravel() > 0).tolist()
    assert bad["nans"] == nans.ravel()[nans.ravel() > 0].tolist()
    assert set(bad["infs"]) == {0.0}
    # coarser bins take the maximum of each bin's steps
    h = get(client, "heatmap?run=demo&kind=grad_reduced&stat=norm&bins=7&step_lo=10&step_hi=59")
    values, _ = decode(h)
    _, edges = bin_edges(10, 59, 7)
    for i in range(7):
        steps = list(range(edges[i], edges[i + 1]))
        want = np.nanmax(
            csv[csv.step.isin(steps)].pivot(index="name", columns="step", values="norm").loc[h["names"]],
            axis=1,
        )
        np.testing.assert_allclose(values[:, i], want, rtol=2e-6, atol=1e-6)
    # steps 140-149 in one bin: a marked cell's count is the most NaN elements at one of its steps
    h = get(client, "heatmap?run=demo&kind=grad_reduced&stat=norm&bins=1&step_lo=140&step_hi=149")
    most = csv[csv.step >= 140].groupby("name")["nans"].max().loc[h["names"]].to_numpy()
    assert h["nonfinite"]["cells"] == np.flatnonzero(most > 0).tolist()
    assert h["nonfinite"]["nans"] == most[most > 0].tolist()
    # min takes the minimum; a name glob picks rows
    h = get(client, "heatmap?run=demo&kind=actv&stat=nans&name=layers.2.mlp.fc2.*&bins=150")
    assert h["names"] == ["layers.2.mlp.fc2.input", ORIGIN]
    values, _ = decode(h)
    assert values[1, NAN_STEP] == 32768 and values[1, NAN_STEP - 1] == 0


def test_series_and_its_anomaly_markers(client, logdir):
    csv = pd.read_csv(logdir / "demo" / "rank_0" / "actv.csv")
    rows = csv[csv.name == ORIGIN].set_index("step")
    s = get(client, f"series?run=demo&kind=actv&name={ORIGIN}&stat=nans")
    assert s["steps"] == rows.index.tolist()
    assert s["values"] == rows["nans"].astype(float).tolist()
    norm = get(client, f"series?run=demo&kind=actv&name={ORIGIN}&stat=norm")
    assert norm["values"][NAN_STEP] == "nan" and isinstance(norm["values"][0], float)
    markers = [m for m in s["anomalies"] if m["origin"]]
    assert markers[0] == {"step": NAN_STEP, "rule": "nan", "stat": "nans", "value": 32768.0, "origin": True}
    get(client, "series?run=demo&kind=actv&name=no.such&stat=nans", 404)


def described(tensor: torch.Tensor) -> tuple[str, str]:
    """(shape, dtype) as the tab shows them: ``("[256, 64]", "float32")``."""
    return "[" + ", ".join(str(d) for d in tensor.shape) + "]", str(tensor.dtype).removeprefix("torch.")


def demo_shapes() -> dict[tuple[str, str], tuple[str, str]]:
    """(kind, name) -> (shape, dtype) of the demo's tensors, from its model, not from the run: each
    parameter's for the parameter kinds, each module's first input and its output on a batch for ``actv``
    (and the same for their gradients, ``actv_grad``), a scalar for the tracked loss."""
    setup = DemoSetup()
    model, _ = build(setup)
    out = {("scalar", "loss"): ("[]", "float32")}
    state_kinds = [k.value for k in Kind if k.value not in ("actv", "actv_grad", "scalar", "comm")]
    for name, p in model.named_parameters():
        out.update({(kind, name): described(p) for kind in state_kinds})

    def record(module_name: str):
        def hook(module, inputs, output) -> None:
            for side, tensor in (("input", inputs[0]), ("output", output)):
                out[("actv", f"{module_name}.{side}")] = described(tensor)
                out[("actv_grad", f"{module_name}.{side}_grad")] = described(tensor)

        return hook

    for module_name, module in model.named_modules():
        if module_name:
            module.register_forward_hook(record(module_name))
    with torch.no_grad():
        model(synthetic_batch(setup, torch.Generator().manual_seed(1))[:, :-1])
    return out


def test_the_views_name_each_tensor_with_the_shape_the_store_recorded(client):
    """Every tensor of the heat maps, the series and the anomaly list comes with its shape and dtype (the
    model's), once per name: a Linear's weight is [out, in], an activation [batch, sequence, width]."""
    expected = demo_shapes()
    fc1 = expected[("grad_reduced", "layers.0.mlp.fc1.weight")]
    assert fc1 == ("[256, 64]", "float32")  # nn.Linear(64, 256): [out, in]
    assert expected[("actv", ORIGIN)] == ("[16, 32, 64]", "float32")
    assert expected[("actv", "embedding.input")] == ("[16, 32]", "int64")  # the tokens
    for kind in get(client, "runs")["runs"][0]["stat_kinds"]:
        h = get(client, f"heatmap?run=demo&kind={kind}&stat=norm&bins=10")
        assert h["names"], kind
        assert list(zip(h["shapes"], h["dtypes"], strict=True)) == [expected[(kind, n)] for n in h["names"]]
    # a glob's rows keep their own shapes
    h = get(client, "heatmap?run=demo&kind=actv&stat=norm&name=layers.2.mlp.fc*.output&bins=10")
    assert dict(zip(h["names"], h["shapes"], strict=True)) == {
        "layers.2.mlp.fc1.output": "[16, 32, 256]",
        ORIGIN: "[16, 32, 64]",
    }
    s = get(client, "series?run=demo&kind=grad_reduced&name=layers.0.mlp.fc1.weight&stat=norm")
    assert (s["shape"], s["dtype"]) == ("[256, 64]", "float32")
    s = get(client, f"series?run=demo&kind=actv&name={ORIGIN}&stat=nans")
    assert (s["shape"], s["dtype"]) == ("[16, 32, 64]", "float32")
    events = get(client, f"events?run=demo&step_lo={NAN_STEP - 1}&step_hi={NAN_STEP}&limit=5000")["events"]
    tensors = [e for e in events if e["kind"] in {k.value for k in Kind}]
    assert len(tensors) > 40 and {e["kind"] for e in tensors} >= {"actv", "scalar"}
    assert [(e["shape"], e["dtype"]) for e in tensors] == [expected[(e["kind"], e["name"])] for e in tensors]
    assert tensors[0]["name"] == ORIGIN and tensors[0]["shape"] == "[16, 32, 64]"
    summaries = [e for e in events if e["name"] == "*"]  # the per-step cap's lines name no tensor
    assert summaries and all(e["shape"] is None and e["dtype"] is None for e in summaries)


SHAPED_RANKS = 3  # and rank 3: an old store, which recorded no shapes


def write_shaped_run(run: Path) -> None:
    """Ranks holding a tensor of another shape each (pipeline stages), written by the monitor's own sink; a
    config reload adds ``late.output`` at step 3; rank 3 has an old store. One NaN of each tensor listed."""
    for rank in range(SHAPED_RANKS):
        sink = StatStoreSink(run, rank)
        for step in range(6):
            rows = [Row("grad_reduced", "fc.weight", 0, 0, "optimizer", (rank + 2, 4), "torch.bfloat16")]
            if step >= 3:
                rows.append(Row("actv", "late.output", 0, 0, "forward", (8, rank + 1), "torch.float32"))
            p = np.tile([4.0, 0, 0, 0, -1, 1, 0, 4], (len(rows), 1))
            record = StepRecord(step, rank, tuple(rows), p, 0.0)
            sink.write(record, Derived(record))
        sink.close()
    stats_names_file(run, 3).write_bytes(old_names_line(0, "grad_reduced", "fc.weight"))
    old = np.zeros(6, dtype=STAT_RECORD)
    old["step"] = np.arange(6)
    old.tofile(stats_records_file(run, 3))
    for rank in range(SHAPED_RANKS + 1):
        with AnomalyLog(run, rank) as log:
            log.write_step(1, [Anomaly(1, rank, "grad_reduced", "fc.weight", "nans", 1.0, "nan")])
            log.write_step(4, [Anomaly(4, rank, "actv", "late.output", "nans", 1.0, "nan")])


def test_shapes_are_each_ranks_read_once_and_a_bounded_number_an_answer(tmp_path, monkeypatch):
    write_shaped_run(tmp_path / "shaped")
    reads: list[tuple[int, int]] = []
    read_meta = shape_index.read_meta

    def counted(run, rank, step_lo, step_hi):
        assert step_lo == step_hi  # one step a read: never a whole store
        reads.append((rank, step_lo))
        return read_meta(run, rank, step_lo, step_hi)

    monkeypatch.setattr(shape_index, "read_meta", counted)
    monkeypatch.setattr(shape_index, "MAX_READS", 4)
    client = make_client(tmp_path)

    def shapes() -> dict[tuple[int, str], tuple]:
        events = get(client, "events?run=shaped&step_lo=0&step_hi=5")["events"]
        return {(e["rank"], e["name"]): (e["shape"], e["dtype"]) for e in events}

    # the first answer: each rank's first step, then late.output at its anomaly's step (4 reads at most)
    first = shapes()
    assert reads == [(0, 0), (1, 0), (2, 0), (0, 4)]
    wanted = {(r, "fc.weight"): (f"[{r + 2}, 4]", "bfloat16") for r in range(SHAPED_RANKS)}
    wanted |= {(r, "late.output"): (f"[8, {r + 1}]", "float32") for r in range(SHAPED_RANKS)}
    wanted |= {(3, "fc.weight"): (None, None), (3, "late.output"): (None, None)}  # the old store: none
    assert first == wanted | {(1, "late.output"): (None, None), (2, "late.output"): (None, None)}
    # the next answer reads the rest; then nothing is read again
    assert shapes() == wanted and reads[4:] == [(1, 4), (2, 4)]
    assert shapes() == wanted and len(reads) == 6
    # the heat map of a tensor added later: read at its first step
    h = get(client, "heatmap?run=shaped&rank=2&kind=actv&stat=norm")
    assert (h["names"], h["shapes"], h["dtypes"]) == (["late.output"], ["[8, 3]"], ["float32"])
    h = get(client, "heatmap?run=shaped&rank=3&kind=grad_reduced&stat=norm")
    assert (h["names"], h["shapes"], h["dtypes"]) == (["fc.weight"], [None], [None])
    client = make_client(tmp_path)  # a fresh plugin, the heat map first: the late tensor at its first step
    h = get(client, "heatmap?run=shaped&rank=1&kind=actv&stat=norm")
    assert h["shapes"] == ["[8, 2]"] and reads[6:] == [(1, 0), (1, 3)]
    s = get(client, "series?run=shaped&rank=1&kind=grad_reduced&name=fc.weight&stat=max")
    assert (s["shape"], s["dtype"]) == ("[3, 4]", "bfloat16") and len(reads) == 8


def test_ranks_holding_the_same_tensors_keep_one_table_of_shapes(tmp_path):
    """A data-parallel job's ranks hold the same tensors: their shapes are kept once, whatever the ranks; a
    rank that adds a tensor gets a table of its own, the others keep theirs."""
    for rank in range(4):
        sink = StatStoreSink(tmp_path, rank)
        for step in range(2):
            rows = [Row("grad_reduced", "fc.weight", 0, 0, "optimizer", (3, 4), "torch.float32")]
            if rank == 3 and step == 1:
                rows.append(Row("actv", "fc.output", 0, 0, "forward", (2, 3), "torch.bfloat16"))
            p = np.tile([12.0, 0, 0, 0, -1, 1, 0, 4], (len(rows), 1))
            record = StepRecord(step, rank, tuple(rows), p, 0.0)
            sink.write(record, Derived(record))
        sink.close()
    index = shape_index.ShapeIndex(tmp_path)
    weights = [(rank, "grad_reduced", "fc.weight") for rank in range(4)]
    assert index.lookup(weights, lambda tensor: None) == [("float32", "[3, 4]")] * 4
    assert index.kept() == (4, 1)
    assert index.lookup([(3, "actv", "fc.output")], lambda tensor: 1) == [("bfloat16", "[2, 3]")]
    assert index.kept() == (4, 2)
    assert index.lookup(weights, lambda tensor: None) == [("float32", "[3, 4]")] * 4


def test_dump_meta_statistics_equal_the_kernel_and_histogram_counts_the_finite_values(client, logdir):
    dumps = list_dumps(logdir / "demo")
    for entry in (next(d for d in dumps if d.name == ORIGIN), next(d for d in dumps if d.kind == "scalar")):
        meta = get(client, f"dump_meta?run=demo&path={entry.path}")
        tensor = load_file(logdir / "demo" / entry.path)["tensor"]
        want = derive(partials(tensor).double().numpy())
        assert meta["entry"]["path"] == entry.path and meta["tensor"]["shape"] == list(tensor.shape)
        assert meta["stats"]["numel"] == tensor.numel()
        assert meta["stats"]["nans"] == int(torch.isnan(tensor).sum())
        for stat in ("min", "max", "mean", "norm", "zeros"):
            w = float(want[stat][0])
            assert meta["stats"][stat] == ("nan" if math.isnan(w) else w)
        finite = int(torch.isfinite(tensor).sum())
        assert sum(meta["histogram"]["counts"]) == finite
    # the loss dump holds the loss of its step, as the CSV says
    scalar = next(d for d in dumps if d.kind == "scalar")
    loss = pd.read_csv(logdir / "demo" / "rank_0" / "scalar.csv").set_index("step")["mean"][scalar.step]
    meta = get(client, f"dump_meta?run=demo&path={scalar.path}")
    assert meta["stats"]["mean"] == pytest.approx(loss, abs=1e-6)


def test_dump_download_is_the_file(client, logdir):
    entry = list_dumps(logdir / "demo")[0]
    r = client.get(f"/data/plugin/trainmon/dump?run=demo&path={entry.path}")
    assert r.status_code == 200
    assert r.get_data() == (logdir / "demo" / entry.path).read_bytes()
    assert r.headers["Content-Disposition"].startswith("attachment;")
    assert r.headers["X-Content-Type-Options"] == "nosniff"


def test_dump_requests_need_the_flag_and_json(logdir, client):
    body = {"run": "demo", "name": "layers.0.*", "kind": "actv", "rank": 0}
    r = client.post("/data/plugin/trainmon/request_dump", json=body)
    assert r.status_code == 403 and "--trainmon_allow_dump_requests" in r.get_json()["error"]
    allowed = make_client(logdir, "--trainmon_allow_dump_requests")
    path = requests_file(logdir / "demo")
    before = path.read_text().splitlines() if path.exists() else []
    r = allowed.post("/data/plugin/trainmon/request_dump", json=body)
    assert r.status_code == 200, r.get_data(as_text=True)
    lines = path.read_text().splitlines()
    assert len(lines) == len(before) + 1
    request = DumpRequest.from_dict(json.loads(lines[-1]))
    assert (request.name, request.kind, request.rank, request.step) == ("layers.0.*", "actv", 0, None)
    assert request.id == r.get_json()["id"]
    # a form post (what a cross-site page can send without a preflight) is refused
    r = allowed.post("/data/plugin/trainmon/request_dump", data={"run": "demo", "name": "x"})
    assert r.status_code == 400 and "application/json" in r.get_json()["error"]
    r = allowed.post("/data/plugin/trainmon/request_dump", json={**body, "cmd": "rm"})
    assert r.status_code == 400 and "cmd" in r.get_json()["error"]
    r = allowed.post("/data/plugin/trainmon/request_dump", json={**body, "kind": "weights"})
    assert r.status_code == 400 and "kind" in r.get_json()["error"]
    r = allowed.post("/data/plugin/trainmon/request_dump", json={**body, "run": "../demo"})
    assert r.status_code == 400
    for blank in ("", "   "):  # a glob that matches no tensor (issue 32)
        r = allowed.post("/data/plugin/trainmon/request_dump", json={**body, "name": blank})
        assert r.status_code == 400 and "'name'" in r.get_json()["error"]
    assert len(path.read_text().splitlines()) == len(before) + 1


def test_a_run_with_dumps_on_the_timeline_warms_the_dump_reader_up(client):
    """The first dump opened in a fresh TensorBoard opens as fast as the next ones: what reading a dump
    imports (torch, the stats kernel: 2 s) is imported once the tab shows a run with dumps, not by the first
    /dump_meta (bench/plugin_first_view.py measures it)."""
    from trainmon_tb import dump_view

    assert get(client, "runs")["runs"][0]["dumps"] > 0
    get(client, "timeline?run=demo")
    assert dump_view.WARM.wait(60)


@pytest.mark.parametrize(
    ("route", "status", "words"),
    [
        ("timeline?run=..", 400, "'..'"),
        ("timeline?run=%2e%2e%2fdemo", 400, "'..'"),
        ("timeline?run=/etc", 400, "absolute"),
        ("timeline?run=demo%2f..%2f..", 400, "'..'"),
        ("timeline?run=nothere", 404, "no trainmon run"),
        ("timeline", 400, "'run' is required"),
        ("dump_meta?run=demo&path=../../etc/passwd", 400, "'..'"),
        ("dump_meta?run=demo&path=%2fetc%2fpasswd", 400, "absolute"),
        ("dump_meta?run=demo&path=rank_0%5c..%5cx.safetensors", 400, "backslash"),
        ("dump_meta?run=demo&path=rank_0/actv.csv", 400, ".safetensors"),
        ("dump?run=demo&path=plugins/trainmon/dumps/nope.safetensors", 404, "no dump"),
        ("dump?run=demo&path=..%2F..%2Fsecret.safetensors", 400, "'..'"),
        ("timeline?run=demo&bins=0", 400, "'bins'"),
        ("timeline?run=demo&bins=abc", 400, "expected an integer"),
        ("timeline?run=demo&axis=diagonal", 400, "'axis'"),
        ("timeline?run=demo&step_lo=10&step_hi=5", 400, "below"),
        ("timeline?run=demo&ranks=a,b", 400, "'ranks'"),
        ("timeline?run=demo&ranks=0,-1", 400, ">= 0"),
        ("heatmap?run=demo&kind=bogus", 400, "'kind'"),
        ("heatmap?run=demo&kind=actv&stat=median", 400, "'stat'"),
        ("heatmap?run=demo&kind=actv&rank=7", 404, "rank 7"),
        ("events?run=demo&limit=100000", 400, "'limit'"),
        ("static/..%2f..%2fplugin.py", 400, "'..'"),
        ("static/nope.js", 404, "no static file"),
    ],
)
def test_bad_input_gets_a_clear_error(client, route, status, words):
    got = get(client, route, status)
    assert words in got["error"]


def test_a_symlink_out_of_the_logdir_is_refused(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    secret = outside / "secret.safetensors"
    secret.write_bytes(b"not for you")
    logdir = tmp_path / "logs"
    run = logdir / "job" / "plugins" / "trainmon"
    run.mkdir(parents=True)
    os.symlink(secret, logdir / "job" / "link.safetensors")
    os.symlink(outside, logdir / "escape")
    (outside / "plugins" / "trainmon").mkdir(parents=True)  # a run only reachable through the symlink
    client = make_client(logdir)
    got = get(client, "dump?run=job&path=link.safetensors", 400)
    assert "outside the logdir" in got["error"]
    assert "outside the logdir" in get(client, "timeline?run=escape", 400)["error"]
    assert [r["run"] for r in get(client, "runs")["runs"]] == ["job"]  # a link out of the logdir: not walked


def test_symlinked_run_folders_inside_the_logdir_are_listed_as_tensorboard_lists_them(tmp_path):
    """A ``latest`` link to a run and a folder of links to runs kept elsewhere in the logdir are listed under
    the links' names, and read through them; a link back up the tree (a loop) is not walked."""
    logdir = tmp_path / "logs"
    store = logdir / "store"
    for name, step in (("a", 3), ("b", 5)):
        with AnomalyLog(store / name, 0) as log:
            log.write_step(step, [Anomaly(step=step, rank=0, kind="actv", name="m.output", stat="nans",
                                          value=1.0, rule="nan", origin=True)])  # fmt: skip
    (logdir / "picked").mkdir()
    os.symlink(store / "b", logdir / "latest")  # absolute
    os.symlink(Path("..") / "store" / "a", logdir / "picked" / "a")  # relative
    os.symlink(logdir, logdir / "picked" / "loop")  # back to the logdir: a loop
    client = make_client(logdir)
    assert [r["run"] for r in get(client, "runs")["runs"]] == ["latest", "picked/a", "store/a", "store/b"]
    assert get(client, "timeline?run=latest")["first"]["step"] == 5
    assert get(client, "timeline?run=picked/a")["first"]["step"] == 3


def test_new_records_appear_and_partial_batches_wait(tmp_path):
    from trainmon.anomaly.log import AnomalyLog
    from trainmon.run.columnar import segments
    from trainmon.run.records import Anomaly

    run = tmp_path / "logs" / "live"
    log = AnomalyLog(run, rank=3)
    log.write_step(
        5, [Anomaly(step=5, rank=3, kind="actv", name="a.output", stat="nans", value=1.0, rule="nan")]
    )
    client = make_client(tmp_path / "logs")
    assert get(client, "timeline?run=live")["total"] == 1
    later = Anomaly(
        step=9, rank=3, kind="actv", name="b.output", stat="nans", value=2.0, rule="nan", origin=True
    )
    stream = segments(log.path)[-1].path  # the Arrow stream being written
    before = stream.read_bytes()
    log.write_step(9, [later])
    after = stream.read_bytes()
    stream.write_bytes(after[: len(before) + 20])  # a writer caught mid-batch
    assert get(client, "timeline?run=live")["total"] == 1
    stream.write_bytes(after)
    t = get(client, "timeline?run=live&axis=module")
    assert t["total"] == 2 and t["rows"] == ["a.output", "b.output"] and t["step_hi"] == 9
    assert t["first"]["name"] == "a.output"  # the first NaN in collection order
    # a damaged last message (not Arrow at all) is ignored; the whole batches before it still count
    with open(stream, "ab") as f:
        f.write(b"{not arrow\n" * 8)
    assert get(client, "timeline?run=live")["total"] == 2
    # a new run appears without restarting TensorBoard
    AnomalyLog(tmp_path / "logs" / "second", rank=0).write_step(
        1, [Anomaly(step=1, rank=0, kind="actv", name="x", stat="nans", value=1.0, rule="nan")]
    )
    assert get(client, "timeline?run=second")["total"] == 1
    log.close()


def test_a_plugin_that_cannot_import_leaves_tensorboard_running(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "trainmon_tb.plugin", None)  # import raises ImportError
    parser = argparse.ArgumentParser()
    TrainmonLoader().define_flags(parser)
    context = base_plugin.TBContext(logdir=str(tmp_path), flags=parser.parse_args([]))
    assert TrainmonLoader().load(context) is None


def test_poll_secs_flag_is_checked():
    parser = argparse.ArgumentParser()
    loader = TrainmonLoader()
    loader.define_flags(parser)
    with pytest.raises(base_plugin.FlagsError, match="trainmon_poll_secs"):
        loader.fix_flags(parser.parse_args(["--trainmon_poll_secs", "0"]))


def test_the_old_layout_gives_the_same_index(logdir, tmp_path):
    """A run written before the columnar tables (one JSON line a record) is indexed as the same records."""
    from trainmon_tb.anomaly_index import AnomalyIndex

    from trainmon.run.anomalies import anomaly_to_json
    from trainmon.run.layout import anomalies_file

    old_run = tmp_path / "old"
    anomalies_file(old_run, 0).parent.mkdir(parents=True)
    anomalies_file(old_run, 0).write_text("".join(anomaly_to_json(a) + "\n" for a in anomalies(logdir)))
    whole = AnomalyIndex(logdir / "demo")
    whole.refresh()
    old = AnomalyIndex(old_run)
    old.refresh()
    assert len(old) == len(whole) == len(anomalies(logdir))
    a = whole.timeline("module", 0, 149, 150)
    b = old.timeline("module", 0, 149, 150)
    assert (a.rows, a.cells, a.origins, a.first) == (b.rows, b.cells, b.origins, b.first)
    assert whole.events(140, 140, limit=5000) == old.events(140, 140, limit=5000)


# ---------------------------------------------------------------------------------------------- exact capture
# The run is written with the library's own writers (``AnomalyLog``, ``DumpWriter``), as an exact capture lays
# it out: at step 7 the origin module ``layers.1`` has clean inputs and a NaN/Inf output, all dumped at step 7
# with reasons ``exact: ...``; a request-based dump of the same output follows at step 8.

EXACT_RUN = "exact"
EXACT_STEP = 7
EXACT_MODULE = "layers.1"
EXACT_REASON = f"exact: nan origin actv {EXACT_MODULE}.output"


def origin_output() -> torch.Tensor:
    """[2, 2, 6]: NaN at [0,1,2] and [0,1,5], +inf at [1,1,0], -inf at [1,1,1]; as 2-D, rows 1 and 3."""
    x = torch.arange(24, dtype=torch.float32).reshape(2, 2, 6)
    x[0, 1, 2] = x[0, 1, 5] = math.nan
    x[1, 1, 0], x[1, 1, 1] = math.inf, -math.inf
    return x


def write_exact_run(run_dir: Path) -> None:
    """Anomalies and dumps of a run whose ``layers.1`` output goes non-finite at step 7 (see above)."""
    anomaly = dict(rank=0, stat="nans", micro_step=0, phase="forward")
    with AnomalyLog(run_dir, 0) as log:
        log.write_step(
            3,
            [
                Anomaly(
                    step=3,
                    kind="scalar",
                    name="loss",
                    value=9.0,
                    rule="turbulence",
                    seq=40,
                    stat="mean",
                    rank=0,
                    baseline=1.0,
                    dump="request:anomaly-step3-0",
                )
            ],
        )
        log.write_step(EXACT_STEP, [
            Anomaly(step=EXACT_STEP, kind="actv", name=f"{EXACT_MODULE}.output", value=2.0, rule="nan", seq=5,
                    origin=True, dump="request:anomaly-step7-0", **anomaly),
            Anomaly(step=EXACT_STEP, kind="actv", name="layers.2.output", value=6.0, rule="nan", seq=8,
                    propagated=True, **anomaly),
            Anomaly(step=EXACT_STEP, kind="grad_reduced", name=f"{EXACT_MODULE}.weight", value=1.0,
                    rule="nan", seq=30, **{**anomaly, "phase": "optimizer"}),
        ])  # fmt: skip
    finite = torch.linspace(-1.0, 1.0, 24).reshape(4, 6)
    with DumpWriter(run_dir, 0) as w:
        w.write(5, 0, "scalar", "loss", torch.tensor(9.0), "request anomaly-step3-0")
        # what an exact capture saves at step 7 (the origin module's call, a gradient, its state, the loss)
        w.write(EXACT_STEP, 0, "actv", f"{EXACT_MODULE}.input", finite, EXACT_REASON)
        # the same tensor twice
        w.write(EXACT_STEP, 0, "actv", f"{EXACT_MODULE}.input", finite * 2, "request manual")
        w.write(EXACT_STEP, 0, "actv", f"{EXACT_MODULE}.input_1", finite.to(torch.bfloat16), EXACT_REASON)
        w.write(EXACT_STEP, 0, "actv", f"{EXACT_MODULE}.output", origin_output(), EXACT_REASON)
        # another micro-step's call
        w.write(EXACT_STEP, 1, "actv", f"{EXACT_MODULE}.input", finite * 3, EXACT_REASON)
        grad = torch.ones(3, 4, dtype=torch.bfloat16)
        grad[2, 1] = math.nan
        for kind, tensor in (
            ("grad_reduced", grad),
            ("param_origin", finite[:3, :4]),
            ("exp_avg", finite[:3, :4]),
            ("exp_avg_sq", finite[:3, :4] ** 2),
        ):
            w.write(EXACT_STEP, 0, kind, f"{EXACT_MODULE}.weight", tensor, EXACT_REASON)
        # not this anomaly's tensor
        w.write(EXACT_STEP, 0, "grad_reduced", "layers.0.weight", finite, EXACT_REASON)
        w.write(EXACT_STEP, 0, "scalar", "loss", torch.tensor(1.5), EXACT_REASON)
        # the request-based dump of the origin output, at its next occurrence
        later = origin_output() * 0
        w.write(EXACT_STEP + 1, 0, "actv", f"{EXACT_MODULE}.output", later, "request anomaly-step7-0")


@pytest.fixture(scope="module")
def exact_logdir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("exact")
    write_exact_run(root / EXACT_RUN)
    return root


@pytest.fixture(scope="module")
def exact_client(exact_logdir):
    return make_client(exact_logdir)


def by_path(logdir: Path) -> dict:
    return {e.path: e for e in list_dumps(logdir / EXACT_RUN)}


def names(dumps: list[dict]) -> list[tuple]:
    return [(d["step"], d["kind"], d["name"], d["same_step"], d["own"]) for d in dumps]


def events_at(client, step: int) -> dict:
    got = get(client, f"events?run={EXACT_RUN}&step_lo={step}&step_hi={step}")
    return {(e["kind"], e["name"]): e for e in got["events"]}


def test_the_origin_links_to_its_own_step_first_and_later_dumps_after(exact_client):
    origin = events_at(exact_client, EXACT_STEP)[("actv", f"{EXACT_MODULE}.output")]
    assert origin["dump_step"] == EXACT_STEP
    assert names(origin["dumps"]) == [
        (EXACT_STEP, "actv", f"{EXACT_MODULE}.output", True, True),
        (EXACT_STEP, "actv", f"{EXACT_MODULE}.input", True, False),
        (EXACT_STEP, "actv", f"{EXACT_MODULE}.input_1", True, False),
        (EXACT_STEP, "scalar", "loss", True, False),
        (EXACT_STEP, "actv", f"{EXACT_MODULE}.input", True, False),  # the second micro-step's call, after
        (EXACT_STEP + 1, "actv", f"{EXACT_MODULE}.output", False, True),
    ]
    assert all(d["reason"] == EXACT_REASON for d in origin["dumps"][:5])
    assert origin["dumps"][-1]["reason"] == "request anomaly-step7-0"


def test_a_parameter_anomaly_gets_its_state_and_the_module_call_of_its_step(exact_client):
    grad = events_at(exact_client, EXACT_STEP)[("grad_reduced", f"{EXACT_MODULE}.weight")]
    assert grad["dump_step"] == EXACT_STEP
    assert names(grad["dumps"]) == [
        (EXACT_STEP, "grad_reduced", f"{EXACT_MODULE}.weight", True, True),
        (EXACT_STEP, "actv", f"{EXACT_MODULE}.input", True, False),
        (EXACT_STEP, "actv", f"{EXACT_MODULE}.input_1", True, False),
        (EXACT_STEP, "actv", f"{EXACT_MODULE}.output", True, False),
        (EXACT_STEP, "exp_avg", f"{EXACT_MODULE}.weight", True, False),
        (EXACT_STEP, "exp_avg_sq", f"{EXACT_MODULE}.weight", True, False),
        (EXACT_STEP, "param_origin", f"{EXACT_MODULE}.weight", True, False),
        (EXACT_STEP, "scalar", "loss", True, False),
        (EXACT_STEP, "actv", f"{EXACT_MODULE}.input", True, False),  # micro-step 1, after micro-step 0's
    ]  # layers.0.weight's gradient, also captured at step 7, belongs to no anomaly here


def test_a_propagated_tensor_without_its_own_dump_still_gets_the_origin_call(exact_client):
    propagated = events_at(exact_client, EXACT_STEP)[("actv", "layers.2.output")]
    assert propagated["dump_step"] is None
    assert [d["name"] for d in propagated["dumps"]][:4] == [
        f"{EXACT_MODULE}.input",
        f"{EXACT_MODULE}.input_1",
        f"{EXACT_MODULE}.output",
        "loss",
    ]
    assert not any(d["own"] for d in propagated["dumps"])


def test_only_a_later_dump_is_marked_as_later(exact_client):
    (loss,) = events_at(exact_client, 3).values()
    assert loss["dump_step"] == 5
    assert names(loss["dumps"]) == [(5, "scalar", "loss", False, True)]


def test_dump_meta_of_the_origin_output_shows_its_module_call_and_its_non_finite_values(
    exact_client, exact_logdir
):
    entries = by_path(exact_logdir)
    output = next(
        p for p, e in entries.items() if e.step == EXACT_STEP and e.name == f"{EXACT_MODULE}.output"
    )
    meta = get(exact_client, f"dump_meta?run={EXACT_RUN}&path={output}")
    assert meta["stats"]["nans"] == 2 and meta["stats"]["infs"] == 2
    assert meta["nonfinite"] == {
        "count": 4,
        "first": [
            {"index": [0, 1, 2], "value": "nan"},
            {"index": [0, 1, 5], "value": "nan"},
            {"index": [1, 1, 0], "value": "inf"},
            {"index": [1, 1, 1], "value": "-inf"},
        ],
        "rows": {"shape": [4, 6], "flattened": True, "with_non_finite": 2, "counts": [[1, 2], [3, 2]]},
    }
    module = meta["module"]
    assert (module["module"], module["step"], module["rank"], module["micro_step"]) == (
        EXACT_MODULE,
        EXACT_STEP,
        0,
        0,
    )
    got = [(t["name"], t["role"], t["side"], t["reason"]) for t in module["tensors"]]
    assert got == [
        # the exact dump, not the manual one of the same input
        (f"{EXACT_MODULE}.input", "input", "input", EXACT_REASON),
        (f"{EXACT_MODULE}.input_1", "input", "input", EXACT_REASON),
        (f"{EXACT_MODULE}.output", "output", "output", EXACT_REASON),
    ]
    assert module["tensors"][2]["path"] == output
    # the inputs are clean: nothing to locate, and a 2-D view with no bad row
    for t in module["tensors"][:2]:
        inp = get(exact_client, f"dump_meta?run={EXACT_RUN}&path={t['path']}")
        assert inp["stats"]["nans"] == inp["stats"]["infs"] == 0
        assert inp["nonfinite"] == {
            "count": 0,
            "first": [],
            "rows": {"shape": [4, 6], "flattened": False, "with_non_finite": 0, "counts": []},
        }
    assert (
        get(exact_client, f"dump_meta?run={EXACT_RUN}&path={module['tensors'][1]['path']}")["tensor"]["dtype"]
        == "bfloat16"
    )


def test_dump_meta_of_a_bf16_gradient_locates_its_nan_and_has_no_module(exact_client, exact_logdir):
    grad = next(
        p
        for p, e in by_path(exact_logdir).items()
        if e.kind == "grad_reduced" and e.name == f"{EXACT_MODULE}.weight"
    )
    meta = get(exact_client, f"dump_meta?run={EXACT_RUN}&path={grad}")
    assert meta["module"] is None
    assert meta["nonfinite"] == {
        "count": 1,
        "first": [{"index": [2, 1], "value": "nan"}],
        "rows": {"shape": [3, 4], "flattened": False, "with_non_finite": 1, "counts": [[2, 1]]},
    }
    scalar = next(p for p, e in by_path(exact_logdir).items() if e.kind == "scalar" and e.step == EXACT_STEP)
    assert get(exact_client, f"dump_meta?run={EXACT_RUN}&path={scalar}")["nonfinite"] == {
        "count": 0,
        "first": [],
        "rows": None,
    }


def test_module_roles_follow_the_monitor_names():
    assert module_role("actv", "layers.0.input_proj.output") == ("layers.0.input_proj", "output", "")
    assert module_role("actv", "m.input_1") == ("m", "input", "1")
    assert module_role("actv", "m.input_grad") == ("m", "input", "grad")  # a keyword input named grad
    assert module_role("actv_grad", "m.input_grad") == ("m", "input_grad", "")
    assert module_role("actv_grad", "m.output_grad_0") == ("m", "output_grad", "0")
    assert module_role("grad_reduced", "m.input") is None
    assert module_role("actv", "input") is None


def test_locating_caps_the_lists_but_counts_everything():
    classes = torch.ones(600, 2, dtype=torch.int8).numpy().reshape(-1)
    got = locate_non_finite(classes, (600, 2))
    assert got["count"] == 1200 and len(got["first"]) == FIRST_NON_FINITE
    assert got["first"][1] == {"index": [0, 1], "value": "nan"}
    assert got["rows"]["with_non_finite"] == 600 and len(got["rows"]["counts"]) == MAX_BAD_ROWS
    assert locate_non_finite(torch.tensor([0, 2], dtype=torch.int8).numpy(), (2,)) == {
        "count": 1,
        "first": [{"index": [1], "value": "inf"}],
        "rows": None,
    }
    assert locate_non_finite(torch.tensor([1], dtype=torch.int8).numpy(), ()) == {
        "count": 1,
        "first": [{"index": [], "value": "nan"}],
        "rows": None,
    }


# ------------------------------------------------- the origin's micro-step first (issue 22, point 5)


@pytest.mark.timeout(120)
def test_the_origins_first_dump_link_is_its_own_micro_step(tmp_path):
    """With gradient accumulation the origin at micro-step 2 links first to its dump of micro-step 2 (where
    the NaN is), not to micro-step 0's; the module call of that dump is micro-step 2's."""
    write_acc_run(tmp_path / "acc", micro_steps=4, nan_micro=2, where="leaf")
    client = make_client(tmp_path)
    events = get(client, f"events?run=acc&step_lo={ACC_NAN_STEP}&step_hi={ACC_NAN_STEP}")["events"]
    origin = events[0]
    assert (origin["name"], origin["origin"], origin["micro_step"]) == ("1.v.output", True, 2)
    own = [(d["micro_step"], d["same_step"]) for d in origin["dumps"] if d["own"]]
    assert own == [(2, True), (0, True), (1, True), (3, True)]
    assert origin["dumps"][0]["path"].endswith("actv__1.v.output__m2.safetensors")
    # then the module call of that micro-step: the input next to it
    assert [(d["name"], d["micro_step"]) for d in origin["dumps"] if not d["own"]][:1] == [("1.v.input", 2)]
    meta = get(client, f"dump_meta?run=acc&path={origin['dumps'][0]['path']}")
    assert meta["module"]["micro_step"] == 2 and meta["nonfinite"]["count"] == 2
