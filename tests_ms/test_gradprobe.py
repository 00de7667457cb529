"""grad_probe with MindSpore: the fingerprints written from MindSpore gradients, read back with the common
reader, equal numpy references computed from the same gradients (the PyTorch collector's record format)."""

from __future__ import annotations

import logging

import mindspore as ms
import numpy as np
import pytest
from conftest import Net
from mindspore import nn
from test_stats import reference

import trainmon.mindspore
from trainmon.gradprobe.reader import RankFingerprints, ranks
from trainmon.gradprobe.sampling import sample_positions, sample_seed
from trainmon.mindspore import gradprobe
from trainmon.mindspore.gradprobe import MindSporeGradProbe, bin_counts, dtype_name, pack_signs
from trainmon.run.records import N_PARTIALS

BOUNDS = (-0.05, 0.0, 0.05)
K = 5
STEPS = 3
EPS = 1e-8


def train_probed(run, config, steps=STEPS):
    ms.set_seed(0)
    net = Net()
    opt = nn.SGD(net.trainable_params(), learning_rate=0.1)
    mon = trainmon.mindspore.attach(net, opt, config=config, logdir=run)
    loss_fn = nn.MSELoss()
    grad_fn = ms.value_and_grad(lambda x, y: loss_fn(net(x), y), None, opt.parameters)
    rng = np.random.default_rng(1)
    names = [p.name for p in opt.parameters]
    grads_per_step = []
    for _ in range(steps):
        x = ms.Tensor(rng.standard_normal((3, 4)).astype(np.float32))
        y = ms.Tensor(rng.standard_normal((3, 2)).astype(np.float32))
        _, grads = grad_fn(x, y)
        grads_per_step.append({n: g.asnumpy() for n, g in zip(names, grads, strict=True)})
        opt(grads)
    mon.close()
    return grads_per_step


def test_fingerprints_equal_numpy_references(tmp_path):
    run = tmp_path / "run"
    config = {
        "format": ["csv"],
        "grad_probe": {"enable": True, "bounds": list(BOUNDS), "sample_size": K, "sign_bitmap": True},
    }
    grads = train_probed(run, config)
    assert ranks(run) == [0]
    fps = RankFingerprints(run, 0)
    assert fps.steps == list(range(STEPS))
    layouts = {layout.name: layout for layout in fps.params.values()}
    assert sorted(layouts) == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
    for step in range(STEPS):
        got = fps.step(step)
        assert len(got) == 4
        for name, g in grads[step].items():
            fp = got[(0, name)]
            layout = fp.layout
            assert layout.shape == g.shape and layout.dtype == "float32" and layout.level == "L2"
            assert layout.seed == sample_seed(name, g.shape, "name")
            np.testing.assert_allclose(fp.partials, reference(g, EPS), rtol=1e-6, atol=1e-12)
            assert fp.partials[0] == g.size
            flat = g.ravel()
            counts = [(flat <= np.float32(b)).sum() for b in BOUNDS] + [(flat == 0).sum()]
            np.testing.assert_array_equal(fp.counts, np.array(counts, dtype=np.float64))
            positions = sample_positions(g.size, K, layout.seed)
            assert layout.k == len(positions) == min(K, g.size)
            np.testing.assert_array_equal(fp.sample, flat[positions].astype(np.float32))
            np.testing.assert_array_equal(fp.signs, np.packbits(flat > 0))
            np.testing.assert_array_equal(fp.sign_bits(), flat > 0)
    assert gradprobe._kernel.compiled  # the compiled pieces, not the eager fallback
    # one param line per parameter, one step line per step
    lines = (run / "plugins" / "trainmon" / "gradprobe" / "rank_0.index.jsonl").read_text().splitlines()
    assert len(lines) == 1 + 4 + STEPS


def test_shape_seed_param_list_level_and_schedule(tmp_path):
    run = tmp_path / "run"
    config = {
        "format": ["csv"],
        "step_interval": 2,
        "grad_probe": {
            "enable": True,
            "grad_level": "L1",
            "param_list": ["*.weight"],
            "sample_size": 4,
            "sample_seed": "shape",
        },
    }
    grads = train_probed(run, config, steps=4)
    fps = RankFingerprints(run, 0)
    assert fps.steps == [0, 2]
    layouts = {layout.name: layout for layout in fps.params.values()}
    assert sorted(layouts) == ["fc1.weight", "fc2.weight"]
    for name, layout in layouts.items():
        assert layout.bounds == () and layout.n_counts == 0 and not layout.sign_bitmap
        assert layout.seed == sample_seed("anything", layout.shape, "shape")
        g = grads[2][name].ravel()
        fp = fps.step(2)[(0, name)]
        assert fp.counts is None and fp.signs is None
        np.testing.assert_array_equal(fp.sample, g[sample_positions(g.size, 4, layout.seed)])


def test_no_files_when_disabled_or_not_on_disk(tmp_path):
    train_probed(tmp_path / "off", {"format": ["csv"]}, steps=1)
    assert ranks(tmp_path / "off") == []


def test_helpers_match_numpy():
    rng = np.random.default_rng(3)
    for n in (1, 7, 8, 13):
        g = rng.standard_normal(n).astype(np.float32)
        g[0] = 0.0
        t = ms.Tensor(g)
        np.testing.assert_array_equal(pack_signs(t).asnumpy(), np.packbits(g > 0))
        want = [(g <= b).sum() for b in (-1.0, 0.0, 1.0)] + [(g == 0).sum()]
        np.testing.assert_array_equal(bin_counts(t, (-1.0, 0.0, 1.0)).asnumpy(), want)
        # bfloat16: compared in float32 (MindSpore's CPU comparisons do not take bfloat16)
        bf = t.astype(ms.bfloat16)
        assert bin_counts(bf, (0.0,)).asnumpy()[0] == (g <= 0).sum()
    assert dtype_name(ms.float32) == "float32" and dtype_name(ms.bfloat16) == "bfloat16"
    assert dtype_name(ms.float16) == "float16"


def test_sharded_or_missing_gradients_are_skipped(tmp_path, caplog):
    from trainmon.config import GradProbe

    probe = MindSporeGradProbe(tmp_path, 0)
    w = ms.Parameter(ms.Tensor(np.ones((4, 2), np.float32)), name="w")
    b = ms.Parameter(ms.Tensor(np.ones((2,), np.float32)), name="b")
    probe.configure(GradProbe(enable=True, grad_level="L0"), [("w", w), ("b", b)], EPS)
    assert probe.names == ["w", "b"]
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        # w's gradient is a shard (half its rows), b has none
        probe.collect(0, [("w", ms.Tensor(np.ones((2, 2), np.float32))), ("b", None)])
        probe.collect(1, [("w", ms.Tensor(np.full((4, 2), 2.0, np.float32))), ("b", None)])
    probe.sink.close()
    assert sum("sharded" in r.getMessage() for r in caplog.records) == 1
    fps = RankFingerprints(tmp_path, 0)
    assert fps.steps == [1]
    fp = fps.step(1)[(0, "w")]
    assert fp.partials.shape == (N_PARTIALS,) and fp.partials[0] == 8 and fp.partials[6] == 16.0


@pytest.mark.parametrize("dtype", [ms.float16, ms.bfloat16])
def test_half_precision_gradients(tmp_path, dtype):
    from trainmon.config import GradProbe

    probe = MindSporeGradProbe(tmp_path, 0)
    w = ms.Parameter(ms.Tensor(np.ones((3, 5), np.float32)), name="w")
    probe.configure(GradProbe(enable=True, sample_size=4, sign_bitmap=True), [("w", w)], EPS)
    g = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
    t = ms.Tensor(g).astype(dtype)
    ref = t.astype(ms.float32).asnumpy().ravel()
    probe.collect(0, [("w", t)])
    probe.sink.close()
    fp = RankFingerprints(tmp_path, 0).step(0)[(0, "w")]
    assert fp.layout.dtype == dtype_name(dtype)
    np.testing.assert_array_equal(fp.sample, ref[sample_positions(15, 4, fp.layout.seed)])
    np.testing.assert_array_equal(fp.signs, np.packbits(ref > 0))
    assert fp.partials[0] == 15
    assert gradprobe._kernel.compiled


def test_eager_fallback_writes_the_same_bytes(tmp_path, monkeypatch):
    from trainmon.config import GradProbe

    g = ms.Tensor(np.random.default_rng(5).standard_normal((6, 7)).astype(np.float32))
    w = ms.Parameter(ms.Tensor(np.zeros((6, 7), np.float32)), name="w")
    blocks = []
    for compiled in (True, False):
        monkeypatch.setattr(gradprobe._kernel, "compiled", compiled)
        run = tmp_path / str(compiled)
        probe = MindSporeGradProbe(run, 0)
        probe.configure(GradProbe(enable=True, sample_size=10, sign_bitmap=True), [("w", w)], EPS)
        probe.collect(0, [("w", g)])
        probe.sink.close()
        blocks.append((run / "plugins" / "trainmon" / "gradprobe" / "rank_0.bin").read_bytes())
    assert blocks[0] == blocks[1] and len(blocks[0]) == 64 + 32 + 40 + 6
