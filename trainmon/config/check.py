"""The validators every config section uses (``trainmon.config.keys`` picks them by each key's type), so that
every section checks values the same way and reports errors the same way.

Each takes ``(value, key path)`` and returns the normalised value or raises :class:`ConfigError`, whose
message names the key path, what was expected and, for a misspelt name, the closest allowed one.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Collection, Mapping
from typing import Any

__all__ = [
    "ConfigError",
    "as_bool",
    "as_int",
    "as_list",
    "as_mapping",
    "as_number",
    "as_str",
    "as_str_list",
    "check_keys",
    "child",
    "choices",
    "dedupe",
    "describe",
    "expected",
    "unknown",
]


class ConfigError(ValueError):
    """A config that cannot be used. ``str()`` is ``[file: ][key path: ]reason``."""

    def __init__(self, message: str, *, key: str | None = None, file: str | None = None) -> None:
        self.reason = message
        self.key = key
        self.file = file
        super().__init__(": ".join([*(p for p in (file, key) if p), message]))


_TYPE_NAMES = {
    bool: "bool",
    int: "int",
    float: "float",
    str: "string",
    list: "list",
    tuple: "list",
    dict: "mapping",
    type(None): "null",
}


def describe(v: Any) -> str:
    """``int 3``, ``string 'x'``: a value as an error message shows it."""
    if v is None:
        return "null"
    text = repr(v)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{_TYPE_NAMES.get(type(v), type(v).__name__)} {text}"


def expected(path: str, what: str, v: Any) -> ConfigError:
    return ConfigError(f"expected {what}, got {describe(v)}", key=path)


def child(path: str | None, key: str) -> str:
    """The key path of ``key`` under ``path``: ``alert.rules``, or ``targets['a b']`` for odd keys."""
    if path is None:
        return key
    return f"{path}.{key}" if re.fullmatch(r"\w+", key) else f"{path}[{key!r}]"


def _suggest(value: str, allowed: Collection[str]) -> str:
    close = difflib.get_close_matches(value, list(allowed), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def unknown(path: str, what: str, value: str, allowed: Collection[str], sort: bool = False) -> ConfigError:
    """The error for a name that is not one of ``allowed``, with the closest one and the whole list."""
    listed = ", ".join(sorted(allowed) if sort else allowed)
    return ConfigError(f"unknown {what} {value!r}{_suggest(value, allowed)} (allowed: {listed})", key=path)


def check_keys(m: Mapping[Any, Any], allowed: Collection[str], path: str | None) -> None:
    """Every key of ``m`` is a string and one of ``allowed``."""
    for k in m:
        if not isinstance(k, str):
            raise ConfigError(f"keys must be strings, got {describe(k)}", key=path or "<top level>")
        if k not in allowed:
            raise unknown(child(path, k), "key", k, allowed, sort=True)


def as_bool(v: Any, path: str) -> bool:
    if not isinstance(v, bool):
        raise expected(path, "a bool (true or false)", v)
    return v


def as_int(v: Any, path: str, lo: int = 0, hi: int | None = None) -> int:
    # JSON writers print 1e8 for 100000000; an integral float is still an integer.
    integral = isinstance(v, int) or (isinstance(v, float) and v.is_integer())
    if isinstance(v, bool) or not integral:
        raise expected(path, "an integer", v)
    v = int(v)
    if v < lo or (hi is not None and v > hi):
        bounds = f"between {lo} and {hi}" if hi is not None else f">= {lo}"
        raise ConfigError(f"must be {bounds}, got {v}", key=path)
    return v


def as_number(v: Any, path: str, lo: float = 0.0, hi: float | None = None) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise expected(path, "a finite number", v)
    if v < lo or (hi is not None and v > hi):
        bounds = f"between {lo:g} and {hi:g}" if hi is not None else f">= {lo:g}"
        raise ConfigError(f"must be {bounds}, got {v!r}", key=path)
    return float(v)


def as_mapping(v: Any, path: str) -> Mapping[str, Any]:
    if not isinstance(v, Mapping):
        raise expected(path, "a mapping", v)
    return v


def as_list(v: Any, path: str) -> list[Any]:
    if not isinstance(v, (list, tuple)):
        raise expected(path, "a list", v)
    return list(v)


def as_str(v: Any, path: str) -> str:
    if not isinstance(v, str):
        raise expected(path, "a string", v)
    return v


def as_str_list(v: Any, path: str) -> list[str]:
    return [as_str(item, f"{path}[{i}]") for i, item in enumerate(as_list(v, path))]


def choices(v: Any, path: str, what: str, allowed: tuple[str, ...]) -> list[str]:
    """A string or a list of strings, each one of ``allowed``."""
    single = isinstance(v, str)
    items = [v] if single else as_list(v, path)
    for i, item in enumerate(items):
        item_path = path if single else f"{path}[{i}]"
        if not isinstance(item, str):
            raise expected(item_path, f"a string naming the {what}", item)
        if item not in allowed:
            raise unknown(item_path, what, item, allowed)
    return items


def dedupe(items: list[Any]) -> tuple[Any, ...]:
    return tuple(dict.fromkeys(items))
