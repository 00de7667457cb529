"""The benchmark of a captured call: the same API re-run on the CPU with its floating-point inputs upcast
(fp16/bf16 -> fp32, fp32 -> fp64), and each output the training produced judged against it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from trainmon.precheck.capture import CapturedCall
from trainmon.precheck.judge import Status, first_pass

_UP = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.float32: torch.float64}


def resolve(api: str) -> Any:
    """The function an API name stands for, looked up in torch by name (not the object the training
    called: a kernel or function replaced there is not replaced here)."""
    if api.startswith("aten."):  # a backward operator: aten.<op>.<overload>
        _, packet, overload = api.split(".")
        return getattr(getattr(torch.ops.aten, packet), overload)
    owner, _, name = api.rpartition(".")
    if owner == "Tensor":
        return getattr(torch.Tensor, name)
    if owner == "torch.nn.functional":
        return getattr(F, name)
    if owner == "torch":
        return getattr(torch, name)
    raise LookupError(f"no benchmark for {api}")


def _upcast(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        up = _UP.get(value.dtype, value.dtype)
        return value.detach().to("cpu", up)
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_upcast(v) for v in value)
    if isinstance(value, dict):
        return {k: _upcast(v) for k, v in value.items()}
    if isinstance(value, torch.dtype):
        return _UP.get(value, value)
    return value


@dataclass(frozen=True)
class Judged:
    name: str
    module: str
    output: int
    dtype: torch.dtype
    status: Status


def judge_call(call: CapturedCall) -> list[Judged]:
    """The first-pass status of each floating-point output of ``call`` against its upcast re-run."""
    with torch.no_grad():
        golden = resolve(call.api)(*_upcast(call.args), **_upcast(call.kwargs))
    golden = golden if isinstance(golden, (tuple, list)) else (golden,)
    golden = [g for g in golden if isinstance(g, torch.Tensor)]
    judged = []
    for i, (out, ref) in enumerate(zip(call.outputs, golden, strict=False)):
        if out.dtype.is_floating_point:
            judged.append(Judged(call.name, call.module, i, out.dtype, first_pass(out, ref, out.dtype)))
    return judged
