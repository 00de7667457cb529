"""Real tiny torch runs with gradient accumulation and ``alert.capture: exact`` whose NaN is born in a later
micro-step of the step: in a parent's own code (inf attention scores into a softmax inside ``1``, an
attention module) or in a leaf (``1.v``, a Linear whose output goes NaN). Shared by test_explain.py (issue 22
points 1 and 5), test_plugin_routes.py and test_plugin_ui.py (the dump link of the origin)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

import trainmon

NAN_STEP = 1
STEPS = 2
CONFIG = {
    "xy_distribution": True,
    "all_xy": True,
    "wg_distribution": True,
    "mv_distribution": True,
    "param_distribution": True,
    "format": "csv",
    "alert": {"capture": "exact", "rate_limit_s": 0},
}


class NanLinear(nn.Linear):
    """A Linear whose own forward writes NaN into its output when ``poisoned``."""

    poisoned = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        if self.poisoned:
            y = y.clone()
            y[0, :2] = float("nan")
        return y


class Attention(nn.Module):
    """Single-head self-attention; at the poisoned call its own code puts +inf on the scores' diagonal,
    and the softmax makes NaN of it (``where == "parent"``), or ``v``'s output goes NaN (``"leaf"``)."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.q, self.k, self.o = (nn.Linear(d, d) for _ in range(3))
        self.v = NanLinear(d, d)
        self.poison_call: int | None = None  # which call of the step (= micro-step) is poisoned
        self.where = "parent"
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        poisoned = self.calls == self.poison_call
        self.calls += 1
        scores = self.q(x) @ self.k(x).transpose(-1, -2)
        if poisoned and self.where == "parent":
            scores = scores.masked_fill(torch.eye(len(x), dtype=torch.bool), float("inf"))
        self.v.poisoned = poisoned and self.where == "leaf"
        return self.o(torch.softmax(scores, -1) @ self.v(x))


def write_acc_run(run_dir: Path, *, micro_steps: int, nan_micro: int, where: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), Attention(), nn.Linear(8, 2))
    model[1].where = where
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with trainmon.attach(model, optimizer, config=CONFIG, logdir=run_dir, grad_acc_steps=micro_steps):
        for step in range(STEPS):
            model[1].calls = 0
            model[1].poison_call = nan_micro if step == NAN_STEP else None
            for micro in range(micro_steps):
                x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step * 10 + micro))
                model(x).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
