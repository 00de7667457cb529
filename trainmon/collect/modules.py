"""Activations (forward inputs, kwargs, outputs) and activation gradients (grad_input/grad_output)."""

from __future__ import annotations

import functools
import itertools
import logging
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

from trainmon.adapters import Shard
from trainmon.collect import traced
from trainmon.collect.base import Guard, HookSlot, guarded
from trainmon.device import backward_pass_id, in_backward_pass, is_dtensor
from trainmon.joblog import job_wide
from trainmon.run.names import call_name, encode_name
from trainmon.run.records import Kind, Phase
from trainmon.step.buffer import StepBuffer
from trainmon.step.gate import GATE
from trainmon.step.position import LoopPosition
from trainmon.step.timing import StepTimer

logger = logging.getLogger("trainmon")

# a callable the autograd engine runs when the backward pass it is queued in is done (what DDP waits on)
_queue_callback = torch.autograd.Variable._execution_engine.queue_callback
_grad_enabled = torch.is_grad_enabled  # read by the hooks of every module call: bound once
_is_compiling = torch.compiler.is_compiling  # True while dynamo traces a hook: it then takes the traced path
_Tensor = torch.Tensor

logger = logging.getLogger("trainmon")

# what a traced module hook asks of its site's handler at run time (trainmon.collect.traced)
_CALL, _CALL_GRAD, _INPUT, _OUTPUT, _INPUT_GRAD, _OUTPUT_GRAD, _PASS = range(7)
_ROLES = {_INPUT: "input", _OUTPUT: "output", _INPUT_GRAD: "input_grad", _OUTPUT_GRAD: "output_grad"}
# ... and of the micro-step counter's
_FORWARD_START, _FORWARD_END, _FORWARD_END_GRAD, _BACKWARD_START = range(4)

_ACTV, _ACTV_GRAD = Kind.ACTV.value, Kind.ACTV_GRAD.value
_FORWARD, _BACKWARD = Phase.FORWARD.value, Phase.BACKWARD.value
_GRAD_KINDS = frozenset({Kind.GRAD_UNREDUCED.value, Kind.GRAD_REDUCED.value})


# what each_tensor calls for a tensor: (names, role, key, indexed, call, micro, tensor)
Visit = Callable[[Any, str, Any, bool, int, int, torch.Tensor], None]


# modules that wrap another and put it under an attribute of this name: torch.compile's OptimizedModule,
# activation checkpointing's and FSDP1's wrappers. They are no part of the model's names: a run compiled or
# wrapped names its tensors as the eager run does (TensorBoard tags, run comparisons)
WRAPPER_ATTRIBUTES = frozenset(
    {"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module", "_forward_module"}  # Fabric: the last
)


def clean_name(name: str) -> str:
    """``name`` without the wrappers' own segments: ``_orig_mod.blocks.0.fc1`` -> ``blocks.0.fc1``."""
    if "_mod" not in name and "wrapped" not in name:  # most names: nothing to look at
        return name
    return ".".join([part for part in name.split(".") if part not in WRAPPER_ATTRIBUTES])


def named_modules(chunk: nn.Module) -> list[tuple[str, nn.Module]]:
    """``chunk.named_modules()`` under clean names; where a wrapper and the module it wraps get one name,
    the wrapped module (the model's own) stands for it."""
    found: dict[str, nn.Module] = {}
    for name, module in chunk.named_modules():
        found[clean_name(name)] = module  # the wrapped module comes after its wrapper
    return list(found.items())


@dataclass(frozen=True)
class ModuleSite:
    vpp_stage: int
    name: str
    module: nn.Module


class _Names:
    """Row names of one module, built once: ``<module>.input``, ``<module>.input_1``, ``<module>.output``,
    and ``...#<n>`` for its ``n``-th call in one forward pass (trainmon.run.names); the gradient hook of each
    name, also built once (hooks run for every module call); and the count of the module's calls."""

    def __init__(self, base: str, state: LoopPosition, buffer: StepBuffer, vpp: int) -> None:
        self.base = base
        self._cache: dict[tuple[str, Any, bool, int], str] = {}
        self._hooks: dict[tuple[str, Any, bool, int], Any] = {}
        self._state, self.buffer, self.vpp = state, buffer, vpp
        self._pass: int | None = None  # the forward pass (or recomputation) the call count belongs to
        self._calls = 0
        # an output that tensor parallelism reduces after our forward hook, recorded by the hook behind
        # tensor parallelism's once reduced: (call, micro-step, the DTensor pending its reduction)
        self.deferred: tuple[int, int, Any] | None = None
        self.open: list[int] = []  # numbers of the calls between their pre-hook and their forward hook
        # beside each open call: its micro-step and where each input that requires grad enters autograd's
        # graph (``_input_edges``), taken before the module runs (an in-place change of an input moves its
        # grad_fn), or None. A list, not a dict: a dict that takes such an entry is tracked by the garbage
        # collector anew at every step
        self.open_inputs: list[tuple[int, list[tuple[Any, bool, Any, int]]] | None] = []
        # the traced path (compiled code): its site id, the number of the call running now and whether it
        # is a recomputation, and the numbers of the calls whose gradients are still to come
        self.site = -1
        self.traced_call = 0
        self.traced_recompute = False
        self.grad_calls: list[int] = []

    def call(self, forward_pass: int) -> int:
        """The number of a call that starts now in ``forward_pass`` (0 for the module's first call there)."""
        if forward_pass != self._pass:
            self._pass, self._calls = forward_pass, 0
            self.open.clear()
            self.open_inputs.clear()
        else:
            self._calls += 1
        return self._calls

    def get(self, role: str, key: Any, indexed: bool, call: int = 0) -> str:
        cache_key = (role, key, indexed, call)
        name = self._cache.get(cache_key)
        if name is None:
            # a dict output's key is any string: written encoded, as the module name is (run.names)
            name = f"{self.base}.{role}_{encode_name(str(key))}" if indexed else f"{self.base}.{role}"
            name = self._cache[cache_key] = call_name(name, call)
        return name

    def node_hook(self, key: Any, indexed: bool, call: int, micro: int, index: int) -> Any:
        """The node hook of an input's gradient that one node sends along its edge ``index`` (one object per
        (name, micro-batch, edge) for the run, as :meth:`grad_hook`)."""
        cache_key = ("node", key, indexed, call, micro, index)
        hook = self._hooks.get(cache_key)
        if hook is None:
            hook = self._hooks[cache_key] = _NodeGrad(
                self.grad_hook("input_grad", key, indexed, call, micro), index
            )
        return hook

    def grad_hook(self, role: str, key: Any, indexed: bool, call: int, micro: int):
        """The gradient hook of a name for a graph built in forward micro-batch ``micro``: one object per
        (name, micro-batch) for the run, so hooking a tensor allocates nothing that outlives its backward."""
        cache_key = (role, key, indexed, call, micro)
        hook = self._hooks.get(cache_key)
        if hook is None:
            base = self._hooks.get((role, key, indexed, call))
            if base is None:
                base = _grad_hook(self._state, self.buffer, self.get(role, key, indexed, call), self.vpp)
                self._hooks[(role, key, indexed, call)] = base
            hook = self._hooks[cache_key] = functools.partial(base, micro)
        return hook


def each_tensor(
    values: Any, visit: Visit, names: Any, role: str, call: int, micro: int, nested: bool = False
) -> None:
    """``visit(names, role, key, indexed, call, micro, tensor)`` for every tensor of a hook argument: the
    argument itself (key 0), each tensor element of a tuple or list (key: its index; ``indexed`` when there
    are several elements) and each tensor value of a dict (key: its key, always indexed). With ``nested``,
    containers inside containers are walked too (their keys say nothing then).

    The one walk of hook arguments (forward rows, gradient hooks, the micro-step counter's outputs): hooks run
    for every monitored tensor, so it passes plain arguments and builds no closure, tuple or generator."""
    if isinstance(values, torch.Tensor):
        visit(names, role, 0, False, call, micro, values)
    elif isinstance(values, (tuple, list)):
        indexed = len(values) > 1
        for i, value in enumerate(values):
            if isinstance(value, torch.Tensor):
                visit(names, role, i, indexed, call, micro, value)
            elif nested:
                each_tensor(value, visit, names, role, call, micro, True)
    elif isinstance(values, dict):
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                visit(names, role, key, True, call, micro, value)
            elif nested:
                each_tensor(value, visit, names, role, call, micro, True)


def _record(
    names: _Names, role: str, key: Any, indexed: bool, call: int, micro: int, tensor: torch.Tensor
) -> None:
    """A forward row of ``tensor`` (its statistics kernel builds no autograd graph: no ``no_grad`` needed).
    The name's cache is read here, not through ``names.get``: one call per tensor, as before the walk."""
    name = names._cache.get((role, key, indexed, call))
    if name is None:
        name = names.get(role, key, indexed, call)
    names.buffer.add(_ACTV, name, names.vpp, micro, _FORWARD, tensor)


def _hook_grad(
    names: _Names, role: str, key: Any, indexed: bool, call: int, micro: int, tensor: torch.Tensor
) -> None:
    """A tensor hook on an output the call produced that requires grad (``_produced``, inlined): it fires
    with the gradient w.r.t. that output."""
    if tensor.requires_grad and not tensor.is_leaf:
        on_grad(tensor, names.grad_hook(role, key, indexed, call, micro))


class ModuleCollector:
    """Forward and full backward hooks on the target modules, installed only on collected steps (on every
    step once the model is compiled: :meth:`pause`; under tracing they take their traced path).

    A module called several times in one forward pass of its model chunk (a shared block, a loop over a
    layer) gets a call number per call, in its rows' names (``name#1``; trainmon.run.names): the passes are
    counted by a pre-hook on each chunk, and a recomputation (activation checkpointing, inside backward)
    counts its calls apart, per backward pass.

    The forward hooks run last among a module's forward hooks, so they record the output other hooks hand
    on (a hook that rewrites a module's output is part of that module's call): hooks registered after ours
    are moved in front of ours at the first forward pass of every step, before any of them runs."""

    def __init__(
        self,
        sites: Sequence[ModuleSite],
        state: LoopPosition,
        buffer: StepBuffer,
        *,
        forward: bool,
        backward: bool,
        chunks: Sequence[nn.Module] = (),
    ) -> None:
        self._sites = list(sites)
        self._state = state
        self._buffer = buffer
        self._forward = forward
        self._backward = backward
        self._chunks = list(chunks)
        # forward passes of each chunk so far (never reset: a pass is a new number); chunks unknown: one
        self._passes = [0] * max(1, len(self._chunks), *(s.vpp_stage + 1 for s in self._sites))
        self._slots: list[HookSlot] = []  # every hook, built at the first arm and kept (HookSlot)
        # (module, our forward hook's slot, the slot of the one behind tensor parallelism's hooks or None)
        self._forward_hooks: list[tuple[nn.Module, HookSlot, HookSlot | None]] = []
        self._armed = False
        self._ordered_at = -1  # the step whose first forward pass put our forward hooks last
        # compiled code (torch.compile) keeps the hooks it was traced with and never sees hooks armed later:
        # once the model is compiled the hooks stay armed, and their traced path reads the loop state at run
        # time (trainmon.collect.traced). ``_entries``: dynamo's compiled entries of the model's code at the
        # last step boundary (None before the first)
        self.compiled = False
        self._entries: int | None = None
        self._frames = -1  # frames dynamo had compiled at the last boundary (traced.frames_compiled)
        self._codes: list[Any] | None = None
        self._sites_ids: list[int] = []  # every traced site id of ours (released by disarm)
        self._pass_sites: list[int] = []  # the traced form of each chunk's pass counter
        self._probe: torch.Tensor | None = None  # the tensor of an op that has no tensor of its own
        self._traced_ran = False  # a traced hook of ours ran in compiled code
        self._warned_blind = False
        self._all_names: list[_Names] = []  # every site's names, built with its hooks
        self._unread_said: set[tuple[int, int]] = set()  # traced.UNREAD said so far

    def arm(self) -> None:
        """A collected step: the hooks in."""
        self._hooks_in()
        traced.set_collecting(id(self), True)

    def _hooks_in(self) -> None:
        self._follow_compile()
        if self._armed:
            return
        if not self._slots:
            self._build()
        for slot in self._slots:
            slot.arm()
        self._armed = True

    def _say_unread(self) -> None:
        """Once per row: the activation rows compiled code left out (``traced.UNREAD``), by reason; of this
        collector's sites only (an earlier monitor's compiled code may have left out rows of its own)."""
        sites = {names.site: names.base for names in self._all_names}
        unread = {
            key: why for key, why in traced.UNREAD.items() if key[0] in sites and key not in self._unread_said
        }
        if not unread:
            return
        self._unread_said |= set(unread)
        for why in sorted(set(unread.values())):
            rows = sorted(
                f"{sites[site]}.{_WHAT_ROLES.get(what, what)}"
                for (site, what), reason in unread.items()
                if reason == why
            )
            job_wide(logger).warning(
                "trainmon: %d activation rows are not recorded: they are %s (docs/compile.md): %s%s. "
                "Parameters, gradients and Adam state are recorded, and the model's gradients are unchanged",
                len(rows),
                why,
                ", ".join(rows[:8]),
                " ..." if len(rows) > 8 else "",
            )

    def pause(self) -> None:
        """An off step: the hooks come out (eager hooks cost nothing then), unless the model is compiled:
        compiled code would not see them again, so they stay, and the off step runs the entry dynamo
        compiled without their ops (``traced.COLLECTING``)."""
        self._follow_compile()
        traced.set_collecting(id(self), False)
        if self.compiled:
            self._hooks_in()
        else:
            self.disarm()

    def _follow_compile(self) -> None:
        """At each step boundary: has the model been compiled? Then the hooks stay armed from now on, and
        compiled code traced while they were out (before attach, or on an off step) is dropped, for that
        code only, so that its next call traces the hooks (``traced.drop_compiled``)."""
        if self.compiled or not self._sites:
            return
        try:
            first = self._codes is None
            wrapped = False
            if first:  # at attach: the model's code objects, and whether it is compiled already
                modules = [m for chunk in self._chunks for m in chunk.modules()]
                modules = modules or [s.module for s in self._sites]
                self._codes = traced.candidate_codes(modules)
                wrapped = traced.compiled_wrappers(modules)
            # dynamo compiled no frame since the last boundary: no new compiled code (an eager step's case)
            frames = traced.frames_compiled()
            if not first and frames == self._frames and not self._traced_ran:
                return
            self._frames = frames
            entries = traced.cache_entries(self._codes)
            stale = entries > 0 if first else entries > (self._entries or 0) and not self._armed
            self._entries = entries
            if not (self._traced_ran or entries > 0 or wrapped):
                return
            self.compiled = True
            if stale and not self._traced_ran:
                dropped = traced.drop_compiled(self._codes)
                logger.info(
                    "trainmon: the model was compiled before its hooks were installed; dropped the compiled "
                    "code of %s so that it is traced again with them (one recompilation)",
                    ", ".join(dropped),
                )
        except Exception:  # a failed look at dynamo's caches must never stop training
            logger.exception("trainmon: checking whether the model is compiled failed")
            self.compiled = True  # hooks armed on every step: never fewer tensors than asked for

    @guarded("the check that the module hooks ran")
    def step_done(self, rows: Sequence[Any], forward_ran: bool) -> None:
        """After a collected step: a model that ran (its forward seen by the micro-step counter, or
        gradients recorded) but gave none of our rows runs code traced without our hooks that we could not
        find (a compiled function around the model): say so, once. DTensor activations that compiled code
        left out (``traced.UNREAD``) are said once too."""
        self._say_unread()
        if self._warned_blind or not self._sites:
            return
        kinds = {_ACTV} if self._forward else {_ACTV_GRAD}
        if any(row.kind in kinds for row in rows):
            return
        if not (forward_ran or any(row.kind in _GRAD_KINDS for row in rows)):
            return
        self._warned_blind = True
        job_wide(logger).warning(
            "trainmon: step %d trained the model, but none of the %d monitored modules' hooks ran: "
            "activations%s are not collected. The model most likely runs compiled code traced before "
            "trainmon attached (e.g. a torch.compile'd function around the model). Attach before compiling, "
            "or call torch._dynamo.reset() after attaching.",
            self._state.step,
            len(self._sites),
            " and activation gradients" if self._backward else "",
        )

    def _build(self) -> None:
        """The hooks of every site, made once: their names, name caches and gradient hooks (``_Names``) then
        last the whole run, through every step that arms them again."""
        device = _device_of(self._chunks, self._sites)
        self._probe = torch.zeros(1, device=device)
        for vpp, chunk in enumerate(self._chunks):
            self._pass_sites.append(self._site(self._pass_handler(vpp)))
            count = functools.partial(self._count_pass, vpp)
            self._slots.append(HookSlot(functools.partial(chunk.register_forward_pre_hook, count)))
        for site in self._sites:
            names = _Names(site.name, self._state, self._buffer, site.vpp_stage)
            names.site = self._site(self._traced_handler(site.vpp_stage, names))
            self._all_names.append(names)
            if self._backward:
                # the pre-hook notes the inputs' graph edges before the module runs
                pre = self._inputs_hook(site.vpp_stage, names)
                register = functools.partial(site.module.register_forward_pre_hook, pre, with_kwargs=True)
                self._slots.append(HookSlot(register))
            if self._forward or self._backward:
                hook = self._forward_hook(site.vpp_stage, names)
                slot = HookSlot(functools.partial(site.module.register_forward_hook, hook, with_kwargs=True))
                self._slots.append(slot)
                after = None
                if self._forward and any(map(_hands_on_layout, site.module._forward_hooks.values())):
                    reduced = _reduced_output_hook(names)
                    register = functools.partial(site.module.register_forward_hook, reduced, with_kwargs=True)
                    after = HookSlot(register)
                    self._slots.append(after)
                self._forward_hooks.append((site.module, slot, after))

    def disarm(self) -> None:
        """The hooks out: on an off step of an eager model, or for good (close, a config reload): compiled
        code traced with them keeps calling their traced path, which does nothing once released here."""
        for slot in self._slots:
            slot.disarm()
        self._armed = False
        traced.set_collecting(id(self), False)
        if not self.compiled:
            return
        for site in self._sites_ids:
            traced.unregister(site)
        self._sites_ids.clear()
        self._slots.clear()
        self._forward_hooks.clear()

    def _site(self, handler: traced.Handler) -> int:
        site = traced.register(handler)
        self._sites_ids.append(site)
        return site

    def _count_pass(self, vpp: int, module: nn.Module, args: tuple) -> None:
        if _is_compiling():  # traced (the chunk itself is inside compiled code): counted at run time
            if module.training:
                traced.emit(self._probe, self._pass_sites[vpp], _PASS)
            return
        if module.training and not in_backward_pass():
            self._passes[vpp] += 1
            if self._ordered_at != self._state.step:
                self._ordered_at = self._state.step
                self._keep_forward_hooks_last()

    @guarded("ordering the forward hooks")
    def _keep_forward_hooks_last(self) -> None:
        """Move our forward hook of each module behind hooks registered after it (torch runs a module's
        forward hooks in the order of its ``_forward_hooks`` dict), but in front of the hooks by which
        tensor parallelism hands a layer's output on in another layout (``distribute_module``'s): the
        module's output is the DTensor it computed, whose placements say how to read it whole, not this
        rank's plain piece of it."""
        for module, slot, after in self._forward_hooks:
            hooks, hook_id = module._forward_hooks, slot.id
            if not hooks or hook_id not in hooks:
                continue
            layouts = [key for key, hook in hooks.items() if _hands_on_layout(hook)]
            tail = [hook_id, *layouts] + ([after.id] if after is not None and after.id in hooks else [])
            if list(hooks)[len(hooks) - len(tail) :] != tail:
                for key in tail:
                    hooks.move_to_end(key)

    def _forward_hook(self, vpp: int, names: _Names):
        state, forward, backward, passes = self._state, self._forward, self._backward, self._passes
        guard = Guard(f"forward hook of {names.base!r}")

        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
            if _is_compiling():
                return self._traced_forward(names, module, args, kwargs, output)
            try:
                if not module.training:
                    return  # eval passes are not micro-batches
                # activation recomputation (checkpointing) runs the forward again inside backward: its
                # activations were recorded by the first pass (which ran under no_grad), but gradient hooks
                # can only be attached now, to the recomputed graph
                backward_pass = backward_pass_id()
                recompute = backward_pass != -1
                # the number the pre-hook gave this call (it counts where there is one: a call starts there)
                opened = names.open
                call = opened.pop() if opened else names.call(_pass_of(passes, vpp, backward_pass))
                inputs = names.open_inputs.pop() if names.open_inputs else None
                if inputs is not None and _grad_enabled():
                    _hook_consumers(names, call, *inputs, output)
                if backward and _grad_enabled():
                    micro = _graph_micro(state, vpp, recompute)
                    if type(output) is _Tensor:  # most modules: one tensor out (each_tensor, inlined)
                        if output.requires_grad and not output.is_leaf:
                            on_grad(output, names.grad_hook("output_grad", 0, False, call, micro))
                    else:
                        each_tensor(output, _hook_grad, names, "output_grad", call, micro)
                if not forward or recompute:
                    return
                micro = state.forward_micro
                if len(args) == 1 and type(args[0]) is _Tensor:  # most calls: one tensor in
                    _record(names, "input", 0, False, call, micro, args[0])
                else:
                    each_tensor(args, _record, names, "input", call, micro)
                if kwargs:  # most calls have none: no call for them
                    each_tensor(kwargs, _record, names, "input", call, micro)
                if type(output) is _Tensor:
                    _record(names, "output", 0, False, call, micro, output)
                elif _pending_reduction(output):
                    names.deferred = (call, micro, output)
                else:
                    each_tensor(output, _record, names, "output", call, micro)
            except Exception as error:
                guard.failed(error)

        return hook

    def _inputs_hook(self, vpp: int, names: _Names):
        """Activation gradients w.r.t. the module's inputs, from this module only (the module's
        ``grad_input``), read without touching the graph: the pre-hook notes where each input that requires
        grad enters autograd's graph, and the forward hook puts node hooks on the nodes of the module's call
        that consume it (``_hook_consumers``); their gradients for it are summed by the monitor. A view of
        the input through which to read them (what ``register_full_backward_hook`` does) would make autograd
        sum the input's gradients in another grouping wherever the input has other consumers too (the
        residual stream of every pre-norm transformer), which moves the training's numbers in their last
        bits. Models that modify activations in place (Megatron's masked softmax) keep working: the edges
        are taken before the module runs."""
        state, passes = self._state, self._passes
        guard = Guard(f"backward hook of {names.base!r}")

        def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            if _is_compiling():
                return self._traced_inputs(names, module, args, kwargs)
            try:
                if not module.training:
                    return None
                backward_pass = backward_pass_id()
                call = names.call(_pass_of(passes, vpp, backward_pass))
                names.open.append(call)
                edges = _input_edges(args, kwargs) if _grad_enabled() else None
                micro = _graph_micro(state, vpp, backward_pass != -1) if edges else 0
                names.open_inputs.append((micro, edges) if edges else None)
            except Exception as error:
                guard.failed(error)
            return None

        return hook

    # ------------------------------------------------------------------------------------ traced path
    # What the hooks do while dynamo traces them: no loop state read, no Python side effect, only ops
    # (``traced.emit``, ``traced.observe_grad``) whose run-time handlers below do what the eager hooks do.

    def _traced_forward(
        self, names: _Names, module: nn.Module, args: tuple, kwargs: dict, output: Any
    ) -> Any:
        if not module.training or not traced.COLLECTING:
            return None
        site = names.site
        grads = self._backward and torch.is_grad_enabled()
        # the op's tensor: the output where it is one (on the model's device, already materialised)
        anchor = output if isinstance(output, _Tensor) and not is_dtensor(output) else self._probe
        traced.emit(anchor, site, _CALL_GRAD if grads else _CALL)
        if self._forward:
            for key, tensor in _keyed(args, single_index=False):
                traced.emit(tensor, site, _INPUT, key)
            for key, tensor in _keyed(kwargs, single_index=False):
                traced.emit(tensor, site, _INPUT, key)
            for key, tensor in _keyed(output, single_index=False):
                traced.emit(tensor, site, _OUTPUT, key)
        if not grads:
            return None
        return _with_grad_sites(output, site, _OUTPUT_GRAD)

    def _traced_inputs(self, names: _Names, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        if not module.training or not torch.is_grad_enabled() or not traced.COLLECTING:
            return None
        site = names.site
        # the eager pre-hook's names: one argument alone is unindexed, else indexed when several are tensors
        indexed = sum([isinstance(a, _Tensor) for a in args]) > 1
        new_args = tuple(
            [_grad_site(a, site, _INPUT_GRAD, str(i) if indexed else "") for i, a in enumerate(args)]
        )
        new_kwargs = {k: _grad_site(v, site, _INPUT_GRAD, str(k)) for k, v in kwargs.items()}
        return new_args, new_kwargs

    def _pass_handler(self, vpp: int) -> traced.Handler:
        passes = self._passes
        guard = Guard(f"forward pass counter of chunk {vpp}")

        def handle(what: int, key: str, tensor: torch.Tensor) -> None:
            try:
                if not in_backward_pass():
                    passes[vpp] += 1
            except Exception as error:
                guard.failed(error)

        return handle

    def _traced_handler(self, vpp: int, names: _Names) -> traced.Handler:
        """Run time of a traced module hook: what the eager hooks would have done, reading the loop state
        now (collected or not, which micro-step), so compiled code never depends on it."""
        state, buffer, passes = self._state, self._buffer, self._passes
        guard = Guard(f"traced hook of {names.base!r}")

        def handle(what: int, key: str, tensor: torch.Tensor) -> None:
            try:
                if what <= _CALL_GRAD:  # a call starts: its number, as the eager pre-hook gives it
                    self._traced_ran = True
                    backward_pass = backward_pass_id()
                    call = names.call(_pass_of(passes, vpp, backward_pass))
                    names.traced_call, names.traced_recompute = call, backward_pass != -1
                    if what == _CALL_GRAD:
                        if call == 0:
                            names.grad_calls.clear()
                        names.grad_calls.append(call)
                    return
                if not state.collecting:
                    return
                role = _ROLES[what]
                if what <= _OUTPUT:
                    if not names.traced_recompute:
                        name = names.get(role, key or 0, key != "", names.traced_call)
                        buffer.add(_ACTV, name, vpp, state.forward_micro, _FORWARD, tensor)
                    return
                # gradients come in reverse order of the calls: the last call's first (a module called
                # once per pass, the usual case, has one number: 0)
                calls = names.grad_calls
                name = names.get(role, key or 0, key != "", calls[-1] if calls else 0)
                micro = state.backward_micro
                buffer.add(_ACTV_GRAD, name, vpp, micro if micro > 0 else 0, _BACKWARD, tensor)
            except Exception as error:
                guard.failed(error)

        return handle


def _device_of(chunks: Sequence[nn.Module], sites: Sequence[ModuleSite]) -> torch.device:
    """The device of the model's first parameter or buffer (the CPU for a model without any)."""
    for module in [*chunks, *(s.module for s in sites)]:
        for tensor in itertools.chain(module.parameters(), module.buffers()):
            return tensor.device
    return torch.device("cpu")


def _keyed(values: Any, single_index: bool) -> list[tuple[str, torch.Tensor]]:
    """The tensors of a hook argument with the keys their eager rows are named by (``each_tensor``): ""
    for an unindexed tensor (one alone), else the element's index or dict key."""
    if isinstance(values, torch.Tensor):
        return [("", values)]
    if isinstance(values, (tuple, list)):
        indexed = single_index or len(values) > 1
        return [(str(i) if indexed else "", v) for i, v in enumerate(values) if isinstance(v, torch.Tensor)]
    if isinstance(values, dict):
        return [(str(k), v) for k, v in values.items() if isinstance(v, torch.Tensor)]
    return []


_WHAT_ROLES = {_INPUT: "input", _OUTPUT: "output", _INPUT_GRAD: "input_grad", _OUTPUT_GRAD: "output_grad"}


def _grad_site(value: Any, site: int, what: int, key: str) -> Any:
    """``value``, its gradient observed at ``site`` when it is a tensor that autograd produced."""
    if (
        isinstance(value, torch.Tensor)
        and value.requires_grad
        and not value.is_leaf
        and traced.traceable(value, site, what, grad=True)
    ):
        return traced.observe_grad(value, site, what, key)
    return value


def _with_grad_sites(output: Any, site: int, what: int) -> Any:
    """The module's output, each tensor of it (keyed as ``_keyed`` does) with its gradient observed."""
    if isinstance(output, torch.Tensor):
        return _grad_site(output, site, what, "")
    if isinstance(output, (tuple, list)):
        indexed = len(output) > 1
        values = [_grad_site(v, site, what, str(i) if indexed else "") for i, v in enumerate(output)]
        return type(output)(values) if type(output) in (tuple, list) else output
    if isinstance(output, dict) and type(output) is dict:
        return {k: _grad_site(v, site, what, str(k)) for k, v in output.items()}
    return None  # another container: its gradients are not observed (no hook can swap its tensors safely)


def _pending_reduction(output: Any) -> bool:
    """A DTensor output with a ``Partial`` placement (a row-wise parallel layer's): the tensor parallelism
    hook behind ours reduces it anyway, and a reduction made here would be a second one (and would consume the
    mask of a vocabulary-parallel embedding's ``_MaskPartial``)."""
    return is_dtensor(output) and any(p.is_partial() for p in output.placements)


def _reduced_output_hook(names: _Names):
    """The forward hook behind tensor parallelism's output hooks: records an output :func:`_pending_reduction`
    left, as tensor parallelism hands it on (reduced: replicated, or a DTensor)."""
    guard = Guard(f"forward hook of {names.base!r} (reduced output)")

    def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        deferred, names.deferred = names.deferred, None
        if deferred is None:
            return
        try:
            call, micro, pending = deferred
            name = names.get("output", 0, False, call)
            if is_dtensor(output):
                names.buffer.add(_ACTV, name, names.vpp, micro, _FORWARD, output)
                return
            local = output.trigger_wait() if hasattr(output, "trigger_wait") else output
            if not isinstance(local, _Tensor):
                return
            whole = tuple(pending.shape)
            if tuple(local.shape) == whole:  # reduced to a replica: the whole tensor
                names.buffer.add(_ACTV, name, names.vpp, micro, _FORWARD, local)
                return
            # reduced to a shard (row-wise parallel's output_layouts=Shard(d)) and handed on as this rank's
            # plain piece: merged over the mesh dimensions the reduction ran over
            dims = [i for i, p in enumerate(pending.placements) if p.is_partial()]
            piece = Shard(local, GATE.groups_of(pending.device_mesh, tuple(dims)), whole)
            names.buffer.add_shard(_ACTV, name, names.vpp, micro, _FORWARD, piece)
            _say_local_shards_go_on(names.base)
        except Exception as error:
            guard.failed(error)

    return hook


_said_local_shards: list[str] = []


def _say_local_shards_go_on(module: str) -> None:
    """Once a process: a layer hands its output on as this rank's plain piece of a sharded tensor (sequence
    parallelism with ``use_local_output=True``), so the modules downstream that are not parallelised
    themselves (a block around the layer, the residual stream) receive a piece without a placement."""
    if _said_local_shards:
        return
    _said_local_shards.append(module)
    job_wide(logger).warning(
        "trainmon: tensor parallelism hands the output of %r on as this rank's piece of a sharded tensor "
        "(use_local_output=True); it is recorded whole, but modules downstream that are not parallelised "
        "themselves (the blocks around it, the residual stream) receive plain pieces and record this "
        "rank's piece only. Parallelise with use_local_output=False to have them recorded whole "
        "(docs/fsdp.md)",
        module,
    )


def _hands_on_layout(hook: Any) -> bool:
    """A forward hook that ``torch.distributed.tensor.distribute_module`` installed (tensor parallelism's
    output layouts: a DTensor output redistributed, or turned into this rank's local tensor)."""
    return getattr(hook, "__module__", None) == "torch.distributed.tensor._api"


def _pass_of(passes: list[int], vpp: int, backward_pass: int) -> int:
    """The forward pass a call belongs to: the chunk's current pass, or (negative) the backward pass whose
    recomputation runs it."""
    return passes[vpp] if backward_pass == -1 else -2 - backward_pass


def _graph_micro(state: LoopPosition, vpp: int, recompute: bool) -> int:
    """The forward micro-batch a graph being built belongs to, or -1 where that does not say which backward
    micro-batch its hooks run in: recomputation happens inside a backward that has started already, and
    the micro-steps are counted on the first model chunk only (other chunks' forwards interleave with it)."""
    return -1 if recompute or vpp != 0 else state.forward_micro


def _input_edges(args: tuple, kwargs: dict) -> list[tuple[Any, bool, Any, int]]:
    """(key, indexed, node, output_nr) of every tensor argument that requires grad: the autograd node that
    produced it (its gradient accumulator for a leaf) and which of the node's outputs it is, keyed as
    ``each_tensor`` keys the pre-hook's arguments (one argument alone unindexed, else indexed)."""
    edges = []
    several = sum([isinstance(a, _Tensor) for a in args]) > 1
    for key, value in itertools.chain(enumerate(args), kwargs.items()):
        if isinstance(value, _Tensor) and value.requires_grad:
            node = value.grad_fn
            if node is None:  # a leaf: the accumulator its gradient goes to (no view made for it)
                node = get_gradient_edge(value).node
            edges.append((key, several or isinstance(key, str), node, value.output_nr))
    return edges


def _hook_consumers(
    names: _Names, call: int, micro: int, edges: list[tuple[Any, bool, Any, int]], output: Any
) -> None:
    """Node hooks on the nodes of this call that take an input directly: found by walking the graph back
    from the call's outputs, never past the nodes that produced its inputs nor into nodes older than them
    (the graph built before the call). Each input's gradient is the sum of what those nodes send it."""
    targets = {(id(node), nr): (key, indexed) for key, indexed, node, nr in edges}
    oldest = max((_sequence_nr(node) for _, _, node, _ in edges), default=-1)
    # the inputs' own nodes are never walked past: marked seen from the start
    seen = {id(node) for _, _, node, _ in edges}
    stack = [t.grad_fn for t in _output_tensors(output) if t.grad_fn is not None]
    consumers: dict[int, tuple[Any, list[tuple[int, Any]]]] = {}
    target_of, visited, walk = targets.get, seen.add, stack.append
    while stack:
        node = stack.pop()
        key = id(node)
        if key in seen:
            continue
        visited(key)
        for index, (after, nr) in enumerate(node.next_functions):
            if after is not None:
                target = target_of((id(after), nr))
                if target is not None:
                    consumers.setdefault(key, (node, []))[1].append((index, target))
                elif id(after) not in seen and oldest < after._sequence_nr() < _ACCUMULATOR_NR:
                    walk(after)
    if not consumers:
        return
    if len(consumers) == 1:
        node, taken = next(iter(consumers.values()))
        if len(taken) == 1:  # most inputs: one node of the call takes them, once (no sum to make)
            index, (key, indexed) = taken[0]
            node.register_hook(names.node_hook(key, indexed, call, micro, index))
            return
    sums = _InputGradSums(names, call, micro, consumers.values())
    for node, taken in consumers.values():
        node.register_hook(functools.partial(sums.arrived, taken))


_ACCUMULATOR_NR = 1 << 62  # gradient accumulators carry UINT64_MAX as their sequence number


def _sequence_nr(node: Any) -> int:
    nr = node._sequence_nr()
    return -1 if nr >= _ACCUMULATOR_NR else nr  # a gradient accumulator: as old as can be


def _output_tensors(output: Any) -> list[torch.Tensor]:
    if isinstance(output, _Tensor):
        return [output] if output.requires_grad else []
    found: list[torch.Tensor] = []
    values = (
        output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else ()
    )
    for value in values:
        found.extend(_output_tensors(value))
    return found


class _NodeGrad:
    """A node hook that hands the gradient the node sends along its edge ``index`` to a row's gradient hook
    (made once per row and micro-batch, as those are: hooking a node allocates nothing that outlives it)."""

    __slots__ = ("_hook", "_index")

    def __init__(self, hook: Callable[[torch.Tensor], None], index: int) -> None:
        self._hook, self._index = hook, index

    def __call__(self, grad_inputs: tuple, grad_outputs: tuple) -> None:
        grad = grad_inputs[self._index]
        if grad is not None:
            self._hook(grad)


class _InputGradSums:
    """The gradients the consumer nodes of one call send each input, summed; recorded as the input's
    ``input_grad`` row once every consumer has sent its share (in the order backward runs them)."""

    __slots__ = ("_names", "_call", "_micro", "_left", "_sums")

    def __init__(self, names: _Names, call: int, micro: int, consumers: Any) -> None:
        self._names, self._call, self._micro = names, call, micro
        self._left: dict[Any, int] = {}
        for _, taken in consumers:
            for _, target in taken:
                self._left[target] = self._left.get(target, 0) + 1
        self._sums: dict[Any, torch.Tensor] = {}

    def arrived(self, taken: list[tuple[int, Any]], grad_inputs: tuple, grad_outputs: tuple) -> None:
        try:
            self._add(taken, grad_inputs)
        except Exception as error:  # a node hook that raised would stop the training's backward
            Guard(f"input gradient of {self._names.base!r}").failed(error)

    def _add(self, taken: list[tuple[int, Any]], grad_inputs: tuple) -> None:
        for index, target in taken:
            grad = grad_inputs[index]
            if grad is not None:
                held = self._sums.get(target)
                self._sums[target] = grad if held is None else held + grad
            self._left[target] -= 1
            if self._left[target] == 0:
                total = self._sums.pop(target, None)
                if total is not None:
                    key, indexed = target
                    self._names.grad_hook("input_grad", key, indexed, self._call, self._micro)(total)


_HOOK_IDS = itertools.count(-1, -1)  # keys of our hooks in a tensor's hook dictionary: never torch's own


def on_grad(tensor: torch.Tensor, hook: Callable[[torch.Tensor], None]) -> None:
    """``tensor.register_hook(hook)`` for a hook that lives as long as the tensor (a non-leaf that requires
    grad): autograd's hook dictionary of the tensor written as that method writes it, without the removable
    handle it builds, the import it runs and the dispatch checks it makes on every call (most of a
    monitored activation's host time). Tensor subclasses take the method itself."""
    if type(tensor) is not torch.Tensor:
        tensor.register_hook(hook)
        return
    hooks = tensor._backward_hooks
    if hooks is None:
        hooks = tensor._backward_hooks = OrderedDict()
        tensor.grad_fn._register_hook_dict(tensor)
    hooks[next(_HOOK_IDS)] = hook


def _produced(value: torch.Tensor) -> bool:
    """A non-leaf that requires grad. A leaf output is a parameter handed back as it is (Megatron's
    linear layers return ``(output, self.bias)`` to fuse the bias later): a hook on it would stay for the
    run, one more every call, and fire in later micro-batches and steps with a stale micro-step."""
    return value.requires_grad and not value.is_leaf


def _grad_hook(state: LoopPosition, buffer: StepBuffer, name: str, vpp: int):
    guard = Guard(f"gradient hook of {name!r}")

    def hook(forward_micro: int, grad: torch.Tensor) -> None:
        try:
            if state.collecting:  # a graph built on a collected step may be run backward after it ended
                # this hook may be the first of its micro-batch to fire (a module whose output is the model's
                # output was hooked before the micro-step counter saw that output): start the micro-batch here
                if forward_micro > state.backward_of:
                    state.start_backward(forward_micro)
                micro = state.backward_micro
                buffer.add(_ACTV_GRAD, name, vpp, micro if micro > 0 else 0, _BACKWARD, grad)
        except Exception as error:
            guard.failed(error)

    return hook


class MicroStepCounter:
    """Counts forward and backward micro-batches of the model's first chunk. Always installed: two Python
    calls per micro-batch, needed to number micro-steps and to find the last one. On timed steps the same
    hooks mark where the step's forward and backward passes start and end (``timer``,
    trainmon.step.timing)."""

    def __init__(self, root: nn.Module, state: LoopPosition) -> None:
        self._state = state
        self.timer: StepTimer | None = None
        # the traced path, where the root itself runs inside compiled code (a compiled function around it)
        device = _device_of([root], ())
        self._probe = torch.zeros(1, device=device)
        self._site = traced.register(self._traced_handler)
        self._graphs: deque[int] = deque()  # forward micro-steps whose backward is still to come
        self._backward_task = -1  # the backward pass that started the last backward micro-step
        self._handles = [
            root.register_forward_pre_hook(self._on_forward_start),
            root.register_forward_hook(self._on_forward_end),
        ]

    @guarded("micro-step counter")
    def _on_forward_start(self, module: nn.Module, args: tuple) -> None:
        if _is_compiling():
            if module.training:
                anchor = args[0] if args and isinstance(args[0], _Tensor) else self._probe
                traced.emit(anchor, self._site, _FORWARD_START)
            return
        if module.training and not in_backward_pass():
            self._state.start_forward()
            timer = self.timer
            if timer is not None and timer.active:
                timer.forward_start()

    @guarded("micro-step counter")
    def _on_forward_end(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if _is_compiling():
            if not module.training:
                return None
            grads = torch.is_grad_enabled()
            anchor = output if isinstance(output, _Tensor) and not is_dtensor(output) else self._probe
            traced.emit(anchor, self._site, _FORWARD_END_GRAD if grads else _FORWARD_END)
            return _with_grad_sites(output, self._site, _BACKWARD_START) if grads else None
        if not module.training or in_backward_pass():
            return
        timer = self.timer
        if timer is not None and timer.active:
            timer.forward_end()
        if not torch.is_grad_enabled():
            return
        # every output, not only the first: the backward of a later output (an auxiliary loss) may run first
        start = functools.partial(self._on_backward_start, self._state.forward_micro)
        each_tensor(output, _hook_start, start, "", 0, 0, nested=True)

    def _on_backward_start(self, forward_micro: int, grad: torch.Tensor) -> None:
        self._state.start_backward(forward_micro)
        timer = self.timer
        if timer is not None and timer.active and timer.backward_start():
            _queue_callback(timer.backward_end)  # the engine calls it when this backward pass is done

    @guarded("micro-step counter (compiled)")
    def _traced_handler(self, what: int, key: str, tensor: torch.Tensor) -> None:
        """Run time of the traced hooks: the eager hooks' work. A backward micro-step starts at the first
        gradient of a new backward pass, and belongs to the oldest forward micro-step still waiting."""
        if what == _FORWARD_START:
            if not in_backward_pass():
                self._on_forward_start_now()
        elif what == _BACKWARD_START:
            task = backward_pass_id()
            if task != self._backward_task and self._graphs:
                self._backward_task = task
                self._on_backward_start(self._graphs.popleft(), tensor)
        elif not in_backward_pass():
            timer = self.timer
            if timer is not None and timer.active:
                timer.forward_end()
            if what == _FORWARD_END_GRAD:
                self._graphs.append(self._state.forward_micro)

    def _on_forward_start_now(self) -> None:
        self._state.start_forward()
        if self._state.forward_micro == 0:
            self._graphs.clear()  # a new step: forward micro-steps of the last that never ran backward
        timer = self.timer
        if timer is not None and timer.active:
            timer.forward_start()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        traced.unregister(self._site)


def _hook_start(
    start: Any, role: str, key: Any, indexed: bool, call: int, micro: int, tensor: torch.Tensor
) -> None:
    """The micro-step counter's hook on an output of the model chunk: the first to fire starts the backward
    micro-batch."""
    if _produced(tensor):
        on_grad(tensor, start)
