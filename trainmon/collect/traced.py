"""What the monitor's hooks put into a graph that dynamo traces (``torch.compile``).

A hook traced by dynamo is not run again in Python: its Python side effects would be replayed or break the
graph, and whatever loop state it read (collecting? which micro-step?) would be baked into the graph as a
constant, guarded, and recompiled at every change. So a hook that runs under tracing emits one call of the
custom op ``trainmon::observe(tensor, site, what, key)`` per tensor instead. The op is opaque to the compiler
(its fake implementation returns nothing) and registered as an ordered side effect, so that no pass drops or
reorders it, in the forward graph and in the backward graph alike (AOTAutograd threads effect tokens through
both). An op that mutates a token tensor instead would be dropped from no graph either, but a token used in
backward is saved for it, and the next micro-batch's forward mutating it fails autograd's version check.
Its real implementation runs at run time, in Python, with the real tensor, and hands it to the handler
registered under ``site`` at build time (before any tracing), which reads the loop state then and calls the
eager path (``StepBuffer.add``). Which micro-step runs, or a config edit of what is collected, never
recompiles the graph; whether the step collects activations at all (``COLLECTING``) is the one thing the
graph depends on: an off step runs code with none of the monitor's ops.

Gradients: ``observe_grad(x, ...)`` returns a view of ``x`` through an autograd Function whose backward
emits the op on the gradient (the traced form of a tensor hook, which dynamo cannot trace with side effects).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from trainmon.joblog import job_wide

logger = logging.getLogger("trainmon")

# what a handler gets: (what, key, tensor); ``what`` and ``key`` are the hook's own codes
Handler = Callable[[int, str, torch.Tensor], None]

_HANDLERS: list[Handler | None] = []  # site id -> its handler; None once its collector is gone


def register(handler: Handler) -> int:
    """A site id for ``handler``: an int the traced hook bakes into the graph (registered before tracing,
    so tracing itself has no side effect)."""
    _HANDLERS.append(handler)
    return len(_HANDLERS) - 1


def unregister(site: int) -> None:
    """Compiled code may call a site after its collector is gone (it keeps the hooks it was traced with):
    such calls then do nothing."""
    if 0 <= site < len(_HANDLERS):
        _HANDLERS[site] = None


@torch.library.custom_op("trainmon::observe", mutates_args=())
def observe(tensor: torch.Tensor, site: int, what: int, key: str) -> None:
    """Run time: the handler of ``site`` with the real tensor (its exceptions are the handler's to catch)."""
    handler = _HANDLERS[site] if site < len(_HANDLERS) else None
    if handler is not None:
        handler(what, key, tensor)


@observe.register_fake
def _observe_fake(tensor: torch.Tensor, site: int, what: int, key: str) -> None:
    return None


def _ordered() -> bool:
    """Register the op's side effect (torch's own ``_print`` is registered so); False where torch has no
    such registration: then compiled code may drop the op, and the hooks say so (``ORDERED``)."""
    try:
        from torch._library.effects import EffectType

        torch.library._register_effectful_op("trainmon::observe", EffectType.ORDERED)
        return True
    except Exception:
        job_wide(logger).warning(
            "trainmon: this torch cannot mark trainmon::observe as a side effect; compiled code may leave "
            "out the statistics of activations and activation gradients"
        )
        return False


ORDERED = _ordered()


class _GradSite(torch.autograd.Function):
    """Identity forward (a view: no copy, same values); the backward emits ``observe`` on the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, site: int, what: int, key: str) -> torch.Tensor:
        ctx.site, ctx.what, ctx.key = site, what, key
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        torch.ops.trainmon.observe(grad, ctx.site, ctx.what, ctx.key)
        return grad, None, None, None


try:  # what compiled code cannot hand the op (a DTensor's placements do not survive tracing)
    from torch.distributed.tensor import DTensor as _DTensor
except Exception:  # a torch without distributed support
    _DTensor = None

_PLAIN = (torch.Tensor, nn.Parameter)

# why a row is left out of compiled code (the values of ``UNREAD``)
PLACEMENTS_LOST = "DTensors, whose placements compiled code does not keep"
GRADIENT_LOST = (
    "tensor subclasses (such as tensor parallelism's AsyncCollectiveTensor) entering compiled code, whose "
    "gradient an autograd function in the graph would cut off from the model"
)

# rows that a trace left out: (site, what) -> why (one of the reasons above), said once at a step boundary
UNREAD: dict[tuple[int, int], str] = {}

# Whether some collector takes activations this step. The traced hooks read it, so dynamo guards on its
# value: compiled code keeps two entries, one with the monitor's ops for collected steps and one without
# any for off steps (traced once each, at the first step of each kind), and each step's guards pick one.
COLLECTING = False
_collecting: set[int] = set()


def set_collecting(owner: int, on: bool) -> None:
    """Whether ``owner`` (a collector's id) takes activations in the coming step."""
    global COLLECTING
    if on:
        _collecting.add(owner)
    else:
        _collecting.discard(owner)
    COLLECTING = bool(_collecting)


def traceable(tensor: torch.Tensor, site: int, what: int, grad: bool = False) -> bool:
    """Whether the op may take ``tensor`` (``grad``: its gradient, through :func:`observe_grad`) under
    tracing. A DTensor inside compiled code (tensor parallelism compiled) reaches the op as its local piece
    without its placements, which could only be read as this rank's piece. A gradient is observed on plain
    tensors only: on a tensor subclass that enters the compiled region (tensor parallelism hands a layer's
    output on as an ``AsyncCollectiveTensor``), the autograd function of :func:`observe_grad` leaves the
    region's gradient for it undefined (torch 2.13), which would change the model's gradients. Either is
    left out, and noted in ``UNREAD`` (a side effect dynamo replays)."""
    if _DTensor is not None and isinstance(tensor, _DTensor):
        UNREAD[(site, what)] = PLACEMENTS_LOST
        return False
    if grad and type(tensor) not in _PLAIN:
        UNREAD[(site, what)] = GRADIENT_LOST
        return False
    return True


def emit(tensor: torch.Tensor, site: int, what: int, key: str = "") -> None:
    """The traced form of a hook's work on ``tensor`` (call it only under tracing)."""
    if traceable(tensor, site, what):
        torch.ops.trainmon.observe(tensor, site, what, key)


def observe_grad(x: torch.Tensor, site: int, what: int, key: str = "") -> torch.Tensor:
    """``x`` again, whose gradient goes to ``site`` (only under tracing, on a tensor that requires grad)."""
    return _GradSite.apply(x, site, what, key)


# ------------------------------------------------------------------------------------------- compiled code
def _dynamo_loaded() -> bool:
    return "torch._dynamo" in sys.modules


def compiled_wrappers(modules: Iterable[nn.Module]) -> bool:
    """Whether any of ``modules`` is compiled already: a ``torch.compile(module)`` wrapper
    (``OptimizedModule``) or a module compiled in place (``module.compile()``)."""
    if not _dynamo_loaded():
        return False
    from torch._dynamo.eval_frame import OptimizedModule

    return any(
        isinstance(m, OptimizedModule) or getattr(m, "_compiled_call_impl", None) is not None for m in modules
    )


def candidate_codes(modules: Iterable[nn.Module]) -> list[Any]:
    """The code objects dynamo compiles when these modules are compiled: each class's ``forward`` (what
    ``torch.compile(module)`` and ``module.compile()`` trace, the root's hooks running outside), the generic
    wrapper dynamo uses for torch's own module classes, and ``Module._call_impl``."""
    codes: dict[int, Any] = {}
    for module in modules:
        forward = getattr(type(module), "forward", None)
        code = getattr(forward, "__code__", None)
        if code is not None:
            codes[id(code)] = code
    for fn in (nn.Module._call_impl, nn.Module._wrapped_call_impl, _wrap_inline_code()):
        code = getattr(fn, "__code__", None) if fn is not None else None
        if code is not None:
            codes[id(code)] = code
    return list(codes.values())


def _wrap_inline_code() -> Any:
    try:
        from torch._dynamo.external_utils import wrap_inline

        return wrap_inline(_nothing)
    except Exception:  # another torch: no such wrapper
        return None


def _nothing() -> None:
    return None


def frames_compiled() -> int:
    """A count of what dynamo has compiled in this process (0 where it was never loaded): a cheap look that
    says, by changing, whether compiled code may have appeared since the last one. Frames and graphs both:
    torch 2.13 counts no frame compiled with ``fullgraph=True``, but every graph."""
    if not _dynamo_loaded():
        return 0
    from torch._dynamo.utils import counters

    return counters["frames"]["total"] + counters["stats"]["unique_graphs"]


def cache_entries(codes: Iterable[Any]) -> int:
    """How many compiled entries dynamo holds for ``codes`` (0 where dynamo was never loaded)."""
    if not _dynamo_loaded():
        return 0
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

    return sum(len(_debug_get_cache_entry_list(code)) for code in codes)


def drop_compiled(codes: Iterable[Any]) -> list[str]:
    """Forget dynamo's compiled entries of ``codes`` only (``torch._dynamo.reset()`` would drop every compiled
    function of the process), so their next call traces again and sees the hooks installed since. Returns
    the names of the functions dropped."""
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list, reset_code

    dropped = []
    for code in codes:
        if _debug_get_cache_entry_list(code):
            reset_code(code)
            dropped.append(f"{code.co_name} ({code.co_filename}:{code.co_firstlineno})")
    return dropped
