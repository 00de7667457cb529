"""A config file edited under a 2-rank job (gloo, CPU): every rank applies each edit at the same step.

The config file is replaced (written aside, then renamed over it) every 0.05 s for the whole run, switching
between two configs that collect different parameters on different step grids, both with
``alert.on_nan: skip`` (one all_reduce per collected step). If the ranks applied an edit one step apart, the
job would die of a collective mismatch (DDP, and ZeRO-2's merge of gradient and optimizer shards), ranks would
collect different steps, and ZeRO-2 would merge one rank's shard of ``layers.0`` with the other's of
``layers.1`` into one row. The worker is tests/reload_worker.py.
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
from pathlib import Path

import pandas as pd
import pytest

from tests.test_deepspeed import run_torchrun

WORKER = Path(__file__).with_name("reload_worker.py")
STEPS = 400
COMMON = {
    "wg_distribution": True,
    "param_distribution": True,
    "mv_distribution": True,
    "format": ["csv"],
    "alert": {"on_nan": "skip"},
}
# A: layers.0 at every step; B: layers.1 and layers.2 at steps 1, 4, 7, ... (the grid of start_step 1)
CONFIGS = (
    {**COMMON, "targets": ["re:(module\\.)?layers\\.0"]},
    {**COMMON, "targets": ["re:(module\\.)?layers\\.[12]"], "start_step": 1, "step_interval": 3},
)
LAYER = re.compile(r"layers\.(\d)\.")


class Swapper:
    """Replaces the config file atomically every ``period`` seconds, alternating the two configs."""

    def __init__(self, path: Path, period: float = 0.05) -> None:
        self.path, self.period, self.swaps = path, period, 0
        self._stop = threading.Event()
        self._write(CONFIGS[0])
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _write(self, config: dict) -> None:
        aside = self.path.with_suffix(".tmp")
        aside.write_text(json.dumps(config))
        os.replace(aside, self.path)

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.swaps += 1
            self._write(CONFIGS[self.swaps % 2])

    def __enter__(self) -> Swapper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def steps_and_names(run: Path, rank: int) -> dict[str, dict[int, frozenset[str]]]:
    """Per CSV kind: collected step -> the names of its rows."""
    out = {}
    for csv in sorted((run / f"rank_{rank}").glob("*.csv")):
        frame = pd.read_csv(csv)
        out[csv.stem] = {int(s): frozenset(g["name"]) for s, g in frame.groupby("step")}
    return out


def run_job(tmp_path: Path, engine: str) -> Path:
    config, run = tmp_path / "monitor.json", tmp_path / "run"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        str(WORKER), "--engine", engine, "--config", str(config), "--logdir", str(run),
        "--steps", str(STEPS),
    ]  # fmt: skip
    with Swapper(config) as swapper:
        proc = run_torchrun(command, [run], timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert swapper.swaps > 20, swapper.swaps
    return run


def check_ranks_agree(run: Path) -> None:
    ranks = [steps_and_names(run, r) for r in (0, 1)]
    assert set(ranks[0]) >= {"grad_reduced", "param_origin", "param_updated", "exp_avg", "exp_avg_sq"}
    # every rank collected the same steps, and the same tensors at each of them
    assert ranks[0] == ranks[1]
    steps = ranks[0]["param_updated"]
    assert max(steps) >= STEPS - 3  # the run went on to the end
    # each collected step follows one config, on its own grid (anchored at start_step, not at the reload)
    layers_at = {step: {int(LAYER.search(n).group(1)) for n in names} for step, names in steps.items()}
    kinds_of_step = []
    for step, layers in sorted(layers_at.items()):
        assert layers in ({0}, {1, 2}), (step, layers)
        if layers == {1, 2}:
            assert (step - 1) % 3 == 0, step
        kinds_of_step.append(0 if layers == {0} else 1)
    # the edits did land: the run switched between the two configs many times
    switches = sum(a != b for a, b in zip(kinds_of_step, kinds_of_step[1:], strict=False))
    assert switches >= 4, switches


def check_names_match_tensors(run: Path) -> None:
    """layers.<i>.* holds values in [10 i, 10 i + 1) (+- 0.05 of training): a row whose min or max falls
    outside was merged from the shards of two different tensors."""
    for rank in (0, 1):
        for kind in ("param_origin", "param_updated"):
            frame = pd.read_csv(run / f"rank_{rank}" / f"{kind}.csv")
            layer = frame["name"].map(lambda n: int(LAYER.search(n).group(1)))
            assert (frame["min"] >= 10 * layer - 0.05).all(), frame[frame["min"] < 10 * layer - 0.05]
            assert (frame["max"] <= 10 * layer + 1.05).all(), frame[frame["max"] > 10 * layer + 1.05]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ddp_config_swapped_every_50ms(tmp_path):
    run = run_job(tmp_path, "ddp")
    check_ranks_agree(run)
    check_names_match_tensors(run)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_deepspeed_zero2_config_swapped_every_50ms(tmp_path):
    run = run_job(tmp_path, "zero2")
    check_ranks_agree(run)
    check_names_match_tensors(run)


def test_worker_model_ranges():
    """The premise of check_names_match_tensors: each layer's values lie in their own band."""
    sys.path.insert(0, str(WORKER.parent))
    from reload_worker import Layered

    for name, p in Layered().named_parameters():
        i = int(LAYER.search(name + ".").group(1))
        assert 10 * i <= float(p.min()) and float(p.max()) < 10 * i + 1, name
