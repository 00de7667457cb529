"""The ``--map`` file of ``trainmon compare``: names that denote the same tensor or module in the two runs.

A JSON or YAML mapping, one entry a line::

    norm.weight: norm.gamma          # a tensor (a parameter, or a row such as fc1.output)
    encoder.fc1: enc.dense1          # a module: its activations, their gradients and its parameters

An entry pairs two names; which run holds which is found out (the map is read both ways), so one file serves
RUN_A RUN_B and RUN_B RUN_A. msprobe's mapping files are read as well: the module and cell names of its
dumps (``Module.fc1.Linear.forward.0``, ``Cell.network.fc1.Dense.forward.0``, with or without the
``.input.0`` / ``.output.0`` of a data mapping) stand for their module path (``fc1``, ``network.fc1``);
entries naming operators rather than modules (``Functional.``, ``Torch.``, ``Tensor.``, ``Mint.``,
``NPU.``...) are kept aside, as trainmon records modules only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import yaml

__all__ = ["MapError", "NameMap", "load_map"]

# msprobe's dump names of a module or cell call: <Module|Cell>.<path>.<Class>.<forward|backward>[.<n>][...]
_MSPROBE_MODULE = re.compile(
    r"^(?:Module|Cell)\.(?P<path>.+?)\.[A-Za-z_]\w*\.(?:forward|backward)(?:\.\d+)?(?:\..*)?$"
)
_MSPROBE_API = re.compile(
    r"^(?:Functional|Torch|Tensor|Mint|MintFunctional|NPU|Distributed|Aten|Jit|Primitive)\."
)


class MapError(ValueError):
    """A map file that cannot be used: unreadable, not a mapping of names, or naming nothing of either run."""


@dataclass(frozen=True)
class NameMap:
    """The pairs of a map file, in file order, and the operator entries left aside."""

    path: str
    pairs: tuple[tuple[str, str], ...]
    operators: tuple[str, ...] = ()


def _module_path(text: str) -> str | None:
    """A name of the map as trainmon names it: msprobe's module/cell dump names become their module path;
    an operator's dump name is None."""
    m = _MSPROBE_MODULE.match(text)
    if m:
        return m.group("path")
    if _MSPROBE_API.match(text):
        return None
    return text


def load_map(path: str | Path) -> NameMap:
    """Read a map file; :class:`MapError` names the file (and line) of what is wrong."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise MapError(f"{path}: cannot read the map file: {getattr(e, 'strerror', None) or e}") from None
    try:
        root = yaml.compose(text)  # JSON is YAML; nodes keep their line numbers
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        raise MapError(f"{path}{where}: not JSON or YAML: {getattr(e, 'problem', None) or e}") from None
    if root is None:
        raise MapError(f"{path}: the map file is empty")
    if not isinstance(root, yaml.MappingNode):
        raise MapError(f"{path}: expected a mapping {{name in one run: name in the other}}")
    pairs: list[tuple[str, str]] = []
    operators: list[str] = []
    for key, value in root.value:
        line = key.start_mark.line + 1
        if (
            not isinstance(key, yaml.ScalarNode)
            or not isinstance(value, yaml.ScalarNode)
            or not (key.tag.endswith(":str") and value.tag.endswith(":str"))
        ):
            found = value.value if isinstance(value, yaml.ScalarNode) else type(value).__name__
            raise MapError(f"{path}:{line}: {key.value!r}: names must be strings, got {found!r}")
        a, b = _module_path(key.value.strip()), _module_path(value.value.strip())
        if not key.value.strip() or not value.value.strip():
            raise MapError(f"{path}:{line}: an empty name")
        if a is None or b is None:
            operators.append(key.value)
            continue
        pairs.append((a, b))
    if not pairs:
        what = f" ({len(operators)} name operators, which trainmon does not record)" if operators else ""
        raise MapError(f"{path}: no entry names a module or tensor{what}")
    return NameMap(str(path), tuple(pairs), tuple(operators))
