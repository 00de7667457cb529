"""Issue 15, point 14: ``trainmon.enable_megatron`` without Megatron-LM says what to do instead, and the
Megatron example writes only where ``--logdir`` says.

The .venv has megatron-core 0.16.1, which ships no ``megatron.training``; the other installs are made in a
subprocess (a ``None`` entry in ``sys.modules`` hides a package, a directory on ``PYTHONPATH`` adds one to
the ``megatron`` namespace package).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from launch import free_port

REPO = Path(__file__).resolve().parents[1]

_CALL = """
import sys
{setup}
import trainmon
try:
    trainmon.enable_megatron(config={{}})
except ImportError as e:
    print(type(e).__name__ + ": " + str(e))
else:
    print("no error")
"""


def _enable_megatron_error(setup: str = "", pythonpath: Path | None = None) -> str:
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", _CALL.format(setup=setup)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return done.stdout.strip()


ATTACH_HINT = (
    "In a training loop of your own on megatron-core, add instead, after building the model chunks and the "
    "optimizer: trainmon.attach(model_chunks, optimizer, grad_acc_steps=num_microbatches, "
    "start_iteration=iteration) (docs/megatron.md)"
)


@pytest.mark.timeout(150)
def test_enable_megatron_with_megatron_core_only_points_to_attach():
    assert _enable_megatron_error() == (
        "ImportError: trainmon.enable_megatron needs Megatron-LM (megatron.training, where pretrain() comes "
        "from): megatron-core is installed, but not Megatron-LM. " + ATTACH_HINT
    )


@pytest.mark.timeout(150)
def test_enable_megatron_without_any_megatron():
    hidden = "sys.modules['megatron'] = None  # as if neither megatron-core nor Megatron-LM were installed"
    assert _enable_megatron_error(hidden) == (
        "ImportError: trainmon.enable_megatron needs Megatron-LM (megatron.training, where pretrain() comes "
        "from): Megatron-LM is not installed. " + ATTACH_HINT
    )


@pytest.mark.timeout(150)
def test_enable_megatron_keeps_the_error_of_a_missing_megatron_lm_dependency(tmp_path):
    """Megatron-LM installed but one of its own imports missing: that import's error, not ours."""
    training = tmp_path / "megatron" / "training"
    training.mkdir(parents=True)
    (training / "__init__.py").write_text("")
    (training / "training.py").write_text("import a_dependency_megatron_lm_needs  # noqa\n")
    got = _enable_megatron_error(pythonpath=tmp_path)
    assert got == "ModuleNotFoundError: No module named 'a_dependency_megatron_lm_needs'"


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_megatron_example_writes_only_under_logdir(tmp_path):
    """The example run from a copy of the files it uses (its checkout): two ranks under torchrun write their
    run under --logdir, and the checkout afterwards holds exactly the files it held before."""
    checkout = tmp_path / "checkout"
    for name in ("integrations/megatron/train.py", "tests/megatron_worker.py", "tests/megatron_cpu_shim.py"):
        (checkout / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / name, checkout / name)
    before = _files(checkout)
    logdir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # the example must keep bytecode out on its own
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(free_port()),
            str(checkout / "integrations/megatron/train.py"),
            "--logdir",
            str(logdir),
            "--steps",
            "2",
        ],
        cwd=checkout,  # a relative default path would land here
        env=env,
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"written to {logdir}" in done.stdout
    assert _files(checkout) == before
    for rank in (0, 1):
        assert (logdir / f"rank_{rank}" / "grad_reduced.csv").is_file()
