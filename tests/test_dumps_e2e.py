"""Dumps taken by a running monitor: on request (trainmon dump request) and on an anomaly (alert.dump)."""

from __future__ import annotations

import torch

import trainmon
from trainmon.cli import main
from trainmon.demo import DemoSetup, build, lm_loss, synthetic_batch
from trainmon.read.dump_contents import load_dump
from trainmon.run.anomaly_table import read_anomalies
from trainmon.run.dumps import list_dumps
from trainmon.run.statstore import read_series

CONFIG = {"xy_distribution": True, "all_xy": True, "wg_distribution": True, "param_distribution": True}


def test_requested_tensors_are_dumped_at_the_next_collected_step(tmp_path):
    run = tmp_path / "run"
    setup = DemoSetup()
    model, optimizer = build(setup)
    generator = torch.Generator().manual_seed(0)
    with trainmon.attach(model, optimizer, config=CONFIG, logdir=run) as mon:
        for step in range(5):
            if step == 2:  # between steps 1 and 2; seen at the end of step 2, so step 3 is captured
                assert main(["dump", "request", str(run), "--name", "layers.1.mlp.fc2.*"]) == 0
            loss = lm_loss(model, synthetic_batch(setup, generator))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        mon.flush()
    entries = list_dumps(run)
    assert {e.step for e in entries} == {3}
    assert {(e.kind, e.name) for e in entries} == {
        ("actv", "layers.1.mlp.fc2.input"), ("actv", "layers.1.mlp.fc2.output"),
        ("actv_grad", "layers.1.mlp.fc2.input_grad"), ("actv_grad", "layers.1.mlp.fc2.output_grad"),
        ("grad_unreduced", "layers.1.mlp.fc2.weight"), ("grad_unreduced", "layers.1.mlp.fc2.bias"),
        ("grad_reduced", "layers.1.mlp.fc2.weight"), ("grad_reduced", "layers.1.mlp.fc2.bias"),
        ("param_origin", "layers.1.mlp.fc2.weight"), ("param_origin", "layers.1.mlp.fc2.bias"),
        ("param_updated", "layers.1.mlp.fc2.weight"), ("param_updated", "layers.1.mlp.fc2.bias"),
    }  # fmt: skip
    # the dumped tensor is the one the statistics describe
    entry = next(e for e in entries if e.name == "layers.1.mlp.fc2.output")
    tensor, metadata = load_dump(run / entry.path)
    steps, values = read_series(run, 0, "actv", "layers.1.mlp.fc2.output", ["max", "norm"])  # the store
    at = steps.tolist().index(3)
    assert float(tensor.max()) == values["max"][at]  # the store keeps the statistic's float32
    assert abs(float(tensor.norm()) - values["norm"][at]) < 1e-4 * values["norm"][at]
    assert metadata["step"] == "3" and metadata["kind"] == "actv"
    # the request was served once: later steps dump nothing more
    assert max(e.step for e in entries) == 3


def test_anomaly_triggers_a_dump_of_its_origin_module(tmp_path):
    run = tmp_path / "run"
    setup = DemoSetup()
    model, optimizer = build(setup)
    generator = torch.Generator().manual_seed(0)
    with trainmon.attach(model, optimizer, config={**CONFIG, "alert": {"dump": True}}, logdir=run) as mon:
        for step in range(6):
            if step == 2:
                with torch.no_grad():
                    model.layers[1].mlp.fc2.weight[0, 0] = float("nan")
            loss = lm_loss(model, synthetic_batch(setup, generator))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            mon.flush()  # the writer thread has seen this step before the next-but-one starts
    everything = list_dumps(run)
    # at once, at the next step boundary: the matching parameters, their gradients and Adam state, as they are
    at_hand = [e for e in everything if e.reason.endswith("(at hand)")]
    assert {(e.kind, e.name) for e in at_hand} == {
        (kind, f"layers.1.mlp.fc2.{p}") for kind in ("param_updated", "grad_reduced", "exp_avg", "exp_avg_sq")
        for p in ("weight", "bias")
    }  # fmt: skip
    weight = next(e for e in at_hand if e.kind == "param_updated" and e.name.endswith("weight"))
    assert torch.isnan(load_dump(run / weight.path)[0]).any()
    # at the next occurrence: the module's activations (and everything else matching)
    entries = [e for e in everything if not e.reason.endswith("(at hand)")]
    origin = [e for e in entries if e.name == "layers.1.mlp.fc2.output"]
    # the next occurrence after the writer thread flagged step 2: step 3, or 4 if it flagged it later
    assert origin and origin[0].step in (3, 4) and origin[0].reason == "request anomaly-step2-0"
    assert len({e.step for e in entries}) == 1  # served once
    tensor, _ = load_dump(run / origin[0].path)
    assert torch.isnan(tensor).any()
    # the anomaly record links to it: its dump field is the request the dump index names as reason
    anomalies = read_anomalies(run, 0)
    records = [a for a in anomalies if a.origin and a.name == "layers.1.mlp.fc2.output"]
    assert records[0].dump == "request:anomaly-step2-0" and origin[0].reason == "request anomaly-step2-0"
