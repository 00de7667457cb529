"""Framework adapters, chosen by a small registry.

An adapter answers the framework-specific questions (which modules are the model chunks, where a
parameter's gradient and optimizer state live, how to hook the optimizer step); the core (stats,
buffer, writers) knows nothing about frameworks. Later adapters register themselves here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

logger = logging.getLogger("trainmon")


@dataclass(frozen=True)
class Shard:
    """This rank's piece of a tensor that is split over the ranks of ``group``.

    The pieces of the ranks of ``group`` are disjoint and together make the whole tensor (padding trimmed,
    tensor-parallel duplicates given as empty pieces), so statistics merged over ``group`` are those of the
    whole tensor. Every rank of ``group`` must give a piece (empty when it holds nothing) for the same
    tensors in the same order: the merge is a collective. ``group`` None is the default process group.
    """

    local: torch.Tensor
    group: Any = None
    shape: tuple[int, ...] | None = None  # the whole tensor's shape, for the records (None: local's)
    # this rank has no such tensor this step (a gradient that is None here, Adam state not made yet): it
    # gives no row, but keeps its place in the merge, so that the ranks' merges line up whatever each holds
    absent: bool = False


# What adapters return for a tensor: the whole tensor, or this rank's shard of it.
Piece = torch.Tensor | Shard


class OptimizerAdapter(Protocol):
    """What the monitor asks of a framework's optimizer. Every member is used; none is probed for."""

    # Pieces are Shards merged over ranks: every rank must then take part in each collected step.
    sharded: bool
    # ``register_step_hooks`` can keep a step's update from landing (``alert.on_nan: skip``) ...
    skips_steps: bool
    # ... and when it cannot, why not (the monitor's warning says so); "" when it can.
    skip_unsupported: str

    @property
    def name(self) -> str:
        """The optimizer's name in messages (its class name)."""

    def hooked_objects(self) -> list[Any]:
        """The objects whose ``step`` the adapter hooks (the optimizer, a DeepSpeed engine): a second
        monitor attached to any of them replaces the first."""

    def step_skipped(self) -> bool:
        """After a step: the framework itself skipped its update (a loss-scale overflow), as it would
        without the monitor. Such a step is reported as a loss-scale skip, not as a NaN alarm."""

    def params(self) -> list[torch.Tensor]:
        """Parameters the optimizer updates (model parameters, in a stable order)."""

    def grad(self, param: torch.Tensor) -> Piece | None:
        """The gradient the optimizer is about to apply to ``param`` (reduced over data parallelism)."""

    def value(self, param: torch.Tensor) -> Piece:
        """The parameter's value (the parameter itself unless the framework partitions it)."""

    def moments(self, param: torch.Tensor) -> tuple[Piece, Piece] | None:
        """Adam-style (exp_avg, exp_avg_sq) of ``param``, or None when the optimizer keeps none."""

    def adam_bias_corrections(self, param: torch.Tensor) -> tuple[float, float, float] | None:
        """(1 - beta1**t, 1 - beta2**t, eps) for ``param``'s update; None outside the Adam family."""

    def register_step_hooks(self, pre: Callable[[], bool], post: Callable[[], None]) -> list[Any]:
        """Call ``pre`` before and ``post`` after every optimizer step; returns removable handles.

        When ``pre`` returns True the step's update must not land (``alert.on_nan: skip``): the adapter
        skips it the way its framework skips an fp16-overflow step, leaves parameters and optimizer state
        bitwise as they were, and still calls ``post``. Adapters that can do this set ``skips_steps``."""


@dataclass(frozen=True)
class Resolved:
    """What ``attach`` needs from a framework: the model chunks, the optimizer adapter, and what the
    framework knows better than the caller (None: take the caller's argument)."""

    chunks: tuple[nn.Module, ...]
    optimizer: OptimizerAdapter | None
    grad_acc_steps: int | None = None
    start_iteration: int | None = None
    pp_stage: int = 0  # this rank's pipeline stage (Megatron), recorded with its anomalies


_Matcher = Callable[[Any, Any], bool]
_Resolver = Callable[[Any, Any], Resolved]
_FRAMEWORKS: list[tuple[str, _Matcher, _Resolver]] = []


def register_framework(name: str, matches: _Matcher) -> Callable[[_Resolver], _Resolver]:
    """Register a resolver for objects ``attach`` may receive (a DeepSpeed engine, Megatron chunks...)."""

    def decorate(resolver: _Resolver) -> _Resolver:
        _FRAMEWORKS.insert(0, (name, matches, resolver))  # later registrations are more specific
        return resolver

    return decorate


# Adapter modules of frameworks; they register themselves when imported, and import their framework only
# when it is already in use (importing trainmon never imports DeepSpeed, Megatron or torchtitan).
_ADAPTER_MODULES = (
    "trainmon.adapters.deepspeed",
    "trainmon.adapters.megatron",
    "trainmon.adapters.torchtitan",
)


def _load_adapters() -> None:
    import importlib
    import importlib.util

    for module in _ADAPTER_MODULES:
        if importlib.util.find_spec(module) is not None:
            importlib.import_module(module)


def resolve(model: Any, optimizer: Any) -> Resolved:
    _load_adapters()
    for _name, matches, resolver in _FRAMEWORKS:
        if matches(model, optimizer):
            return resolver(model, optimizer)
    raise TypeError(
        f"trainmon.attach: cannot monitor {type(model).__name__}; pass an nn.Module or a list of chunks"
    )


def _chunks_of(model: Any) -> Sequence[Any]:
    return list(model) if isinstance(model, (list, tuple, nn.ModuleList)) else [model]


def _is_torch(model: Any, optimizer: Any) -> bool:
    from trainmon.adapters.torch_optim import inner_optimizer

    return all(isinstance(chunk, nn.Module) for chunk in _chunks_of(model)) and (
        optimizer is None or isinstance(inner_optimizer(optimizer), torch.optim.Optimizer)
    )


@register_framework("torch", _is_torch)
def _resolve_torch(model: Any, optimizer: Any) -> Resolved:
    from trainmon.adapters.torch_optim import TorchOptimizerAdapter, inner_optimizer

    chunks = tuple(_chunks_of(model))
    if not chunks:
        raise ValueError("trainmon.attach: the list of model chunks is empty")
    if optimizer is None:
        return Resolved(chunks, None)
    inner = inner_optimizer(optimizer)
    if inner is not optimizer:
        logger.info("trainmon: watching %s inside %s", type(inner).__name__, type(optimizer).__name__)
    return Resolved(chunks, TorchOptimizerAdapter(inner))
