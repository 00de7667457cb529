"""What only a real CUDA device can show: no synchronising call in a collected step, kernels launched per
step, statistics computed on the GPU equal to the CPU kernel's on the same tensors, training unchanged.

Skipped (with the reason) where torch sees no CUDA device; run ``pytest tests/test_cuda.py`` on a GPU
machine. The kernels' arithmetic is covered everywhere by test_stats.py and test_stats_triton.py under
Triton's interpreter.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import trainmon
from tests.conftest import FULL_COVERAGE
from trainmon import stats
from trainmon.run.records import MAX, MIN, NUMEL, SUM, SUMSQ

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA device: run `pytest tests/test_cuda.py` on a GPU machine",
)

FULL = {**FULL_COVERAGE, "ur_distribution": True, "format": "csv"}
INF, NAN = float("inf"), float("nan")


class Block(nn.Module):
    """A pre-LN transformer block (the benchmark's, small)."""

    def __init__(self, d: int = 256, heads: int = 4) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def model_and_optimizer(layers: int = 4):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Embedding(512, 256), *[Block() for _ in range(layers)], nn.Linear(256, 512)
    ).cuda()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def train_step(model, optimizer, i: int, monitor=None) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(i)
    tokens = torch.randint(0, 512, (4, 129), generator=g, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.float().reshape(-1, 512), tokens[:, 1:].reshape(-1))
    if monitor is not None:
        monitor.track("loss", loss)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.detach()


def test_statistics_are_triton_on_cuda():
    assert stats.backend_of(torch.device("cuda"), torch.bfloat16) == "triton"
    assert stats.backend_of(torch.device("cuda"), torch.float32) == "triton"
    assert stats.backend_of(torch.device("cuda"), torch.int64) == "torch"


def test_a_collected_step_never_synchronises(tmp_path):
    model, optimizer = model_and_optimizer()
    with trainmon.attach(model, optimizer, config=FULL, logdir=tmp_path / "run") as mon:
        for i in range(3):  # kernels compiled, tables built, buffers grown
            train_step(model, optimizer, i, mon)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # any synchronising call in this step raises
        try:
            train_step(model, optimizer, 3, mon)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        latest = mon.latest()
    assert latest is not None and len(latest) > 200
    assert all(not math.isnan(s["norm"]) for key, s in latest.items() if not key.startswith("scalar"))


def _kernels_in(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(
        1
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset"))
    )


def test_kernels_per_collected_step(tmp_path):
    """Per collected step the monitor adds at most one kernel per tensor taken in a hook (activations,
    their gradients, gradients as backward accumulates them, tracked scalars) plus one for each of the few
    tensors that must be made contiguous, and O(1) for the whole parameter side."""
    model, optimizer = model_and_optimizer()
    config = {**FULL, "step_interval": 2}
    with trainmon.attach(model, optimizer, config=config, logdir=tmp_path / "run") as mon:
        for i in range(4):
            train_step(model, optimizer, i, mon)
        collected = _kernels_in(lambda: train_step(model, optimizer, 4, mon))
        idle = _kernels_in(lambda: train_step(model, optimizer, 5, mon))
        rows = mon._latest[0].rows
    hooked = sum(r.kind in ("actv", "actv_grad", "grad_unreduced", "scalar") for r in rows)
    param_side = len(rows) - hooked
    assert hooked > 100 and param_side > 100
    added = collected - idle
    assert added <= 2 * hooked + 12, (added, hooked, param_side)


def test_gpu_statistics_equal_the_cpu_kernel():
    torch.manual_seed(1)
    cases = []
    for n in (1, 1000, 65_537, 3_000_001):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x = torch.randn(n) * 3 + 0.25
            if n > 10:
                x[[1, 5, 7, 9]] = torch.tensor([NAN, INF, -INF, 0.0])
            cases.append(x.to(dtype))
    cases += [torch.empty(0), torch.full((100,), NAN), torch.arange(10), torch.randn(99, dtype=torch.float64)]
    for x in cases:
        got = stats.partials(x.cuda()).cpu().numpy()
        want = stats.partials(x).numpy()  # the native CPU kernel (float64 accumulation)
        np.testing.assert_array_equal(got[:SUM], want[:SUM])
        bound = 1e-6 * math.sqrt(max(want[SUMSQ], 0.0) * max(want[NUMEL], 1.0))  # >= 1e-6 * sum|x|
        assert abs(got[SUM] - want[SUM]) <= bound + 1e-300, (x.dtype, x.numel())
        assert got[SUMSQ] == pytest.approx(want[SUMSQ], rel=1e-6, abs=1e-300), (x.dtype, x.numel())


def test_monitored_gpu_step_matches_cpu_statistics_of_its_tensors(tmp_path):
    model, optimizer = model_and_optimizer(layers=2)
    with trainmon.attach(model, optimizer, config=FULL, logdir=tmp_path / "run") as mon:
        for i in range(2):
            train_step(model, optimizer, i, mon)
        latest = mon.latest()
        for name, p in model.named_parameters():
            want = stats.partials(p.detach().cpu()).numpy()
            got = latest[f"param_updated/{name}"]
            assert got["min"] == want[MIN] and got["max"] == want[MAX], name
            assert got["norm"] == pytest.approx(math.sqrt(want[SUMSQ]), rel=1e-6), name
            moments = optimizer.state[p]
            for kind, key in (("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
                ref = stats.partials(moments[key].cpu()).numpy()
                assert latest[f"{kind}/{name}"]["norm"] == pytest.approx(math.sqrt(ref[SUMSQ]), rel=1e-6)


def test_losses_are_bitwise_equal_with_and_without_the_monitor(tmp_path, monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    try:
        model, optimizer = model_and_optimizer(layers=2)
        plain = [train_step(model, optimizer, i) for i in range(4)]
        model, optimizer = model_and_optimizer(layers=2)
        with trainmon.attach(model, optimizer, config=FULL, logdir=tmp_path / "run") as mon:
            monitored = [train_step(model, optimizer, i, mon) for i in range(4)]
    finally:
        torch.use_deterministic_algorithms(False)
    assert torch.equal(torch.stack(plain), torch.stack(monitored))
