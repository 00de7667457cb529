"""Issue 16, the plugin side of exact capture: an anomaly links to the dump of its own step before any later
one (and says when only a later one exists), and a dump of a module's input or output comes with the other
tensors of that module call and the places of its non-finite values.

The run is written with the library's own writers (``AnomalyLog``, ``DumpWriter``), as an exact capture lays
it out: at step 7 the origin module ``layers.1`` has clean inputs and a NaN/Inf output, all dumped at step 7
with reasons ``exact: ...``; a request-based dump of the same output follows at step 8."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from test_plugin_routes import get, make_client
from trainmon_tb import runs as runs_module
from trainmon_tb.dump_index import module_role
from trainmon_tb.dump_view import FIRST_NON_FINITE, MAX_BAD_ROWS, locate_non_finite

from trainmon.anomaly.log import AnomalyLog
from trainmon.run.dumps import list_dumps
from trainmon.run.records import Anomaly
from trainmon.writer.dumps import DumpWriter

RUN = "exact"
STEP = 7
ORIGIN = "layers.1"
REASON = f"exact: nan origin actv {ORIGIN}.output"


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
        log.write_step(STEP, [
            Anomaly(step=STEP, kind="actv", name=f"{ORIGIN}.output", value=2.0, rule="nan", seq=5,
                    origin=True, dump="request:anomaly-step7-0", **anomaly),
            Anomaly(step=STEP, kind="actv", name="layers.2.output", value=6.0, rule="nan", seq=8,
                    propagated=True, **anomaly),
            Anomaly(step=STEP, kind="grad_reduced", name=f"{ORIGIN}.weight", value=1.0, rule="nan", seq=30,
                    **{**anomaly, "phase": "optimizer"}),
        ])  # fmt: skip
    finite = torch.linspace(-1.0, 1.0, 24).reshape(4, 6)
    with DumpWriter(run_dir, 0) as w:
        w.write(5, 0, "scalar", "loss", torch.tensor(9.0), "request anomaly-step3-0")
        # what an exact capture saves at step 7 (the origin module's call, a gradient, its state, the loss)
        w.write(STEP, 0, "actv", f"{ORIGIN}.input", finite, REASON)
        w.write(STEP, 0, "actv", f"{ORIGIN}.input", finite * 2, "request manual")  # the same tensor twice
        w.write(STEP, 0, "actv", f"{ORIGIN}.input_1", finite.to(torch.bfloat16), REASON)
        w.write(STEP, 0, "actv", f"{ORIGIN}.output", origin_output(), REASON)
        w.write(STEP, 1, "actv", f"{ORIGIN}.input", finite * 3, REASON)  # another micro-step's call
        grad = torch.ones(3, 4, dtype=torch.bfloat16)
        grad[2, 1] = math.nan
        for kind, tensor in (
            ("grad_reduced", grad),
            ("param_origin", finite[:3, :4]),
            ("exp_avg", finite[:3, :4]),
            ("exp_avg_sq", finite[:3, :4] ** 2),
        ):
            w.write(STEP, 0, kind, f"{ORIGIN}.weight", tensor, REASON)
        w.write(STEP, 0, "grad_reduced", "layers.0.weight", finite, REASON)  # not this anomaly's tensor
        w.write(STEP, 0, "scalar", "loss", torch.tensor(1.5), REASON)
        # the request-based dump of the origin output, at its next occurrence
        w.write(STEP + 1, 0, "actv", f"{ORIGIN}.output", origin_output() * 0, "request anomaly-step7-0")


@pytest.fixture(scope="module")
def logdir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("i16")
    write_exact_run(root / RUN)
    return root


@pytest.fixture(scope="module")
def client(logdir):
    return make_client(logdir)


@pytest.fixture(autouse=True)
def _refresh_on_every_request(monkeypatch):
    monkeypatch.setattr(runs_module, "MIN_REFRESH_SECS", 0.0)


def by_path(logdir: Path) -> dict:
    return {e.path: e for e in list_dumps(logdir / RUN)}


def names(dumps: list[dict]) -> list[tuple]:
    return [(d["step"], d["kind"], d["name"], d["same_step"], d["own"]) for d in dumps]


def events_at(client, step: int) -> dict:
    got = get(client, f"events?run={RUN}&step_lo={step}&step_hi={step}")
    return {(e["kind"], e["name"]): e for e in got["events"]}


def test_the_origin_links_to_its_own_step_first_and_later_dumps_after(client):
    origin = events_at(client, STEP)[("actv", f"{ORIGIN}.output")]
    assert origin["dump_step"] == STEP
    assert names(origin["dumps"]) == [
        (STEP, "actv", f"{ORIGIN}.output", True, True),
        (STEP, "actv", f"{ORIGIN}.input", True, False),
        (STEP, "actv", f"{ORIGIN}.input", True, False),  # the second micro-step's call
        (STEP, "actv", f"{ORIGIN}.input_1", True, False),
        (STEP, "scalar", "loss", True, False),
        (STEP + 1, "actv", f"{ORIGIN}.output", False, True),
    ]
    assert all(d["reason"] == REASON for d in origin["dumps"][:5])
    assert origin["dumps"][-1]["reason"] == "request anomaly-step7-0"


def test_a_parameter_anomaly_gets_its_state_and_the_module_call_of_its_step(client):
    grad = events_at(client, STEP)[("grad_reduced", f"{ORIGIN}.weight")]
    assert grad["dump_step"] == STEP
    assert names(grad["dumps"]) == [
        (STEP, "grad_reduced", f"{ORIGIN}.weight", True, True),
        (STEP, "actv", f"{ORIGIN}.input", True, False),
        (STEP, "actv", f"{ORIGIN}.input", True, False),
        (STEP, "actv", f"{ORIGIN}.input_1", True, False),
        (STEP, "actv", f"{ORIGIN}.output", True, False),
        (STEP, "exp_avg", f"{ORIGIN}.weight", True, False),
        (STEP, "exp_avg_sq", f"{ORIGIN}.weight", True, False),
        (STEP, "param_origin", f"{ORIGIN}.weight", True, False),
        (STEP, "scalar", "loss", True, False),
    ]  # layers.0.weight's gradient, also captured at step 7, belongs to no anomaly here


def test_a_propagated_tensor_without_its_own_dump_still_gets_the_origin_call(client):
    propagated = events_at(client, STEP)[("actv", "layers.2.output")]
    assert propagated["dump_step"] is None
    assert [d["name"] for d in propagated["dumps"]][:4] == [
        f"{ORIGIN}.input",
        f"{ORIGIN}.input",
        f"{ORIGIN}.input_1",
        f"{ORIGIN}.output",
    ]
    assert not any(d["own"] for d in propagated["dumps"])


def test_only_a_later_dump_is_marked_as_later(client):
    (loss,) = events_at(client, 3).values()
    assert loss["dump_step"] == 5
    assert names(loss["dumps"]) == [(5, "scalar", "loss", False, True)]


def test_dump_meta_of_the_origin_output_shows_its_module_call_and_its_non_finite_values(client, logdir):
    entries = by_path(logdir)
    output = next(p for p, e in entries.items() if e.step == STEP and e.name == f"{ORIGIN}.output")
    meta = get(client, f"dump_meta?run={RUN}&path={output}")
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
    assert (module["module"], module["step"], module["rank"], module["micro_step"]) == (ORIGIN, STEP, 0, 0)
    got = [(t["name"], t["role"], t["side"], t["reason"]) for t in module["tensors"]]
    assert got == [
        (f"{ORIGIN}.input", "input", "input", REASON),  # the exact dump, not the manual one of the same input
        (f"{ORIGIN}.input_1", "input", "input", REASON),
        (f"{ORIGIN}.output", "output", "output", REASON),
    ]
    assert module["tensors"][2]["path"] == output
    # the inputs are clean: nothing to locate, and a 2-D view with no bad row
    for t in module["tensors"][:2]:
        inp = get(client, f"dump_meta?run={RUN}&path={t['path']}")
        assert inp["stats"]["nans"] == inp["stats"]["infs"] == 0
        assert inp["nonfinite"] == {
            "count": 0,
            "first": [],
            "rows": {"shape": [4, 6], "flattened": False, "with_non_finite": 0, "counts": []},
        }
    assert (
        get(client, f"dump_meta?run={RUN}&path={module['tensors'][1]['path']}")["tensor"]["dtype"]
        == "bfloat16"
    )


def test_dump_meta_of_a_bf16_gradient_locates_its_nan_and_has_no_module(client, logdir):
    grad = next(
        p for p, e in by_path(logdir).items() if e.kind == "grad_reduced" and e.name == f"{ORIGIN}.weight"
    )
    meta = get(client, f"dump_meta?run={RUN}&path={grad}")
    assert meta["module"] is None
    assert meta["nonfinite"] == {
        "count": 1,
        "first": [{"index": [2, 1], "value": "nan"}],
        "rows": {"shape": [3, 4], "flattened": False, "with_non_finite": 1, "counts": [[2, 1]]},
    }
    scalar = next(p for p, e in by_path(logdir).items() if e.kind == "scalar" and e.step == STEP)
    assert get(client, f"dump_meta?run={RUN}&path={scalar}")["nonfinite"] == {
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
