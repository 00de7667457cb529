"""Test-only shim that lets megatron-core 0.16.1 train on a machine without CUDA.

megatron-core hard-codes ``device="cuda"`` / ``torch.cuda.current_device()`` in a handful of places (DDP
buffers, optimizer scalars, CUDA streams, the recompute RNG state, ``param.type()`` checks). On a GPU none of
this is needed; here it maps those calls to the CPU so the real GPTModel, mcore DDP and the real Megatron
optimizers run on gloo. It is never imported by trainmon itself.

Usage (before building any Megatron object)::

    from megatron_cpu_shim import install
    install()

Self-contained on purpose: other tests import it too.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_INSTALLED: list[Any] = []


def _to_cpu(device: Any) -> Any:
    """``cuda``, ``cuda:N``, an int index or a cuda ``torch.device`` become the CPU; others are kept."""
    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class _CudaToCpu(TorchFunctionMode):
    """Rewrites device arguments to the CPU, makes ``Tensor.cuda()`` the identity and makes ``Tensor.type()``
    answer ``torch.cuda.*Tensor`` (Megatron's optimizers check the type string of CUDA parameters)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
        if "device" in kwargs:
            kwargs["device"] = _to_cpu(kwargs["device"])
        if func is torch.Tensor.to:
            args = tuple(_to_cpu(a) for a in args)
        return func(*args, **kwargs)


class _FakeStream:
    """Stands for a CUDA stream/event: on the CPU every op is already ordered."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, *args: Any) -> None:
        pass

    def wait_event(self, *args: Any) -> None:
        pass

    def record_event(self, *args: Any) -> _FakeStream:
        return self

    def record(self, *args: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


def install() -> None:
    """Apply the shim to this process (idempotent). Call before megatron-core builds a model."""
    if _INSTALLED:
        return
    cuda = torch.cuda
    cuda.current_device = lambda: "cpu"  # buffers allocated with device=current_device() land on the CPU
    cuda.current_stream = lambda *a, **k: _FakeStream()
    cuda.default_stream = lambda *a, **k: _FakeStream()
    cuda.Stream = _FakeStream  # type: ignore[misc]
    cuda.Event = _FakeStream  # type: ignore[misc]
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.synchronize = lambda *a, **k: None
    cuda.empty_cache = lambda: None

    from megatron.core.tensor_parallel import random as mcore_random

    # activation recompute saves and restores the CUDA RNG state around the recomputed forward
    mcore_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mcore_random._set_cuda_rng_state = lambda *a, **k: None

    mode = _CudaToCpu()
    mode.__enter__()  # stays active for the life of the process (this thread: the training thread)
    _INSTALLED.append(mode)


def seed(value: int) -> None:
    """Megatron's model-parallel seeding without CUDA RNG states (a no-op RNG tracker) plus torch's seed."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(value)
    model_parallel_cuda_manual_seed(value, inference_rng_tracker=True)


def causal_mask(seq_len: int) -> torch.Tensor:
    """Megatron's default causal mask is built on "cuda"; pass this one instead (True = masked)."""
    return torch.triu(torch.ones(1, 1, seq_len, seq_len, dtype=torch.bool), diagonal=1)
