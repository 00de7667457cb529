"""A prechecked step's API calls captured in the training process and judged against an upcast re-run
(issue 52, first pieces): stable names and modules, training numerics unchanged, random calls named and not
judged, no false alarm on a clean bf16 model, and a faulty bf16 GELU kernel planted in the process found at
its call and module and nowhere else."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from trainmon.precheck.capture import ApiCapture, api_name
from trainmon.precheck.judge import Status
from trainmon.precheck.rerun import judge_call


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(F.gelu(self.up(self.norm(x)))))


class Net(nn.Module):
    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(2))
        self.head = nn.Linear(dim, 64)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def step(model: nn.Module, tokens: torch.Tensor, capture: bool):
    torch.manual_seed(1)
    if capture:
        with ApiCapture(model) as captured:
            logits = model(tokens[:, :-1])
    else:
        captured, logits = None, model(tokens[:, :-1])
    loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return loss, captured


def make() -> tuple[Net, torch.Tensor]:
    torch.manual_seed(0)
    return Net().to(torch.bfloat16), torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(2))


def test_names_modules_and_unchanged_numerics():
    model, tokens = make()
    plain, _ = step(model, tokens, capture=False)
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    loss, captured = step(model, tokens, capture=True)
    assert torch.equal(loss, plain)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
    names = [c.name for c in captured.calls]
    assert len(names) == len(set(names))
    by_name = {c.name: c for c in captured.calls}
    assert by_name["torch.nn.functional.gelu.1.forward"].module == "blocks.1"
    assert by_name["torch.nn.functional.linear.0.forward"].module == "blocks.0.up"
    assert by_name["torch.nn.functional.linear.4.forward"].module == "head"
    assert by_name["torch.nn.functional.layer_norm.0.forward"].module == "blocks.0.norm"
    assert by_name["torch.nn.functional.embedding.0.forward"].module == "embed"
    assert captured.skipped == {"torch.nn.functional.dropout": 2}  # random: named, not judged
    # the outputs are the training's own
    up = by_name["torch.nn.functional.linear.0.forward"]
    assert torch.equal(up.outputs[0], F.linear(*up.args, **up.kwargs))


def test_api_names():
    assert api_name(torch.add) == "torch.add"
    assert api_name(torch.Tensor.add) == "Tensor.add"
    assert api_name(F.gelu) == "torch.nn.functional.gelu"
    assert api_name(F.dropout) == "torch.nn.functional.dropout"


def test_a_clean_bf16_model_has_no_error():
    model, tokens = make()
    _, captured = step(model, tokens, capture=True)
    statuses = [j.status for call in captured.calls for j in judge_call(call)]
    assert len(statuses) == 12  # embedding, 2 x (layer_norm, linear, gelu, linear, add), head
    assert Status.ERROR not in statuses


@pytest.fixture
def faulty_bf16_gelu():
    """aten::gelu's CPU kernel replaced in this process: bf16 inputs get 1/1.4 for 1/sqrt(2) (a truncated
    constant), other dtypes the exact formula."""
    library = torch.library.Library("aten", "IMPL")

    def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
        scale = 1 / 1.4 if x.dtype == torch.bfloat16 else 1 / math.sqrt(2)
        wide = x.to(torch.float64)
        return (0.5 * wide * (1 + torch.erf(wide * scale))).to(x.dtype)

    library.impl("gelu", gelu, "CPU")
    yield
    library._destroy()


def test_a_faulty_kernel_in_the_training_process_is_found_at_its_call(faulty_bf16_gelu):
    model, tokens = make()
    _, captured = step(model, tokens, capture=True)
    errors = {
        (j.name, j.module) for call in captured.calls for j in judge_call(call) if j.status is Status.ERROR
    }
    assert errors == {
        ("torch.nn.functional.gelu.0.forward", "blocks.0"),
        ("torch.nn.functional.gelu.1.forward", "blocks.1"),
    }
