"""Device specifics in one place: nothing else in trainmon touches torch.cuda / torch.npu directly."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

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


def is_dtensor(t: Any) -> bool:
    """A DTensor (FSDP2's parameters, tensor parallelism's weights), found without importing
    torch.distributed where it is not loaded."""
    if not isinstance(t, torch.Tensor) or type(t) in (torch.Tensor, torch.nn.Parameter):
        return False
    try:
        from torch.distributed.tensor import DTensor
    except Exception:  # a torch without distributed support
        return False
    return isinstance(t, DTensor)


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


def collective_device() -> torch.device:
    """Where the default process group's collectives take tensors: the current accelerator for NCCL and
    HCCL, the CPU for gloo."""
    import torch.distributed as dist

    backend = str(dist.get_backend()).lower()
    for name, device_type in (("nccl", "cuda"), ("hccl", "npu")):
        module = backend_for(device_type)
        if backend == name and module is not None:
            return torch.device(device_type, module.current_device())
    return torch.device("cpu")


def backend_for(device_type: str) -> Any | None:
    """The torch device module that owns ``device_type`` tensors: ``torch.cuda`` for ``cuda``, ``torch.npu``
    for ``npu`` (present once the job itself imported torch_npu), None when torch has none.

    The one place a device type becomes a backend: an ``npu`` tensor never reaches ``torch.cuda``, and
    nothing here imports torch_npu (a job with npu tensors has imported it already)."""
    if device_type == "cpu":
        return None
    return getattr(torch, device_type, None)


def device_memory(device: torch.device) -> int | None:
    """Total memory of an accelerator in bytes (a host-side property query, no synchronisation), or None for
    the CPU and devices whose backend does not say."""
    backend = backend_for(device.type)
    properties = getattr(backend, "get_device_properties", None)
    if properties is None:
        return None
    try:
        index = device.index if device.index is not None else backend.current_device()
        total = getattr(properties(index), "total_memory", None)
    except Exception:  # noqa: BLE001 - a backend that cannot say: the caller's default applies
        return None
    return int(total) if total else None


def copy_to_host(t: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None] | None]:
    """Start the one device-to-host copy of a step's statistics.

    Returns the host tensor and, on accelerators, a callable that blocks until the copy has landed.
    The training thread never calls it; the writer thread does, so the next step is not stalled.
    """
    if t.device.type == "cpu":
        return t.to("cpu", copy=True), None
    return start_host_copy(t, backend_for(t.device.type))


def start_host_copy(t: torch.Tensor, backend: Any | None) -> tuple[torch.Tensor, Callable[[], None] | None]:
    """Copy ``t`` into pinned host memory without blocking, then record an event of ``backend`` (torch.cuda,
    torch.npu: the same Event/current_stream API) on the stream that issued the copy; the returned
    ``event.synchronize`` is what the writer thread waits on. A backend without events copies synchronously.
    """
    event_cls = getattr(backend, "Event", None)
    if event_cls is None:
        return t.to("cpu"), None
    host = _pinned_empty(t.shape, t.dtype)
    host.copy_(t, non_blocking=True)
    event = event_cls()
    # the copy was queued on t's device's current stream: record there, not on the current device's stream
    event.record(backend.current_stream(t.device))
    return host, event.synchronize


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` (a small CPU table built by the monitor) on ``device`` without synchronising it: staged
    through page-locked memory and copied with ``non_blocking`` (a copy from pageable memory would make the
    host wait for the device). The page-locked block is not reused before the copy has run (torch's caching
    host allocator records the copy's stream). On the CPU, ``host`` itself."""
    if device.type == "cpu":
        return host
    if backend_for(device.type) is None:
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def launch_guard(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Make ``device`` current while a kernel is launched: launchers such as Triton's start kernels on the
    current device, which need not be the tensor's in a process that drives several devices."""
    backend = backend_for(device.type)
    if backend is None or device.index is None or backend.current_device() == device.index:
        return contextlib.nullcontext()
    return backend.device(device.index)


def _pinned_empty(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """Page-locked host memory of the job's accelerator (CUDA, or the NPU that torch_npu registered)."""
    return torch.empty(shape, dtype=dtype, pin_memory=True)


def _no_backward_pass() -> int:
    return -1


# The id of the backward pass the autograd engine is running on this thread (one per ``backward()`` call),
# -1 outside backward: torch's own function where it has one (hooks of every module call ask it), else -1.
backward_pass_id: Callable[[], int] = getattr(torch._C, "_current_graph_task_id", None) or _no_backward_pass


def in_backward_pass() -> bool:
    """True while the autograd engine is running a backward pass on this thread.

    A forward hook firing then is activation recomputation (checkpointing), not a new micro-batch.
    """
    return backward_pass_id() != -1


class EventMarks:
    """Timing events of one accelerator, created once and reused step after step: ``slots`` rows of
    ``points`` events at a step's points and ``collectives`` events around its collectives. An event is
    recorded on the device's current stream; its time is read only once it has completed (``query``), so
    nothing here ever waits for the device."""

    def __init__(self, device: torch.device, backend: Any, slots: int, points: int, collectives: int) -> None:
        self._device = device
        self._backend = backend
        self._points = [[backend.Event(enable_timing=True) for _ in range(points)] for _ in range(slots)]
        self._colls = [[backend.Event(enable_timing=True) for _ in range(collectives)] for _ in range(slots)]

    def record(self, slot: int, i: int) -> None:
        self._points[slot][i].record(self._backend.current_stream(self._device))

    def record_collective(self, slot: int, i: int) -> None:
        self._colls[slot][i].record(self._backend.current_stream(self._device))

    def done(self, slot: int, i: int) -> bool:
        return bool(self._points[slot][i].query())

    def collective_done(self, slot: int, i: int) -> bool:
        return bool(self._colls[slot][i].query())

    def elapsed_s(self, slot: int, i: int, j: int) -> float:
        """Seconds from point ``i`` to point ``j`` of ``slot`` (both completed)."""
        return self._points[slot][i].elapsed_time(self._points[slot][j]) / 1000.0

    def collective_elapsed_s(self, slot: int, i: int, j: int) -> float:
        return self._colls[slot][i].elapsed_time(self._colls[slot][j]) / 1000.0


def timing_events(device: torch.device, slots: int, points: int, collectives: int) -> EventMarks | None:
    """The event pool for timing steps on ``device``'s accelerator (torch.cuda, or torch.npu once torch_npu is
    imported), or None on the CPU and where the backend has no timing events (the host's clock is used)."""
    backend = backend_for(device.type)
    if backend is None or getattr(backend, "Event", None) is None:
        return None
    try:
        if not backend.is_available():
            return None
        return EventMarks(device, backend, slots, points, collectives)
    except Exception:  # no events on this build or device: the host's clock it is
        return None
