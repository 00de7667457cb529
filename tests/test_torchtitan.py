"""torchtitan's own Trainer with trainmon attached in one line (``trainmon.attach(trainer, ...)``).

The adapter's test needs no torchtitan (a stand-in Trainer). The training tests run torchtitan 0.3.0's llama3
debug model with its own Trainer (FSDP2 on 2 gloo ranks, bf16 parameters, selective activation
checkpointing, fused AdamW, clipping, 2 micro-batches a step) under tests/torchtitan_cpu_shim.py's patches
(tests/torchtitan_worker.py), once without and once with the monitor, every kind on: the monitored job equals
the other bitwise, its statistics equal those of the whole tensors, its gradient norm the one torchtitan
logs, and every module holding parameters has its rows. They are skipped where torchtitan is not installed
(it is not in the test extras: integrations/torchtitan/README.md says why and how to install it).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from launch import free_port, run_ranks

from trainmon.adapters import resolve

REPO = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("torchtitan_worker.py")
RANKS = 2
STEPS = 3
RTOL = 1e-5
# torch's float32 norm on the CPU (torchtitan's clip_grad_norm_) accumulates in float32: on this model's
# gradients it is 5e-5 from the exact norm, which the monitor's float64 sums give
LOGGED_NORM_RTOL = 1e-3
KINDS = (
    "grad_unreduced",
    "grad_reduced",
    "param_origin",
    "param_updated",
    "exp_avg",
    "exp_avg_sq",
    "update",
    "ratio",
)


def stand_in_trainer(pp: bool) -> object:
    """An object of a class named ``Trainer`` in a ``torchtitan.`` module, with what the adapter reads."""
    cls = type("Trainer", (), {"__module__": "torchtitan.trainer"})
    trainer = cls()
    trainer.model_parts = [torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)]
    params = [p for part in trainer.model_parts for p in part.parameters()]
    trainer.optimizers = torch.optim.AdamW(params)
    trainer.gradient_accumulation_steps = 2
    trainer.num_pipeline_parallel_microbatches = 3
    trainer.parallel_dims = types.SimpleNamespace(pp_enabled=pp)
    trainer.step = 7
    return trainer


@pytest.mark.parametrize("pp", [False, True])
def test_a_trainer_gives_its_parts_optimizers_micro_batches_and_step(pp):
    trainer = stand_in_trainer(pp)
    resolved = resolve(trainer, None)
    assert resolved.chunks == tuple(trainer.model_parts)
    assert resolved.optimizer.params() == [p for part in trainer.model_parts for p in part.parameters()]
    assert resolved.grad_acc_steps == (6 if pp else 2)
    assert resolved.start_iteration == 7


def test_a_class_named_trainer_elsewhere_is_not_torchtitans():
    cls = type("Trainer", (torch.nn.Module,), {"__module__": "mylib.trainer"})
    assert resolve(cls(), None).chunks[0].__class__ is cls  # an ordinary module, as any other


needs_torchtitan = pytest.mark.skipif(
    importlib.util.find_spec("torchtitan") is None,
    reason="torchtitan is not installed (optional: see integrations/torchtitan/README.md)",
)


def train(out: Path, jobs: list[str]) -> dict[str, list[dict]]:
    """Run ``jobs`` in turn on 2 gloo ranks; returns their ranks' results (tests/torchtitan_worker.py)."""
    master = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    run_ranks([sys.executable, str(WORKER), str(out), *jobs], RANKS, timeout=540, env=master)
    names = [job.partition(":")[0] for job in jobs]
    return {n: [json.loads((out / n / f"rank_{r}.json").read_text()) for r in range(RANKS)] for n in names}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, dict[str, list[dict]]]:
    out = tmp_path_factory.mktemp("torchtitan")
    return out, train(out, ["off:off", "on"])


def combined_norm(stats: dict[str, dict[str, float]], kind: str) -> float:
    return math.sqrt(sum(v["norm"] ** 2 for k, v in stats.items() if k.startswith(f"{kind}/")))


@needs_torchtitan
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_monitored_trainer_trains_bitwise_as_without_the_monitor(runs):
    _, results = runs
    for rank, (on, off) in enumerate(zip(results["on"], results["off"], strict=True)):
        assert len(on["logged"]) == STEPS, rank
        assert [s["loss"] for s in on["logged"]] == [s["loss"] for s in off["logged"]], rank
        assert [s["grad_norm"] for s in on["logged"]] == [s["grad_norm"] for s in off["logged"]], rank
        assert on["after"] == off["after"], f"rank {rank}: parameters or AdamW moments differ after a step"


@needs_torchtitan
@pytest.mark.slow
def test_every_statistic_is_that_of_the_whole_tensor(runs):
    _, results = runs
    checked = 0
    for rank, result in enumerate(results["on"]):
        for step, (truth, got) in enumerate(zip(result["truth"], result["monitor"], strict=True)):
            for key, want in truth.items():
                assert key in got, f"rank {rank} step {step}: {key} not recorded"
                for stat in ("min", "max", "norm"):
                    x, y = got[key][stat], want[stat]
                    assert abs(x - y) <= RTOL * max(abs(y), 1e-12), (rank, step, key, stat, x, y)
                    checked += 1
    assert checked == RANKS * STEPS * 5 * 45 * 3  # 5 kinds of the 45 parameters, 3 statistics


@needs_torchtitan
@pytest.mark.slow
def test_the_gradient_norm_is_the_one_torchtitan_logs(runs):
    from trainmon.run.steptable import read_steps

    out, results = runs
    for rank, result in enumerate(results["on"]):
        table = read_steps(out / "on" / "run", rank, ("step", "grad_norm")).to_pylist()
        assert [row["step"] for row in table] == list(range(STEPS))  # from trainer.step (0) on
        for step, (logged, truth, got) in enumerate(
            zip(result["logged"], result["truth"], result["monitor"], strict=True)
        ):
            recorded = combined_norm(got, "grad_reduced")
            assert table[step]["grad_norm"] == pytest.approx(recorded, rel=1e-12)
            assert recorded == pytest.approx(combined_norm(truth, "grad_reduced"), rel=1e-6)
            # what the optimizer applies: torchtitan's norm, clipped (by its max_norm, torch's epsilon)
            norm = logged["grad_norm"]
            applied = norm * min(1.0, result["max_norm"] / (norm + 1e-6))
            assert recorded == pytest.approx(applied, rel=LOGGED_NORM_RTOL), (rank, step)


@needs_torchtitan
@pytest.mark.slow
def test_every_module_and_parameter_has_its_rows(runs):
    _, results = runs
    for rank, result in enumerate(results["on"]):
        params = {k.partition("/")[2] for k in result["truth"][0] if k.startswith("param_origin/")}
        assert len(params) == 45, rank
        for step, rows in enumerate(result["monitor"]):
            for module in result["modules"]:
                for row in (f"actv/{module}.output", f"actv_grad/{module}.output_grad"):
                    assert row in rows, (rank, step, row)
            for name in params:
                for kind in KINDS:
                    assert f"{kind}/{name}" in rows, (rank, step, kind, name)
        # the adapter gave the micro-batches (no correction) and nothing was left out
        assert all("grad_acc_steps" not in line for line in result["log"]), result["log"]
        assert not any("not recorded" in line for line in result["log"]), result["log"]


@needs_torchtitan
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_example_writes_only_under_logdir(tmp_path):
    """integrations/torchtitan/train.py as documented (torchrun, 2 processes), from a copy of the files it
    uses: its run under --logdir, and the copy afterwards holds exactly the files it held before."""
    from trainmon.run.steptable import read_steps

    checkout = tmp_path / "checkout"
    for name in (
        "integrations/torchtitan/train.py",
        "tests/torchtitan_worker.py",
        "tests/torchtitan_cpu_shim.py",
    ):
        (checkout / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / name, checkout / name)
    before = {str(p.relative_to(checkout)) for p in checkout.rglob("*")}
    logdir = tmp_path / "example"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # the example must keep bytecode out on its own
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    command += ["--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    command += [str(checkout / "integrations/torchtitan/train.py"), "--logdir", str(logdir)]
    done = subprocess.run(command, cwd=checkout, env=env, capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"run directory: {logdir / 'run'}" in done.stdout
    assert {str(p.relative_to(checkout)) for p in checkout.rglob("*")} == before
    for rank in range(RANKS):
        assert read_steps(logdir / "run", rank, ("step",)).num_rows == STEPS
