"""End-to-end collection on plain PyTorch: every kind, exact values against float64 references."""

from __future__ import annotations

import csv
import logging

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import trainmon
from tests.conftest import FULL_COVERAGE, assert_stats_close, reference_partials, to_numpy
from trainmon.run import records

# these tests read the rows a run recorded from its CSV, one row per micro-step (asked for since issue 33)
CSV = {"format": ["tensorboard", "csv"]}
FULL = {**FULL_COVERAGE, "ur_distribution": True, **CSV}


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def make_toy(seed: int = 0) -> tuple[Toy, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Toy()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def expected_stats(values: np.ndarray) -> dict[str, float]:
    derived = records.derive(reference_partials(values)[None, :])
    return {stat: float(derived[stat][0]) for stat in records.STATS}


def assert_stats(actual: dict[str, float], values: np.ndarray, rtol: float = 1e-6) -> None:
    expected = expected_stats(values)
    for stat in records.STATS:
        np.testing.assert_allclose(actual[stat], expected[stat], rtol=rtol, atol=1e-9, err_msg=stat)


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    monitor: trainmon.Monitor | None = None,
) -> torch.Tensor:
    loss = F.mse_loss(model(x), y)
    if monitor is not None:
        monitor.track("loss", loss)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss


def test_activation_and_activation_grad_values(tmp_path):
    model, optimizer = make_toy()
    seen: dict[str, np.ndarray] = {}

    def capture_forward(name):
        def hook(module, args, output):
            seen[f"actv/{name}.input"] = to_numpy(args[0])
            seen[f"actv/{name}.output"] = to_numpy(output)

        return hook

    def capture_backward(name):
        def hook(module, grad_input, grad_output):
            seen[f"actv_grad/{name}.output_grad"] = to_numpy(grad_output[0])
            if grad_input[0] is not None:
                seen[f"actv_grad/{name}.input_grad"] = to_numpy(grad_input[0])

        return hook

    for name, module in model.named_children():
        module.register_forward_hook(capture_forward(name))
        module.register_full_backward_hook(capture_backward(name))
    x, y = torch.randn(5, 4), torch.randn(5, 2)
    with trainmon.attach(
        model, optimizer, config={"xy_distribution": True, "all_xy": True}, logdir=tmp_path / "run"
    ) as mon:
        train_step(model, optimizer, x, y)
        latest = mon.latest()
    assert latest.step == 0
    assert set(latest) == set(seen)  # fc1.input_grad exists? x needs no grad: torch gives None, no row
    for key, values in seen.items():
        assert_stats(latest[key], values)


def test_weight_grads_params_and_adam_state_values(tmp_path):
    model, optimizer = make_toy()
    before: dict[str, np.ndarray] = {}

    def snapshot_before(opt, args, kwargs):
        for name, p in model.named_parameters():
            before[f"grad_reduced/{name}"] = to_numpy(p.grad)
            before[f"param_origin/{name}"] = to_numpy(p)

    optimizer.register_step_pre_hook(snapshot_before)
    x, y = torch.randn(5, 4), torch.randn(5, 2)
    with trainmon.attach(model, optimizer, config=FULL, logdir=tmp_path / "run") as mon:
        for _ in range(3):  # step 2 checks the bias corrections with t = 3
            train_step(model, optimizer, x, y, mon)
        latest = mon.latest()
    assert latest.step == 2
    beta1, beta2 = optimizer.param_groups[0]["betas"]
    eps = optimizer.param_groups[0]["eps"]
    for name, p in model.named_parameters():
        state = optimizer.state[p]
        t = float(state["step"])
        assert t == 3
        m, v = to_numpy(state["exp_avg"]), to_numpy(state["exp_avg_sq"])
        m_hat, v_hat = m / (1 - beta1**t), v / (1 - beta2**t)
        assert_stats(latest[f"grad_reduced/{name}"], before[f"grad_reduced/{name}"])
        assert_stats(latest[f"grad_unreduced/{name}"], before[f"grad_reduced/{name}"])  # no DP: equal
        assert_stats(latest[f"param_origin/{name}"], before[f"param_origin/{name}"])
        assert_stats(latest[f"param_updated/{name}"], to_numpy(p))
        assert_stats(latest[f"exp_avg/{name}"], m)
        assert_stats(latest[f"exp_avg_sq/{name}"], v)
        assert_stats(latest[f"update/{name}"], m_hat / (np.sqrt(v_hat) + eps), rtol=1e-5)
        assert_stats(latest[f"ratio/{name}"], m_hat / np.sqrt(v_hat), rtol=1e-5)
    losses = latest["scalar/loss"]
    assert losses["min"] == losses["max"] == losses["mean"]


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_steps_start_iteration_micro_steps_and_csv(tmp_path):
    model, optimizer = make_toy()
    run = tmp_path / "run"
    config = {"xy_distribution": True, "targets": {"fc1": {}}, "wg_distribution": True, **CSV}
    with trainmon.attach(model, optimizer, config=config, logdir=run, grad_acc_steps=2, start_iteration=100):
        for _ in range(3):
            optimizer.zero_grad()
            for _micro in range(2):
                F.mse_loss(model(torch.randn(3, 4)), torch.randn(3, 2)).backward()
            optimizer.step()
    actv = read_csv(run / "rank_0" / "actv.csv")
    assert list(actv[0])[:4] == ["vpp_stage", "name", "step", "micro_step"]
    assert list(actv[0])[-2:] == ["shape", "dtype"]
    assert {r["name"] for r in actv} == {"fc1.input", "fc1.output"}
    assert [(r["step"], r["micro_step"]) for r in actv if r["name"] == "fc1.output"] == [
        ("100", "0"),
        ("100", "1"),
        ("101", "0"),
        ("101", "1"),
        ("102", "0"),
        ("102", "1"),
    ]
    assert actv[0]["shape"] == "[3, 4]" and actv[0]["dtype"] == "torch.float32"
    grads = read_csv(run / "rank_0" / "grad_unreduced.csv")
    # the accumulated gradient once per step, on the last micro-batch; target fc1 selects its parameters
    assert sorted((r["step"], r["name"], r["micro_step"]) for r in grads) == [
        (str(s), n, "1") for s in (100, 101, 102) for n in ("fc1.bias", "fc1.weight")
    ]


def test_monitor_mbs_grad_records_every_micro_batch(tmp_path):
    model, optimizer = make_toy()
    run = tmp_path / "run"
    with trainmon.attach(
        model,
        optimizer,
        config={"wg_distribution": True, "monitor_mbs_grad": True, "targets": ["fc2"], **CSV},
        logdir=run,
        grad_acc_steps=3,
    ):
        optimizer.zero_grad()
        for _ in range(3):
            F.mse_loss(model(torch.randn(3, 4)), torch.randn(3, 2)).backward()
        optimizer.step()
    rows = read_csv(run / "rank_0" / "grad_unreduced.csv")
    assert sorted((r["micro_step"], r["name"]) for r in rows) == [
        (str(m), n) for m in range(3) for n in ("fc2.bias", "fc2.weight")
    ]


def test_wrong_grad_acc_steps_is_corrected_after_one_step(tmp_path, caplog):
    model, optimizer = make_toy()
    run = tmp_path / "run"
    with (
        caplog.at_level(logging.WARNING, "trainmon"),
        trainmon.attach(
            model, optimizer, config={"wg_distribution": True, "targets": ["fc2.bias"], **CSV}, logdir=run
        ),
    ):
        for _ in range(2):
            optimizer.zero_grad()
            for _ in range(2):
                F.mse_loss(model(torch.randn(3, 4)), torch.randn(3, 2)).backward()
            optimizer.step()
    assert "grad_acc_steps=1 but step 0 ran 2 micro-batches" in caplog.text
    rows = read_csv(run / "rank_0" / "grad_unreduced.csv")
    assert [(r["step"], r["micro_step"]) for r in rows] == [("0", "0"), ("1", "1")]


def test_schedule_gates_hook_installation(tmp_path):
    model, optimizer = make_toy()
    config = {**FULL, "start_step": 2, "step_interval": 3, "collect_times": 2}
    installed = []
    with trainmon.attach(model, optimizer, config=config, logdir=tmp_path / "run") as mon:
        for _ in range(12):
            installed.append((mon.step, len(model.fc1._forward_hooks), len(model.fc1._forward_pre_hooks)))
            train_step(model, optimizer, torch.randn(2, 4), torch.randn(2, 2), mon)
    assert [s for s, fwd, bwd in installed if fwd or bwd] == [2, 5]
    assert all(fwd == bwd == 1 for s, fwd, bwd in installed if s in (2, 5))
    steps = {r["step"] for r in read_csv(tmp_path / "run" / "rank_0" / "param_origin.csv")}
    assert steps == {"2", "5"}


def test_module_ranks_excluding_this_rank_collects_nothing(tmp_path):
    model, optimizer = make_toy()
    with trainmon.attach(
        model, optimizer, config={**FULL, "module_ranks": [1]}, logdir=tmp_path / "run"
    ) as mon:
        for _ in range(2):
            train_step(model, optimizer, torch.randn(2, 4), torch.randn(2, 2), mon)
        assert mon.latest() is None
        assert not model.fc1._forward_hooks
    assert not (tmp_path / "run" / "rank_0" / "actv.csv").exists()


def test_close_removes_every_hook(tmp_path):
    model, optimizer = make_toy()
    mon = trainmon.attach(model, optimizer, config=FULL, logdir=tmp_path / "run")
    train_step(model, optimizer, torch.randn(2, 4), torch.randn(2, 2), mon)
    mon.close()
    mon.close()  # idempotent
    for module in model.modules():
        assert not module._forward_hooks and not module._backward_hooks and not module._forward_pre_hooks
    assert not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks
    for p in model.parameters():
        assert not getattr(p, "_post_accumulate_grad_hooks", None)


def test_recomputation_and_eval_are_not_micro_batches(tmp_path):
    model, optimizer = make_toy()

    class Checkpointed(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return checkpoint(self.inner, x, use_reentrant=False)

    wrapped = Checkpointed(model)
    run = tmp_path / "run"
    with trainmon.attach(
        wrapped, optimizer, config={"xy_distribution": True, "targets": ["inner.fc1"], **CSV}, logdir=run
    ):
        wrapped.eval()
        with torch.no_grad():
            wrapped(torch.randn(2, 4))
        wrapped.train()
        train_step(wrapped, optimizer, torch.randn(2, 4), torch.randn(2, 2))
    rows = read_csv(run / "rank_0" / "actv.csv")
    assert [(r["name"], r["micro_step"]) for r in rows] == [
        ("inner.fc1.input", "0"),
        ("inner.fc1.output", "0"),
    ]


def test_monitor_fault_never_reaches_training(tmp_path, monkeypatch, caplog):
    from trainmon.stats.direct import DirectReducer

    def broken(*args, **kwargs):
        raise RuntimeError("kernel exploded")

    x, y = torch.randn(4, 4), torch.randn(4, 2)
    model, optimizer = make_toy()
    reference = [train_step(model, optimizer, x, y).item() for _ in range(3)]
    model, optimizer = make_toy()
    monkeypatch.setattr(DirectReducer, "row", broken)
    with (
        caplog.at_level(logging.ERROR, "trainmon"),
        trainmon.attach(model, optimizer, config=FULL, logdir=tmp_path / "run") as mon,
    ):
        losses = [train_step(model, optimizer, x, y, mon).item() for _ in range(3)]
        assert mon.step == 3
    assert losses == reference
    assert "kernel exploded" in caplog.text


def test_model_chunks_get_vpp_stages(tmp_path):
    torch.manual_seed(0)
    chunks = [nn.Linear(3, 3), nn.Linear(3, 3)]
    optimizer = torch.optim.Adam([p for c in chunks for p in c.parameters()])
    run = tmp_path / "run"
    with trainmon.attach(chunks, optimizer, config={"param_distribution": True, **CSV}, logdir=run) as mon:
        chunks[1](chunks[0](torch.randn(2, 3))).sum().backward()
        optimizer.step()
        assert set(mon.latest()) == {
            f"param_{w}/{c}:{p}" for w in ("origin", "updated") for c in (0, 1) for p in ("weight", "bias")
        }
    rows = read_csv(run / "rank_0" / "param_origin.csv")
    assert [(r["vpp_stage"], r["name"]) for r in rows] == [
        ("0", "weight"),
        ("0", "bias"),
        ("1", "weight"),
        ("1", "bias"),
    ]


def test_attach_rejects_what_it_cannot_monitor(tmp_path):
    with pytest.raises(TypeError, match="cannot monitor"):
        trainmon.attach(object(), None, logdir=tmp_path)
    with pytest.raises(trainmon.ConfigError, match="xy_distrbution"):
        trainmon.attach(nn.Linear(2, 2), None, config={"xy_distrbution": True}, logdir=tmp_path)


def test_kwargs_and_tuple_elements_get_their_own_rows(tmp_path):
    class Pair(nn.Module):
        def forward(self, x, *, scale):
            return x * scale, x + scale

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(3, 3)
            self.pair = Pair()

        def forward(self, x):
            a, b = self.pair(self.inner(x), scale=torch.full((2, 3), 2.0))
            return a + b

    torch.manual_seed(0)
    net = Net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    x = torch.randn(2, 3)
    h = net.inner(x).detach()  # the input of `pair`, before the step changes `inner`
    with trainmon.attach(net, optimizer, config={"xy_distribution": True, "targets": ["pair"]},
                         logdir=tmp_path / "run") as mon:
        net(x).sum().backward()
        optimizer.step()
        latest = mon.latest()
    assert set(latest) == {
        "actv/pair.input", "actv/pair.input_scale", "actv/pair.output_0", "actv/pair.output_1",
        "actv_grad/pair.output_grad_0", "actv_grad/pair.output_grad_1", "actv_grad/pair.input_grad",
    }  # fmt: skip
    assert_stats(latest["actv/pair.input_scale"], np.full((2, 3), 2.0))
    assert_stats(latest["actv/pair.output_0"], to_numpy(h * 2))
    assert_stats(latest["actv/pair.output_1"], to_numpy(h + 2))
    assert_stats(latest["actv_grad/pair.input_grad"], np.full((2, 3), 3.0))  # d(2h + h + 2)/dh


def test_portable_torch_path_gives_the_same_statistics_end_to_end(tmp_path):
    """The path GPUs and NPUs run (torch ops only) agrees with the native CPU kernel on a whole step."""
    from trainmon import stats

    results = {}
    for backend in ("auto", "torch"):
        stats.set_backend(backend)
        try:
            model, optimizer = make_toy()
            torch.manual_seed(1)
            with trainmon.attach(model, optimizer, config=FULL, logdir=tmp_path / backend) as mon:
                for _ in range(2):
                    train_step(model, optimizer, torch.randn(6, 4), torch.randn(6, 2), mon)
                results[backend] = {key: dict(values) for key, values in mon.latest().items()}
        finally:
            stats.set_backend("auto")
    assert results["auto"].keys() == results["torch"].keys() and len(results["auto"]) > 30
    for key, native in results["auto"].items():
        derived = key.startswith(("update/", "ratio/"))  # the monitor computes these tensors itself
        assert_stats_close(results["torch"][key], native, where=key, exact_extremes=not derived)


class HandNorm(nn.Module):
    """An RMSNorm written out in float32: its input is used twice inside it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)


class Residual(nn.Module):
    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm, self.fc = norm, nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(self.norm(x))  # x also flows around the norm


@pytest.mark.parametrize(
    ("norm", "config"),
    [(nn.LayerNorm, {}), (HandNorm, {"forward_only": True})],
    ids=["used-once-all-rows", "used-twice-forward-only"],
)
def test_gradients_stay_bitwise_what_output_md_promises(tmp_path, norm, config):
    """docs/output.md: modules that use their input once keep every gradient bit for bit with activation
    gradients collected, and a norm written out by hand keeps them with forward rows only."""

    def gradients(monitored: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 16), Residual(norm(16) if norm is nn.LayerNorm else norm()))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        rows = {"xy_distribution": True, "all_xy": True, **config}
        monitor = trainmon.attach(model, optimizer, config=rows, logdir=tmp_path) if monitored else None
        torch.manual_seed(1)
        grads = []
        for _ in range(3):
            train_step(model, optimizer, torch.randn(32, 16), torch.randn(32, 16))
            grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        if monitor is not None:
            assert any(name.startswith("actv/1.norm") for name in monitor.latest())
            monitor.close()
        return grads

    for plain, monitored in zip(gradients(False), gradients(True), strict=True):
        assert torch.equal(plain, monitored)
