"""How tensor names are written and read: escapes that make any name writable, and the rows of a module call.

**Escapes.** Every output (TensorBoard tags, CSV, the statistics store, anomaly records, the manifest, dumps
and their index) holds a name as valid UTF-8 text without NUL. A module or parameter name is any Python
string: file systems and ``os.fsdecode`` give names holding lone surrogates (``"\\udc80"``), which UTF-8
cannot hold, and a ``ModuleDict`` key may hold a NUL. Such characters are written as backslash escapes,
``\\uXXXX`` (four lowercase hex digits), and a backslash as ``\\\\``, so the encoding is lossless
(:func:`decode_name` gives the name back) and no two names are written alike. Names without a backslash, NUL
or lone surrogate (all names PyTorch models usually have) are written as they are.

**Rows of a module call.** The monitor names the rows of one module call (trainmon/collect/modules.py,
trainmon/mindspore/hooks.py):

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

import functools
import re
from typing import NamedTuple

__all__ = [
    "CALL_SEP",
    "ModuleCall",
    "call_name",
    "decode_name",
    "encode_name",
    "flows_in",
    "module_call",
    "module_role",
]

_ESCAPED = re.compile("[\\\\\x00\ud800-\udfff]")
_ESCAPE = re.compile(r"\\(\\|u[0-9a-f]{4})")


def _escape(m: re.Match[str]) -> str:
    c = m.group()
    return "\\\\" if c == "\\" else f"\\u{ord(c):04x}"


def encode_name(name: str) -> str:
    """``name`` as every output writes it (the name itself when it needs no escape)."""
    if _ESCAPED.search(name) is None:
        return name
    return _ESCAPED.sub(_escape, name)


def _unescape(m: re.Match[str]) -> str:
    code = m.group(1)
    return "\\" if code == "\\" else chr(int(code[1:], 16))


def decode_name(text: str) -> str:
    """The name :func:`encode_name` wrote as ``text``."""
    if "\\" not in text:
        return text
    return _ESCAPE.sub(_unescape, text)


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


@functools.lru_cache(maxsize=1 << 16)  # asked for every row of every anomalous step (anomaly/origin.py)
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
