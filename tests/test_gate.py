"""The gate (trainmon/step/gate.py) through the real hooks: every kind of tensor that is not a plain dense
strided tensor (tensors under tracing, a float8-style wrapper subclass, nested, sparse, meta, quantized) is
skipped with one warning naming the row and the type, the plain rows around it are still recorded, and
training goes on. A DTensor is read exactly (tests/test_dtensor.py)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_map

import trainmon
from trainmon.step.gate import GATE, is_plain

CONFIG = {"xy_distribution": True, "wg_distribution": True, "format": ["api"]}


class ScaledFloat8(torch.Tensor):
    """A float8 training tensor in the way torchao's are built: a wrapper subclass (no storage of its own)
    holding float8 data and a scale, which computes in the scaled-up precision."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=torch.float32, device=data.device)

    def __init__(self, data: torch.Tensor, scale: torch.Tensor) -> None:
        self._data, self._scale = data, scale

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def plain(t):
            return t._data.to(torch.float32) * t._scale if isinstance(t, ScaledFloat8) else t

        return func(*tree_map(plain, args), **tree_map(plain, kwargs or {}))

    @staticmethod
    def of(x: torch.Tensor) -> ScaledFloat8:
        scale = x.detach().abs().max() / 448
        return ScaledFloat8((x.detach() / scale).to(torch.float8_e4m3fn), scale)


KINDS = {
    "float8": (ScaledFloat8.of, "ScaledFloat8"),
    "nested": (lambda x: torch.nested.nested_tensor([x[0], x[1, :2]], layout=torch.jagged), "NestedTensor"),
    "sparse": (lambda x: x.detach().to_sparse(), "layout torch.sparse_coo"),
    "meta": (lambda x: torch.empty(x.shape, device="meta"), "meta device"),
    "quantized": (lambda x: torch.quantize_per_tensor(x.detach(), 0.1, 0, torch.qint8), "quantized"),
}


class Odd(nn.Module):
    """Returns its input and, beside it, the tensor of kind ``kind`` made from it."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.make = KINDS[kind][0]

    def forward(self, x: torch.Tensor):
        return x, self.make(x)


class Net(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.odd = Odd(kind)
        self.out = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.odd(self.fc(x))
        return self.out(y).sum()


def warnings_about(caplog, text: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if "cannot read exactly" in r.getMessage() and text in r.getMessage()
    ]


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_each_kind_of_tensor_is_skipped_with_one_warning_naming_it(kind, caplog, tmp_path):
    torch.manual_seed(0)
    model = Net(kind)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = trainmon.attach(model, optimizer, config=CONFIG, logdir=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        for _ in range(3):
            loss = model(torch.randn(2, 4))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    latest = monitor.latest()
    monitor.close()
    said = warnings_about(caplog, "'odd.output_1'")
    assert len(said) == 1, said  # once over three steps
    assert KINDS[kind][1] in said[0]
    assert "actv/odd.output_1" not in latest  # nothing recorded of it...
    for key in ("actv/fc.output", "actv/odd.output_0", "actv/out.output", "grad_unreduced/fc.weight"):
        assert key in latest  # ... and everything around it is
    assert latest["actv/odd.output_0"]["norm"] == pytest.approx(latest["actv/fc.output"]["norm"])


def test_sparse_gradients_are_skipped_with_one_warning(caplog, tmp_path):
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = trainmon.attach(model, optimizer, config=CONFIG, logdir=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        for _ in range(2):
            model(torch.tensor([1, 2, 3])).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    latest = monitor.latest()
    monitor.close()
    assert len(warnings_about(caplog, "'0.weight'")) == 2  # grad_unreduced and grad_reduced, once each
    assert "grad_reduced/0.weight" not in latest and "grad_reduced/1.weight" in latest


def test_tensors_under_tracing_are_skipped_with_one_warning(caplog, tmp_path):
    """FakeTensor (a model run under FakeTensorMode) and torch.func.functionalize's wrappers (plain tensors
    to Python, without memory) reach the real forward hooks; neither is read."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = trainmon.attach(model, optimizer, config=CONFIG, logdir=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        with FakeTensorMode(allow_non_fake_inputs=True):
            model(torch.randn(2, 4))
        torch.func.functionalize(model)(torch.randn(2, 4))
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
    latest = monitor.latest()
    monitor.close()
    fake = warnings_about(caplog, "FakeTensor")
    functional = warnings_about(caplog, "functionalization")
    assert fake and functional and all("docs/compile.md" in m for m in fake + functional)
    assert len({m for m in fake}) == len(fake)  # one per row
    assert latest["actv/1.output"]["norm"] > 0  # the real pass is recorded


def test_is_plain_says_which_tensors_a_kernel_may_read():
    x = torch.randn(3, 4)
    assert is_plain(x) and is_plain(nn.Parameter(x)) and is_plain(x.t())
    for kind, (make, _) in KINDS.items():
        assert not is_plain(make(x)), kind
    assert GATE.piece(x, "x") is x
