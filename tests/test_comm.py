"""Collective statistics (``cc_distribution``, trainmon.collect.comm) and the device module's NPU branch.

Collectives run for real: 2 processes, gloo on 127.0.0.1 (workers in tests/comm_worker.py and
tests/comm_ds_worker.py). Recorded statistics are compared exactly with statistics of the tensors themselves,
and the calls the wrappers see with the ``c10d`` ops a ``TorchDispatchMode`` sees in the same region.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from launch import free_port

from trainmon import device
from trainmon.config import CcDistribution, ConfigError, load_config

HERE = Path(__file__).resolve().parent



def run_two(
    script: str, args: list[str], out: Path, timeout: float, extra_env: dict | None = None
) -> list[dict]:
    """Run ``script`` as ranks 0 and 1 of a gloo job and return their JSON reports."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **(extra_env or {})})
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / script), str(out), *args],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-4000:]
    return [json.loads((out / f"rank_{r}.json").read_text()) for r in range(2)]


def same(a, b) -> bool:
    return np.array_equal(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64), equal_nan=True)


def assert_rows(report: dict) -> None:
    rows, expected = report["rows"], report["expected"]
    assert [r[0] for r in rows] == [e[0] for e in expected]  # names, in the order the calls happened
    assert [r[1] for r in rows] == [e[1] for e in expected]  # collectives counted when each row was taken
    for row, exp in zip(rows, expected, strict=True):
        assert same(row[2], exp[2]), (row, exp)


@pytest.fixture(scope="module")
def ops_reports(tmp_path_factory) -> list[dict]:
    return run_two("comm_worker.py", [], tmp_path_factory.mktemp("comm_ops"), timeout=120)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_every_collective_records_exact_input_and_output_statistics(ops_reports):
    for rank, report in enumerate(ops_reports):
        assert report["kinds"] == ["comm"]
        assert_rows(report)
        names = {r[0] for r in report["rows"]}
        for op in (
            "all_reduce",
            "broadcast",
            "all_gather",
            "all_gather_into_tensor",
            "reduce_scatter_tensor",
            "all_to_all_single",
            "scatter",
            "all_reduce_coalesced",
            "batch_isend_irecv",
        ):
            # broadcast and scatter send from their source (rank 0) only
            assert (f"{op}.world.input" in names) == (rank == 0 or op not in ("broadcast", "scatter"))
            assert f"{op}.world.output" in names
        # rooted collectives: the root's side only; point to point: what this rank sent or received
        assert ("reduce.world.output" in names) == (rank == 1)
        assert ("gather.world.output" in names) == (rank == 0)
        assert ("broadcast.world.input" in names) == (rank == 0)
        assert {"send.world.input", "isend.world.input"} <= names if rank == 0 else True
        assert {"recv.world.output", "irecv.world.output"} <= names if rank == 1 else True
        # a group of its own gets rows of its own
        assert any(n.startswith("all_reduce.") and ".world." not in n for n in names)
        # the NaN and Inf rank 1 put into the first all_reduce: counted in its input, NaN in both outputs
        first_in = next(r for r in report["rows"] if r[0] == "all_reduce.world.input")
        first_out = next(r for r in report["rows"] if r[0] == "all_reduce.world.output")
        assert first_in[2][1:3] == ([1.0, 1.0] if rank == 1 else [0.0, 0.0])
        assert first_out[2][1] == 1.0
        assert report["objects"] == [0, 1]
        assert report["restored"]


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_step_aggregation_is_the_statistics_of_the_concatenation(ops_reports):
    for report in ops_reports:
        assert set(report["merged"]) == set(report["expected_merged"])
        for name, partials in report["expected_merged"].items():
            assert same(report["merged"][name], partials), name


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_wrappers_count_what_the_dispatcher_sees(ops_reports):
    for report in ops_reports:
        assert report["hook_calls"] == report["dispatch_calls"]
        # calls the dispatcher sees as several ops: each is still one call for the counter
        assert report["special_hook_calls"] == {
            "all_reduce_coalesced": 1,
            "batch_isend_irecv": 1,
            "all_gather_object": 1,
            "barrier": 1,
        }
        assert report["special_dispatch_calls"] == {
            "all_reduce": 2,
            "send": 1,
            "recv": 1,
            "all_gather": 2,
            "barrier": 1,
        }


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_megatron_aliases_and_coalesced_blocks_are_seen(tmp_path):
    for report in run_two("comm_worker.py", ["megatron"], tmp_path, timeout=120):
        assert report["patched"] == [
            "_coalescing_manager",
            "dist_all_gather_func",
            "dist_reduce_scatter_func",
        ]
        assert (
            report["hook_calls"]
            == report["dispatch_calls"]
            == {
                "reduce_scatter_tensor": 2,
                "all_gather_into_tensor": 2,
            }
        )
        assert_rows(report)
        assert report["restored"]


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_zero_collectives_match_the_dispatcher(tmp_path, stage):
    reports = run_two(
        "comm_ds_worker.py", [str(stage)], tmp_path, timeout=180, extra_env={"DS_ACCELERATOR": "cpu"}
    )
    expected = (
        {"all_reduce": 4, "all_gather_into_tensor": 2}
        if stage == 2
        else {"broadcast": 8, "all_gather_into_tensor": 5, "reduce_scatter_tensor": 2, "all_reduce": 2}
    )
    for report in reports:
        assert report["hooks"] == report["dispatch"] == expected
        assert report["monitored"] == report["plain"]  # bitwise: the wrappers never touch the numbers
        for step in report["steps"]:
            assert {n.rsplit(".", 1)[1] for n in step} == {"input", "output"}
            assert {n.split(".", 1)[0] for n in step} == set(expected) - (
                {"broadcast"} if stage == 2 else set()
            )


# --------------------------------------------------------------------------------------------- config


def test_cc_distribution_is_a_typed_key():
    c = load_config(
        {"cc_distribution": {"enable": True, "cc_codeline": [r"train\.py\[23\]"], "cc_pre_hook": True}}
    )
    assert c.cc_distribution == CcDistribution(True, (r"train\.py\[23\]",), True, False)
    assert "comm" in c.kinds and "cc_distribution" not in c.pending_active
    assert load_config(c.to_dict()) == c
    assert "comm" not in load_config({"cc_distribution": {"enable": True, "cc_log_only": True}}).kinds
    with pytest.raises(ConfigError, match="did you mean 'enable'"):
        load_config({"cc_distribution": {"enabled": True}})
    with pytest.raises(ConfigError, match=r"cc_distribution\.cc_codeline\[0\]"):
        load_config({"cc_distribution": {"cc_codeline": ["("]}})


# --------------------------------------------------------------------------------------------- device


class _Log(list):
    pass


class _StandInNpu:
    """torch.npu's Stream/Event surface as torch_npu exposes it; every call is logged."""

    def __init__(self, log: _Log) -> None:
        self.log = log
        module = self

        class Event:
            def __init__(self) -> None:
                module.log.append("Event()")

            def record(self, stream=None) -> None:
                module.log.append(f"record({stream})")

            def synchronize(self) -> None:
                module.log.append("synchronize()")

        self.Event = Event

    def current_stream(self, device=None) -> str:
        self.log.append(f"current_stream({device})")
        return "npu-stream"


class _NoCuda:
    def __getattr__(self, name: str):
        raise AssertionError(f"torch.cuda.{name} touched on an NPU job")


class _LoggedHost(torch.Tensor):
    """A host buffer that logs how it is copied into."""

    log: _Log

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.copy_:
            cls.log.append(f"copy_(non_blocking={(kwargs or {}).get('non_blocking', False)})")
        return super().__torch_function__(func, types, args, kwargs)


def test_npu_backend_is_torch_npu_and_never_torch_cuda(monkeypatch):
    log = _Log()
    npu = _StandInNpu(log)
    monkeypatch.setattr(torch, "npu", npu, raising=False)
    monkeypatch.setattr(torch, "cuda", _NoCuda())
    assert device.backend_for("npu") is npu
    assert device.backend_for("cpu") is None
    assert device.backend_for("xpu_that_does_not_exist") is None


def test_npu_host_copy_order_pinned_nonblocking_event_then_sync(monkeypatch):
    log = _Log()
    npu = _StandInNpu(log)
    monkeypatch.setattr(torch, "cuda", _NoCuda())
    _LoggedHost.log = log

    def pinned_empty(shape, dtype):
        log.append(f"pinned_empty({tuple(shape)}, {dtype})")
        return torch.empty(shape, dtype=dtype).as_subclass(_LoggedHost)

    monkeypatch.setattr(device, "_pinned_empty", pinned_empty)
    stats = torch.arange(16, dtype=torch.float64).reshape(2, 8)
    host, ready = device.start_host_copy(stats, npu)
    assert log == [
        "pinned_empty((2, 8), torch.float64)",
        "copy_(non_blocking=True)",
        "Event()",
        "current_stream(cpu)",
        "record(npu-stream)",
    ]
    assert ready is not None
    ready()  # the writer thread's wait
    assert log[-1] == "synchronize()"
    assert torch.equal(host.as_subclass(torch.Tensor), stats)


def test_backend_without_events_copies_synchronously():
    t = torch.ones(3)
    host, ready = device.start_host_copy(t, object())
    assert ready is None and torch.equal(host, t)


def test_import_trainmon_neither_imports_torch_npu_nor_initialises_cuda():
    code = (
        "import sys, torch, trainmon, trainmon.collect.comm, trainmon.device as d\n"
        "from trainmon.step.buffer import StepBuffer\n"
        "b = StepBuffer(1e-8); b.add('comm', 'x', 0, 0, 'comm', torch.ones(3)); b.finish(0, 0)\n"
        "assert 'torch_npu' not in sys.modules, 'torch_npu imported'\n"
        "assert not torch.cuda.is_initialized(), 'cuda initialised'\n"
        "print('ok')\n"
    )
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
