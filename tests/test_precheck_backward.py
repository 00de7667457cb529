"""The backward pass's operators captured at the aten level and judged (issue 52, point 1's backward): the
gradients are those without the capture, and a faulty bf16 ``aten::gelu_backward`` kernel planted in the
process is found at its calls and adds no other error."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tests.test_precheck_capture import make
from trainmon.precheck.capture import BackwardCapture
from trainmon.precheck.judge import Status
from trainmon.precheck.rerun import judge_call


def backward(model, tokens, capture: bool):
    logits = model(tokens[:, :-1])
    # scaled so that the gradients pass the first pass's absolute cut (max abs error < 0.001 passes at once:
    # msprobe's first pass cannot judge gradients that small, the benchmark method's ratios can)
    loss = 1000 * F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    if not capture:
        loss.backward()
        return None
    with BackwardCapture() as captured:
        loss.backward()
    return captured


LAYER_NORM = {f"aten.native_layer_norm_backward.default.{i}.backward" for i in (0, 1)}


def errors(captured) -> set[str]:
    return {j.name for call in captured.calls for j in judge_call(call) if j.status is Status.ERROR}


def test_gradients_unchanged_and_a_clean_model_has_no_error():
    model, tokens = make()
    model.eval()  # no dropout: the same numbers twice
    backward(model, tokens, capture=False)
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    captured = backward(model, tokens, capture=True)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
    names = {c.name for c in captured.calls}
    assert {"aten.gelu_backward.default.0.backward", "aten.mm.default.0.backward"} <= names
    # the first pass flags bf16 layer norm backward on this clean model (its weight gradient sums in bf16):
    # open in issue 52 (the benchmark method's ratios against a second device are what judge such kernels)
    assert errors(captured) <= LAYER_NORM


@pytest.fixture
def faulty_bf16_gelu_backward():
    library = torch.library.Library("aten", "IMPL")

    def gelu_backward(grad: torch.Tensor, x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
        wide, g = x.double(), grad.double()
        cdf = 0.5 * (1 + torch.erf(wide / math.sqrt(2)))
        pdf = torch.exp(-0.5 * wide * wide) / math.sqrt(2 * math.pi)
        factor = 1.2 if x.dtype == torch.bfloat16 else 1.0  # the planted fault
        return (g * (cdf + wide * pdf) * factor).to(x.dtype)

    library.impl("gelu_backward", gelu_backward, "CPU")
    yield
    library._destroy()


def test_a_faulty_backward_kernel_is_found_at_its_calls(faulty_bf16_gelu_backward):
    model, tokens = make()
    model.eval()
    captured = backward(model, tokens, capture=True)
    gelu = {"aten.gelu_backward.default.0.backward", "aten.gelu_backward.default.1.backward"}
    assert errors(captured) - LAYER_NORM == gelu
