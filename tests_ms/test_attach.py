"""attach() refuses what it cannot monitor with a message that says what to do, never imports torch, and
the framework-free core never imports MindSpore."""

from __future__ import annotations

import subprocess
import sys

import mindspore as ms
import pytest
from conftest import CONFIG, Net
from mindspore import nn

import trainmon.mindspore
from trainmon.config import ConfigError


def test_graph_mode_is_refused_with_the_fix(tmp_path):
    net = Net()
    opt = nn.SGD(net.trainable_params(), learning_rate=1e-2)
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        with pytest.raises(RuntimeError, match="PYNATIVE_MODE"):
            trainmon.mindspore.attach(net, opt, config=CONFIG, logdir=tmp_path / "run")
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)
    assert not (tmp_path / "run").exists()


def test_a_config_typo_names_the_key_and_the_allowed_ones(tmp_path):
    net = Net()
    opt = nn.SGD(net.trainable_params(), learning_rate=1e-2)
    with pytest.raises(ConfigError) as err:
        trainmon.mindspore.attach(net, opt, config=dict(CONFIG, xy_distribuiton=True), logdir=tmp_path / "r")
    assert "xy_distribuiton" in str(err.value) and "xy_distribution" in str(err.value)


def test_the_core_imports_no_framework():
    code = (
        "import sys, trainmon, trainmon.config, trainmon.run.records, trainmon.cli, trainmon.anomaly.sink, "
        "trainmon.writer, trainmon.gradprobe.compare, trainmon.read.dump_contents, trainmon_tb.plugin; "
        "print(sorted(m for m in ('torch', 'mindspore') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
