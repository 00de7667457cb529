"""Real tiny training runs for the comparison tests (tests/test_compare.py): one network, trained on the CPU
with the monitor at full coverage, as it is or with one thing changed.

``Net``: fc1 (Linear 8 -> 16), act (GELU), norm (LayerNorm), fc2 (Linear 16 -> 4), MSE loss, Adam. Every
run starts from the same weights and sees the same batches. The variants:

- ``base``: the network as it is;
- ``noise``: the same functions, other rounding: both Linears sum their products in two halves of the inner
  dimension, the LayerNorm takes its mean and variance in another order (what other kernels, thread splits
  or atomics do);
- ``forward``: GELU's tanh approximation in ``act``;
- ``backward``: ``act``'s forward unchanged, its backward (a custom autograd function) the derivative of the
  tanh approximation;
- ``wgrad``: ``fc2``'s weight gradient (a custom autograd function) computed from bfloat16 copies of its
  operands, its input gradient and bias gradient exact: the weight-gradient computation alone;
- ``optimizer``: Adam's beta1 0.8 instead of 0.9;
- ``data``: one sample of the batch of step :data:`DATA_STEP` replaced;
- ``concat``: one rank training on the batches two ranks of ``compare_worker.py`` see, concatenated (the
  same gradients as the two ranks' average: the same training in another data-parallel layout);
- ``wrapped``: the network inside a wrapper (``module.fc1.weight``, as DistributedDataParallel names it);
- ``spelled``: the LayerNorm's parameters named as MindSpore names them (``norm.gamma``, ``norm.beta``);
- ``renamed``: the same layers under other names (``enc``, ``f``, ``ln``, ``head``).

Mixed precision (:data:`PRECISION_VARIANTS`, tests/test_compare_precision.py): ``bf16`` trains the base under
``torch.autocast("cpu", bfloat16)`` (the Linears compute in bfloat16; the data, parameters and Adam's state
stay float32); ``data3``/``bf16_data3`` feed the batch of step :data:`DATA_STEP` 3% too large (in float32 /
under autocast); ``weights30``/``bf16_weights30`` start with ``fc1.weight`` 30% larger.
"""

from __future__ import annotations

import types
from pathlib import Path

import torch
import torch.nn.functional as F
from conftest import FULL_COVERAGE
from torch import nn

import trainmon

STEPS = 4
DATA_STEP = 2
CONFIG = {**FULL_COVERAGE, "format": ["tensorboard"], "tensorboard_ranks": []}
VARIANTS = ("base", "noise", "forward", "backward", "wgrad", "optimizer", "data", "concat", "wrapped",
            "spelled", "renamed")  # fmt: skip
RENAMED = {"fc1": "enc", "act": "f", "norm": "ln", "fc2": "head"}
PRECISION_VARIANTS = ("bf16", "data3", "bf16_data3", "weights30", "bf16_weights30")
DATA_ERROR = 1.03  # the data bug: step DATA_STEP's batch 3% too large
WEIGHTS_ERROR = 1.3  # the initial weights of fc1 30% apart


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.act = nn.GELU()
        self.norm = nn.LayerNorm(16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.norm(self.act(self.fc1(x))))


class _TanhBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return F.gelu(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            leaf = x.detach().requires_grad_()
            (out,) = torch.autograd.grad(F.gelu(leaf, approximate="tanh"), leaf, grad)
        return out


class _Bf16WeightGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        dw = (grad.t().to(torch.bfloat16) @ x.to(torch.bfloat16)).float()
        return grad @ weight, dw, grad.sum(0)


def _split_linear(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    h = self.in_features // 2
    return F.linear(x[..., :h], self.weight[:, :h]) + F.linear(x[..., h:], self.weight[:, h:]) + self.bias


def _reordered_norm(self: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1]
    mean = x.flip(-1).sum(-1, keepdim=True) / d
    var = ((x - mean) ** 2).flip(-1).sum(-1, keepdim=True) / d
    return (x - mean) * torch.rsqrt(var + self.eps) * self.weight + self.bias


class Wrapped(nn.Module):
    def __init__(self, net: Net) -> None:
        super().__init__()
        self.module = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


class LayerNormMs(nn.Module):
    """A LayerNorm whose parameters are named as MindSpore's: ``gamma``, ``beta``."""

    def __init__(self, norm: nn.LayerNorm) -> None:
        super().__init__()
        self.gamma, self.beta, self.eps = norm.weight, norm.bias, norm.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.gamma, self.beta, self.eps)


class Renamed(nn.Module):
    def __init__(self, net: Net) -> None:
        super().__init__()
        self.enc, self.f, self.ln, self.head = net.fc1, net.act, net.norm, net.fc2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln(self.f(self.enc(x))))


def build(variant: str = "base") -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = Net()
    if variant == "noise":
        for linear in (net.fc1, net.fc2):
            linear.forward = types.MethodType(_split_linear, linear)
        net.norm.forward = types.MethodType(_reordered_norm, net.norm)
    elif variant == "forward":
        net.act.approximate = "tanh"
    elif variant == "backward":
        net.act.forward = types.MethodType(lambda self, x: _TanhBackward.apply(x), net.act)
    elif variant == "wgrad":
        fc2 = net.fc2
        fc2.forward = types.MethodType(lambda self, x: _Bf16WeightGrad.apply(x, self.weight, self.bias), fc2)
    elif variant == "spelled":
        net.norm = LayerNormMs(net.norm)
    betas = (0.8, 0.999) if variant == "optimizer" else (0.9, 0.999)
    model: nn.Module = Wrapped(net) if variant == "wrapped" else Renamed(net) if variant == "renamed" else net
    return model, torch.optim.Adam(model.parameters(), lr=1e-2, betas=betas)


def batches(variant: str = "base", steps: int = STEPS, rank: int = 0):
    if variant == "concat":  # what ranks 0 and 1 see, as one batch
        for (x0, y0), (x1, y1) in zip(batches("base", steps, 0), batches("base", steps, 1), strict=True):
            yield torch.cat([x0, x1]), torch.cat([y0, y1])
        return
    data = torch.Generator().manual_seed(1 + rank)
    other = torch.Generator().manual_seed(99)
    for step in range(steps):
        x, y = torch.randn(32, 8, generator=data), torch.randn(32, 4, generator=data)
        if variant == "data" and step == DATA_STEP:
            x[5] = torch.randn(8, generator=other)
        yield x, y


def train(run: Path, variant: str = "base", steps: int = STEPS) -> None:
    """One run of ``variant`` into the run folder ``run``."""
    if variant in PRECISION_VARIANTS:
        return _train_precision(run, variant, steps)
    net, opt = build(variant)
    with trainmon.attach(net, opt, config=CONFIG, logdir=run):
        for x, y in batches(variant, steps):
            opt.zero_grad()
            F.mse_loss(net(x), y).backward()
            opt.step()


def _train_precision(run: Path, variant: str, steps: int) -> None:
    net, opt = build("base")
    if variant.endswith("weights30"):
        with torch.no_grad():
            net.fc1.weight.mul_(WEIGHTS_ERROR)
    low = variant.startswith("bf16")
    with trainmon.attach(net, opt, config=CONFIG, logdir=run):
        for step, (x, y) in enumerate(batches("base", steps)):
            if variant.endswith("data3") and step == DATA_STEP:
                x = x * DATA_ERROR
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=low):
                out = net(x)
            F.mse_loss(out.float(), y).backward()
            opt.step()
