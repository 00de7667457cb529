"""Megatron: a tiny megatron-core 0.16.1 GPTModel in mcore DDP with the real Megatron optimizers, trained on
the CPU (gloo) through tests/megatron_cpu_shim.py, in subprocesses (tests/megatron_worker.py).

Reference: the 1-process run with FP32Optimizer (same seed, same global batch of 4 micro-batches). The
2-process runs (distributed optimizer over DP=2; tensor parallel TP=2) give every rank only its shard of the
gradients, parameters and Adam state; the monitor's statistics of the whole tensors must equal the reference.
Tolerances: the parameters at step 0 are the same numbers, so min/max/zeros are equal and sums agree to the
rounding of summing the pieces in another order (1e-7); gradients are summed in a different order (DP
all-reduce / reduce-scatter of two halves, TP matmul pieces) than in the 1-process run (four micro-batches
accumulated), so they and the Adam state derived from them agree to float32 rounding (rtol 2e-6), step 0
only (later steps compound that rounding through Adam).

Then the ways in: ``trainmon.enable_megatron`` (and, without Megatron-LM, what it says to do instead), and the
Megatron example, which writes only where ``--logdir`` says.
"""

from __future__ import annotations

import csv
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from launch import free_port

from trainmon.run.statstore import stored_tensors

REPO = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("megatron_worker.py")
OPTIMIZER_KINDS = (
    "grad_reduced",
    "param_origin",
    "param_updated",
    "exp_avg",
    "exp_avg_sq",
    "update",
    "ratio",
)


def run_worker(tmp_path: Path, name: str, *args: str, nproc: int = 1) -> list[dict]:
    """Run the worker on ``nproc`` ranks; returns each rank's {"losses", "stats"}."""
    out = tmp_path / name
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    env["WORLD_SIZE"] = str(nproc)
    command = [
        sys.executable,
        str(WORKER),
        "--out",
        str(out),
        "--logdir",
        str(tmp_path / f"run_{name}"),
        *args,
    ]
    procs = [
        subprocess.Popen(command, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stderr=subprocess.PIPE)
        for r in range(nproc)
    ]
    errors = [p.communicate(timeout=150)[1].decode(errors="replace") for p in procs]
    for p, err in zip(procs, errors, strict=True):
        assert p.returncode == 0, err[-3000:]
    return [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(nproc)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    folder = tmp_path_factory.mktemp("megatron_ref")
    return {**run_worker(folder, "ref", "--trainmon")[0], "run": str(folder / "run_ref")}


def _close(a: float, b: float, rtol: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return abs(a - b) <= rtol * abs(a)


def assert_whole_tensor_stats(reference: dict, got: dict) -> None:
    """Step 0 statistics of every optimizer-side tensor equal the 1-process run's (see module docstring)."""
    ref, seen = reference["stats"][0], got["stats"][0]
    keys = {k for k in ref if k.split("/")[0] in OPTIMIZER_KINDS}
    assert keys == {k for k in seen if k.split("/")[0] in OPTIMIZER_KINDS}
    assert len(keys) > 100
    checked = 0
    for key in sorted(keys):
        kind, a, b = key.split("/")[0], ref[key], seen[key]
        assert (a["nans"], a["infs"]) == (b["nans"], b["infs"]) == (0.0, 0.0), key
        if kind == "param_origin":  # the same numbers: only the summation order of the pieces differs
            assert (a["min"], a["max"], a["zeros"]) == (b["min"], b["max"], b["zeros"]), key
            assert _close(a["norm"], b["norm"], 1e-7), key
            assert abs(a["mean"] - b["mean"]) <= 1e-7 * max(abs(a["min"]), abs(a["max"])), key
        elif kind in ("grad_reduced", "exp_avg"):
            for stat in ("min", "max", "norm"):
                assert _close(a[stat], b[stat], 2e-6), (key, stat, a[stat], b[stat])
            assert abs(a["mean"] - b["mean"]) <= 2e-6 * max(abs(a["min"]), abs(a["max"])), key
        elif kind == "exp_avg_sq":  # its min (square of a near-zero gradient) is rounding noise
            assert _close(a["max"], b["max"], 2e-6) and _close(a["norm"], b["norm"], 2e-6), key
        else:
            continue
        checked += 1
    assert checked > 100


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_one_process_fp32_losses_unchanged_and_stats_of_main_grads(tmp_path, reference):
    off = run_worker(tmp_path, "off")[0]
    assert off["losses"] == reference["losses"]  # bitwise: the monitor never changes training
    stats = reference["stats"]
    assert [s["step"] for s in stats] == [0, 1, 2]
    # names are the model's, without mcore DDP's "module." prefix; grads come from main_grad
    assert "grad_reduced/decoder.layers.0.self_attention.linear_qkv.weight" in stats[0]
    assert not any("/module." in k for k in stats[0])
    assert stats[0]["grad_reduced/output_layer.weight"]["norm"] > 0


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_distributed_optimizer_one_process_equals_fp32_optimizer(tmp_path, reference):
    got = run_worker(tmp_path, "dist1", "--trainmon", "--optimizer", "dist")[0]
    assert got["losses"] == reference["losses"]
    assert got["stats"] == reference["stats"]  # one owner of every element: the very same statistics


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "layout",
    [("--optimizer", "dist"), ("--optimizer", "fp32", "--tp", "2"), ("--optimizer", "dist", "--tp", "2")],
    ids=["dp2-distopt", "tp2-fp32", "tp2-distopt"],
)
def test_two_processes_sharded_stats_equal_whole_tensor(tmp_path, reference, layout):
    ranks = run_worker(tmp_path, "two", "--trainmon", *layout, nproc=2)
    for got in ranks:
        assert_whole_tensor_stats(reference, got)
    # ... and the records show the whole tensors' shapes, as one process does (a TP-split weight included)
    whole = csv_shapes(Path(reference["run"]) / "rank_0")
    for rank in (0, 1):
        shapes = csv_shapes(tmp_path / "run_two" / f"rank_{rank}")
        assert shapes and shapes.keys() <= whole.keys()
        for tensor, shape in shapes.items():
            assert shape == whole[tensor], (rank, tensor, shape, whole[tensor])
    # merged statistics are the same on both ranks (what each wrote for its shard, after the merge)
    for key in ranks[0]["stats"][0]:
        if key.split("/")[0] in OPTIMIZER_KINDS:
            assert ranks[0]["stats"][0][key] == ranks[1]["stats"][0][key], key


def csv_shapes(folder: Path) -> dict[tuple[str, str], str]:
    """(kind, name) -> the shape the run's CSV of each parameter-side kind records."""
    found = {}
    for kind in OPTIMIZER_KINDS:
        with open(folder / f"{kind}.csv", newline="") as f:
            found |= {(kind, row["name"]): row["shape"] for row in csv.DictReader(f)}
    return found


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_processes_losses_unchanged_by_monitor(tmp_path):
    on = run_worker(tmp_path, "on", "--trainmon", "--optimizer", "dist", "--tp", "2", nproc=2)
    off = run_worker(tmp_path, "off", "--optimizer", "dist", "--tp", "2", nproc=2)
    assert [r["losses"] for r in on] == [r["losses"] for r in off]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_full_recompute_records_each_activation_once(tmp_path, reference):
    """Full recompute runs each layer's forward twice (under no_grad, then again in backward). Every
    statistic, activations and activation gradients included, equals the run without recompute: a second
    recording would change sums and norms, a missing gradient hook would drop actv_grad rows."""
    got = run_worker(tmp_path, "recompute", "--trainmon", "--recompute")[0]
    assert got["losses"] == reference["losses"]
    assert any(k.startswith("actv_grad/decoder.layers.1.") for k in got["stats"][0])
    assert got["stats"] == reference["stats"]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_enable_megatron_one_line(tmp_path, reference):
    """enable_megatron() before a Megatron-LM-shaped pretrain(): attached to what setup_model_and_optimizer
    returned, with grad_acc_steps and start_iteration from get_args(); undone by close()."""
    got = run_worker(tmp_path, "enabled", "--enable")[0]
    assert got["losses"] == reference["losses"]
    assert [s.pop("step") for s in got["stats"]] == [5, 6, 7]  # args.iteration after checkpoint loading
    assert got["stats"] == [{k: v for k, v in s.items() if k != "step"} for s in reference["stats"]]


def test_importing_trainmon_does_not_import_megatron():
    code = (
        "import sys, trainmon, trainmon.adapters; trainmon.adapters._load_adapters(); "
        "assert not any(m.startswith('megatron') for m in sys.modules), 'megatron imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_grad_acc_steps_from_megatron_args():
    from types import SimpleNamespace

    from trainmon.adapters.megatron import grad_acc_steps_from

    args = SimpleNamespace(global_batch_size=64, micro_batch_size=2, data_parallel_size=4)
    assert grad_acc_steps_from(args) == 8
    assert grad_acc_steps_from(SimpleNamespace()) is None


# ------------------------------------------------------- enable_megatron without Megatron-LM, and the example
# The .venv has megatron-core 0.16.1, which ships no ``megatron.training``; the other installs are made in a
# subprocess (a ``None`` entry in ``sys.modules`` hides a package, a directory on ``PYTHONPATH`` adds one to
# the ``megatron`` namespace package).

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
    for rank in (0, 1):  # both ranks' statistics in the store (no CSV by default since issue 33)
        assert any(kind == "grad_reduced" for kind, _ in stored_tensors(logdir, rank))
