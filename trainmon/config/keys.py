"""How a config key is declared: once, as a field of a section (a frozen dataclass deriving from
:class:`Section`), with :func:`key`.

The field's name is the key, its annotation the type (``Literal[...]`` where there are choices: the
allowed values are spelled there and nowhere else), its default the default; :class:`Key` adds a one-line
help, the validator (derived from the type when none is given), the msprobe spelling and whether an edit
of the key applies while the run goes on. Everything else reads the declaration: the loader and its error
messages (:meth:`Section.parse`), ``trainmon config init`` (its template and comments), ``trainmon config
check``, the export in msprobe's spelling (:meth:`Section.msprobe_dict`), the key tables of
``docs/config.md`` (``trainmon.config.reference``) and the watcher's note on edits that wait for the next
run (:func:`not_live`).

A nested section (``alert``, ``grad_probe``, a webhook, a rule) is a :class:`Section` declared the same way;
a subclass may change a key's default by naming the field again, and keeps its declaration.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from types import MappingProxyType
from typing import Any, ClassVar, Literal, get_args, get_origin, get_type_hints

from trainmon.config.check import (
    as_bool,
    as_int,
    as_list,
    as_mapping,
    as_number,
    as_str,
    check_keys,
    child,
    dedupe,
    expected,
    unknown,
)

__all__ = ["Declared", "Key", "Section", "Validator", "freeze", "key", "not_live", "one_of", "plain"]

Validator = Callable[[Any, str], Any]
_UNSET: Any = object()


@dataclass(frozen=True)
class Key:
    """What a field declares beyond its name, type and default."""

    help: str  # one line: the comment above the key in `trainmon config init`
    check: Validator | None = None  # (value, key path) -> the value normalised; None: from the type
    lo: float | None = None  # numbers: the smallest value allowed (default 0)
    hi: float | None = None  # numbers: the largest value allowed (default: none)
    what: str = ""  # keys with choices: the noun of "unknown <what> 'x'" (default: the key's name)
    # how msprobe writes the key: True (as trainmon does), a function of the value, or False (trainmon's own)
    msprobe: bool | Callable[[Any], Any] = False
    live: bool = True  # an edit of the config file applies from the next step (False: at the next attach)
    doc: str = ""  # the meaning in docs/config.md when the help line says too little
    type_doc: str = ""  # the type column of docs/config.md when the type alone says too little
    default_doc: str = ""  # the default column of docs/config.md when the value alone says too little
    group: str = ""  # the table of docs/config.md that lists a top-level key
    example: Any = _UNSET  # what `trainmon config init` writes when it is not the default
    used_when: str = ""  # accepted-but-not-implemented keys: when a value asks for something


def key(default: Any, help: str, *, hash: bool | None = None, **declared: Any) -> Any:  # noqa: A002
    """The field of a config key: ``name: type = key(default, "one line of help", ...)`` (:class:`Key`)."""
    metadata = {"key": Key(help, **declared)}
    if isinstance(default, Mapping):  # read-only, but unhashable: dataclasses want a factory for it
        return field(default_factory=lambda: default, hash=hash, metadata=metadata)
    return field(default=default, hash=hash, metadata=metadata)


@dataclass(frozen=True)
class Declared:
    """One key of a section, resolved: its name, declaration, type, default and validator."""

    name: str
    key: Key
    type: Any
    default: Any
    validate: Validator

    @property
    def example(self) -> Any:
        """What a template writes for this key."""
        return self.default if self.key.example is _UNSET else self.key.example


class Section:
    """A config section: a frozen dataclass whose keys are fields declared with :func:`key`. Fields without
    a declaration (``given``: the keys a config set, ``written``: an entry as the config spelled it) are
    bookkeeping. Constructing a section validates and normalises it; :meth:`parse` does the same for a
    mapping from a config file, with key paths under ``path`` in its error messages."""

    PATH: ClassVar[str | None] = None  # where the section sits in a config file, for direct construction

    # --- the declaration

    @classmethod
    def declared(cls) -> tuple[Declared, ...]:
        cached = cls.__dict__.get("_declared")
        if cached is None:
            hints = get_type_hints(cls)
            out = []
            for f in fields(cls):  # type: ignore[arg-type]
                k = _key_of(cls, f.name)
                if k is None:
                    continue
                default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
                tp = hints[f.name]
                out.append(Declared(f.name, k, tp, default, k.check or validator_for(tp, k, f.name)))
            cached = tuple(out)
            type.__setattr__(cls, "_declared", cached)
        return cached

    @classmethod
    def key_names(cls) -> tuple[str, ...]:
        return tuple(d.name for d in cls.declared())

    # --- building

    def __post_init__(self) -> None:
        self._fill({d.name: getattr(self, d.name) for d in self.declared()}, self.PATH)

    @classmethod
    def parse(cls, v: Any, path: str | None = None) -> Any:
        """The section from a config mapping (``None`` values mean the default), or as it is. Key paths in
        errors start at ``path`` (default: where the section sits, ``PATH``)."""
        path = cls.PATH if path is None else path
        if isinstance(v, cls):
            return v
        if v is None:
            return cls()
        m = as_mapping(v, path or "<top level>")
        check_keys(m, cls.key_names(), path)
        given = {k: val for k, val in m.items() if val is not None}
        return cls.build(given, path, given=tuple(given))

    @classmethod
    def build(cls, values: Mapping[str, Any], path: str | None, **extra: Any) -> Any:
        """A section of ``values`` (keys; the others take their defaults), validated with key paths under
        ``path``; ``extra`` sets fields that are no keys (where the class has them)."""
        obj = object.__new__(cls)
        names = set(cls.key_names())
        for f in fields(cls):  # type: ignore[arg-type]
            if f.name not in names:
                value = extra[f.name] if f.name in extra else _default(f)
                object.__setattr__(obj, f.name, value)
        obj._fill(values, path)
        return obj

    def _fill(self, values: Mapping[str, Any], path: str | None) -> None:
        for d in self.declared():
            value = values.get(d.name)
            if value is None:
                value = d.default
            object.__setattr__(self, d.name, d.validate(value, child(path, d.name)))
        self._check(path)

    def _check(self, path: str | None) -> None:
        """Checks across keys, once every key is valid on its own (raise :class:`ConfigError`)."""

    # --- writing

    def to_dict(self) -> dict[str, Any]:
        """The section as plain data that :meth:`parse` reads back equal: every key, or the keys the config
        set where the section keeps them (``given``)."""
        given = getattr(self, "given", None)
        names = self.key_names() if given is None else given
        return {name: plain(getattr(self, name)) for name in names}

    def msprobe_dict(self) -> dict[str, Any]:
        """The keys msprobe has, in msprobe's spelling (``trainmon config init --preset msprobe``)."""
        out = {}
        for d in self.declared():
            spell = d.key.msprobe
            if spell is False:
                continue
            value = getattr(self, d.name)
            out[d.name] = spell(value) if callable(spell) else _msprobe_plain(value)
        return out


def _key_of(cls: type, name: str) -> Key | None:
    """The declaration of ``name``: on the class's own field, or (a default changed by a subclass) on the
    nearest base class that declares it."""
    for klass in cls.__mro__:
        f = getattr(klass, "__dataclass_fields__", {}).get(name)
        if f is not None and "key" in f.metadata:
            return f.metadata["key"]
    return None


def _default(f: dataclasses.Field) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    raise TypeError(f"field {f.name} has no default")


def plain(v: Any) -> Any:
    """A value as JSON-able data: sections as mappings, tuples as lists."""
    if isinstance(v, Section):
        return v.to_dict()
    if isinstance(v, Mapping):
        return {k: plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [plain(x) for x in v]
    return v


def _msprobe_plain(v: Any) -> Any:
    if isinstance(v, Section):
        return v.msprobe_dict()
    if isinstance(v, (list, tuple)):
        return [_msprobe_plain(x) for x in v]
    return plain(v)


def freeze(v: Any) -> Any:
    """Plain data, read-only: mappings as mapping proxies, lists as tuples."""
    if isinstance(v, Mapping):
        return MappingProxyType({k: freeze(x) for k, x in v.items()})
    if isinstance(v, (list, tuple)):
        return tuple(freeze(x) for x in v)
    return v


def not_live(old: Section, new: Section, path: str | None = None) -> list[str]:
    """Key paths that differ between ``old`` and ``new`` and are declared to apply only at the next attach."""
    out = []
    for d in old.declared():
        a, b = getattr(old, d.name), getattr(new, d.name)
        if a == b:
            continue
        if not d.key.live:
            out.append(child(path, d.name))
        elif isinstance(a, Section) and type(a) is type(b):
            out += not_live(a, b, child(path, d.name))
    return out


# ---------------------------------------------------------------------------------------------------------
# Validators from the type


def one_of(v: Any, path: str, what: str, allowed: tuple[str, ...]) -> str:
    """A string that is one of ``allowed``."""
    if not isinstance(v, str):
        raise expected(path, f"a string naming the {what}", v)
    if v not in allowed:
        raise unknown(path, what, v, allowed)
    return v


def _singular(name: str) -> str:
    return name[:-1] if name.endswith("s") else name


def validator_for(tp: Any, k: Key, name: str) -> Validator:
    """The validator of a key of type ``tp``: bool, int, float (finite; ``lo``/``hi`` bound both), str,
    ``Literal`` choices, a section, ``X | None`` (None allowed), and ``tuple[X, ...]`` (a list of X, a single
    X for a one-item list, duplicates dropped; a list of sections is read entry by entry)."""
    origin, args = get_origin(tp), get_args(tp)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1 and len(args) == 2:
            inner = validator_for(rest[0], k, name)
            return lambda v, p: None if v is None else inner(v, p)
    if tp is bool:
        return as_bool
    if tp is int:
        lo, hi = int(k.lo or 0), None if k.hi is None else int(k.hi)
        return lambda v, p: as_int(v, p, lo, hi)
    if tp is float:
        flo = 0.0 if k.lo is None else float(k.lo)
        return lambda v, p: as_number(v, p, flo, k.hi)
    if tp is str:
        return as_str
    if origin is Literal:
        what = k.what or name
        return lambda v, p: one_of(v, p, what, args)
    if isinstance(tp, type) and issubclass(tp, Section):
        return tp.parse
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        item = args[0]
        if isinstance(item, type) and issubclass(item, Section):
            return lambda v, p: tuple(item.parse(x, f"{p}[{i}]") for i, x in enumerate(as_list(v, p)))
        each = validator_for(item, dataclasses.replace(k, what=k.what or _singular(name)), name)
        scalar = str if get_origin(item) is Literal or item is str else item

        def items(v: Any, p: str) -> tuple[Any, ...]:
            if isinstance(v, scalar) and not isinstance(v, bool):
                return (each(v, p),)
            return dedupe([each(x, f"{p}[{i}]") for i, x in enumerate(as_list(v, p))])

        return items
    raise TypeError(f"config key {name}: no validator for type {tp!r}; declare one with check=")


# ---------------------------------------------------------------------------------------------------------
# How the declaration reads in the docs (trainmon.config.reference)


def type_text(d: Declared) -> str:
    """The type column of a key's row."""
    if d.key.type_doc:
        return d.key.type_doc
    return _type_text(d.type, d.key)


def _type_text(tp: Any, k: Key) -> str:
    origin, args = get_origin(tp), get_args(tp)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        return f"{_type_text(rest[0], k)}, or `null`"
    if tp is bool:
        return "bool"
    if tp in (int, float):
        noun = "int" if tp is int else "number"
        lo = 0 if k.lo is None else k.lo
        if k.hi is not None:
            return f"{noun} {number_text(lo)}..{number_text(k.hi)}"
        return noun if lo == -math.inf else f"{noun} >= {number_text(lo)}"
    if tp is str:
        return "string"
    if origin is Literal:
        return ", ".join(f"`{a}`" for a in args)
    if isinstance(tp, type) and issubclass(tp, Section):
        return "mapping"
    if origin is tuple:
        item = args[0]
        if isinstance(item, type) and issubclass(item, Section):
            return "list of mappings"
        if get_origin(item) is Literal:
            return "list of " + ", ".join(f"`{a}`" for a in get_args(item))
        return f"list of {_type_text(item, k)}s"
    return str(tp)


def number_text(v: float) -> str:
    """``1e-8``, ``0.5``, ``300``: a number as the docs write it."""
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, int) or (isinstance(v, float) and v.is_integer() and abs(v) < 1e15):
        return str(int(v))
    text = format(v, "g")
    mantissa, e, exponent = text.partition("e")
    return mantissa + (e + str(int(exponent)) if e else "")


def value_text(v: Any) -> str:
    """A default as the docs write it (YAML-ish flow style)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return number_text(v)
    if isinstance(v, Section):
        return "{}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(value_text(x) for x in v) + "]"
    if isinstance(v, Mapping):
        return "{" + ", ".join(f"{k}: {value_text(x)}" for k, x in v.items()) + "}"
    return str(v)


def default_text(d: Declared) -> str:
    """The default column of a key's row."""
    return d.key.default_doc or f"`{value_text(d.default)}`"


def meaning_text(d: Declared) -> str:
    """The meaning column of a key's row: the doc (else the help line as a sentence), and when an edit
    waits for the next attach."""
    text = d.key.doc or (d.key.help[:1].upper() + d.key.help[1:] + ("" if d.key.help.endswith(".") else "."))
    if not d.key.live:
        text += " Read at attach: an edit of it applies to the next run."
    return text
