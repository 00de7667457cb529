"""Micro-step labels under gradient accumulation.

The first gradient row of a micro-batch must carry that micro-batch, whatever order the backward hooks run
in: a module whose output is the model's output had its hook on that tensor before the micro-step counter
did, and an auxiliary output's backward can run before the main output's."""

from __future__ import annotations

import csv
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import trainmon
from trainmon.csvtb import convert, tb2csv

GRAD_ACC = 3
STEPS = 2
# the CSV keeps a row per micro-step (asked for: no longer a default since issue 33), TensorBoard every tensor
OUTPUTS = {"format": ["tensorboard", "csv"], "tensorboard_tensors": "all"}
CONFIG = {"xy_distribution": True, "all_xy": True, "ndigits": 20, **OUTPUTS}


def read_rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def all_rows(rank_dir: Path) -> dict[str, list[dict[str, str]]]:
    return {p.stem: read_rows(p) for p in sorted(rank_dir.glob("*.csv"))}


def assert_unique(rows_by_kind: dict[str, list[dict[str, str]]]) -> None:
    keys = Counter(
        (kind, r["vpp_stage"], r["name"], r["step"], r["micro_step"])
        for kind, rows in rows_by_kind.items()
        for r in rows
    )
    assert [k for k, n in keys.items() if n > 1] == []


def unhooked_copy(model: nn.Module, make) -> nn.Module:
    """The model's current weights in a fresh module: a deepcopy would copy the monitor's hooks too."""
    ref = make()
    ref.load_state_dict(model.state_dict())
    return ref


def max_of(rows: list[dict[str, str]], name: str) -> dict[tuple[int, int], float]:
    return {(int(r["step"]), int(r["micro_step"])): float(r["max"]) for r in rows if r["name"] == name}


def test_sequential_labels_unique_exact_and_round_trip_lossless(tmp_path):
    torch.manual_seed(0)

    def make() -> nn.Module:
        return nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))

    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = tmp_path / "run"
    # d loss / d model output of every micro-batch, from a copy of the model as it is at that step
    expected: dict[tuple[int, int], float] = {}
    with trainmon.attach(model, opt, config=CONFIG, logdir=run, grad_acc_steps=GRAD_ACC):
        for step in range(STEPS):
            ref = unhooked_copy(model, make)
            for micro in range(GRAD_ACC):
                x, y = torch.randn(3, 4), torch.randn(3, 2)
                out = ref(x)
                (g,) = torch.autograd.grad(F.mse_loss(out, y), out)
                expected[(step, micro)] = float(g.max())
                F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    rows = all_rows(run / "rank_0")
    assert_unique(rows)
    actv_grad = rows["actv_grad"]
    # 5 gradient rows per micro-batch: 0/1/2 output grads, 1/2 input grads (0's input needs no grad)
    assert len(actv_grad) == STEPS * GRAD_ACC * 5
    assert max_of(actv_grad, "2.output_grad") == expected
    # csv2tb -> tb2csv keeps every row: nothing is "replaced by a later row"
    summary = convert([run], tmp_path / "tb", workers=1)
    assert summary.duplicates == 0
    tb2csv(tmp_path / "tb", tmp_path / "csv")
    back = all_rows(tmp_path / "csv" / "rank_0")
    assert {k: len(v) for k, v in back.items()} == {k: len(v) for k, v in rows.items()}
    for kind, original in rows.items():
        key = lambda r: (r["name"], int(r["step"]), int(r["micro_step"]))  # noqa: E731
        got = sorted((key(r), np.float32(float(r["norm"]))) for r in back[kind])
        want = sorted((key(r), np.float32(float(r["norm"]))) for r in original)
        assert got == want, kind


class WithAux(nn.Module):
    """Two outputs; the auxiliary one is computed last, so its backward runs before the main output's."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 2)
        self.aux = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.fc1(x))
        return self.fc2(h), self.aux(h)


@pytest.mark.parametrize("activations", [True, False], ids=["with-activations", "gradients-only"])
def test_auxiliary_output_backward_first_gets_its_own_micro_step(tmp_path, activations):
    torch.manual_seed(1)
    model = WithAux()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = tmp_path / "run"
    expected: dict[str, dict[tuple[int, int], float]] = {"fc2.output_grad": {}, "aux.output_grad": {}}
    # without activation hooks only the micro-step counter can start a micro-batch: it must see every output
    cfg = {**(CONFIG if activations else OUTPUTS), "wg_distribution": True, "monitor_mbs_grad": True}
    with trainmon.attach(model, opt, config=cfg, logdir=run, grad_acc_steps=GRAD_ACC):
        for step in range(STEPS):
            ref = unhooked_copy(model, WithAux)
            for micro in range(GRAD_ACC):
                x, y = torch.randn(3, 4), torch.randn(3, 2)
                out, aux = ref(x)
                g_out, g_aux = torch.autograd.grad(F.mse_loss(out, y) + aux.pow(2).mean(), (out, aux))
                expected["fc2.output_grad"][(step, micro)] = float(g_out.max())
                expected["aux.output_grad"][(step, micro)] = float(g_aux.max())
                out, aux = model(x)
                (F.mse_loss(out, y) + aux.pow(2).mean()).backward()
            opt.step()
            opt.zero_grad()
    rows = all_rows(run / "rank_0")
    assert_unique(rows)
    for name, want in expected.items() if activations else ():
        assert max_of(rows["actv_grad"], name) == want, name
    # parameter gradients of every micro-batch, each labelled once
    labels = sorted((r["step"], r["micro_step"]) for r in rows["grad_unreduced"] if r["name"] == "aux.bias")
    assert labels == [(str(s), str(m)) for s in range(STEPS) for m in range(GRAD_ACC)]


class BiasLater(nn.Module):
    """Megatron's linear layers with skip_bias_add: the call returns ``(x @ W^T, self.bias)``, the bias
    parameter itself, and the caller adds it."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 4) * 0.3)
        self.bias = nn.Parameter(torch.randn(8) * 0.1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x @ self.weight.t(), self.bias


class WithBiasLater(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = BiasLater()
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, bias = self.fc(x)
        return self.head(torch.tanh(out + bias))


def test_a_parameter_returned_by_a_module_gets_no_hook_and_labels_stay_right(tmp_path):
    """A hook on a returned parameter outlives its call: one more every call, firing in later steps with the
    micro-step of the call that added it, which moved the step's last micro-batch forward (grad_unreduced of
    a Megatron run was taken after the first micro-batch from the second step on)."""
    torch.manual_seed(2)
    model = WithBiasLater()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = tmp_path / "run"
    expected: dict[int, float] = {}
    cfg = {**CONFIG, "wg_distribution": True}
    with trainmon.attach(model, opt, config=cfg, logdir=run, grad_acc_steps=GRAD_ACC):
        for step in range(STEPS):
            ref = unhooked_copy(model, WithBiasLater)
            for _ in range(GRAD_ACC):
                x, y = torch.randn(3, 4), torch.randn(3, 2)
                F.mse_loss(ref(x), y).backward()
                F.mse_loss(model(x), y).backward()
            expected[step] = float(ref.fc.weight.grad.max())  # accumulated over the step's micro-batches
            opt.step()
            opt.zero_grad()
    assert not model.fc.bias._backward_hooks  # no hook left behind on the parameter
    rows = all_rows(run / "rank_0")
    assert_unique(rows)
    taken = {
        (int(r["step"]), int(r["micro_step"])): float(r["max"])
        for r in rows["grad_unreduced"]
        if r["name"] == "fc.weight"
    }
    assert taken == {(s, GRAD_ACC - 1): pytest.approx(v, rel=1e-6) for s, v in expected.items()}
