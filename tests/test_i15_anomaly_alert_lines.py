"""Issue 15, point 13: alert lines say each fact once, and a NaN/Inf burst is one line a step and rank:
``NaN at step 140 rank 0: actv layers.2.mlp.fc2.output (origin, forward), 32768 NaN; +50 more tensors``."""

from __future__ import annotations

import logging

from tests.test_anomaly_e2e import XY, train
from trainmon.anomaly.alerts import Alert, AlertDispatcher, CallbackSink
from trainmon.run.anomalies import iter_anomalies
from trainmon.run.layout import anomalies_file
from trainmon.run.records import Anomaly


def nan(name: str, seq: int, value: float = 8.0, **kw) -> Anomaly:
    return Anomaly(140, 0, "actv", name, "nans", value, "nan", seq=seq, **kw)


def alert_of(anomalies: list[Anomaly], **kw) -> Alert:
    got: list[Alert] = []
    d = AlertDispatcher([CallbackSink(got.append)], rate_limit_s=0, **kw)
    d.notify(anomalies, run="exp1", rank=0)
    assert d.close(3)
    assert len(got) == 1
    return got[0]


def test_a_burst_is_one_line_led_by_its_origin():
    burst = [
        nan("layers.2.mlp.fc2.output", 2, 32768.0, origin=True),  # mark() orders the origin first
        nan("layers.2.mlp.fc2.input", 3, 16.0),
        *(nan(f"layers.{i}.output", 8 + i) for i in range(3, 6)),
        Anomaly(140, 0, "actv", "layers.5.output", "infs", 4.0, "inf", seq=13),  # a tensor counted once
        Anomaly(140, 0, "actv_grad", "layers.5.output_grad", "nans", 8.0, "nan", seq=20, phase="backward"),
    ]
    alert = alert_of(burst)
    assert alert.lines == (
        "NaN and Inf at step 140 rank 0: actv layers.2.mlp.fc2.output (origin, forward), 32768 NaN; "
        "+5 more tensors",
    )
    assert alert.title == "trainmon: NaN, Inf at step 140 on rank 0 (run exp1)"
    assert len(alert.anomalies) == 7  # the webhook payload keeps every record


def test_burst_counts_the_capped_records_and_other_rules_keep_their_own_line():
    spike = Anomaly(
        140, 0, "scalar", "loss", "mean", 12.5, "max_ratio", seq=1,
        message="scalar/loss mean 12.5 is above 10 x its previous max 1.25",
    )  # fmt: skip
    capped = Anomaly(140, 0, "*", "*", "*", 120.0, "suppressed", seq=30, message="120 more anomalies ...")
    head = nan("layers.0.output", 5, 4.0, micro_step=1, dump="request:anomaly-step140-0")
    alert = alert_of([spike, head, nan("layers.1.output", 6, micro_step=1), capped])
    assert alert.lines == (
        "spike at step 140 rank 0: scalar loss (forward), mean 12.5 is above 10 x its previous max 1.25",
        "NaN at step 140 rank 0: actv layers.0.output (forward, micro-step 1), 4 NaN "
        "[dump: request:anomaly-step140-0]; +1 more tensor; 120 more anomalies not recorded (max_per_step)",
    )


def test_a_nan_run_logs_one_alert_line_for_the_burst(tmp_path, caplog):
    run = tmp_path / "run"
    with caplog.at_level(logging.WARNING, "trainmon"):
        train(run, 4, {**XY, "alert": {"rate_limit_s": 0, "max_per_step": 1000}}, poison_step=3)
    step3 = [a for a in iter_anomalies(anomalies_file(run, 0)) if a.step == 3]
    origin = next(a for a in step3 if a.origin)
    tensors = {(a.kind, a.name) for a in step3} - {(origin.kind, origin.name)}
    assert origin.name == "layers.1.mlp.fc2.output" and len(tensors) > 10
    logged = [line for r in caplog.records for line in r.getMessage().splitlines()]
    assert [line for line in logged if "at step 3 rank 0" in line] == [
        "trainmon (run run): NaN at step 3 rank 0: actv layers.1.mlp.fc2.output (origin, forward), "
        f"{int(origin.value)} NaN; +{len(tensors)} more tensors"
    ]
