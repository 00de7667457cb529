"""A real TensorBoard server (both loaders) serves the scalars our writer produces."""

from __future__ import annotations

import math
import time
import urllib.parse
import urllib.request

import numpy as np
import pytest
import torch
from tbserver import get_json, tensorboard_server

from trainmon.cli import main
from trainmon.run import records
from trainmon.run.records import Row, StepRecord
from trainmon.run.statstore import read_stats
from trainmon.run.steptable import read_steps
from trainmon.writer.tensorboard import TensorBoardSink

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

OPS = ("min", "max", "mean", "nans")
ROWS = (
    Row("actv", "layers.0.mlp.fc1.output", 0, 0, "forward", torch.Size([4, 8]), torch.float32),
    Row("actv", "layers.0.mlp.fc1.output", 0, 1, "forward", torch.Size([4, 8]), torch.float32),
    Row("grad_reduced", "layers.0.mlp.fc1.weight", 0, 0, "optimizer", torch.Size([8, 8]), torch.float32),
)


def partials(step: int) -> np.ndarray:
    p = np.zeros((3, records.N_PARTIALS))
    p[:, records.NUMEL] = 32
    p[0, [records.MIN, records.MAX, records.SUM]] = (-step, step, 3.0 * step)
    p[1, [records.MIN, records.MAX, records.SUM]] = (-2.0 * step, 0.5, 1.0)  # second micro-step
    p[2, [records.MIN, records.MAX, records.SUM]] = (0.25, 1.5 + step, -0.1 * step)
    if step == 3:
        p[2, records.NANS] = 32  # all-NaN gradient: min/max/mean are NaN, nans = 32
    return p


def make_logdir(root):
    wall = {}
    for rank in (0, 1):
        sink = TensorBoardSink(root / f"rank_{rank}", OPS)
        for step in range(6):
            rec = StepRecord(step, rank, ROWS, partials(step) * (rank + 1), 1.7e9 + step)
            sink.write(rec, records.Derived(rec))
            wall[step] = rec.wall_time
        sink.close()
    # what the sink writes for rank 0: float32 of the step-level (micro-step merged) statistics
    golden: dict[str, list[tuple[int, float]]] = {}
    for step in range(6):
        p = partials(step)
        for kind, name, idx in (
            ("actv", "layers.0.mlp.fc1.output", [0, 1]),
            ("grad_reduced", "layers.0.mlp.fc1.weight", [2]),
        ):
            d = records.derive(records.merge(p[idx]))
            for op in OPS:
                golden.setdefault(records.tag(kind, name, op), []).append((step, float(np.float32(d[op][0]))))
    return golden, wall


def wait_for_tags(base: str, runs: set[str], tags_wanted: set[str]) -> dict:
    deadline = time.monotonic() + 60
    while True:
        try:
            tags = get_json(f"{base}/data/plugin/scalars/tags")
        except OSError:
            tags = {}
        if runs <= set(tags) and tags_wanted <= set(tags[sorted(runs)[0]]):
            return tags
        assert time.monotonic() < deadline, f"runs never appeared: {tags}"
        time.sleep(0.25)


def read_scalars(base: str, run: str, tag: str, steps: int) -> list:
    """The points of one series, once the server has loaded ``steps`` of them (the legacy loader lists a
    tag as soon as its first events are read, while the rest of the file is still loading)."""
    deadline = time.monotonic() + 60
    while True:
        got = get_json(
            f"{base}/data/plugin/scalars/scalars?" + urllib.parse.urlencode({"run": run, "tag": tag})
        )
        if len(got) >= steps or time.monotonic() > deadline:
            return got
        time.sleep(0.25)


@pytest.mark.parametrize("load_fast", ["true", "false"])
def test_tensorboard_serves_our_scalars(tmp_path, load_fast):
    logdir = tmp_path / "run"
    golden, wall = make_logdir(logdir)
    with tensorboard_server(logdir, tmp_path, load_fast) as base:
        tags = wait_for_tags(base, {"rank_0", "rank_1"}, set(golden))
        assert set(tags["rank_0"]) == set(golden)  # one tag per (kind, name, stat): micro-steps merged

        for tag, want in golden.items():
            got = read_scalars(base, "rank_0", tag, len(want))
            assert [s for _, s, _ in got] == [s for s, _ in want], tag
            for (wt, step, value), (_, expected) in zip(got, want, strict=True):
                value = float(value)  # TB's JSON writes non-finite values as "NaN", "Infinity"
                assert wt == pytest.approx(wall[step])
                assert (math.isnan(value) and math.isnan(expected)) or value == expected, (tag, step)
        # the all-NaN gradient of step 3 came through as NaN, its count as 32
        nan_min = dict(
            (s, float(v))
            for _, s, v in get_json(
                f"{base}/data/plugin/scalars/scalars?run=rank_0&tag=grad_reduced/layers.0.mlp.fc1.weight/min"
            )
        )
        assert math.isnan(nan_min[3])


@pytest.mark.parametrize("load_fast", ["true", "false"])
def test_tensorboard_shows_a_monitored_training_run(tmp_path, load_fast):
    """End to end: ``trainmon demo`` trains with the monitor (the default outputs: TensorBoard's summary and
    the statistics store), TensorBoard serves the summary, whose figures are those of the stored tensors."""
    logdir = tmp_path / "demo"
    assert main(["demo", "--logdir", str(logdir), "--steps", "8", "--spike-step", "5"]) == 0
    frame = read_stats(logdir, 0, ("mean", "norm"))
    loss = frame.values["mean"][:, frame.tensors.index(("scalar", "loss"))]
    layer0 = [j for j, (kind, name) in enumerate(frame.tensors)
              if kind == "grad_reduced" and name.startswith("layers.0.")]  # fmt: skip
    norms = frame.values["norm"][:, layer0].astype(np.float64)
    steps = read_steps(logdir, 0, ["grad_norm"]).column("grad_norm").to_numpy()
    with tensorboard_server(logdir, tmp_path, load_fast) as base:
        wanted = {"scalar/loss/mean", "grad_reduced/layers.0.*/norm", "step/grad_norm", "actv/*/max"}
        tags = wait_for_tags(base, {"rank_0"}, wanted)
        assert 100 <= len(tags["rank_0"]) <= 300  # the summary, not 7 tags for each of ~600 tensors
        for tag, want, rtol in (
            ("scalar/loss/mean", loss, 0),  # the same float32
            ("step/grad_norm", steps.astype(np.float32), 0),  # the steps table's, as float32
            ("grad_reduced/layers.0.*/norm", np.sqrt((norms * norms).sum(axis=1)), 1e-6),  # the layer's norm
        ):
            got = read_scalars(base, "rank_0", tag, 8)
            assert [s for _, s, _ in got] == list(range(8))
            np.testing.assert_allclose([float(v) for _, _, v in got], want, rtol=rtol, atol=0)
