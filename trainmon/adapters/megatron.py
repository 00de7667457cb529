"""Megatron (megatron-core and Megatron-LM): model chunks wrapped in mcore DDP and a Megatron optimizer.

Where things live (megatron-core 0.16):
- gradients: mcore DDP accumulates into ``param.main_grad`` (a view into a contiguous grad buffer) and
  sets ``param.grad`` to None, so ``.grad`` is never the gradient; at ``optimizer.step()`` entry
  ``main_grad`` holds the data-parallel reduced gradient (``finalize_model_grads`` ran), before clipping;
- ``FP32Optimizer``: the base optimizer updates the model parameters themselves;
- ``Float16OptimizerWithFloat16Params``: it updates fp32 copies (``param.main_param``), which are the values
  and the keys of the Adam state;
- ``DistributedOptimizer``: each data-parallel rank owns a range of every parameter's flattened elements
  (``_get_model_param_range_map(p)["param"]``, KeyError when it owns none); after the reduce-scatter only
  that range of ``main_grad`` is reduced, and the base optimizer's state is keyed by the owned shard's main
  parameter. Those ranges are reported as :class:`~trainmon.adapters.Shard` pieces, so statistics are those
  of the whole tensor without gathering it;
- ``ChainedOptimizer``: several of the above (``chained_optimizers``), stepped by one ``step()``.

Tensor parallelism: parameters with ``tensor_model_parallel`` are split over the TP ranks (disjoint pieces);
the others are replicated on every TP rank and given only by TP rank 0 (empty pieces elsewhere). All sharded
rows of a step use one group, so merging them costs the step's two collectives: the TP group with a
non-distributed optimizer (data-parallel replicas are identical and each computes the whole), the
TP x DP (x CP) group with the distributed optimizer.

Nothing here imports megatron at import time: classes are matched by name, and ``megatron.core`` is imported
only once Megatron objects are handed to ``attach``.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from trainmon.adapters import Piece, Resolved, Shard, register_framework

logger = logging.getLogger("trainmon")

# Wrappers whose ``.module`` is the model (mcore DDP, Megatron-FSDP, torch FSDP adapter, Float16Module):
# names are the wrapped model's, so they read "decoder.layers.0..." as in Megatron's own logs.
_WRAPPERS = {
    "DistributedDataParallel",
    "FullyShardedDataParallel",
    "TorchFullyShardedDataParallel",
    "Float16Module",
}
_OPTIMIZERS = {
    "ChainedOptimizer",
    "DistributedOptimizer",
    "FP32Optimizer",
    "Float16OptimizerWithFloat16Params",
}


def _class_names(obj: Any) -> set[str]:
    return {cls.__name__ for cls in type(obj).__mro__}


def _is_megatron_optimizer(optimizer: Any) -> bool:
    names = _class_names(optimizer)
    return bool(names & _OPTIMIZERS) or "MegatronOptimizer" in names


def _chunks_of(model: Any) -> list[Any]:
    return list(model) if isinstance(model, (list, tuple, nn.ModuleList)) else [model]


def _matches(model: Any, optimizer: Any) -> bool:
    """A Megatron optimizer, or model chunks that are mcore DDP wrappers (attach without an optimizer)."""
    if optimizer is not None:
        return _is_megatron_optimizer(optimizer)
    chunks = _chunks_of(model)
    return bool(chunks) and all(
        isinstance(c, nn.Module) and type(c).__name__ in _WRAPPERS and "megatron" in type(c).__module__
        for c in chunks
    )


def unwrap(chunk: nn.Module) -> nn.Module:
    """The model inside mcore DDP / Float16Module wrappers (same parameters, without the "module." prefix)."""
    while type(chunk).__name__ in _WRAPPERS and isinstance(getattr(chunk, "module", None), nn.Module):
        chunk = chunk.module
    return chunk


# ---------------------------------------------------------------------------------------------- groups
@dataclass(frozen=True)
class _Layout:
    """The parallel layout the pieces are cut for."""

    tp_rank: int
    tp_split_group: Any  # group over which TP-split tensors are merged (None: no merge needed)
    tp_size: int
    dist_group: Any  # TP x DP group for the distributed optimizer's ranges (None: not used)
    pp_stage: int


def _layout(distributed: bool) -> _Layout:
    parallel_state = importlib.import_module("megatron.core.parallel_state")
    if not parallel_state.model_parallel_is_initialized():
        return _Layout(0, None, 1, None, 0)
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_group = parallel_state.get_tensor_model_parallel_group() if tp_size > 1 else None
    dist_group = None
    if distributed:
        dist_group = parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
    return _Layout(tp_rank, tp_group, tp_size, dist_group, parallel_state.get_pipeline_model_parallel_rank())


def _is_tp_split(param: torch.Tensor) -> bool:
    return bool(getattr(param, "tensor_model_parallel", False))


def _whole_shape(param: torch.Tensor, tp_size: int) -> tuple[int, ...]:
    """The shape of the whole tensor whose piece ``param`` is: a TP-split parameter holds 1/tp of it along
    Megatron's ``partition_dim`` (the records show the whole tensor, as its merged statistics do)."""
    shape = list(param.shape)
    if _is_tp_split(param) and tp_size > 1 and shape:
        shape[getattr(param, "partition_dim", 0)] *= tp_size
    return tuple(shape)


# ---------------------------------------------------------------------------------------------- optimizers
@dataclass(frozen=True)
class _Slot:
    """Where one model parameter's optimizer-side tensors are."""

    base: torch.optim.Optimizer  # the torch optimizer that updates it (keys of its state)
    main: torch.Tensor | None  # the tensor the base optimizer updates (None: this rank owns no piece)
    owned: tuple[int, int] | None  # DistributedOptimizer: owned [start, end) of the flattened param


def _inner_optimizers(optimizer: Any) -> list[Any]:
    if "ChainedOptimizer" in _class_names(optimizer):
        return list(optimizer.chained_optimizers)
    return [optimizer]


def _slots_of(inner: Any) -> Iterator[tuple[torch.Tensor, _Slot]]:
    names = _class_names(inner)
    base = getattr(inner, "optimizer", None)
    if base is None or getattr(inner, "is_stub_optimizer", False):
        return
    if "DistributedOptimizer" in names:
        main_of: dict[int, torch.Tensor] = {}
        for model_groups, shard_groups in (
            (inner.model_float16_groups, inner.shard_fp32_from_float16_groups),
            (inner.model_fp32_groups, inner.shard_fp32_groups),
        ):
            for model_group, shard_group in zip(model_groups, shard_groups, strict=True):
                for model_param, shard in zip(model_group, shard_group, strict=True):
                    main_of[id(model_param)] = shard
        for buffer in inner.buffers:
            for param in buffer.param_index_map:
                main = main_of.get(id(param))
                owned = None
                if main is not None:
                    found = inner._get_model_param_range_map(param)["param"]
                    owned = (found.start, found.end)
                yield param, _Slot(base, main, owned if owned is not None else (0, 0))
    elif "Float16OptimizerWithFloat16Params" in names:
        for model_group, main_group in zip(inner.float16_groups, inner.fp32_from_float16_groups, strict=True):
            for model_param, main in zip(model_group, main_group, strict=True):
                yield model_param, _Slot(base, main, None)
        for group in inner.fp32_from_fp32_groups:
            for param in group:
                yield param, _Slot(base, param, None)
    else:  # FP32Optimizer and other MegatronOptimizers whose base optimizer holds the model params
        for group in base.param_groups:
            for param in group["params"]:
                yield param, _Slot(base, param, None)


class MegatronOptimizerAdapter:
    """Gradients from ``main_grad``, values and Adam state from the optimizer's main parameters, as pieces."""

    def __init__(self, optimizer: Any, layout: _Layout | None = None) -> None:
        self.optimizer = optimizer
        inners = _inner_optimizers(optimizer)
        self.distributed = any("DistributedOptimizer" in _class_names(o) for o in inners)
        self._layout = layout if layout is not None else _layout(self.distributed)
        self._slots: dict[int, _Slot] = {}
        self._params: list[torch.Tensor] = []
        for inner in inners:
            for param, slot in _slots_of(inner):
                if id(param) not in self._slots:
                    self._slots[id(param)] = slot
                    self._params.append(param)
        self._config = getattr(optimizer, "config", None)
        self._last_result: Any = None
        self._forced_skip = False  # the last step was skipped by alert.on_nan: skip, not by Megatron
        # alert.on_nan: skip (see _StepWrap), except under fp16 dynamic loss scaling: Megatron then skips
        # every step whose gradients hold a NaN/Inf itself and lowers the scale; taking those steps from it
        # would keep the scale from coming down, and its warm-up overflows would use up max_skips
        self.skips_steps = not any(_dynamic_loss_scale(o) for o in inners)
        self.skip_unsupported = (
            ""
            if self.skips_steps
            else "under fp16 dynamic loss scaling Megatron itself skips every step whose gradients hold a "
            "NaN/Inf (and lowers the loss scale); trainmon leaves those steps to it and reports them"
        )

    @property
    def pp_stage(self) -> int:
        return self._layout.pp_stage

    @property
    def name(self) -> str:
        return type(self.optimizer).__name__

    def hooked_objects(self) -> list[Any]:
        return [self.optimizer]

    @property
    def sharded(self) -> bool:
        """Statistics are merged over ranks (so every rank must take part in each collected step)."""
        return self.distributed or self._layout.tp_split_group is not None

    def params(self) -> list[torch.Tensor]:
        return list(self._params)

    # -- pieces
    def _piece(self, param: torch.Tensor, slot: _Slot, whole: torch.Tensor, flat_owned: bool) -> Piece:
        """``whole`` is the param-shaped tensor, or (``flat_owned``) already this rank's owned range."""
        layout = self._layout
        if self.distributed:
            if not flat_owned:
                start, end = slot.owned if slot.owned is not None else (0, 0)
                whole = whole.reshape(-1)[start:end]
            if not _is_tp_split(param) and layout.tp_rank != 0:
                whole = whole[:0]  # a TP duplicate: its elements are counted on TP rank 0
            return Shard(whole, layout.dist_group, _whole_shape(param, layout.tp_size))
        if layout.tp_split_group is None:
            return whole
        if not _is_tp_split(param) and layout.tp_rank != 0:
            whole = whole.reshape(-1)[:0]
        return Shard(whole, layout.tp_split_group, _whole_shape(param, layout.tp_size))

    def grad(self, param: torch.Tensor) -> Piece | None:
        grad = getattr(param, "main_grad", None)
        if grad is None:
            grad = param.grad
        slot = self._slots.get(id(param))
        if grad is None or slot is None:
            return None
        return self._piece(param, slot, grad, flat_owned=False)

    def value(self, param: torch.Tensor) -> Piece:
        slot = self._slots.get(id(param))
        if slot is None:
            return param
        if self.distributed:
            main = slot.main if slot.main is not None else param.detach().reshape(-1)[:0].float()
            return self._piece(param, slot, main, flat_owned=True)
        return self._piece(param, slot, slot.main if slot.main is not None else param, flat_owned=False)

    def moments(self, param: torch.Tensor) -> tuple[Piece, Piece] | None:
        slot = self._slots.get(id(param))
        if slot is None:
            return None
        if slot.main is None:  # DistributedOptimizer, no owned element: empty pieces once Adam has state
            if not slot.base.state:
                return None
            empty = param.detach().reshape(-1)[:0].float()
            return self._piece(param, slot, empty, True), self._piece(param, slot, empty, True)
        state = slot.base.state.get(slot.main)
        if not state or "exp_avg" not in state or "exp_avg_sq" not in state:
            return None
        flat = self.distributed
        return (
            self._piece(param, slot, state["exp_avg"], flat_owned=flat),
            self._piece(param, slot, state["exp_avg_sq"], flat_owned=flat),
        )

    def adam_bias_corrections(self, param: torch.Tensor) -> tuple[float, float, float] | None:
        """Megatron keeps one Adam step count for all parameters (it synchronizes them), and betas/eps come
        from its OptimizerConfig; so a rank owning no piece of ``param`` answers like the others."""
        slot = self._slots.get(id(param))
        if slot is None:
            return None
        step = _step_count(slot.base, slot.main)
        if step is None or step <= 0:
            return None
        group = _group_of(slot.base, slot.main)
        config = self._config
        if group is not None and "betas" in group:
            beta1, beta2 = group["betas"]
            eps = float(group.get("eps", 1e-8))
        elif config is not None and hasattr(config, "adam_beta1"):
            beta1, beta2, eps = config.adam_beta1, config.adam_beta2, float(config.adam_eps)
        else:
            return None
        return 1.0 - beta1**step, 1.0 - beta2**step, eps

    # -- step hooks
    def register_step_hooks(self, pre: Callable[[], bool], post: Callable[[], None]) -> list[Any]:
        return [_StepWrap(self, pre, post)]

    def step_skipped(self) -> bool:
        """Megatron's ``step()`` returns ``(update_successful, grad_norm, num_zeros)``: False on fp16
        overflow. A step skipped by ``alert.on_nan: skip`` is not Megatron's (the monitor knows why)."""
        if self._forced_skip:
            return False
        result = self._last_result
        if isinstance(result, tuple) and result:
            return result[0] is False
        return result is False


# What megatron-core's optimizers (0.16: MixedPrecisionOptimizer, FP32Optimizer, ChainedOptimizer) return
# from ``step()`` when they find inf/NaN gradients, before clipping or updating anything; Megatron-LM's
# train_step then counts a skipped iteration and leaves the LR scheduler where it was.
_OVERFLOW_RESULT = (False, None, None)


def _dynamic_loss_scale(inner: Any) -> bool:
    scaler = getattr(inner, "grad_scaler", None)
    return scaler is not None and "DynamicGradScaler" in _class_names(scaler)


class _StepWrap:
    """Wraps ``optimizer.step`` on the instance (Megatron optimizers have no step hooks); ``remove``
    undoes it. When ``pre`` returns True (``alert.on_nan: skip``) the step ends as an fp16-overflow step
    does in Megatron: the original is not called, so no gradient is copied, clipped or applied, no
    parameter, Adam moment or step count changes, nothing is gathered, and the caller gets
    ``(False, None, None)``."""

    def __init__(self, adapter: MegatronOptimizerAdapter, pre: Callable[[], bool], post: Callable[[], None]):
        optimizer = adapter.optimizer
        self._optimizer = optimizer
        self._had_own = "step" in vars(optimizer)
        self._previous = vars(optimizer).get("step")
        original = optimizer.step

        def step(*args: Any, **kwargs: Any) -> Any:
            adapter._forced_skip = bool(pre())
            result = _OVERFLOW_RESULT if adapter._forced_skip else original(*args, **kwargs)
            adapter._last_result = result
            post()
            return result

        self._wrapper = step
        optimizer.step = step

    def remove(self) -> None:
        if vars(self._optimizer).get("step") is not self._wrapper:
            return  # someone wrapped it after us: leave theirs in place (ours then calls through)
        if self._had_own:
            self._optimizer.step = self._previous
        else:
            del self._optimizer.step


def _step_count(base: torch.optim.Optimizer, main: torch.Tensor | None) -> float | None:
    state = base.state.get(main) if main is not None else None
    if not state:  # no piece here: every parameter has the same count, take any
        state = next((s for s in base.state.values() if "step" in s), None)
    if not state or "step" not in state:
        return None
    step = state["step"]
    if isinstance(step, torch.Tensor):
        if step.device.type != "cpu":  # fused optimizers keep it on the device: reading it would sync
            return None
        step = float(step)
    return float(step)


def _group_of(base: torch.optim.Optimizer, main: torch.Tensor | None) -> dict | None:
    for group in base.param_groups:
        if main is not None and any(p is main for p in group["params"]):
            return group
    return base.param_groups[0] if base.param_groups else None


# ---------------------------------------------------------------------------------------------- resolver
@register_framework("megatron", _matches)
def _resolve_megatron(model: Any, optimizer: Any) -> Resolved:
    wrapped = _chunks_of(model)
    if not wrapped:
        raise ValueError("trainmon.attach: the list of model chunks is empty")
    chunks = tuple(unwrap(c) for c in wrapped)
    adapter = MegatronOptimizerAdapter(optimizer) if optimizer is not None else None
    pp_stage = adapter.pp_stage if adapter is not None else _layout(False).pp_stage
    return Resolved(chunks, adapter, pp_stage=pp_stage)


# ---------------------------------------------------------------------------------------------- one line
class MegatronHandle:
    """What ``trainmon.enable_megatron`` returns: ``monitor`` once Megatron built the model; ``close()``
    restores Megatron's functions and closes the monitor."""

    def __init__(self, training: Any, original: Callable[..., Any]) -> None:
        self._training = training
        self._original = original
        self.monitor: Any = None

    def close(self) -> None:
        if getattr(self._training, "setup_model_and_optimizer", None) is not self._original:
            self._training.setup_model_and_optimizer = self._original
        if self.monitor is not None:
            self.monitor.close()

    def __enter__(self) -> MegatronHandle:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def grad_acc_steps_from(args: Any) -> int | None:
    """Megatron-LM's micro-batches per step: global_batch_size // (micro_batch_size * data_parallel_size)."""
    try:
        per_step = int(args.micro_batch_size) * int(args.data_parallel_size)
        return max(1, int(args.global_batch_size) // per_step)
    except (AttributeError, TypeError, ValueError, ZeroDivisionError):
        return None


def wrap_setup(
    attach: Callable[..., Any], config: Any = None, attach_kwargs: dict[str, Any] | None = None
) -> MegatronHandle:
    """What ``trainmon.enable_megatron`` does: wrap ``megatron.training.training.setup_model_and_optimizer``
    (``pretrain`` calls it as a module global) so that ``attach`` (``trainmon.attach``, handed down by the
    package that defines it) monitors the model chunks and the optimizer it returns, with ``grad_acc_steps``
    and ``start_iteration`` (``args.iteration``, set by checkpoint loading) read from Megatron's
    ``get_args()``. ``attach_kwargs`` go to ``attach`` and win over those."""
    training = _import_megatron_training()
    original: Sequence[Any] | Callable[..., Any] = training.setup_model_and_optimizer
    handle = MegatronHandle(training, original)
    kwargs = dict(attach_kwargs or {})

    def setup_model_and_optimizer(*args: Any, **setup_kwargs: Any) -> Any:
        result = original(*args, **setup_kwargs)
        try:
            handle.monitor = _attach_after_setup(attach, result, config, kwargs, training)
        except Exception:  # the monitor must never stop training
            logger.exception("trainmon: attaching to Megatron's model failed; training continues unmonitored")
        return result

    setup_model_and_optimizer.__wrapped__ = original  # type: ignore[attr-defined]
    training.setup_model_and_optimizer = setup_model_and_optimizer
    return handle


def _import_megatron_training() -> Any:
    """``megatron.training.training``, or an ImportError that says what to do instead: megatron-core (the
    pip package ``megatron-core``) ships without ``megatron.training``, and its users write their own loop,
    where ``attach`` is the line to add. Failing here, at the line before ``pretrain``, stops nothing that
    was running: a script that reaches ``pretrain`` has Megatron-LM."""
    try:
        return importlib.import_module("megatron.training.training")
    except ModuleNotFoundError as e:
        if e.name not in ("megatron", "megatron.training", "megatron.training.training"):
            raise  # Megatron-LM is there but one of its own dependencies is not: its message says which
        if _has_module("megatron.core"):
            found = "megatron-core is installed, but not Megatron-LM"
        else:
            found = "Megatron-LM is not installed"
        raise ImportError(
            f"trainmon.enable_megatron needs Megatron-LM (megatron.training, where pretrain() comes from): "
            f"{found}. In a training loop of your own on megatron-core, add instead, after building the "
            "model chunks and the optimizer: trainmon.attach(model_chunks, optimizer, "
            "grad_acc_steps=num_microbatches, start_iteration=iteration) (docs/megatron.md)"
        ) from e


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:
        return False


def _attach_after_setup(
    attach: Callable[..., Any], result: Any, config: Any, attach_kwargs: dict[str, Any], training: Any
) -> Any:
    model, optimizer = result[0], result[1]
    get_args = getattr(training, "get_args", None)
    if get_args is None:
        get_args = importlib.import_module("megatron.training").get_args
    args = get_args()
    kwargs = dict(attach_kwargs)
    grad_acc = grad_acc_steps_from(args)
    if grad_acc is not None:
        kwargs.setdefault("grad_acc_steps", grad_acc)
    kwargs.setdefault("start_iteration", int(getattr(args, "iteration", 0) or 0))
    return attach(model, optimizer, config=config, **kwargs)
