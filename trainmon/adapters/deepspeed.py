"""DeepSpeed engines: ``trainmon.attach(engine, config=...)`` right after ``deepspeed.initialize``.

The engine is recognised by class name, so importing trainmon never imports DeepSpeed. What the monitor
needs lives in a different place at each ZeRO stage; one small layout class per family answers for it:

- ZeRO-0 with a plain torch optimizer: everything is whole on every rank (``p.grad``, ``optimizer.state[p]``).
- ZeRO-0 in bf16/fp16 (``FP16_UnfusedOptimizer``, ``FP16_Optimizer``): ``p.grad`` of the model parameter; Adam
  moments on the fp32 master copies (one per parameter, or one flat tensor per group).
- ZeRO-1/2 (``DeepSpeedZeroOptimizer``) and ``BF16_Optimizer``: each rank owns a contiguous slice of every
  group's flat fp32 partition; ``p._hp_mapping`` is this rank's fragment of ``p`` (None when it owns none).
- ZeRO-3 (``DeepSpeedZeroOptimizer_Stage3``): every parameter is split in equal parts (``ds_tensor``), the
  last ones padded to the same length; the padding is trimmed here.

Partitioned tensors come back as :class:`~trainmon.adapters.Shard` pieces (empty where a rank owns nothing),
so the step buffer merges their statistics over the data-parallel group with two all-reduces per step:
nothing is gathered.

``alert.on_nan: skip`` sends a step down DeepSpeed's own overflow path (one small skipper per optimizer
family, below the step wrapper), so the engine counts it in ``skipped_steps`` like an fp16 overflow.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from trainmon.adapters import Piece, Resolved, Shard, register_framework
from trainmon.joblog import job_wide

logger = logging.getLogger("trainmon")

_MOMENTS = ("exp_avg", "exp_avg_sq")


def is_deepspeed_engine(model: Any, optimizer: Any = None) -> bool:
    """A ``deepspeed.DeepSpeedEngine`` (or subclass), recognised without importing DeepSpeed."""
    return any(
        cls.__name__ == "DeepSpeedEngine" and cls.__module__.startswith("deepspeed.")
        for cls in type(model).__mro__
    )


@register_framework("deepspeed", is_deepspeed_engine)
def resolve_engine(engine: Any, optimizer: Any = None) -> Resolved:
    """The model is ``engine.module``; steps, micro-batches per step and the optimizer come from the engine
    (an ``optimizer`` argument is ignored: it is ``engine.optimizer`` anyway)."""
    return Resolved(
        chunks=(engine.module,),
        optimizer=DeepSpeedAdapter(engine),
        grad_acc_steps=int(engine.gradient_accumulation_steps()),
        start_iteration=int(engine.global_steps),
    )


class DeepSpeedAdapter:
    """The OptimizerAdapter of a DeepSpeed engine (see the module docstring for where things live)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.wrapper = engine.optimizer
        if self.wrapper is None:
            raise ValueError("trainmon.attach: the DeepSpeed engine has no optimizer (inference engine?)")
        self._layout = _layout_of(self.wrapper)
        self._loss_scaled = bool(engine.fp16_enabled())
        # the step buffer merges Shard rows with collectives: every rank must take part in collected steps
        self.sharded = isinstance(self._layout, (_Fragments, _Zero3))
        self._skipper = _skipper_of(self.wrapper)
        # alert.on_nan: skip is possible where DeepSpeed's overflow path is known for this optimizer
        self.skips_steps = self._skipper is not None
        self.skip_unsupported = (
            ""
            if self.skips_steps
            else f"trainmon knows no overflow path of DeepSpeed's {type(self.wrapper).__name__}; NaN steps "
            "are reported, not skipped"
        )

    @property
    def layout(self) -> str:
        return type(self._layout).__name__.lstrip("_")

    @property
    def name(self) -> str:
        return type(self.wrapper).__name__

    def hooked_objects(self) -> list[Any]:
        return [self.engine]  # its optimizer wrapper is the engine's own

    def params(self) -> list[torch.Tensor]:
        return self._layout.params()

    def grad(self, param: torch.Tensor) -> Piece | None:
        return self._layout.grad(param)

    def value(self, param: torch.Tensor) -> Piece:
        return self._layout.value(param)

    def moments(self, param: torch.Tensor) -> tuple[Piece, Piece] | None:
        return self._layout.moments(param)

    def adam_bias_corrections(self, param: torch.Tensor) -> tuple[float, float, float] | None:
        found = self._layout.master_state(param)
        return None if found is None else _bias_corrections(*found)

    def step_skipped(self) -> bool:
        """fp16 loss scaling found inf/NaN gradients: ``step`` returned without updating anything, and the
        scale goes down. That is expected and reported as a skipped step. DeepSpeed also skips fp32/bf16
        steps whose gradient norm is not finite (the same ``overflow`` flag), but without loss scaling a
        non-finite gradient is a fault: those steps stay NaN alarms. A step the monitor had skipped
        (``alert.on_nan: skip``, through the same flag) counts only when DeepSpeed found the overflow too."""
        if self._skipper is not None and self._skipper.forced:
            return self._loss_scaled and self._skipper.found_overflow
        return bool(self._loss_scaled and getattr(self.wrapper, "overflow", False))

    def register_step_hooks(self, pre: Callable[[], bool], post: Callable[[], None]) -> list[Any]:
        # ``engine.optimizer.step`` is where every stage has its reduced gradients ready (the engine calls it
        # once per accumulation boundary, from ``_take_model_step``), and when it returns the master weights,
        # the optimizer state and the model parameters are updated. The wrapper is per instance.
        return [_StepWrap(self.wrapper, pre, post, self._skipper)]


class _StepWrap:
    """Wraps ``obj.step`` on the instance; ``remove`` restores what was there (e.g. an LR scheduler's own
    instance wrapper), or turns itself into a pass-through when something wrapped it again since. When
    ``pre`` returns True the step goes down DeepSpeed's overflow path instead (``skipper``)."""

    def __init__(
        self,
        obj: Any,
        pre: Callable[[], bool],
        post: Callable[[], None],
        skipper: _Skipper | None = None,
    ) -> None:
        self._obj = obj
        self._had_own = "step" in vars(obj)
        self._previous = vars(obj).get("step")
        self._skipper = skipper
        original = obj.step
        self._active = True

        def step(*args: Any, **kwargs: Any) -> Any:
            if not self._active:
                return original(*args, **kwargs)
            if pre() and skipper is not None:
                result = skipper.skip(original, args, kwargs)
            else:
                if skipper is not None:
                    skipper.applied()
                result = original(*args, **kwargs)
            post()
            return result

        self._wrapper = step
        obj.step = step

    def remove(self) -> None:
        self._active = False
        if self._skipper is not None:
            self._skipper.remove()
        if vars(self._obj).get("step") is self._wrapper:
            if self._had_own:
                self._obj.step = self._previous
            else:
                del self._obj.step


# --------------------------------------------------------------------------------------------- skipping
# ``alert.on_nan: skip`` sends the step down the path DeepSpeed takes on an fp16 overflow: no update of the
# master weights, optimizer state or model parameters, gradients cleared, ``optimizer.overflow`` True, so
# the engine counts the step in ``skipped_steps`` and does not advance the LR scheduler. The monitor agreed
# on the skip over all ranks before the step, so every rank takes the same path (and the same collectives).


class _Skipper:
    """How one optimizer wrapper skips a step; ``forced``/``found_overflow`` describe the last step."""

    def __init__(self, wrapper: Any) -> None:
        self.wrapper = wrapper
        self.forced = False  # the monitor sent the last step down the overflow path
        self.found_overflow = False  # ... and DeepSpeed's own check had found an overflow in it

    def skip(self, original: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        self.forced, self.found_overflow = True, False
        result = self._skip(original, args, kwargs)
        if not getattr(self.wrapper, "overflow", False):  # DeepSpeed took another path: the update landed
            logger.error(
                "trainmon: alert.on_nan: skip could not keep the update of %s from landing",
                type(self.wrapper).__name__,
            )
        return result

    def applied(self) -> None:
        self.forced = False

    def remove(self) -> None:
        pass

    def _skip(self, original: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        raise NotImplementedError


class _ForceOverflow(_Skipper):
    """ZeRO-1/2 and ZeRO-3 (``DeepSpeedZeroOptimizer``, ``DeepSpeedZeroOptimizer_Stage3``): ``step`` checks
    for overflow, then calls ``_update_scale(self.overflow)`` right before its ``if self.overflow:`` branch.
    For this one call ``_update_scale`` is shadowed on the instance to raise the flag there, so the step
    runs DeepSpeed's own overflow branch (checks and their collectives included, on every rank alike). The
    loss scaler sees an overflow, as it would on an fp16 overflow (a no-op without fp16)."""

    def _skip(self, original: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        wrapper = self.wrapper
        update_scale = wrapper._update_scale

        def forced(has_overflow: bool = False) -> None:
            self.found_overflow = bool(has_overflow)
            update_scale(True)
            wrapper.overflow = True

        wrapper._update_scale = forced
        try:
            return original(*args, **kwargs)
        finally:
            if vars(wrapper).get("_update_scale") is forced:
                del wrapper._update_scale


class _OverflowBranch(_Skipper):
    """ZeRO-0 in bf16/fp16 (``FP16_Optimizer``, ``FP16_UnfusedOptimizer``): ``step`` asks its
    ``overflow_checker`` first and, on an overflow, returns ``self._skip_invalid_grad_norm()`` (the flag, an
    infinite grad norm, the loss scale update, gradients cleared). For this one call the checker is one that
    asks the real checker (its collectives included) and answers yes."""

    def _skip(self, original: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        wrapper = self.wrapper
        checker = wrapper.overflow_checker
        wrapper.overflow_checker = _AlwaysOverflow(checker, self)
        try:
            return original(*args, **kwargs)
        finally:
            wrapper.overflow_checker = checker


class _AlwaysOverflow:
    """A DeepSpeed ``CheckOverflow`` whose checks run and then report an overflow (the skipper notes what
    the real check found)."""

    _CHECKS = frozenset({"check", "has_overflow", "check_using_norm"})

    def __init__(self, checker: Any, skipper: _Skipper) -> None:
        self._checker = checker
        self._skipper = skipper

    def __getattr__(self, name: str) -> Any:
        found = getattr(self._checker, name)
        if name not in self._CHECKS:
            return found

        def check(*args: Any, **kwargs: Any) -> bool:
            self._skipper.found_overflow = bool(found(*args, **kwargs))
            return True

        return check


class _Bf16Overflow(_Skipper):
    """``BF16_Optimizer``: its ``step`` on a non-finite gradient norm sets the flag and an infinite norm,
    clears both gradient copies and returns; that branch, without computing the norm."""

    def _skip(self, original: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        wrapper = self.wrapper
        wrapper.overflow = True
        wrapper._global_grad_norm = float("inf")
        wrapper.clear_hp_grads()
        wrapper.clear_lp_grads()
        return None


_ABSENT = object()


class _HiddenGrads(_Skipper):
    """ZeRO-0 in fp32: ``engine.optimizer`` is the client's torch optimizer, which leaves a parameter
    without a gradient untouched (value, moments, step count): the gradients are hidden for this one call
    (the engine zeroes them after the step anyway). A torch optimizer has no ``overflow`` flag; the engine
    reads one where it is there, so one is set on the instance for the skipped step and taken back (or the
    optimizer's own value put back) at the next step and at ``remove``."""

    def __init__(self, wrapper: Any) -> None:
        super().__init__(wrapper)
        self._saved: Any = None  # the instance's own ``overflow`` (or _ABSENT) while ours is set

    def _skip(self, original: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        hidden = [(p, p.grad) for g in self.wrapper.param_groups for p in g["params"] if p.grad is not None]
        for p, _ in hidden:
            p.grad = None
        try:
            result = original(*args, **kwargs)
        finally:
            for p, grad in hidden:
                p.grad = grad
        if self._saved is None:
            self._saved = vars(self.wrapper).get("overflow", _ABSENT)
        self.wrapper.overflow = True
        return result

    def applied(self) -> None:
        super().applied()
        self._put_back()

    def remove(self) -> None:
        self._put_back()

    def _put_back(self) -> None:
        saved, self._saved = self._saved, None
        if saved is _ABSENT:
            vars(self.wrapper).pop("overflow", None)
        elif saved is not None:
            self.wrapper.overflow = saved


def _skipper_of(wrapper: Any) -> _Skipper | None:
    name = type(wrapper).__name__
    if name in ("DeepSpeedZeroOptimizer", "DeepSpeedZeroOptimizer_Stage3") and hasattr(
        wrapper, "_update_scale"
    ):
        return _ForceOverflow(wrapper)
    if name == "BF16_Optimizer" and hasattr(wrapper, "clear_hp_grads"):
        return _Bf16Overflow(wrapper)
    if name in ("FP16_Optimizer", "FP16_UnfusedOptimizer") and hasattr(wrapper, "_skip_invalid_grad_norm"):
        return _OverflowBranch(wrapper)
    if isinstance(wrapper, torch.optim.Optimizer):
        return _HiddenGrads(wrapper)
    return None


def _bias_corrections(group: dict, state: dict | None) -> tuple[float, float, float] | None:
    """(1 - beta1**t, 1 - beta2**t, eps) from the base optimizer's group and the state of the tensor it
    updates; t is the count of the update just made."""
    if not state or "step" not in state or "betas" not in group:
        return None
    step = state["step"]
    if isinstance(step, torch.Tensor):
        if step.device.type != "cpu":  # reading a device counter would sync
            return None
        step = float(step)
    if step <= 0:
        return None
    beta1, beta2 = group["betas"]
    return 1.0 - beta1**step, 1.0 - beta2**step, float(group.get("eps", 1e-8))


# ---------------------------------------------------------------------------------------------- layouts


def _layout_of(wrapper: Any) -> Any:
    name = type(wrapper).__name__
    if name == "DeepSpeedZeroOptimizer_Stage3" or hasattr(wrapper, "fp32_partitioned_groups_flat"):
        return _Zero3(wrapper)
    if hasattr(wrapper, "single_partition_of_fp32_groups"):  # DeepSpeedZeroOptimizer (ZeRO-1/2)
        return _Fragments(wrapper, wrapper.bit16_groups, wrapper.single_partition_of_fp32_groups)
    if hasattr(wrapper, "fp32_groups_flat_partition"):  # BF16_Optimizer
        return _Fragments(wrapper, wrapper.bf16_groups, wrapper.fp32_groups_flat_partition)
    if hasattr(wrapper, "fp16_groups") and (
        hasattr(wrapper, "fp32_groups") or hasattr(wrapper, "fp32_groups_flat")
    ):
        return _MasterCopies(wrapper)
    if isinstance(wrapper, torch.optim.Optimizer):  # ZeRO-0, fp32: the client optimizer itself
        return _Whole(wrapper)
    job_wide(logger).warning(
        "trainmon: DeepSpeed optimizer %s is not known; monitoring gradients from p.grad and no optimizer "
        "state",
        name,
    )
    return _Unknown(wrapper)


def _flat_params(groups: Any) -> list[torch.Tensor]:
    return [p for group in groups for p in group]


class _Whole:
    """ZeRO-0 with a torch optimizer: every tensor is whole on every rank, gradients reduced in place."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self._group = {id(p): g for g in optimizer.param_groups for p in g["params"]}

    def params(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def grad(self, p: torch.Tensor) -> Piece | None:
        return p.grad

    def value(self, p: torch.Tensor) -> Piece:
        return p

    def moments(self, p: torch.Tensor) -> tuple[Piece, Piece] | None:
        state = self.optimizer.state.get(p)
        if not state or any(key not in state for key in _MOMENTS):
            return None
        return state["exp_avg"], state["exp_avg_sq"]

    def master_state(self, p: torch.Tensor) -> tuple[dict, dict | None] | None:
        group = self._group.get(id(p))
        return None if group is None else (group, self.optimizer.state.get(p))


class _Unknown(_Whole):
    def __init__(self, wrapper: Any) -> None:
        self.wrapper = wrapper
        groups = getattr(wrapper, "param_groups", [])
        self._params = [p for g in groups for p in g.get("params", [])]

    def params(self) -> list[torch.Tensor]:
        return self._params

    def moments(self, p: torch.Tensor) -> tuple[Piece, Piece] | None:
        return None

    def master_state(self, p: torch.Tensor) -> tuple[dict, dict | None] | None:
        return None


class _MasterCopies(_Whole):
    """ZeRO-0 in bf16/fp16: the model parameter holds the (reduced) gradient; the base optimizer updates fp32
    master copies, one per parameter (FP16_UnfusedOptimizer) or one flat tensor per group (FP16_Optimizer)."""

    def __init__(self, wrapper: Any) -> None:
        self.wrapper = wrapper
        self.base = wrapper.optimizer
        self._params = _flat_params(wrapper.fp16_groups)
        # id(model param) -> (group index, master tensor, offset in it or None when it is the param's own)
        self._where: dict[int, tuple[int, torch.Tensor, int | None]] = {}
        for i, group in enumerate(wrapper.fp16_groups):
            if hasattr(wrapper, "fp32_groups"):
                for p, master in zip(group, wrapper.fp32_groups[i], strict=True):
                    self._where[id(p)] = (i, master, None)
            else:  # the flat master is the group's parameters concatenated in order, without padding
                offset = 0
                for p in group:
                    self._where[id(p)] = (i, wrapper.fp32_groups_flat[i], offset)
                    offset += p.numel()

    def params(self) -> list[torch.Tensor]:
        return self._params

    def moments(self, p: torch.Tensor) -> tuple[Piece, Piece] | None:
        found = self._where.get(id(p))
        if found is None:
            return None
        _, master, offset = found
        state = self.base.state.get(master)
        if not state or any(key not in state for key in _MOMENTS):
            return None
        if offset is None:
            return state["exp_avg"], state["exp_avg_sq"]
        return tuple(state[key].narrow(0, offset, p.numel()).view_as(p) for key in _MOMENTS)  # type: ignore[return-value]

    def master_state(self, p: torch.Tensor) -> tuple[dict, dict | None] | None:
        found = self._where.get(id(p))
        if found is None:
            return None
        i, master, _ = found
        return self.base.param_groups[i], self.base.state.get(master)


class _Fragments:
    """ZeRO-1/2 and BF16_Optimizer: rank r owns slice r of each group's flat fp32 partition; a parameter's
    part of it is ``p._hp_mapping`` (None when this rank owns no element of ``p``). Fragments of one
    parameter on different ranks are disjoint and cover it, and alignment padding lies outside every
    parameter's fragment, so the pieces are exact shards."""

    def __init__(self, wrapper: Any, lp_groups: Any, flat_partitions: Any) -> None:
        self.wrapper = wrapper
        self.base = wrapper.optimizer
        self._lp_groups = lp_groups
        self._flat = flat_partitions
        self._group_of = {id(p): i for i, group in enumerate(lp_groups) for p in group}
        self._params = _flat_params(lp_groups)
        # BF16_Optimizer accumulates in grad_acc_dtype; ZeRO-1/2 in the parameters' dtype
        self._grad_dtype = getattr(wrapper, "grad_acc_dtype", None)

    def params(self) -> list[torch.Tensor]:
        return self._params

    def _empty(self, p: torch.Tensor, dtype: torch.dtype) -> Shard:
        return Shard(torch.empty(0, dtype=dtype, device=p.device), p._dp_group, tuple(p.shape))

    def _grads_ready(self, i: int) -> bool:
        """Whether the group's reduced gradients exist now (between backward and step). Known on every rank,
        owner of a fragment or not, so all ranks give the same answer and the same rows."""
        offload = getattr(self.wrapper, "cpu_offload", False)
        name = "offload_gradient_dict" if offload else "averaged_gradients"
        if not hasattr(self.wrapper, name):
            name = "fp32_groups_gradient_dict"  # BF16_Optimizer
        grads = getattr(self.wrapper, name, None) or {}
        return i in grads and grads[i] is not None

    def grad(self, p: torch.Tensor) -> Piece | None:
        i = self._group_of.get(id(p))
        if i is None or not self._grads_ready(i):
            return None
        mapping = p._hp_mapping
        if mapping is None:
            return self._empty(p, self._grad_dtype or p.dtype)
        fragment = mapping.get_lp_grad_fragment(p._index_in_param_group).flatten()
        address = mapping.lp_fragment_address
        if fragment.numel() == p.numel():  # BF16_Optimizer keeps the whole (all-reduced) gradient
            fragment = fragment.narrow(0, address.start, address.numel)
        return Shard(fragment, p._dp_group, tuple(p.shape))

    def value(self, p: torch.Tensor) -> Piece:
        return p  # ZeRO-1/2 keep the whole low-precision parameter on every rank

    def moments(self, p: torch.Tensor) -> tuple[Piece, Piece] | None:
        i = self._group_of.get(id(p))
        if i is None:
            return None
        state = self.base.state.get(self._flat[i])
        if not state or any(key not in state for key in _MOMENTS):
            return None  # before the first update: the same answer on every rank
        mapping = p._hp_mapping
        if mapping is None:
            return self._empty(p, state["exp_avg"].dtype), self._empty(p, state["exp_avg_sq"].dtype)
        if mapping.optim_fragment:
            pieces = [mapping.get_optim_state_fragment(key) for key in _MOMENTS]
        else:  # not linked yet (DeepSpeed links after its first update): the same slice of the flat state
            address = mapping.get_hp_fragment_address()
            pieces = [state[key].narrow(0, address.start, address.numel) for key in _MOMENTS]
        return Shard(pieces[0], p._dp_group, tuple(p.shape)), Shard(pieces[1], p._dp_group, tuple(p.shape))

    def master_state(self, p: torch.Tensor) -> tuple[dict, dict | None] | None:
        i = self._group_of.get(id(p))
        if i is None:
            return None
        return self.base.param_groups[i], self.base.state.get(self._flat[i])


class _Zero3:
    """ZeRO-3: ``p`` is empty outside forward; rank r holds elements ``[r*n, (r+1)*n)`` of the flattened
    parameter (n = ``ds_tensor.numel()``), the tail past ``ds_numel`` being padding. Gradients and optimizer
    state partitions have the same layout (DeepSpeed's local accessors)."""

    def __init__(self, wrapper: Any) -> None:
        self.wrapper = wrapper
        self.base = wrapper.optimizer
        self._params = _flat_params(wrapper.fp16_groups)
        self._valid: dict[int, int] = {}

    def params(self) -> list[torch.Tensor]:
        return self._params

    def _group(self, p: torch.Tensor) -> Any:
        return getattr(p, "ds_process_group", None) or self.wrapper.dp_process_group

    def _trim(self, p: torch.Tensor, local: torch.Tensor) -> Shard:
        valid = self._valid.get(id(p))
        if valid is None:
            part = p.ds_tensor.numel()
            rank = torch.distributed.get_rank(group=self._group(p))
            valid = self._valid[id(p)] = max(0, min(part, p.ds_numel - rank * part))
        return Shard(local.flatten()[:valid], self._group(p), tuple(p.ds_shape))

    def grad(self, p: torch.Tensor) -> Piece | None:
        from deepspeed.utils import safe_get_local_grad

        local = safe_get_local_grad(p)
        return None if local is None else self._trim(p, local)

    def value(self, p: torch.Tensor) -> Piece:
        return self._trim(p, p.ds_tensor)

    def _sub_group(self, p: torch.Tensor) -> int:
        return self.wrapper.grad_position[self.wrapper.get_param_id(p)][0]

    def moments(self, p: torch.Tensor) -> tuple[Piece, Piece] | None:
        from deepspeed.utils import safe_get_local_optimizer_state

        state = self.base.state.get(self.wrapper.fp32_partitioned_groups_flat[self._sub_group(p)])
        if not state or any(key not in state for key in _MOMENTS):
            return None
        avg, avg_sq = (safe_get_local_optimizer_state(p, key) for key in _MOMENTS)
        return self._trim(p, avg), self._trim(p, avg_sq)

    def master_state(self, p: torch.Tensor) -> tuple[dict, dict | None] | None:
        sub_group = self._sub_group(p)
        group = self.base.param_groups[self.wrapper.sub_group_to_group_id[sub_group]]
        return group, self.base.state.get(self.wrapper.fp32_partitioned_groups_flat[sub_group])
