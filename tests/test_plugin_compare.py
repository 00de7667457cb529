"""The trainmon tab's comparison of two runs: the /compare and /compare_dumps routes through TensorBoard's
real WSGI application, on real tiny training runs (tests/compare_runs.py); the expected values come from the
command line's comparison of the same runs. The tab itself, in a real browser: test_plugin_compare_ui.py."""

from __future__ import annotations

import base64
import json

import compare_runs
import numpy as np
import pytest
from test_plugin_routes import make_client

from trainmon.cli import main
from trainmon.run.layout import requests_file

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def logdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("compare_plugin")
    for variant in ("base", "forward", "noise", "weights30"):
        compare_runs.train(root / variant, variant)
    return root


def _json(response) -> dict:
    return json.loads(response.get_data(as_text=True))


def _get(client, **params) -> tuple[int, dict]:
    query = "&".join(f"{k}={v}" for k, v in params.items())
    response = client.get(f"/data/plugin/trainmon/compare?{query}")
    return response.status_code, _json(response)


def test_the_compare_route_draws_every_tensor_and_marks_the_first_divergence(logdir, capsys):
    client = make_client(logdir)
    status, answer = _get(client, run_a="base", run_b="forward", bins=4)
    assert status == 200, answer
    assert main(["compare", str(logdir / "base"), str(logdir / "forward"), "--json", "--no-report"]) == 1
    cli = json.loads(capsys.readouterr().out)
    assert answer["diverged"] is True and answer["rank"] == 0 and answer["ranks"] == [0]
    first = answer["first"]
    assert {k: first[k] for k in ("step", "kind", "name", "cause", "stage")} == {
        k: cli["first_divergence"][k] for k in ("step", "kind", "name", "cause", "stage")}  # fmt: skip
    names = [(p["kind"], p["name"]) for p in answer["pairs"]]
    assert len(names) == 51 and answer["marked"] == {"row": names.index(("actv", "act.output")), "bin": 0}
    # 4 steps in 4 bins: one step each
    assert answer["edges"] == [0, 1, 2, 3, 4] and answer["bins"] == 4
    values = np.frombuffer(base64.b64decode(answer["values"]), dtype="<f4").reshape(51, 4)
    flags = np.frombuffer(base64.b64decode(answer["flags"]), dtype=np.uint8).reshape(51, 4)
    row = answer["marked"]["row"]
    assert values[row, 0] == pytest.approx(cli["first_divergence"]["rel"], rel=1e-6)
    assert flags[row, 0] == 3  # a step there, and a divergence
    assert (flags & 1).all()  # every pair has steps in both bins
    before = [i for i, (k, _) in enumerate(names) if i < row and k == "actv"]
    assert all(flags[i, 0] == 1 for i in before)  # the forward before it agrees
    # 2 bins of 2 steps: each cell holds the larger of its steps
    status, binned = _get(client, run_a="base", run_b="forward", bins=2)
    assert status == 200 and binned["edges"] == [0, 2, 4]
    two = np.frombuffer(base64.b64decode(binned["values"]), dtype="<f4").reshape(51, 2)
    assert np.array_equal(two, np.fmax(values[:, 0::2], values[:, 1::2]), equal_nan=True)
    # the same runs compared with the noise run: nothing diverges, the relative differences are the noise
    status, answer = _get(client, run_a="base", run_b="noise", bins=2)
    assert status == 200 and answer["diverged"] is False and answer["first"] is None
    values = np.frombuffer(base64.b64decode(answer["values"]), dtype="<f4")
    assert 0 < np.nanmax(values) < 1e-5 and answer["range"][1] == pytest.approx(float(np.nanmax(values)))


def _cells(answer: dict, name: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(answer[name]), dtype="<f4").reshape(len(answer["pairs"]), -1)


def test_each_cell_carries_the_command_lines_decision_with_its_parts(logdir, capsys, tmp_path):
    """Initial weights 30% apart: every later tensor differs by more than its own tolerance, and the state
    allowance (the parameters' difference) is what keeps most of it from diverging. A cell says so: its score
    is the command line's, relative difference / (tolerance + allowance), divergent exactly above 1."""
    client = make_client(logdir)
    status, answer = _get(client, run_a="base", run_b="weights30", bins=4)
    assert status == 200, answer
    out = tmp_path / "rep"
    assert (
        main(["compare", str(logdir / "base"), str(logdir / "weights30"), "--out", str(out), "--json"]) == 1
    )
    cli = json.loads(capsys.readouterr().out)
    assert answer["first"]["name"] == cli["first_divergence"]["name"] == "fc1.weight"
    assert answer["first"]["kind"] == "param_origin" and answer["first"]["phase"] == "start"
    import pyarrow.parquet as pq

    diffs = pq.read_table(out / "diffs").to_pandas().set_index(["kind", "name", "step"])
    scores, rel_at, slack_at = _cells(answer, "scores"), _cells(answer, "rel_at"), _cells(answer, "slack_at")
    flags = np.frombuffer(base64.b64decode(answer["flags"]), dtype=np.uint8).reshape(scores.shape)
    rtol = np.asarray([p["rtol"] for p in answer["pairs"]], dtype=np.float32)[:, None]
    for i, pair in enumerate(answer["pairs"]):
        for step in range(compare_runs.STEPS):  # one step a bin: the CLI's score, cell by cell
            assert scores[i, step] == pytest.approx(
                diffs.loc[(pair["kind"], pair["name"], step), "score"], rel=1e-6
            )
    assert np.array_equal(flags & 2 > 0, scores > 1)  # the flag is the score's decision
    by_rel = rel_at / (rtol + slack_at)
    decided = np.isfinite(scores) & np.isclose(by_rel, scores, rtol=1e-4)
    assert decided.mean() > 0.9  # the relative difference decides nearly every cell (else zeros or counts)
    # cells whose difference is far above the pair's tolerance and that are within it only with the allowance
    explained = decided & (rel_at > 10 * rtol) & (scores <= 1)
    assert (
        explained.sum() >= 10
        and (slack_at[explained] >= rel_at[explained] - rtol[np.where(explained)[0], 0]).all()
    )
    assert {p["precision"] for p in answer["pairs"]} == {"float32"}
    assert all(p["why"].startswith("float32: ") for p in answer["pairs"])


def test_the_dump_button_writes_requests_into_both_runs_only_when_allowed(logdir):
    body = json.dumps({"run_a": "base", "run_b": "forward", "rank": 0})
    client = make_client(logdir)
    refused = client.post("/data/plugin/trainmon/compare_dumps", data=body, content_type="application/json")
    assert refused.status_code == 403 and "--trainmon_allow_dump_requests" in _json(refused)["error"]
    assert not requests_file(logdir / "base").exists()
    client = make_client(logdir, "--trainmon_allow_dump_requests")
    response = client.post("/data/plugin/trainmon/compare_dumps", data=body, content_type="application/json")
    assert response.status_code == 200, _json(response)
    answer = _json(response)
    assert answer["step"] == 0 and answer["rank"] == 0
    assert {(t["kind"], t["name_a"], t["name_b"]) for t in answer["targets"]} == {
        ("actv", "act.output", "act.output"), ("actv", "act.*", "act.*")}  # fmt: skip
    for run in ("base", "forward"):
        lines = [json.loads(x) for x in requests_file(logdir / run).read_text().splitlines()]
        assert {(r["name"], r["kind"], r["step"], r["rank"]) for r in lines} == {
            ("act.output", "actv", 0, 0), ("act.*", "actv", 0, 0)}  # fmt: skip
        assert {r["id"] for r in lines} == {r["id"] for r in answer["requests"] if r["run"] == run}
    same = json.dumps({"run_a": "base", "run_b": "noise"})
    agree = client.post("/data/plugin/trainmon/compare_dumps", data=same, content_type="application/json")
    assert agree.status_code == 400 and "agree on rank 0: nothing to dump" in _json(agree)["error"]
    text = client.post("/data/plugin/trainmon/compare_dumps", data=body, content_type="text/plain")
    assert text.status_code == 400 and "needs Content-Type: application/json" in _json(text)["error"]
    extra = json.dumps({"run_a": "base", "run_b": "forward", "name": "x"})
    assert client.post("/data/plugin/trainmon/compare_dumps", data=extra,
                       content_type="application/json").status_code == 400  # fmt: skip


def test_bad_compare_requests_are_refused_with_a_reason(logdir):
    client = make_client(logdir)
    status, answer = _get(client, run_a="base")
    assert status == 400 and "'run_b' is required" in answer["error"]
    status, answer = _get(client, run_a="base", run_b="nope")
    assert status == 404 and "no trainmon run 'nope'" in answer["error"]
    status, answer = _get(client, run_a="base", run_b="../etc")
    assert status == 400
    status, answer = _get(client, run_a="base", run_b="forward", rank=3)
    assert status == 400 and "3 is not a rank both runs have" in answer["error"]
    status, answer = _get(client, run_a="base", run_b="forward", bins=0)
    assert status == 400 and "'bins'" in answer["error"]
