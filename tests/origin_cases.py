"""Real tiny torch runs, one per place a NaN can be born: in a leaf module or in a parent's own code (between
its children), two and three levels deep (and one level: the block of issue 22), in forward or in backward.

Shared by tests/test_origin_rule.py (records, the alert line, ``analyze``, ``--explain``, the plugin's routes)
and tests/test_plugin_ui.py (the origin badge and the "first nan" button in a real browser).

The model: ``0`` Linear, ``1`` Block, ``2`` Linear, where

    Block ``1``:            x + poison("1", mlp(gate(x)))          (the issue's block: its own code after mlp)
      Leaf ``1.gate``       depth 2, a leaf
      Mlp ``1.mlp``:        fc2(poison("1.mlp", inner(fc1(x))))     depth 2, a parent
        Leaf ``1.mlp.fc1``  depth 3, a leaf
        Inner ``1.mlp.inner``: b(poison("1.mlp.inner", a(x)))      depth 3, a parent
          Sequential ``1.mlp.inner.a`` of Leaf ``1.mlp.inner.a.0``; Leaf ``1.mlp.inner.b``
        Leaf ``1.mlp.fc2``

Each parent's own code takes a child's output that is also that child's last child's output (``mlp`` returns
``fc2``'s, ``inner`` returns ``b``'s, ``a`` returns ``a.0``'s): in backward two ``output_grad`` rows fire
there, the child's own after its last child's, which is where a call pairing by adjacent rows went wrong.

A leaf is a module without children (its weight is its own parameter) whose own code ends with
``poison(its name)``. ``poison(where)`` is the identity, except at the NaN step of the case naming ``where``:
then it writes a NaN into its forward output, or into the gradient its backward hands on.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import trainmon

NAN_STEP = 1
STEPS = 2
CONFIG = {"xy_distribution": True, "all_xy": True, "format": "csv", "alert": {"rate_limit_s": 0}}


@dataclass(frozen=True)
class Case:
    module: str  # where the NaN is born
    phase: str  # forward or backward
    leaf: bool

    @property
    def run(self) -> str:
        return f"{'leaf' if self.leaf else 'parent'}-{self.module.replace('.', '_')}-{self.phase}"

    @property
    def origin(self) -> str:
        """The row the documented rule names: what flows out of the module's call."""
        return f"{self.module}.{'output' if self.phase == 'forward' else 'input_grad'}"

    @property
    def kind(self) -> str:
        return "actv" if self.phase == "forward" else "actv_grad"


CASES = tuple(
    Case(module, phase, leaf)
    for module, leaf in (("1", False), ("1.mlp", False), ("1.mlp.inner", False), ("1.gate", True),
                         ("1.mlp.fc1", True))
    for phase in ("forward", "backward")
)  # fmt: skip


class _Poison(torch.autograd.Function):
    where: str | None = None  # the module whose own code makes the NaN now
    phase = "forward"

    @staticmethod
    def forward(ctx, x: torch.Tensor, where: str) -> torch.Tensor:
        ctx.bad = _Poison.where == where and _Poison.phase == "backward"
        out = x.clone()
        if _Poison.where == where and _Poison.phase == "forward":
            out[0, 0] = float("nan")
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone()
        if ctx.bad:
            grad[0, 0] = float("nan")
        return grad, None


def poison(where: str, x: torch.Tensor) -> torch.Tensor:
    return _Poison.apply(x, where)


class Leaf(nn.Module):
    def __init__(self, where: str, d: int = 6) -> None:
        super().__init__()
        self.where = where
        self.weight = nn.Parameter(torch.randn(d, d) / d**0.5)
        self.bias = nn.Parameter(torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return poison(self.where, torch.tanh(F.linear(x, self.weight, self.bias)))


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Sequential(Leaf("1.mlp.inner.a.0")), Leaf("1.mlp.inner.b")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(poison("1.mlp.inner", self.a(x)))


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.inner, self.fc2 = Leaf("1.mlp.fc1"), Inner(), Leaf("1.mlp.fc2")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(poison("1.mlp", self.inner(self.fc1(x))))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate, self.mlp = Leaf("1.gate"), Mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + poison("1", self.mlp(self.gate(x)))


def write_case_run(run_dir: Path, case: Case) -> list:
    """Trains the model ``STEPS`` steps with the NaN of ``case`` at ``NAN_STEP``; returns the alerts."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), Block(), nn.Linear(6, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    alerts: list = []
    with trainmon.attach(model, optimizer, config=CONFIG, logdir=run_dir, on_alert=alerts.append):
        for step in range(STEPS):
            _Poison.where, _Poison.phase = (case.module, case.phase) if step == NAN_STEP else (None, "")
            x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
            model(x).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    _Poison.where = None
    return alerts
