"""Perturbation without a reference (issue 52, point 6): the perturbations, the consistency score with its
thresholds, and on the bf16 model of test_precheck_capture: a plain re-run and improve_precision find
nothing on the clean model and find the planted GELU fault at its calls."""

from __future__ import annotations

import math

import pytest
import torch

from tests.test_precheck_capture import faulty_bf16_gelu, make, step  # noqa: F401 - the fixture
from trainmon.precheck.capture import CapturedCall
from trainmon.precheck.perturb import Perturbation, check, consistency, perturbed_inputs


def call_of(*args: torch.Tensor) -> CapturedCall:
    return CapturedCall("torch.add.0.forward", "torch.add", "", args, {}, (torch.add(*args),))


def test_perturbations():
    x, y = torch.tensor([1.0, 0.0, -2.0]), torch.tensor([3.0, 4.0, 5.0])
    (bits, other), _ = perturbed_inputs(call_of(x, y), Perturbation.BIT_NOISE)
    assert bits.tolist() == [1.0000001192092896, 0.0, -2.000000238418579] and other is y  # first input only
    (swapped, _), _ = perturbed_inputs(call_of(x, y), Perturbation.CHANGE_VALUE)
    assert swapped.tolist() == [-2.0, 0.0, 1.0]
    (noisy, _), _ = perturbed_inputs(call_of(x.double(), y.double()), Perturbation.ADD_NOISE)
    assert noisy.tolist() == [1.0 + 1e-16, 0.0, -2.0 + 1e-16]  # where |x| > sqrt(1e-16)
    assert perturbed_inputs(call_of(x, y), Perturbation.IMPROVE_PRECISION) is None  # nothing below fp32
    (up, _), _ = perturbed_inputs(call_of(x.bfloat16(), y.bfloat16()), Perturbation.IMPROVE_PRECISION)
    assert up.dtype == torch.float32


def test_consistency_score_and_bounds():
    a = torch.tensor([1.0, 2.0, 1e-5], dtype=torch.bfloat16)
    assert consistency(a, a, Perturbation.ADD_NOISE) == (True, 1.0)
    assert consistency(a, -a, Perturbation.ADD_NOISE) == (False, math.inf)  # a sign flip
    ok, score = consistency(a, a.double() * 1.003, Perturbation.IMPROVE_PRECISION)
    assert ok and score == pytest.approx(1.003, rel=1e-3)
    assert not consistency(a, a.double() * 1.01, Perturbation.IMPROVE_PRECISION)[0]  # bf16 bound 1.004
    assert not consistency(a, a.double() * 1.001, Perturbation.NO_CHANGE)[0]  # a re-run must be equal
    assert not consistency(a.float(), a.double() * 1.001, Perturbation.ADD_NOISE)[0]  # fp32 bound 1.0002


def inconsistent(captured, how: Perturbation) -> set[str]:
    found = set()
    for call in captured.calls:
        for _, ok, _ in check(call, how) or ():
            if not ok:
                found.add(call.name)
    return found


def test_a_clean_model_is_consistent():
    model, tokens = make()
    _, captured = step(model, tokens, capture=True)
    assert inconsistent(captured, Perturbation.NO_CHANGE) == set()
    assert inconsistent(captured, Perturbation.IMPROVE_PRECISION) == set()


def test_improve_precision_finds_the_faulty_kernel(faulty_bf16_gelu):  # noqa: F811
    model, tokens = make()
    _, captured = step(model, tokens, capture=True)
    assert inconsistent(captured, Perturbation.IMPROVE_PRECISION) == {
        "torch.nn.functional.gelu.0.forward",
        "torch.nn.functional.gelu.1.forward",
    }
