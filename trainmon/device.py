"""Device specifics in one place: nothing else in trainmon touches torch.cuda / torch.npu directly."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch


def current_rank() -> int:
    """Global rank of this process (0 when not distributed)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def collective_counter() -> Callable[[], int]:
    """A cheap counter of the collectives this process has issued on the default process group (the group's
    sequence number, which also counts DDP's internal all-reduces); a constant 0 when not distributed."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        group = torch.distributed.distributed_c10d._get_default_group()
        counter = getattr(group, "_get_sequence_number_for_group", None)
        if counter is not None:
            return counter
    return no_collectives


def no_collectives() -> int:
    return 0


def copy_to_host(t: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None] | None]:
    """Start the one device-to-host copy of a step's statistics.

    Returns the host tensor and, on accelerators, a callable that blocks until the copy has landed.
    The training thread never calls it; the writer thread does, so the next step is not stalled.
    """
    if t.device.type == "cpu":
        return t.to("cpu", copy=True), None
    backend = getattr(torch, t.device.type, None)  # torch.cuda, torch.npu (after import torch_npu), ...
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    event_cls = getattr(backend, "Event", None)
    if event_cls is None:  # a backend without events: fall back to a synchronous copy
        return t.to("cpu"), None
    event = event_cls()
    event.record()
    return host, event.synchronize


def in_backward_pass() -> bool:
    """True while the autograd engine is running a backward pass on this thread.

    A forward hook firing then is activation recomputation (checkpointing), not a new micro-batch.
    """
    graph_task_id = getattr(torch._C, "_current_graph_task_id", None)
    return graph_task_id is not None and graph_task_id() != -1
