"""One captured call kept as a safetensors file and re-run by a standalone script (issue 52, point 5's
``repro``): the call loads back bit for bit, and the script, run in a fresh interpreter without the planted
fault, shows the training's faulty output far from the benchmark and its own re-run next to it."""

from __future__ import annotations

import re
import subprocess
import sys

import torch

from tests.test_precheck_capture import faulty_bf16_gelu, make, step  # noqa: F401 - the fixture
from trainmon.precheck.repro import load_call, save_call, write_script


def test_the_script_shows_the_faulty_output_and_a_clean_rerun(tmp_path, faulty_bf16_gelu):  # noqa: F811
    model, tokens = make()
    _, captured = step(model, tokens, capture=True)
    gelu = next(c for c in captured.calls if c.name == "torch.nn.functional.gelu.0.forward")
    data = save_call(gelu, tmp_path / "gelu.safetensors")
    back = load_call(data)
    assert (back.name, back.api, back.module) == (gelu.name, gelu.api, "blocks.0")
    assert torch.equal(back.args[0], gelu.args[0]) and torch.equal(back.outputs[0], gelu.outputs[0])
    script = write_script(data, tmp_path / "repro_gelu.py")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "torch.nn.functional.gelu.0.forward in blocks.0"
    trained = float(re.search(r"as trained: .*max rel err (\S+)", done.stdout).group(1))
    rerun = float(re.search(r"re-run on cpu: .*max rel err (\S+)", done.stdout).group(1))
    assert trained > 0.01 and rerun < 0.01  # the fault is in the training's output, not in gelu here
