"""Collectives (``cc_distribution``): statistics of what each torch.distributed collective receives and
produces, one ``comm`` row per call and role, named ``{op}.{group}.input`` / ``{op}.{group}.output``.

Where the wrappers go. Megatron and DeepSpeed keep their own references to the collective functions
(``param_and_grad_buffer.dist_reduce_scatter_func``, ``from torch.distributed import _coalescing_manager``,
DeepSpeed's ``TorchBackend.all_gather_function``), so replacing ``torch.distributed.X`` alone misses the
collectives that matter. On arm, every reference to an original function in ``torch.distributed``, in
``distributed_c10d`` (torch routes its deprecated names through those module globals), in the globals of every
loaded ``megatron.*`` / ``deepspeed.*`` module and in DeepSpeed's communication backend object is replaced
by a wrapper; disarm puts the originals back. Calls nested inside a wrapped call (``all_gather_into_tensor``
-> ``all_gather_single``, ``recv`` -> ``irecv``, object collectives, ``batch_isend_irecv``) are the outer
call's business: each user call is counted and recorded once.

When the tensors are read. Inputs before the call (in-place ops overwrite them), outputs when they are valid:
at return for synchronous calls, when the returned ``Work`` is waited for ``async_op=True`` (``Work.wait`` is
wrapped while armed), at the exit of a ``_coalescing_manager`` block (or its ``cm.wait()`` for async blocks)
for ops issued inside one. What is still outstanding when the step ends is taken then if it has completed.
No wrapper ever issues a collective or reads a value on the host.
"""

from __future__ import annotations

import contextlib
import logging
import re
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from trainmon.collect.base import guarded
from trainmon.collect.comm_ops import OPS, arg
from trainmon.joblog import job_wide
from trainmon.run.records import Kind, Phase, Row

if TYPE_CHECKING:
    from trainmon.config import CcDistribution
    from trainmon.step.buffer import StepBuffer
    from trainmon.step.position import LoopPosition
    from trainmon.step.timing import StepTimer

logger = logging.getLogger("trainmon")

_COMM = Kind.COMM.value
_MAX_WAITING = 4096  # async calls whose outputs are awaited; beyond this the oldest are dropped


# ---------------------------------------------------------------------------------------------------------
# Wrappers and the places they are installed.


class _Wrapper:
    """Stands in for one original collective function wherever it is referenced.

    Compares equal to the original (``P2POp`` checks ``op in [isend, irecv]``) and hashes like it."""

    def __init__(self, fn_name: str, original: Callable[..., Any]) -> None:
        self.original = original
        self.op = OPS[fn_name]
        self.fn_name = fn_name
        self.__name__ = getattr(original, "__name__", fn_name)
        self.__qualname__ = getattr(original, "__qualname__", fn_name)
        self.__module__ = getattr(original, "__module__", "torch.distributed")
        self.__doc__ = getattr(original, "__doc__", None)
        self.__wrapped__ = original

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _HUB.call(self, args, kwargs)

    def __eq__(self, other: object) -> bool:
        return other is self or other is self.original

    def __hash__(self) -> int:
        return hash(self.original)

    def __repr__(self) -> str:
        return f"<trainmon wrapper of {self.original!r}>"


def _originals() -> dict[str, Callable[..., Any]]:
    """The collective functions of torch.distributed as torch defines them (unwrapping our own)."""
    import torch.distributed.distributed_c10d as c10d

    found = {}
    for name in (*OPS, "_coalescing_manager"):
        fn = getattr(c10d, name, None)
        if isinstance(fn, _Wrapper):
            fn = fn.original
        elif getattr(fn, "_trainmon_original", None) is not None:
            fn = fn._trainmon_original
        if fn is not None:
            found[name] = fn
    return found


def _holders() -> list[Any]:
    """Namespaces that may hold references to the collective functions: torch.distributed itself, and the
    loaded modules of the frameworks known to bind them at import time (Megatron, DeepSpeed)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    holders: list[Any] = [dist, c10d]
    for name, module in list(sys.modules.items()):
        if module is not None and name.split(".", 1)[0] in ("megatron", "deepspeed"):
            holders.append(module)
    cdb = getattr(sys.modules.get("deepspeed.comm.comm"), "cdb", None)
    if cdb is not None:  # TorchBackend caches all_gather_function / reduce_scatter_function at init
        holders.append(cdb)
    return holders


@dataclass
class _Site:
    holder: Any
    attr: str
    original: Any
    replacement: Any


def _find_sites(originals: dict[str, Callable[..., Any]], replacements: dict[str, Any]) -> list[_Site]:
    by_id = {id(fn): name for name, fn in originals.items()}
    sites = []
    for holder in _holders():
        try:
            items = list(vars(holder).items())
        except TypeError:
            continue
        for attr, value in items:
            name = by_id.get(id(value))
            if name is not None and value is originals[name]:
                sites.append(_Site(holder, attr, value, replacements[name]))
    return sites


# ---------------------------------------------------------------------------------------------------------
# The process-wide dispatcher: one set of patches, one active collector.


class _Local(threading.local):
    depth = 0


class _Hub:
    def __init__(self) -> None:
        self.collector: CommCollector | None = None
        self.calls = 0  # collectives issued while a collector was armed, every group, every thread
        self.calls_by_op: Counter[str] = Counter()
        self.local = _Local()
        self._sites: list[_Site] = []
        self._work_wait: Any = None

    def call(self, wrapper: _Wrapper, args: tuple, kwargs: dict) -> Any:
        local = self.local
        collector = self.collector
        if local.depth or collector is None:  # inside a call already counted, or nothing armed
            return wrapper.original(*args, **kwargs)
        pending = collector.before(wrapper, args, kwargs)
        self.calls += 1
        self.calls_by_op[wrapper.op.name] += 1
        local.depth += 1
        restore = _p2p_ops_to_current(args, kwargs) if wrapper.fn_name == "batch_isend_irecv" else None
        timer = collector.timer
        started = None
        if timer is not None and timer.active and threading.get_ident() == collector._thread:
            started = timer.collective_start()
        try:
            result = wrapper.original(*args, **kwargs)
        finally:
            local.depth -= 1
            if restore:
                restore()
            if started is not None:
                timer.collective_end(started)
        if pending is not None:
            collector.after(pending, result)
        return result

    def coalescing(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """A wrapper of ``_coalescing_manager``: the outputs of the ops inside are valid at exit (sync) or
        when the block's work is waited (``async_ops=True``)."""
        hub = self

        @contextlib.contextmanager
        def _coalescing_manager(*args: Any, **kwargs: Any) -> Iterator[Any]:
            collector = hub.collector
            block = collector.open_block(arg(args, kwargs, 0, "group")) if collector is not None else None
            try:
                with original(*args, **kwargs) as cm:
                    yield cm
            except BaseException:
                if block is not None and collector is not None:
                    collector.drop_block(block)  # the block failed: its outputs are not valid
                raise
            if block is not None and collector is not None:
                collector.close_block(block, cm)

        _coalescing_manager._trainmon_original = original  # type: ignore[attr-defined]
        return _coalescing_manager

    def install(self, collector: CommCollector) -> None:
        if self.collector is not None and self.collector is not collector:
            job_wide(logger).warning("trainmon: a second collective collector replaces the first")
            self.uninstall()
        self.collector = collector
        if self._sites:
            return
        originals = _originals()
        replacements: dict[str, Any] = {
            name: _Wrapper(name, fn) for name, fn in originals.items() if name != "_coalescing_manager"
        }
        if "_coalescing_manager" in originals:
            replacements["_coalescing_manager"] = self.coalescing(originals["_coalescing_manager"])
        self._sites = _find_sites(originals, replacements)
        for site in self._sites:
            setattr(site.holder, site.attr, site.replacement)
        hub = self
        work = torch.distributed.Work
        original_wait = work.wait
        self._work_wait = original_wait

        def wait(work_self: Any, *args: Any, **kwargs: Any) -> Any:
            result = original_wait(work_self, *args, **kwargs)
            collector = hub.collector
            if collector is not None:
                collector.waited(work_self)
            return result

        wait._trainmon_original = original_wait  # type: ignore[attr-defined]
        work.wait = wait

    def uninstall(self) -> None:
        self.collector = None
        for site in self._sites:
            # put the original back only where our wrapper still is (someone may have wrapped it since)
            if getattr(site.holder, site.attr, None) is site.replacement:
                setattr(site.holder, site.attr, site.original)
        self._sites = []
        work = torch.distributed.Work
        if self._work_wait is not None and getattr(work.wait, "_trainmon_original", None) is self._work_wait:
            work.wait = self._work_wait
        self._work_wait = None


_HUB = _Hub()


def _p2p_ops_to_current(args: tuple, kwargs: dict) -> Callable[[], None] | None:
    """``batch_isend_irecv`` tells sends from receives with ``op.op is isend``: point P2POps made with the
    function that is not installed right now at the one that is, for the duration of the call."""
    import torch.distributed.distributed_c10d as c10d

    current = {"isend": c10d.isend, "irecv": c10d.irecv}
    changed = []
    for p2p in arg(args, kwargs, 0, "p2p_op_list") or []:
        name = getattr(p2p.op, "__name__", "")
        target = current.get(name)
        if target is not None and p2p.op is not target and p2p.op == target:
            changed.append((p2p, p2p.op))
            p2p.op = target
    if not changed:
        return None

    def restore() -> None:
        for p2p, op in changed:
            p2p.op = op

    return restore


def installed_wrappers() -> list[tuple[Any, str]]:
    """(namespace, attribute) of every reference replaced right now (for tests and debugging)."""
    return [(site.holder, site.attr) for site in _HUB._sites]


# ---------------------------------------------------------------------------------------------------------
# The collector.


@dataclass
class _Pending:
    """One call's outputs, to be recorded once they are valid."""

    op: str
    label: str
    outputs: list[torch.Tensor]
    micro_step: int
    phase: str
    works: list[Any] = field(default_factory=list)
    done: int = 0
    members: list[_Pending] | None = None  # an async coalescing block: the calls issued inside it


@dataclass
class _Block:
    group: Any
    entries: list[_Pending] = field(default_factory=list)


def _works_of(result: Any) -> list[Any]:
    work_type = torch.distributed.Work
    if isinstance(result, work_type):
        return [result]
    if isinstance(result, (list, tuple)):
        return [w for w in result if isinstance(w, work_type)]
    return []


class CommCollector:
    """Wraps the collective functions while armed (collected steps) and records ``comm`` rows."""

    def __init__(self, state: LoopPosition, buffer: StepBuffer, config: CcDistribution) -> None:
        self._state = state
        self._buffer = buffer
        self.timer: StepTimer | None = None  # times each call on timed steps (trainmon.step.timing)
        self.statistics = True  # False: the calls are only timed (timing.collectives without cc_distribution)
        self.configure(config)
        self._armed = False
        self._recording = False
        self._thread = threading.get_ident()
        self._labels: dict[int, tuple[Any, str]] = {}
        self._waiting: dict[int, _Pending] = {}
        self._blocks: dict[int, _Block] = {}
        self._unbound: list[_Pending] = []  # issued inside a coalescing block we did not wrap
        self._dropped = 0
        self.stacks: dict[str, list[str]] = {}  # cc_log_only: distinct call stacks per collective

    def configure(self, config: CcDistribution) -> None:
        self._pre_hook = config.cc_pre_hook
        self._log_only = config.cc_log_only
        self._codeline = [re.compile(expr) for expr in config.cc_codeline]

    # --- Collector protocol
    def arm(self) -> None:
        if not self._armed:
            _HUB.install(self)
            self._armed = True
        self._thread = threading.get_ident()
        self._recording = True

    def disarm(self) -> None:
        self._recording = False
        if self._armed:
            self._armed = False
            if _HUB.collector is self:
                _HUB.uninstall()
        self._forget()

    def count(self) -> int:
        """Collectives this process has issued, on any group, while armed (the anomaly ordering counter)."""
        return _HUB.calls

    @guarded("collective statistics at the step end")
    def step_end(self) -> None:
        """Before the step's record is closed: record outputs that are valid by now, stop recording (the
        monitor's own end-of-step collectives are not the job's), forget what did not finish."""
        if not self._recording:
            return
        for pending in self._unbound:
            self._record_outputs(pending)
        unfinished = 0
        seen: set[int] = set()
        for pending in list(self._waiting.values()):
            if id(pending) in seen:
                continue
            seen.add(id(pending))
            if all(w.is_completed() for w in pending.works):
                self._record_outputs(pending)
            else:
                unfinished += 1
        if unfinished:
            logger.debug(
                "trainmon: %d async collectives unfinished at the step end; outputs skipped", unfinished
            )
        self._recording = False
        self._forget()

    def _forget(self) -> None:
        self._waiting.clear()
        self._blocks.clear()
        self._unbound.clear()

    # --- called by the wrappers
    @guarded("collective pre-call statistics")
    def before(self, wrapper: _Wrapper, args: tuple, kwargs: dict) -> _Pending | None:
        extract = wrapper.op.extract
        if not self._recording or extract is None or not self.statistics:
            return None
        if threading.get_ident() != self._thread:
            return None
        if self._codeline and not self._stack_matches():
            return None
        if self._log_only:
            self._log_stack(wrapper.op.name)
            return None
        call = extract(args, kwargs)
        label = self._label(call.group)
        micro, phase = self._where()
        if self._pre_hook and call.inputs:
            self._add(f"{wrapper.op.name}.{label}.input", call.inputs, micro, phase)
        if not call.outputs:
            return None
        pending = _Pending(wrapper.op.name, label, call.outputs, micro, phase)
        block = self._coalescing_block(call.group)
        if block is not None:  # issued into a coalescing block: valid when the block is
            (block.entries if isinstance(block, _Block) else self._unbound).append(pending)
            return None
        return pending

    @guarded("collective post-call statistics")
    def after(self, pending: _Pending, result: Any) -> None:
        works = _works_of(result)
        if not works:  # synchronous: the outputs are there
            self._record_outputs(pending)
            return
        self._await(pending, works)

    def waited(self, work: Any) -> None:
        if not self._waiting:
            return
        pending = self._waiting.pop(id(work), None)
        if pending is None or not any(w is work for w in pending.works):
            return
        pending.done += 1
        if pending.done == len(pending.works) and self._recording and threading.get_ident() == self._thread:
            self._guarded_record(pending)

    @guarded("collective output statistics")
    def _guarded_record(self, pending: _Pending) -> None:
        self._record_outputs(pending)

    def open_block(self, group: Any) -> _Block | None:
        if not self._recording or not self.statistics or threading.get_ident() != self._thread:
            return None
        block = _Block(_resolve(group))
        self._blocks[id(block.group)] = block
        return block

    @guarded("coalesced collective statistics")
    def close_block(self, block: _Block, cm: Any) -> None:
        self._blocks.pop(id(block.group), None)
        if not block.entries:
            return
        works = [w for w in getattr(cm, "works", []) if isinstance(w, torch.distributed.Work)]
        if not works:  # a synchronous block has waited at exit
            for pending in block.entries:
                self._record_outputs(pending)
            return
        # one work for the whole block: its wait (cm.wait()) makes every output valid
        self._await(_Pending("", "", [], 0, "", members=block.entries), works)

    def drop_block(self, block: _Block) -> None:
        self._blocks.pop(id(block.group), None)

    # --- helpers
    def _await(self, pending: _Pending, works: list[Any]) -> None:
        if len(self._waiting) >= _MAX_WAITING:
            self._waiting.pop(next(iter(self._waiting)))
            self._dropped += 1
        pending.works = works
        for work in works:
            self._waiting[id(work)] = pending

    def _record_outputs(self, pending: _Pending) -> None:
        if pending.members is not None:
            for member in pending.members:
                self._record_outputs(member)
            return
        name = f"{pending.op}.{pending.label}.output"
        self._add(name, pending.outputs, pending.micro_step, pending.phase)

    def _coalescing_block(self, group: Any) -> _Block | bool | None:
        """The block collecting ``group``'s ops right now: ours, True for one we did not wrap, or None."""
        import torch.distributed.distributed_c10d as c10d

        state = getattr(getattr(c10d, "_world", None), "pg_coalesce_state", None)
        if not state:
            return None
        pg = _resolve(group)
        if pg not in state:
            return None
        return self._blocks.get(id(pg), True)

    def _where(self) -> tuple[int, str]:
        state = self._state
        micro = state.backward_micro if state.phase == Phase.BACKWARD.value else state.forward_micro
        return max(micro, 0), state.phase

    def _label(self, group: Any) -> str:
        cached = self._labels.get(id(group))
        if cached is not None and cached[0] is group:
            return cached[1]
        label = group_label(group)
        self._labels[id(group)] = (group, label)
        return label

    def _add(self, name: str, tensors: Sequence[torch.Tensor], micro: int, phase: str) -> None:
        tensors = [t.detach() for t in tensors]
        if len(tensors) == 1:
            self._buffer.add(_COMM, name, 0, micro, phase, tensors[0])
            return
        numel = sum(t.numel() for t in tensors)
        self._buffer.add_merged(Row(_COMM, name, 0, micro, phase, (numel,), tensors[0].dtype), tensors)

    def _stack_matches(self) -> bool:
        frame = sys._getframe(2)
        while frame is not None:
            where = f"{frame.f_code.co_filename}[{frame.f_lineno}]"
            if any(p.search(where) for p in self._codeline):
                return True
            frame = frame.f_back
        return False

    def _log_stack(self, op: str) -> None:
        frames = []
        frame = sys._getframe(3)
        while frame is not None:
            frames.append(f"{frame.f_code.co_filename}[{frame.f_lineno}] {frame.f_code.co_name}")
            frame = frame.f_back
        text = "\n".join(reversed(frames))
        seen = self.stacks.setdefault(op, [])
        if text not in seen:
            seen.append(text)
            logger.warning("trainmon: cc_log_only: %s called from\n%s", op, text)


def _resolve(group: Any) -> Any:
    if group is None:
        import torch.distributed.distributed_c10d as c10d

        return c10d._get_default_group()
    return group


def group_label(group: Any) -> str:
    """How a process group appears in row names: ``world`` for the default group, else the description
    the framework gave it (Megatron: ``DATA_PARALLEL_GROUP`` ...) or, lacking one, its c10d name."""
    import torch.distributed.distributed_c10d as c10d

    pg = _resolve(group)
    if pg is c10d._get_default_group():
        return "world"
    desc = str(getattr(pg, "group_desc", "") or "")
    if desc and desc != "undefined":
        return desc
    return str(getattr(pg, "group_name", "") or f"group{id(pg)}")


# ---------------------------------------------------------------------------------------------------------
# Wiring into a monitor.
