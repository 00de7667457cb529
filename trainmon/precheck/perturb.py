"""Perturbation without a reference (``mode: perturb``, msprobe's free benchmark): a captured call re-run on
its own device and dtype with its inputs perturbed, and its output judged consistent or not with the one the
training produced (facts: research note 1.6). For users who have no second device."""

from __future__ import annotations

import math
from enum import Enum
from typing import Any

import torch

from trainmon.precheck.capture import CapturedCall
from trainmon.precheck.rerun import resolve


class Perturbation(str, Enum):
    IMPROVE_PRECISION = "improve_precision"  # fp16/bf16 inputs cast to fp32
    ADD_NOISE = "add_noise"  # c added where |x| > sqrt(c), the first tensor input
    BIT_NOISE = "bit_noise"  # the lowest bit flipped where |x| is normal, the first tensor input
    CHANGE_VALUE = "change_value"  # first and last elements swapped, the first tensor input
    NO_CHANGE = "no_change"  # a plain re-run: is the API deterministic?


# the noise c of add_noise, by dtype; a ratio score is consistent within [1/T, T]
NOISE = {torch.bfloat16: 1e-4, torch.float16: 1e-6, torch.float32: 1e-8, torch.float64: 1e-16}
BOUND = {torch.float16: 1.002, torch.bfloat16: 1.004}
DEFAULT_BOUND = 1.0002
BACKWARD_TOLERANCE = 1e-3
_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _map_first(value: Any, change: Any, done: list[bool]) -> Any:
    """``value`` with its first floating tensor replaced by ``change(tensor)`` (None: left as it is)."""
    if isinstance(value, torch.Tensor):
        if done[0] or not value.dtype.is_floating_point:
            return value
        done[0] = True
        changed = change(value)
        return value if changed is None else changed
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_map_first(v, change, done) for v in value)
    if isinstance(value, dict):
        return {k: _map_first(v, change, done) for k, v in value.items()}
    return value


def _upcast_low(value: Any, seen: list[bool]) -> Any:
    if isinstance(value, torch.Tensor):
        if value.dtype in (torch.float16, torch.bfloat16):
            seen[0] = True
            return value.float()
        return value
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_upcast_low(v, seen) for v in value)
    if isinstance(value, dict):
        return {k: _upcast_low(v, seen) for k, v in value.items()}
    return value


def _add_noise(x: torch.Tensor) -> torch.Tensor | None:
    c = NOISE.get(x.dtype, 1e-8)
    if x.numel() == 0 or float(x.abs().max()) < c:
        return None
    return torch.where(x.abs() > math.sqrt(c), x + c, x)


def _bit_noise(x: torch.Tensor) -> torch.Tensor | None:
    ints = _BITS.get(x.element_size())
    if ints is None or x.numel() == 0:
        return None
    flipped = (x.contiguous().view(ints) ^ 1).view(x.dtype).reshape(x.shape)
    return torch.where(x.abs() > torch.finfo(x.dtype).tiny, flipped, x)


def _change_value(x: torch.Tensor) -> torch.Tensor | None:
    if x.numel() < 2:
        return None
    y = x.clone().reshape(-1)
    y[0], y[-1] = x.reshape(-1)[-1], x.reshape(-1)[0]
    return y.reshape(x.shape)


def perturbed_inputs(call: CapturedCall, how: Perturbation) -> tuple[tuple, dict] | None:
    """The call's inputs perturbed, or None where the perturbation does not apply."""
    if how is Perturbation.NO_CHANGE:
        return call.args, call.kwargs
    if how is Perturbation.IMPROVE_PRECISION:
        seen = [False]
        args, kwargs = _upcast_low(call.args, seen), _upcast_low(call.kwargs, seen)
        return (args, kwargs) if seen[0] else None
    change = {Perturbation.ADD_NOISE: _add_noise, Perturbation.BIT_NOISE: _bit_noise}.get(how, _change_value)
    done = [False]
    args = _map_first(call.args, change, done)
    kwargs = call.kwargs if done[0] else _map_first(call.kwargs, change, done)
    if args is call.args and kwargs is call.kwargs:
        return None
    return args, kwargs


def consistency(
    original: torch.Tensor, perturbed: torch.Tensor, how: Perturbation, backward: bool = False
) -> tuple[bool, float]:
    """(consistent, score): a sign flip beyond the tolerance is inconsistent; else the score is
    max(max r, 1 / min r), r = |original| / |perturbed| with both clamped at the tolerance, and must lie in
    [1/T, T] (T = 1 for a plain re-run)."""
    dtype = original.dtype
    tolerance = BACKWARD_TOLERANCE if backward else math.sqrt(NOISE.get(dtype, 1e-8))
    a, b = original.detach().double().reshape(-1), perturbed.detach().to(original.device).double().reshape(-1)
    if a.numel() == 0:
        return True, 1.0
    if bool((a * b < -(tolerance**2)).any()):
        return False, math.inf
    ratio = a.abs().clamp(min=tolerance) / b.abs().clamp(min=tolerance)
    score = max(float(ratio.max()), 1.0 / float(ratio.min()))
    bound = 1.0 if how is Perturbation.NO_CHANGE else BOUND.get(dtype, DEFAULT_BOUND)
    return 1.0 / bound <= score <= bound, score


def check(call: CapturedCall, how: Perturbation) -> list[tuple[int, bool, float]] | None:
    """Each floating output of ``call`` re-run with ``how``'s perturbation: (output, consistent, score);
    None where the perturbation does not apply to this call."""
    inputs = perturbed_inputs(call, how)
    if inputs is None:
        return None
    with torch.no_grad():
        out = resolve(call.api)(*inputs[0], **inputs[1])
    out = out if isinstance(out, (tuple, list)) else (out,)
    return [
        (i, *consistency(orig, pert, how))
        for i, (orig, pert) in enumerate(zip(call.outputs, out, strict=False))
        if isinstance(pert, torch.Tensor) and orig.dtype.is_floating_point
    ]
