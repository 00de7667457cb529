"""Where the Triton kernels cannot run, the torch ops take over with one warning naming the reason, and
training goes on unchanged: Triton missing, Triton older than the oldest supported, or a kernel that fails
at its first launch (a compile error, an unsupported GPU, a driver error) in the first collected step.

The failing kernel is a real Triton kernel that Triton rejects ("arange's range must be a power of 2",
the same error compiled or under the interpreter) launched in place of the named one.
"""

from __future__ import annotations

import logging
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import trainmon
from tests.conftest import FULL_COVERAGE, assert_matches, reference_partials
from trainmon import stats
from trainmon.run.records import MIN
from trainmon.stats import triton_path
from trainmon.stats.direct import DirectReducer

PROBE = {"enable": True, "sample_size": 20, "sign_bitmap": True, "bounds": [-0.01, 0.0, 0.013]}
CONFIG = {**FULL_COVERAGE, "ur_distribution": True, "format": "csv", "grad_probe": PROBE}


def _rejected_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def rejected(x_ptr):
        offs = tl.arange(0, 3)  # not a power of two: Triton refuses to build this kernel
        tl.store(x_ptr + offs, tl.load(x_ptr + offs))

    return rejected


class OneKernelRejected:
    """The kernel module with the kernel ``name`` replaced by a launch of :func:`_rejected_kernel`."""

    def __init__(self, real, name: str) -> None:
        self._real, self._name = real, name
        self.calls = 0
        rejected = _rejected_kernel()
        outer = self

        class Launcher:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    outer.calls += 1
                    rejected[(1,)](torch.zeros(4, device=args[0].device))

                return launch

        self._launcher = Launcher()

    def __getattr__(self, name):
        return self._launcher if name == self._name else getattr(self._real, name)


@pytest.fixture
def kernel_state(triton_tiling):
    """The Triton backend, with the process's record of a failed kernel restored afterwards."""
    state = {name: getattr(triton_path, name, None) for name in ("_kernels", "_unavailable", "_warned")}
    direct = dict(stats._direct)  # the standalone calls' reducers, made while the kernels were off
    previous = stats.get_backend()
    stats.set_backend("triton")
    yield
    stats.set_backend(previous)
    for name, value in state.items():
        setattr(triton_path, name, value)
    stats._direct.clear()
    stats._direct.update(direct)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def train(logdir, steps: int = 2):
    """Losses, and the statistics of every step as the monitor reports them after it."""
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(1)
    losses, latest = [], []
    with trainmon.attach(model, optimizer, config=CONFIG, logdir=logdir) as mon:
        for _ in range(steps):
            loss = F.mse_loss(model(torch.randn(8, 16, generator=data)), torch.ones(8, 4))
            mon.track("loss", loss)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
            latest.append(mon.latest())
    return torch.stack(losses), latest


@pytest.fixture(scope="module")
def torch_run(tmp_path_factory):
    previous = stats.get_backend()
    stats.set_backend("torch")
    try:
        logdir = tmp_path_factory.mktemp("torch")
        return (logdir, *train(logdir))
    finally:
        stats.set_backend(previous)


def trainmon_records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith("trainmon") and r.levelno >= logging.WARNING]


@pytest.mark.parametrize(
    "kernel", ["stats_one", "stats_table", "stats_batch", "adam_table", "finalize", "bins_table"]
)
def test_a_kernel_failing_in_the_first_collected_step_hands_over_to_torch_ops(
    kernel, kernel_state, torch_run, tmp_path, caplog
):
    from trainmon.gradprobe.reader import RankFingerprints

    rejecting = OneKernelRejected(triton_path.kernels(), kernel)
    triton_path._kernels = rejecting
    caplog.set_level(logging.WARNING, logger="trainmon")
    losses, latest = train(tmp_path / "run")
    want_dir, want_losses, want_latest = torch_run

    assert rejecting.calls == 1  # launched once; then the kernels are off
    assert torch.equal(losses, want_losses)  # training unchanged
    warnings = trainmon_records(caplog)
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    message = warnings[0].getMessage()
    assert warnings[0].levelno == logging.WARNING
    assert f"kernel {kernel} failed" in message and "arange's range must be a power of 2" in message, message
    assert "use torch ops" in message
    assert stats.backend_of(torch.device("cpu"), torch.float32) != "triton"
    for got, want in zip(latest, want_latest, strict=True):  # every step complete, the failing one included
        assert got.keys() == want.keys() and len(want) > 40
        for key in want:
            for stat in ("min", "max", "zeros", "nans", "infs"):
                assert got[key][stat] == pytest.approx(want[key][stat], rel=1e-6, abs=1e-12), (key, stat)
            assert got[key]["norm"] == pytest.approx(want[key]["norm"], rel=1e-5, abs=1e-12), key
    got_fp, want_fp = RankFingerprints(tmp_path / "run", 0), RankFingerprints(want_dir, 0)
    assert got_fp.steps == want_fp.steps == [0, 1]
    for step in want_fp.steps:
        a, b = got_fp.step(step), want_fp.step(step)
        assert a.keys() == b.keys() and len(b) == 4
        for key in b:
            np.testing.assert_array_equal(a[key].counts, b[key].counts)
            np.testing.assert_array_equal(a[key].sample, b[key].sample)
            np.testing.assert_array_equal(a[key].signs, b[key].signs)
            np.testing.assert_array_equal(a[key].partials[:MIN], b[key].partials[:MIN])


def test_stage_two_by_torch_ops_equals_the_kernel(kernel_state):
    """The rows of the step in which stage 2 failed are finished by torch ops from the stage-1 rows."""
    torch.manual_seed(3)
    chunk = triton_path.get_tiling().chunk
    tensors = [torch.randn(n) * 2 for n in (0, 1, 5, chunk, 3 * chunk + 17)]
    tensors[-1][[4, 8, 9]] = torch.tensor([float("nan"), float("inf"), 0.0])
    out = torch.full((len(tensors) + 1, 8), -7.0, dtype=torch.float64)
    reducer = stats.reducer_for("cpu")
    reducer.row(tensors[0].to(torch.bfloat16), out, 0, 1e-8)
    reducer.rows(tensors[1:], out, 1, 1e-8)
    descs = reducer.pending_descriptors()
    triton_path.finalize_with_torch(descs, reducer._part, out)
    want = out.clone()
    out.fill_(-7.0)
    reducer.complete(out)  # the kernel
    assert torch.equal(out[:, :MIN], want[:, :MIN])
    assert torch.equal(out[:, MIN : MIN + 2], want[:, MIN : MIN + 2])  # min and max exact
    torch.testing.assert_close(out, want, rtol=1e-12, atol=0)
    for i, t in enumerate(tensors):
        a = (t.to(torch.bfloat16) if i == 0 else t).float().numpy()
        assert_matches(want[i], reference_partials(a), a)


def test_missing_triton_warns_once_and_uses_the_direct_backend(kernel_state, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    monkeypatch.setitem(sys.modules, "trainmon.stats.triton_kernels", None)
    triton_path._kernels, triton_path._unavailable, triton_path._warned = None, None, False
    caplog.set_level(logging.WARNING, logger="trainmon")
    reducers = [stats.reducer_for("cpu") for _ in range(3)]
    assert all(isinstance(r, DirectReducer) for r in reducers)
    warnings = trainmon_records(caplog)
    assert len(warnings) == 1
    assert "Triton does not import: ModuleNotFoundError: import of triton halted" in warnings[0].getMessage()
    x = torch.randn(100)
    assert_matches(stats.partials(x), reference_partials(x.numpy()), x.numpy())


def test_triton_older_than_supported_is_not_used(kernel_state, monkeypatch, caplog):
    import triton

    monkeypatch.setattr(triton, "__version__", "3.1.0")
    triton_path._kernels, triton_path._unavailable, triton_path._warned = None, None, False
    caplog.set_level(logging.WARNING, logger="trainmon")
    assert isinstance(stats.reducer_for("cpu"), DirectReducer)
    assert not stats.triton_available()
    [warning] = trainmon_records(caplog)
    assert "Triton 3.1.0 is older than 3.2, the oldest supported" in warning.getMessage()


def test_version_numbers():
    assert triton_path.version_tuple("3.2.0") == (3, 2, 0)
    assert triton_path.version_tuple("3.3.0+git1234abc") == (3, 3, 0)
    assert triton_path.version_tuple("3.4.0rc1") == (3, 4, 0)
    assert triton_path.version_tuple("3.10.1") > triton_path.version_tuple("3.9.0") >= triton_path.MIN_TRITON
    assert triton_path.version_tuple("3.1.99") < triton_path.MIN_TRITON
