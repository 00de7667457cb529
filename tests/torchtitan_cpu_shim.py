"""Test-only shim that lets torchtitan 0.3.0's own Trainer train on a machine without CUDA (gloo ranks).

torchtitan 0.3.0 as released assumes an accelerator, a PyTorch nightly and FlexAttention. Each patch below
changes one thing, at run time, in this process only; none is in trainmon, and nothing of torchtitan's is
copied. What each does and why:

- ``cpu_device``: torchtitan picks its device with ``torch._utils._get_available_device_type() or "cuda"``
  at import, so a CPU-only torch makes it ``cuda`` and ``torch.cuda.set_device`` fails. The shim sets the
  device type to ``cpu`` (whose default process-group backend is gloo) and gives the modules that copied
  the device module at import a stand-in: ``torch.cpu`` plus the memory-statistics functions torchtitan's
  memory monitor calls (``get_device_name``, ``memory_stats``, ...), which ``torch.cpu`` lacks, and an
  integer ``current_device()`` (torchtitan passes it to ``barrier(device_ids=[...])``, which takes ints;
  ``torch.cpu.current_device()`` is the string ``"cpu"``).
- ``sdpa_attention``: every llama3 flavour is built with FlexAttention, and torch refuses FlexAttention's
  backward on CPU tensors (``NotImplementedError: FlexAttention does not support backward on CPU``). The
  shim gives each layer torchtitan's own ``ScaledDotProductAttention`` (causal) instead: a token's attention
  then crosses document boundaries inside a packed sequence (block-causal becomes causal), which changes
  the numbers, not the model's modules or parameters.
- ``sum_reduction_on_gloo``: torchtitan sets FSDP2's gradient divide factor to 1.0 (it scales the loss by
  the global token count itself), which makes FSDP2 reduce-scatter with ``ReduceOp.PREMUL_SUM``; gloo has
  no such op. The shim also calls ``set_force_sum_reduction_for_comms(True)``: a plain SUM, the same
  gradients.
- ``pg_timeouts``: after the first step torchtitan calls ``torch.distributed.set_timeout``, which exists
  from PyTorch nightlies after 2.13 only; the shim supplies it with 2.13's private ``_set_pg_timeout``.
  Not a CPU matter: any 2.13 install needs it.

Usage, before building the Trainer::

    import torchtitan_cpu_shim
    torchtitan_cpu_shim.install()
    config = torchtitan_cpu_shim.sdpa_attention(config)
"""

from __future__ import annotations

import importlib
import os
import types
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

_INSTALLED: list[str] = []

# the modules of torchtitan 0.3.0 that bind ``device_type`` / ``device_module`` by name at import
_DEVICE_USERS = (
    "torchtitan.tools.utils",
    "torchtitan.components.metrics",
    "torchtitan.distributed.parallel_dims",
    "torchtitan.distributed.utils",
    "torchtitan.tools.profiler",
    "torchtitan.models.common.token_dispatcher",
)


class _CpuDeviceModule(types.ModuleType):
    """``torch.cpu`` with the memory-statistics functions torchtitan's memory monitor calls: the CPU has no
    caching allocator, so every statistic reads as absent (torchtitan logs -1 for those)."""

    def __init__(self) -> None:
        super().__init__("torchtitan_cpu_shim.cpu")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    @staticmethod
    def current_device() -> int:
        # an index, as torch.cuda's: torchtitan passes it to barrier(device_ids=[...]), which takes ints
        # (torch.cpu.current_device() is the string "cpu")
        return 0

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        return "cpu"

    @staticmethod
    def get_device_properties(device: Any = None) -> types.SimpleNamespace:
        return types.SimpleNamespace(total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))

    @staticmethod
    def memory_stats(device: Any = None) -> dict[str, int]:
        return {}

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None


def cpu_device() -> None:
    """torchtitan's device becomes the CPU (process groups on gloo)."""
    stand_in = _CpuDeviceModule()
    for name in _DEVICE_USERS:
        module = importlib.import_module(name)
        if hasattr(module, "device_type"):
            module.device_type = "cpu"
        if hasattr(module, "device_module"):
            module.device_module = stand_in


def sum_reduction_on_gloo() -> None:
    """FSDP2 reduce-scatters with SUM where torchtitan disables its gradient division (no PREMUL_SUM on
    gloo). Patched where torchtitan's FSDP setup looks the function up (a module global)."""
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.distributed import fsdp as titan_fsdp

    original = titan_fsdp.disable_fsdp_gradient_division

    def disable_division_with_sum(model: torch.nn.Module) -> None:
        original(model)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    titan_fsdp.disable_fsdp_gradient_division = disable_division_with_sum


def pg_timeouts() -> None:
    """``torch.distributed.set_timeout(timeout, group)`` on a torch that only has the private helper."""
    if hasattr(dist, "set_timeout"):
        return
    from torch.distributed.distributed_c10d import _set_pg_timeout

    def set_timeout(timeout: timedelta, group: dist.ProcessGroup | None = None) -> None:
        _set_pg_timeout(timeout, group)

    dist.set_timeout = set_timeout  # type: ignore[attr-defined]


def install() -> None:
    """Apply the process-wide patches (idempotent). Call before building a torchtitan Trainer."""
    if _INSTALLED:
        return
    cpu_device()
    sum_reduction_on_gloo()
    pg_timeouts()
    _INSTALLED.append("installed")


def sdpa_attention(config: Any) -> Any:
    """``config`` (a ``Trainer.Config``) with every layer's inner attention torchtitan's causal
    ``ScaledDotProductAttention`` instead of FlexAttention (no FlexAttention backward on CPU)."""
    from torchtitan.models.common.attention import ScaledDotProductAttention

    for layer in config.model_spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config
