"""``trainmon dump request`` reaches a running MindSpore job: the request file is polled at each step start
and the matching tensors of the requested step are dumped (and only those), listed by ``trainmon dump ls``."""

from __future__ import annotations

import subprocess
import sys

import mindspore as ms
import numpy as np
import pytest
from conftest import CONFIG, Net
from mindspore import nn
from safetensors.numpy import load_file
from test_stats import assert_partials, reference

import trainmon.mindspore
from trainmon.read.dump_contents import read_dump
from trainmon.run.dumps import list_dumps
from trainmon.run.records import derive


def cli(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "trainmon", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def test_request_from_the_cli_is_served_at_its_step(tmp_path):
    run = tmp_path / "run"
    ms.set_seed(0)
    net = Net()
    opt = nn.AdamWeightDecay(net.trainable_params(), learning_rate=1e-2)
    mon = trainmon.mindspore.attach(net, opt, config=dict(CONFIG, alert={}), logdir=run)
    grad_fn = ms.value_and_grad(lambda x: (net(x) ** 2).sum(), None, opt.parameters)
    rng = np.random.default_rng(0)
    records = []
    for step in range(5):
        if step == 1:
            asked = cli("dump", "request", str(run), "--name", "fc2.*", "--step", "3")
            assert asked.returncode == 0, asked.stderr
            request_id = asked.stdout.strip().split()[-1]
        _, grads = grad_fn(ms.Tensor(rng.standard_normal((3, 4)).astype(np.float32)))
        opt(grads)
        records.append(mon.latest_record())
    mon.close()

    entries = list_dumps(run)
    assert {e.step for e in entries} == {3}
    assert {(e.kind, e.name) for e in entries} == {
        ("actv", "fc2.input"),
        ("actv", "fc2.output"),
        ("actv_grad", "fc2.output_grad"),
        ("actv_grad", "fc2.input_grad"),
        ("grad_reduced", "fc2.weight"),
        ("grad_reduced", "fc2.bias"),
        ("param_origin", "fc2.weight"),
        ("param_origin", "fc2.bias"),
        ("param_updated", "fc2.weight"),
        ("param_updated", "fc2.bias"),
        ("exp_avg", "fc2.weight"),
        ("exp_avg", "fc2.bias"),
        ("exp_avg_sq", "fc2.weight"),
        ("exp_avg_sq", "fc2.bias"),
    }
    assert all(e.reason == f"request {request_id}" for e in entries)
    partials = {(r.kind, r.name): p for r, p in zip(records[3].rows, records[3].partials, strict=True)}
    for e in entries:
        assert_partials(partials[e.kind, e.name], reference(load_file(str(run / e.path))["tensor"], 1e-8))
        # trainmon dump show / the plugin's dump view: MindSpore's kernel here, the recorded statistics
        shown = read_dump(run / e.path)
        recorded = derive(partials[e.kind, e.name].reshape(1, -1))
        assert shown.dtype == "float32" and shown.shape == e.shape
        assert shown.finite_values.size == shown.numel == int(np.prod(e.shape))
        for stat, value in shown.stats.items():
            assert value == pytest.approx(float(recorded[stat][0]), rel=1e-6, abs=1e-7), (e.name, stat)
    listed = cli("dump", "ls", str(run))
    assert listed.returncode == 0 and "fc2.output_grad" in listed.stdout
