"""Capture of a prechecked step's API calls: every torch function, ``Tensor`` method and ``nn.functional``
call of the forward pass, with copies of its inputs taken before it runs (an in-place call changes them)
and of its outputs, a stable name (``<api>.<call index>.forward``) and the module it ran in. A
``TorchFunctionMode`` and module hooks, installed for the prechecked step only: other steps carry nothing.
Calls made inside a captured call (``nn.functional.dropout`` calling its kernel) are part of it; random
calls are not judged (a benchmark cannot redraw the same numbers) and are named in ``skipped``. The
training's calls run unchanged, on their own arguments: the numerics are those without the capture."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

# calls whose outputs are random draws: named, never judged
RANDOM_APIS = frozenset({
    "dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout", "bernoulli",
    "bernoulli_", "rand", "rand_like", "randn", "randn_like", "randint", "randint_like", "randperm",
    "multinomial", "normal", "normal_", "uniform_", "exponential_", "geometric_", "cauchy_", "log_normal_",
    "random_", "rrelu",
})  # fmt: skip


def api_name(func: Any) -> str:
    """``torch.nn.functional.linear``, ``Tensor.add``, ``torch.add``: the name users know a call by."""
    module = getattr(func, "__module__", None) or ""
    qualname = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
    short = qualname.rsplit(".", 1)[-1]
    if qualname.startswith(("TensorBase.", "_TensorBase.", "Tensor.")):
        return f"Tensor.{short}"
    if module in ("torch._C._nn", "torch.nn.functional"):
        return f"torch.nn.functional.{short}"
    if qualname.startswith("_VariableFunctionsClass.") or module == "torch":
        return f"torch.{short}"
    return f"{module}.{qualname}" if module else qualname


def _copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_copy(v) for v in value) if type(value) in (list, tuple) else value
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    return value


def _tensors(value: Any) -> tuple[torch.Tensor, ...]:
    if isinstance(value, torch.Tensor):
        return (value.detach().clone(),)
    if isinstance(value, (list, tuple)):
        return tuple(t for v in value for t in _tensors(v))
    return ()


@dataclass(frozen=True)
class CapturedCall:
    name: str  # "<api>.<call index>.forward"
    api: str
    module: str  # the innermost module running ("" for the model's own code at the top)
    args: tuple
    kwargs: dict
    outputs: tuple[torch.Tensor, ...]


@dataclass
class StepCapture:
    calls: list[CapturedCall] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)  # api -> calls not judged (random)
    dropped: int = 0  # calls past the byte budget
    held_bytes: int = 0


class _Mode(TorchFunctionMode):
    def __init__(self, capture: StepCapture, modules: list[str], budget_bytes: int) -> None:
        super().__init__()
        self._capture, self._modules, self._budget = capture, modules, budget_bytes
        self._depth = 0
        self._counts: dict[str, int] = {}

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self._depth or _is_accessor(func):  # inside a captured call, or an attribute read (x.shape)
            return func(*args, **kwargs)
        api = api_name(func)
        short = api.rsplit(".", 1)[-1]
        if short in RANDOM_APIS:
            self._capture.skipped[api] = self._capture.skipped.get(api, 0) + 1
            return self._run(func, args, kwargs)
        inputs = (_copy(args), _copy(kwargs))
        out = self._run(func, args, kwargs)
        outputs = _tensors(out)
        size = sum(
            t.numel() * t.element_size() for t in (*_tensors(inputs[0]), *_tensors(inputs[1]), *outputs)
        )
        if not outputs:
            return out
        if self._capture.held_bytes + size > self._budget:
            self._capture.dropped += 1
            return out
        index = self._counts.get(api, 0)
        self._counts[api] = index + 1
        module = self._modules[-1] if self._modules else ""
        self._capture.calls.append(CapturedCall(f"{api}.{index}.forward", api, module, *inputs, outputs))
        self._capture.held_bytes += size
        return out

    def _run(self, func: Any, args: tuple, kwargs: dict) -> Any:
        self._depth += 1
        try:
            return func(*args, **kwargs)
        finally:
            self._depth -= 1


def _is_accessor(func: Any) -> bool:
    return getattr(func, "__name__", "") in ("__get__", "__set__")


class ApiCapture:
    """``with ApiCapture(model) as capture:`` around a prechecked step's forward pass."""

    def __init__(self, model: nn.Module, budget_bytes: int = 1 << 30) -> None:
        self._model, self._budget = model, budget_bytes
        self._modules: list[str] = []
        self._handles: list[Any] = []
        self.capture = StepCapture()

    def __enter__(self) -> StepCapture:
        for name, module in self._model.named_modules():
            if name:
                self._handles.append(module.register_forward_pre_hook(self._enter_module(name)))
                self._handles.append(module.register_forward_hook(self._leave_module))
        self._mode = _Mode(self.capture, self._modules, self._budget)
        self._mode.__enter__()
        return self.capture

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _enter_module(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            self._modules.append(name)

        return hook

    def _leave_module(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._modules:
            self._modules.pop()


class BackwardCapture:
    """``with BackwardCapture() as capture: loss.backward()``: the backward pass's operators at the aten
    level (``aten.<op>.<overload>.<index>.backward``), with copies of their inputs and outputs. Random
    operators are named in ``skipped``; views and the copies autograd makes are left out (no computation)."""

    def __init__(self, budget_bytes: int = 1 << 30) -> None:
        self.capture = StepCapture()
        self._budget = budget_bytes

    def __enter__(self) -> StepCapture:
        from torch.utils._python_dispatch import TorchDispatchMode

        capture, budget, counts = self.capture, self._budget, {}

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(
                self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
            ) -> Any:
                kwargs = kwargs or {}
                packet = func.overloadpacket.__name__
                if func.is_view or packet in _NOT_COMPUTATIONS:
                    return func(*args, **kwargs)
                api = f"aten.{packet}.{func._overloadname}"
                if packet.rstrip("_") in RANDOM_APIS or packet in RANDOM_APIS:
                    capture.skipped[api] = capture.skipped.get(api, 0) + 1
                    return func(*args, **kwargs)
                inputs = (_copy(args), _copy(kwargs))
                out = func(*args, **kwargs)
                outputs = _tensors(out)
                size = sum(t.numel() * t.element_size() for t in (*_tensors(inputs[0]), *outputs))
                if not outputs or capture.held_bytes + size > budget:
                    capture.dropped += bool(outputs)
                    return out
                index = counts.get(api, 0)
                counts[api] = index + 1
                capture.calls.append(CapturedCall(f"{api}.{index}.backward", api, "", *inputs, outputs))
                capture.held_bytes += size
                return out

        self._mode = Mode()
        self._mode.__enter__()
        return self.capture

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)


# aten operators that move or allocate memory rather than compute (autograd's own bookkeeping in backward)
_NOT_COMPUTATIONS = frozenset(
    {
        "detach",
        "copy_",
        "clone",
        "empty_like",
        "zeros_like",
        "ones_like",
        "new_zeros",
        "new_empty",
        "empty",
        "zeros",
        "fill_",
        "_to_copy",
        "lift_fresh",
    }
)
