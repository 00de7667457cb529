"""Names of activation rows: what a row of a module call is called, and how readers take a name apart.

The monitor names the rows of one module call (trainmon/collect/modules.py, trainmon/mindspore/hooks.py)

* ``<module>.input``, ``<module>.output``: the call's one input, its one output (forward, kind ``actv``);
* ``<module>.input_<i>`` / ``<module>.output_<i>``: the ``i``-th of several positional inputs or outputs,
  ``<module>.input_<key>``: a keyword input;
* ``<module>.output_grad[_<i>]`` / ``<module>.input_grad[_<i>]``: the gradients flowing into the call in
  backward and out of it (kind ``actv_grad``);
* ``...#<n>``: the ``n``-th call (from 0) of a module called more than once in one micro-step's forward
  (a shared block, a loop over a layer); the first call's rows carry no suffix, so the names of modules called
  once stay what they always were. The gradients of a call carry its forward call's number.
"""

from __future__ import annotations

import re
from typing import NamedTuple

__all__ = ["CALL_SEP", "ModuleCall", "call_name", "flows_in", "module_call", "module_role"]

CALL_SEP = "#"
_ROLES = {
    "actv": re.compile(r"^(?P<role>input|output)(?:_(?P<key>.+?))?(?:#(?P<call>\d+))?$"),
    "actv_grad": re.compile(r"^(?P<role>output_grad|input_grad)(?:_(?P<key>.+?))?(?:#(?P<call>\d+))?$"),
}
# What flows into a module call: its inputs in forward, the gradients of its outputs in backward.
_FLOWS_IN = frozenset({"input", "output_grad"})


class ModuleCall(NamedTuple):
    """A row's place in a module call: the module, the role (``input``, ``output``, ``output_grad``,
    ``input_grad``), the key (``""``, a position, a keyword) and the call's number in its micro-step."""

    module: str
    role: str
    key: str
    call: int


def call_name(name: str, call: int) -> str:
    """The row name of the ``call``-th call of a module (``name`` itself for the first)."""
    return f"{name}{CALL_SEP}{call}" if call else name


def module_call(kind: str, name: str) -> ModuleCall | None:
    """The module call a row belongs to, from its kind and name; None for rows that are not a module's
    inputs, outputs or their gradients."""
    pattern = _ROLES.get(str(kind))
    module, _, last = name.rpartition(".")
    m = pattern.match(last) if pattern is not None and module else None
    if m is None:
        return None
    return ModuleCall(module, m.group("role"), m.group("key") or "", int(m.group("call") or 0))


def module_role(kind: str, name: str) -> tuple[str, str, str] | None:
    """(module, role, key) of a row; None for rows that are not a module's inputs, outputs or gradients."""
    found = module_call(kind, name)
    return found[:3] if found else None


def flows_in(role: str) -> bool:
    """Whether a row of this role flows into its call (an input, or an output's gradient in backward)."""
    return role in _FLOWS_IN
