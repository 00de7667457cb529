"""A tiny model whose NaN is born inside a layer on demand (its input finite, so that layer is the origin of
the NaN: docs/anomalies.md), and one training step of it: shared by the fault tests."""

from __future__ import annotations

import torch


class Poisonable(torch.nn.Linear):
    """A Linear whose output turns NaN while ``poison`` is set."""

    poison = False

    def forward(self, x):
        y = super().forward(x)
        return y * float("nan") if self.poison else y


class Tiny(torch.nn.Module):
    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.fc1 = Poisonable(8, hidden)
        self.fc2 = torch.nn.Linear(hidden, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def make_model(hidden: int = 16) -> tuple[Tiny, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Tiny(hidden)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def train_step(model: Tiny, optimizer: torch.optim.Optimizer, step: int, poison: bool = False) -> None:
    """One step on a batch seeded by ``step``; with ``poison``, fc1 makes a NaN."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
    model.fc1.poison = poison
    loss = model(x).square().mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
