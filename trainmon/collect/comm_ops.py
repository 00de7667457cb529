"""What each torch.distributed collective's arguments mean: which tensors it reads, which it writes, on which
group, and under which names one collective appears (torch 2.13 routes older names to the ``*_single``
functions). Used by the ``cc_distribution`` collector (:mod:`trainmon.collect.comm`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class _Call:
    group: Any
    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]


def arg(args: tuple, kwargs: dict, i: int, name: str, default: Any = None) -> Any:
    return args[i] if len(args) > i else kwargs.get(name, default)


def _tensors(value: Any) -> list[torch.Tensor]:
    """Tensors of an argument: a tensor, a list of tensors, or a list of lists of tensors."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


def _is_root(group: Any, rank: Any, group_rank: Any) -> bool:
    """This rank is the src/dst of a rooted collective (``group_src``/``group_dst`` are group ranks)."""
    import torch.distributed as dist

    if group_rank is not None:
        return dist.get_rank(group) == group_rank
    return rank is not None and dist.get_rank() == rank


def _in_place(name: str, g: int) -> Callable[[tuple, dict], _Call]:
    """Ops that reduce into their first argument: ``(tensor or tensors, op, group)``."""

    def extract(args: tuple, kwargs: dict) -> _Call:
        tensors = _tensors(arg(args, kwargs, 0, name))
        return _Call(arg(args, kwargs, g, "group"), tensors, tensors)

    return extract


def _out_in(out_name: str, in_name: str, g: int) -> Callable[[tuple, dict], _Call]:
    """Ops whose first argument receives and whose second is sent: ``(output, input, ..., group)``."""

    def extract(args: tuple, kwargs: dict) -> _Call:
        outputs = _tensors(arg(args, kwargs, 0, out_name))
        inputs = _tensors(arg(args, kwargs, 1, in_name))
        return _Call(arg(args, kwargs, g, "group"), inputs, outputs)

    return extract


def _broadcast(args: tuple, kwargs: dict) -> _Call:
    tensor, group = arg(args, kwargs, 0, "tensor"), arg(args, kwargs, 2, "group")
    root = _is_root(group, arg(args, kwargs, 1, "src"), arg(args, kwargs, 4, "group_src"))
    return _Call(group, [tensor] if root else [], [tensor])


def _reduce(args: tuple, kwargs: dict) -> _Call:
    tensor, group = arg(args, kwargs, 0, "tensor"), arg(args, kwargs, 3, "group")
    root = _is_root(group, arg(args, kwargs, 1, "dst"), arg(args, kwargs, 5, "group_dst"))
    return _Call(group, [tensor], [tensor] if root else [])


def _gather(args: tuple, kwargs: dict) -> _Call:
    group = arg(args, kwargs, 3, "group")
    root = _is_root(group, arg(args, kwargs, 2, "dst"), arg(args, kwargs, 5, "group_dst"))
    gathered = _tensors(arg(args, kwargs, 1, "gather_list")) if root else []
    return _Call(group, _tensors(arg(args, kwargs, 0, "tensor")), gathered)


def _scatter(args: tuple, kwargs: dict) -> _Call:
    group = arg(args, kwargs, 3, "group")
    root = _is_root(group, arg(args, kwargs, 2, "src"), arg(args, kwargs, 5, "group_src"))
    sent = _tensors(arg(args, kwargs, 1, "scatter_list")) if root else []
    return _Call(group, sent, _tensors(arg(args, kwargs, 0, "tensor")))


def _all_to_all_single(args: tuple, kwargs: dict) -> _Call:
    outputs, inputs = _tensors(arg(args, kwargs, 0, "output")), _tensors(arg(args, kwargs, 1, "input"))
    return _Call(arg(args, kwargs, 4, "group"), inputs, outputs)


def _send(args: tuple, kwargs: dict) -> _Call:
    return _Call(arg(args, kwargs, 2, "group"), _tensors(arg(args, kwargs, 0, "tensor")), [])


def _recv(args: tuple, kwargs: dict) -> _Call:
    return _Call(arg(args, kwargs, 2, "group"), [], _tensors(arg(args, kwargs, 0, "tensor")))


def _batch_p2p(args: tuple, kwargs: dict) -> _Call:
    ops = list(arg(args, kwargs, 0, "p2p_op_list") or [])
    sends = [op.tensor for op in ops if getattr(op.op, "__name__", "") == "isend"]
    recvs = [op.tensor for op in ops if getattr(op.op, "__name__", "") == "irecv"]
    return _Call(ops[0].group if ops else None, sends, recvs)


@dataclass(frozen=True)
class _Op:
    name: str  # the row name's op part: aliases of one collective share it
    extract: Callable[[tuple, dict], _Call] | None  # None: counted, no statistics (barrier, objects)


OPS: dict[str, _Op] = {
    "all_reduce": _Op("all_reduce", _in_place("tensor", 2)),
    "all_reduce_coalesced": _Op("all_reduce_coalesced", _in_place("tensors", 2)),
    "broadcast": _Op("broadcast", _broadcast),
    "reduce": _Op("reduce", _reduce),
    "all_gather": _Op("all_gather", _out_in("tensor_list", "tensor", 2)),
    "all_gather_coalesced": _Op(
        "all_gather_coalesced", _out_in("output_tensor_lists", "input_tensor_list", 2)
    ),
    "gather": _Op("gather", _gather),
    "scatter": _Op("scatter", _scatter),
    "reduce_scatter": _Op("reduce_scatter", _out_in("output", "input_list", 3)),
    "all_to_all": _Op("all_to_all", _out_in("output_tensor_list", "input_tensor_list", 2)),
    "all_to_all_single": _Op("all_to_all_single", _all_to_all_single),
    "send": _Op("send", _send),
    "isend": _Op("isend", _send),
    "recv": _Op("recv", _recv),
    "irecv": _Op("irecv", _recv),
    "batch_isend_irecv": _Op("batch_isend_irecv", _batch_p2p),
    "barrier": _Op("barrier", None),
}
# one collective under several names (torch 2.13 routes the older ones to the *_single functions)
for _alias in ("all_gather_into_tensor", "_all_gather_base", "all_gather_single"):
    OPS[_alias] = _Op("all_gather_into_tensor", _out_in("output_tensor", "input_tensor", 2))
for _alias in ("reduce_scatter_tensor", "_reduce_scatter_base", "reduce_scatter_single"):
    OPS[_alias] = _Op("reduce_scatter_tensor", _out_in("output", "input", 3))
for _alias in (
    "all_gather_object",
    "gather_object",
    "broadcast_object_list",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
):
    OPS[_alias] = _Op(_alias, None)  # pickled bytes: counted, their statistics mean nothing

COLLECTIVES: tuple[str, ...] = tuple(OPS)
