"""torch.compile: the monitor collects the same tensors under the same names as eager, whichever way round
the model is compiled and the monitor attached, with no graph break of its own (docs/compile.md)."""

from __future__ import annotations

import json
import logging
import os
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import trainmon
from tests.conftest import FULL_COVERAGE
from trainmon.collect.modules import clean_name, named_modules
from trainmon.config.watch import SETTLE_S

torch._dynamo  # noqa: B018  (loaded: the tests read its counters)
from torch._dynamo.utils import counters  # noqa: E402

VOCAB, T, D = 32, 8, 16
STEPS = 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)
        self.fc = nn.Linear(D, 2 * D)
        self.out = nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln(x)).split(D, dim=-1)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.out(F.gelu(self.fc(x)))


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(D, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make(seed: int = 0) -> tuple[TinyGPT, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = TinyGPT()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (2, T + 1), generator=g) for _ in range(n)]


def train(model, optimizer, data, monitor=None) -> tuple[list[float], list[dict]]:
    """Losses of each step and, where a monitor is attached, the statistics of each collected step."""
    losses, stats = [], []
    for batch in data:
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        latest = monitor.latest() if monitor is not None else None
        if latest is not None and latest.step == monitor.step - 1:
            stats.append({key: dict(value) for key, value in latest.items()})
        else:
            stats.append({})
    return losses, stats


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def eager_run(tmp_path, config, data) -> tuple[list[float], list[dict]]:
    model, optimizer = make()
    with trainmon.attach(model, optimizer, config=config, logdir=tmp_path / "eager") as mon:
        return train(model, optimizer, data, mon)


def compiled_unmonitored(data, backend: str = "aot_eager") -> list[float]:
    model, optimizer = make()
    losses, _ = train(torch.compile(model, backend=backend), optimizer, data)
    torch._dynamo.reset()
    counters.clear()
    return losses


def assert_same_stats(actual: dict, expected: dict, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    assert set(actual) == set(expected), (
        sorted(set(expected) - set(actual)),
        sorted(set(actual) - set(expected)),
    )
    for key, stats in expected.items():
        for stat, value in stats.items():
            assert actual[key][stat] == pytest.approx(value, rel=rtol, abs=atol, nan_ok=True), (key, stat)


def assert_no_graph_break() -> None:
    assert dict(counters["graph_break"]) == {}


def compiled_run(tmp_path, order: str, config, data, backend="aot_eager", fullgraph=False):
    """Train the compiled model, the monitor attached in ``order``: before compiling, after, after
    compiled steps ran (``data[0]`` is then trained unmonitored), or before ``module.compile()``."""
    model, optimizer = make()

    def compile_(m):
        return torch.compile(m, backend=backend, fullgraph=fullgraph)

    run = tmp_path / order
    if order == "before":
        mon = trainmon.attach(model, optimizer, config=config, logdir=run)
        runnable = compile_(model)
    elif order == "after":
        runnable = compile_(model)
        mon = trainmon.attach(runnable, optimizer, config=config, logdir=run)
    elif order == "after_steps":
        runnable = compile_(model)
        train(runnable, optimizer, data[:1])
        mon = trainmon.attach(runnable, optimizer, config=config, logdir=run, start_iteration=1)
    elif order == "in_place":
        mon = trainmon.attach(model, optimizer, config=config, logdir=run)
        model.compile(backend=backend, fullgraph=fullgraph)
        runnable = model
    else:
        raise AssertionError(order)
    with mon:
        losses, stats = train(runnable, optimizer, data[1:] if order == "after_steps" else data, mon)
    if order == "after_steps":
        losses, stats = [float("nan"), *losses], [{}, *stats]
    return losses, stats


@pytest.mark.parametrize("order", ["before", "after", "after_steps", "in_place"])
def test_compiled_collects_what_eager_collects(tmp_path, order):
    data = batches(STEPS)
    reference = compiled_unmonitored(data)
    eager_losses, eager_stats = eager_run(tmp_path, FULL_COVERAGE, data)
    losses, stats = compiled_run(tmp_path, order, FULL_COVERAGE, data)

    assert_no_graph_break()
    assert counters["stats"]["unique_graphs"] <= 4  # the model's graph, the root hooks' own frames
    first = 1 if order == "after_steps" else 0
    assert losses[first:] == reference[first:]  # the monitor changes nothing the compiled model computes
    names = {key.split("/", 1)[1] for key in eager_stats[-1]}
    assert "blocks.0.qkv.output" in names and not any("_orig_mod" in n for n in names)
    kinds = {key.split("/", 1)[0] for key in eager_stats[-1]}
    assert {"actv", "actv_grad", "grad_unreduced", "param_origin", "exp_avg"} <= kinds
    for step in range(first, STEPS):
        assert_same_stats(stats[step], eager_stats[step])
    assert losses[first:] == pytest.approx(eager_losses[first:], rel=1e-5)


def test_fullgraph_with_the_monitor(tmp_path):
    data = batches(STEPS)
    _, eager_stats = eager_run(tmp_path, FULL_COVERAGE, data)
    for order in ("before", "after"):
        torch._dynamo.reset()
        _, stats = compiled_run(tmp_path, order, FULL_COVERAGE, data, fullgraph=True)
        assert_same_stats(stats[-1], eager_stats[-1])
    assert_no_graph_break()


@pytest.mark.parametrize("fullgraph", [False, True])
def test_first_compiled_call_on_an_off_step(tmp_path, fullgraph):
    """step_interval: the model is first traced on a step that collects nothing (the eager hooks are out);
    the next collected step still gets every tensor. With ``fullgraph`` dynamo counts no frame in
    ``counters["frames"]`` (torch 2.13): the compiled code is seen by its graphs."""
    config = {**FULL_COVERAGE, "step_interval": 2, "start_step": 1}
    data = batches(4)
    _, eager_stats = eager_run(tmp_path, config, data)
    _, stats = compiled_run(tmp_path, "before", config, data, fullgraph=fullgraph)
    assert stats[0] == {} and stats[2] == {}
    assert_same_stats(stats[1], eager_stats[1])
    assert_same_stats(stats[3], eager_stats[3])
    assert_no_graph_break()


def write_config(path, config: dict, bump: int) -> None:
    path.write_text(json.dumps(config))
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + bump * 1_000_000_000))


def test_config_edit_switches_activations_on(tmp_path, monkeypatch):
    """Activations switched on by a config edit, after the compiled model has trained without them."""
    monkeypatch.delenv("DYNAMIC_MONITOR", raising=False)
    path = tmp_path / "monitor.json"
    write_config(path, {"wg_distribution": True}, bump=0)
    data = batches(6)
    _, eager_stats = eager_run(tmp_path, FULL_COVERAGE, data)
    model, optimizer = make()
    compiled = torch.compile(model, backend="aot_eager")
    with trainmon.attach(compiled, optimizer, config=str(path), logdir=tmp_path / "run") as mon:
        _, before = train(compiled, optimizer, data[:2], mon)
        write_config(path, FULL_COVERAGE, bump=1)
        _, seen = train(compiled, optimizer, data[2:3], mon)  # the end of step 2 sees the edit
        time.sleep(SETTLE_S * 1.5)
        _, after = train(compiled, optimizer, data[3:], mon)  # step 3's end reads it; 4 and 5 collect it
    assert not any(key.startswith("actv") for key in before[1])
    assert_same_stats(after[-1], eager_stats[-1])
    assert_no_graph_break()


def test_inductor(tmp_path):
    data = batches(2)
    reference = compiled_unmonitored(data, backend="inductor")
    _, eager_stats = eager_run(tmp_path, FULL_COVERAGE, data)
    losses, stats = compiled_run(tmp_path, "after", FULL_COVERAGE, data, backend="inductor")
    assert_no_graph_break()
    assert losses == pytest.approx(reference, rel=1e-6)
    # inductor's own numerics (fused kernels, another summation order): a mean near 0 moves by ~1e-4, and
    # Adam's update, which divides by the root of a gradient's square, makes more of it after a step; the
    # tensors before the first update are compared, every tensor's presence at every step
    before_update = {"actv", "actv_grad", "grad_unreduced", "grad_reduced", "param_origin"}
    for step in range(2):
        assert set(stats[step]) == set(eager_stats[step])
    first = {key: value for key, value in stats[0].items() if key.split("/")[0] in before_update}
    expected = {key: value for key, value in eager_stats[0].items() if key.split("/")[0] in before_update}
    assert_same_stats(first, expected, rtol=1e-3, atol=1e-3)


def test_eager_losses_unchanged(tmp_path):
    data = batches(STEPS)
    model, optimizer = make()
    plain, _ = train(model, optimizer, data)
    monitored, _ = eager_run(tmp_path, FULL_COVERAGE, data)
    assert monitored == plain


def test_wrapper_names_are_stripped():
    assert clean_name("_orig_mod.blocks.0.qkv") == "blocks.0.qkv"
    assert clean_name("blocks.0._checkpoint_wrapped_module.fc.weight") == "blocks.0.fc.weight"
    assert clean_name("_fsdp_wrapped_module.head") == "head"
    assert clean_name("blocks.0.my_mod.x") == "blocks.0.my_mod.x"
    model, _ = make()
    eager = [name for name, _ in model.named_modules()]
    model.blocks[0] = torch.compile(model.blocks[0], backend="aot_eager")  # one block compiled alone
    found = named_modules(torch.compile(model, backend="aot_eager"))
    assert [name for name, _ in found] == eager
    assert dict(found)["blocks.0"] is model.blocks[0]._orig_mod  # the model's module, not its wrapper


def test_per_block_compile(tmp_path):
    """torchtitan's way: each block compiled in place, the monitor attached after."""
    data = batches(STEPS)
    _, eager_stats = eager_run(tmp_path, FULL_COVERAGE, data)
    model, optimizer = make()
    for block in model.blocks:
        block.compile(backend="aot_eager", fullgraph=True)
    train(model, optimizer, data[:1])
    with trainmon.attach(
        model, optimizer, config=FULL_COVERAGE, logdir=tmp_path / "run", start_iteration=1
    ) as mon:
        _, stats = train(model, optimizer, data[1:], mon)
    assert_same_stats(stats[-1], eager_stats[-1])
    assert_no_graph_break()


def test_blind_compiled_function_is_said_once(tmp_path, caplog):
    """A compiled function around the model, traced before attach: code trainmon cannot find. Its hooks
    never run; the monitor says so once instead of recording nothing in silence."""
    data = batches(3)
    model, optimizer = make()
    forward = torch.compile(lambda idx: model(idx), backend="aot_eager")
    forward(data[0][:, :-1])
    with (
        caplog.at_level(logging.WARNING, logger="trainmon"),
        trainmon.attach(model, optimizer, config=FULL_COVERAGE, logdir=tmp_path / "run") as mon,
    ):
        train(forward, optimizer, data, mon)
    said = [r for r in caplog.records if "none of the" in r.getMessage() and "hooks" in r.getMessage()]
    assert len(said) == 1


def hooked(module: nn.Module) -> bool:
    return bool(module._forward_hooks)


def test_hooks_stay_armed_only_for_compiled_models(tmp_path):
    """Eager: hooks out on off steps (they cost nothing there). Compiled: in on every step, as compiled code
    never sees hooks armed later; dynamo keeps two entries, one with the monitor's ops for collected steps
    and one without them for off steps, both compiled by the first off step: later steps compile nothing,
    and an off step calls none of the monitor's activation ops."""
    from trainmon.collect import modules, traced

    config = {**FULL_COVERAGE, "step_interval": 2}
    data = batches(6)
    model, optimizer = make()
    with trainmon.attach(model, optimizer, config=config, logdir=tmp_path / "eager"):
        train(model, optimizer, data[:1])  # step 0 collected; step 1 is not
        assert not hooked(model.blocks[0].qkv)
    model, optimizer = make()
    compiled = torch.compile(model, backend="aot_eager")
    with trainmon.attach(compiled, optimizer, config=config, logdir=tmp_path / "compiled") as mon:
        train(compiled, optimizer, data[:2])
        graphs = counters["stats"]["unique_graphs"]
        assert hooked(model.blocks[0].qkv)  # step 2: collected; step 3 not, and still armed after it
        ops: list[int] = []

        def counted(handler):
            return lambda what, key, tensor: (ops.append(what), handler(what, key, tensor))

        traced._HANDLERS[:] = [h and counted(h) for h in traced._HANDLERS]
        train(compiled, optimizer, data[2:3], mon)
        collected, ops[:] = list(ops), []
        train(compiled, optimizer, data[3:4], mon)
        assert modules._OUTPUT in collected and modules._INPUT_GRAD in collected
        assert ops == []  # the off step
        assert mon.latest().step == 2
        train(compiled, optimizer, data[4:])
        assert hooked(model.blocks[0].qkv)
    assert counters["stats"]["unique_graphs"] == graphs
    assert_no_graph_break()


def test_close_leaves_the_compiled_model_unmonitored(tmp_path):
    data = batches(3)
    model, optimizer = make()
    compiled = torch.compile(model, backend="aot_eager")
    with trainmon.attach(compiled, optimizer, config=FULL_COVERAGE, logdir=tmp_path / "run") as mon:
        train(compiled, optimizer, data[:1], mon)
    assert not hooked(model.blocks[0].qkv)
    losses, _ = train(compiled, optimizer, data[1:])  # the traced op still runs, and does nothing
    assert all(loss == loss for loss in losses)
    assert mon.latest().step == 0
