"""A module's ``input_grad`` is read from the nodes of its call that consume the input, so the training's
numbers stay bitwise where the input also flows around the module: a pre-norm residual stream whose
RMSNorm is written out by hand and uses its input twice (Llama, Qwen, Mistral, Gemma in Hugging Face's
code). A view of the input to hook would make autograd add the gradients in another grouping and move
the losses by their last bits (issue 51, point 4)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import trainmon
from tests.conftest import FULL_COVERAGE

STEPS = 8


class HandRMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm, self.mlp = (
            HandRMSNorm(dim),
            nn.Sequential(nn.Linear(dim, 4 * dim), nn.SiLU(), nn.Linear(4 * dim, dim)),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class Net(nn.Module):
    def __init__(self, dim: int = 24, layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, dim)
        self.layers = nn.ModuleList(Block(dim) for _ in range(layers))
        self.head = nn.Linear(dim, 50)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def train(run=None, grad_input_of: str | None = None):
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    monitor = trainmon.attach(model, optimizer, config=FULL_COVERAGE, logdir=run) if run else None
    seen: list[torch.Tensor] = []
    if grad_input_of is not None:  # torch's own meaning of a module's grad_input, for the reference
        module = model.get_submodule(grad_input_of)
        module.register_full_backward_hook(lambda m, grad_in, grad_out: seen.append(grad_in[0].clone()))
    losses, recorded = [], []
    for step in range(STEPS):
        tokens = torch.randint(0, 50, (4, 12), generator=torch.Generator().manual_seed(step))
        loss = nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        if monitor is not None:
            monitor.track("loss", loss)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if monitor is not None:
            recorded.append(monitor.latest())
    if monitor is not None:
        monitor.close()
    return losses, [p.detach().clone() for p in model.parameters()], recorded, seen


def test_losses_and_parameters_bitwise_with_every_activation_gradient(tmp_path):
    losses, params, recorded, _ = train()
    monitored_losses, monitored_params, monitored, _ = train(tmp_path / "run")
    assert monitored_losses == losses
    assert all(torch.equal(a, b) for a, b in zip(params, monitored_params, strict=True))
    names = set(monitored[-1].keys())
    for layer in range(4):  # the rows are there: the norm's and the block's input gradients
        assert f"actv_grad/layers.{layer}.norm.input_grad" in names
        assert f"actv_grad/layers.{layer}.input_grad" in names or layer == 0


@pytest.mark.parametrize("module", ["layers.1.norm", "layers.2", "layers.2.mlp.0"])
def test_input_grad_is_the_modules_own_grad_input(tmp_path, module):
    """Only the gradient that flows back through the module: for a norm on the residual stream, not the
    stream's whole gradient."""
    _, _, recorded, _ = train(tmp_path / "run")
    _, _, _, seen = train(grad_input_of=module)
    for step in range(STEPS):
        stats = recorded[step][f"actv_grad/{module}.input_grad"]
        reference = seen[step].double()
        assert stats["norm"] == pytest.approx(reference.norm().item(), rel=1e-5)
        assert stats["max"] == pytest.approx(reference.max().item(), rel=1e-5)
        assert stats["min"] == pytest.approx(reference.min().item(), rel=1e-5)


def test_a_leaf_input_gets_its_gradient_from_its_accumulator(tmp_path):
    """An input that is a leaf (a tensor the user made with requires_grad): its gradient goes to a gradient
    accumulator, whose edge the consumers are found by; here the first layer is its only consumer, so the
    row equals x.grad."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 6, requires_grad=True)
    with trainmon.attach(model, optimizer, config=FULL_COVERAGE, logdir=tmp_path / "run") as monitor:
        model(x).pow(2).sum().backward()
        optimizer.step()
        stats = monitor.latest()["actv_grad/0.input_grad"]
    assert stats["norm"] == pytest.approx(x.grad.double().norm().item(), rel=1e-6)
    assert stats["max"] == pytest.approx(x.grad.max().item(), rel=1e-6)
