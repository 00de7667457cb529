"""The monitor configuration: one typed, immutable schema and its one loader.

msprobe monitor config files load unchanged. Keys trainmon does not implement yet are validated and kept in
:attr:`MonitorConfig.pending`; everything else in trainmon reads the parsed :class:`MonitorConfig`,
never a raw dict. See ``docs/config.md`` for the user-facing reference.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import math
import os
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml

from trainmon.records import STATS
from trainmon.targets import parse_target

__all__ = [
    "ALLOWED_FORMATS",
    "ALLOWED_OPS",
    "PENDING_KEYS",
    "CcDistribution",
    "ConfigError",
    "GradProbe",
    "MonitorConfig",
    "load_config",
    "read_config_file",
]

logger = logging.getLogger("trainmon")

# Values msprobe accepts in "ops", plus our "infs". shape/dtype are always written as metadata, so they are
# accepted and dropped; "id" (msprobe's undocumented identity op) is accepted with a warning and dropped.
ALLOWED_OPS: tuple[str, ...] = (*STATS, "id", "shape", "dtype")
ALLOWED_FORMATS: tuple[str, ...] = ("tensorboard", "csv", "api")
_DEFAULT_FORMAT: tuple[str, ...] = ("tensorboard", "csv")
_CC_KEYS = ("enable", "cc_codeline", "cc_pre_hook", "cc_log_only")
_L2_HOOKS = ("linear_hook", "attention_hook", "moe_router_weight_hook", "moe_router_logit_hook")


class ConfigError(ValueError):
    """A config that cannot be used. ``str()`` is ``[file: ][key path: ]reason``."""

    def __init__(self, message: str, *, key: str | None = None, file: str | None = None) -> None:
        self.reason = message
        self.key = key
        self.file = file
        super().__init__(": ".join([*(p for p in (file, key) if p), message]))


# ---------------------------------------------------------------------------------------------------------
# Small validators. Each takes (value, key path) and returns the normalised value or raises ConfigError.

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


def _describe(v: Any) -> str:
    if v is None:
        return "null"
    text = repr(v)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{_TYPE_NAMES.get(type(v), type(v).__name__)} {text}"


def _expected(path: str, what: str, v: Any) -> ConfigError:
    return ConfigError(f"expected {what}, got {_describe(v)}", key=path)


def _child(path: str | None, key: str) -> str:
    if path is None:
        return key
    return f"{path}.{key}" if re.fullmatch(r"\w+", key) else f"{path}[{key!r}]"


def _suggest(value: str, allowed: Collection[str]) -> str:
    close = difflib.get_close_matches(value, list(allowed), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _unknown(path: str, what: str, value: str, allowed: Collection[str], sort: bool = False) -> ConfigError:
    listed = ", ".join(sorted(allowed) if sort else allowed)
    return ConfigError(f"unknown {what} {value!r}{_suggest(value, allowed)} (allowed: {listed})", key=path)


def _check_keys(m: Mapping[Any, Any], allowed: Collection[str], path: str | None) -> None:
    for k in m:
        if not isinstance(k, str):
            raise ConfigError(f"keys must be strings, got {_describe(k)}", key=path or "<top level>")
        if k not in allowed:
            raise _unknown(_child(path, k), "key", k, allowed, sort=True)


def _bool(v: Any, path: str) -> bool:
    if not isinstance(v, bool):
        raise _expected(path, "a bool (true or false)", v)
    return v


def _int(v: Any, path: str, lo: int = 0, hi: int | None = None) -> int:
    # JSON writers print 1e8 for 100000000; an integral float is still an integer.
    integral = isinstance(v, int) or (isinstance(v, float) and v.is_integer())
    if isinstance(v, bool) or not integral:
        raise _expected(path, "an integer", v)
    v = int(v)
    if v < lo or (hi is not None and v > hi):
        bounds = f"between {lo} and {hi}" if hi is not None else f">= {lo}"
        raise ConfigError(f"must be {bounds}, got {v}", key=path)
    return v


def _number(v: Any, path: str, lo: float = 0.0) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _expected(path, "a finite number", v)
    if v < lo:
        raise ConfigError(f"must be >= {lo:g}, got {v!r}", key=path)
    return float(v)


def _mapping(v: Any, path: str) -> Mapping[str, Any]:
    if not isinstance(v, Mapping):
        raise _expected(path, "a mapping", v)
    return v


def _list(v: Any, path: str) -> list[Any]:
    if not isinstance(v, (list, tuple)):
        raise _expected(path, "a list", v)
    return list(v)


def _str(v: Any, path: str) -> str:
    if not isinstance(v, str):
        raise _expected(path, "a string", v)
    return v


def _str_list(v: Any, path: str) -> list[str]:
    return [_str(item, f"{path}[{i}]") for i, item in enumerate(_list(v, path))]


def _dedupe(items: list[Any]) -> tuple[Any, ...]:
    return tuple(dict.fromkeys(items))


# ---------------------------------------------------------------------------------------------------------
# Implemented keys.


def _targets(v: Any, path: str) -> tuple[str, ...]:
    # msprobe writes {name: {...}} and ignores the values; a plain list of names is our shorter spelling.
    if isinstance(v, Mapping):
        items = [(_child(path, k) if isinstance(k, str) else path, k) for k in v]
    elif isinstance(v, (list, tuple)):
        items = [(f"{path}[{i}]", k) for i, k in enumerate(v)]
    else:
        raise _expected(path, "a mapping {name: {}} or a list of names", v)
    out = []
    for item_path, pattern in items:
        if not isinstance(pattern, str):
            raise _expected(item_path, "a module or parameter name (string)", pattern)
        try:
            parse_target(pattern)
        except ValueError as e:
            raise ConfigError(str(e), key=item_path) from None
        out.append(pattern)
    return _dedupe(out)


def _choices(v: Any, path: str, what: str, allowed: tuple[str, ...]) -> list[str]:
    """A string or a list of strings, each one of ``allowed``."""
    single = isinstance(v, str)
    items = [v] if single else _list(v, path)
    for i, item in enumerate(items):
        item_path = path if single else f"{path}[{i}]"
        if not isinstance(item, str):
            raise _expected(item_path, f"a string naming the {what}", item)
        if item not in allowed:
            raise _unknown(item_path, what, item, allowed)
    return items


def _ops(v: Any, path: str) -> tuple[str, ...]:
    items = _choices(v, path, "op", ALLOWED_OPS)
    if "id" in items:
        logger.warning("trainmon: op 'id' in %s is not implemented and is ignored", path)
    stats = [op for op in items if op in STATS]
    # An empty list is msprobe's "default"; ours is every statistic. Same when only metadata ops were given.
    return _dedupe(stats) if stats else STATS


def _formats(v: Any, path: str) -> tuple[str, ...]:
    items = _choices(v, path, "format", ALLOWED_FORMATS)
    return _dedupe(items) if items else _DEFAULT_FORMAT


def _module_ranks(v: Any, path: str) -> tuple[int, ...]:
    if isinstance(v, bool):
        raise _expected(path, "a list of ranks", v)
    if isinstance(v, int):
        v = [v]
    elif isinstance(v, str):
        # msprobe's own examples write "0" or "0,1".
        parts = [p.strip() for p in v.split(",") if p.strip()]
        if not all(re.fullmatch(r"\d+", p) for p in parts):
            raise _expected(path, "a list of ranks or a string of comma-separated ranks", v)
        v = [int(p) for p in parts]
    ranks = [_int(r, f"{path}[{i}]") for i, r in enumerate(_list(v, path))]
    return _dedupe(ranks)


def _mbs_grad(v: Any, path: str) -> bool:
    # msprobe treats a non-bool monitor_mbs_grad as false with a warning instead of failing.
    if isinstance(v, bool):
        return v
    logger.warning("trainmon: %s should be true or false, got %s; treating it as false", path, _describe(v))
    return False


_NAN_ACTIONS = ("continue", "raise", "exit", "skip")
_CAPTURE_MODES = ("default", "exact")
_ALERT_DELIVERY_KEYS = ("webhooks", "rate_limit_s", "max_queue", "max_lines")
_ALERT_KEYS = (
    "rules",
    "dump",
    "on_nan",
    "exit_code",
    "max_per_step",
    "saturation",
    "capture",
    "max_skips",
    *_ALERT_DELIVERY_KEYS,
)


def _alert(v: Any, path: str) -> Mapping[str, Any]:
    """The ``alert`` section: msprobe's ``rules``/``dump``, trainmon's rule forms, delivery and NaN action.

    Rules and webhooks are validated by the modules that run them, so there is one parser for each."""
    if v is None:
        return MappingProxyType({})
    m = _mapping(v, path)
    _check_keys(m, _ALERT_KEYS, path)
    # imported here: both modules import ConfigError from this one
    from trainmon.anomaly.alerts import sinks_from_config
    from trainmon.anomaly.rules import parse_rules

    out: dict[str, Any] = {k: val for k, val in m.items() if val is not None}
    parse_rules({k: out[k] for k in ("rules",) if k in out}, path)
    delivery = {k: out[k] for k in _ALERT_DELIVERY_KEYS if k in out}
    if delivery:
        try:
            sinks_from_config(delivery, path=path)
        except ConfigError:
            raise
        except ValueError as e:  # its messages already name the key path
            raise ConfigError(str(e)) from None
    if "dump" in out:
        out["dump"] = _bool(out["dump"], f"{path}.dump")
    if "saturation" in out:
        out["saturation"] = _bool(out["saturation"], f"{path}.saturation")
    if "on_nan" in out:
        action = _str(out["on_nan"], f"{path}.on_nan")
        if action not in _NAN_ACTIONS:
            raise _unknown(f"{path}.on_nan", "action", action, _NAN_ACTIONS)
        out["on_nan"] = action
    if "capture" in out:
        mode = _str(out["capture"], f"{path}.capture")
        if mode not in _CAPTURE_MODES:
            raise _unknown(f"{path}.capture", "mode", mode, _CAPTURE_MODES)
        out["capture"] = mode
    if "max_skips" in out:
        out["max_skips"] = _int(out["max_skips"], f"{path}.max_skips", 0)
    if "exit_code" in out:
        out["exit_code"] = _int(out["exit_code"], f"{path}.exit_code", 0, 255)
    if "max_per_step" in out:
        out["max_per_step"] = _int(out["max_per_step"], f"{path}.max_per_step", 1)
    return _freeze(out)


@dataclass(frozen=True)
class CcDistribution:
    """``cc_distribution``: statistics of the tensors collectives move (``trainmon.collect.comm``).

    ``cc_pre_hook`` adds the inputs (msprobe records only outputs by default); ``cc_codeline`` keeps only
    calls whose Python stack has a frame ``"<file>[<line>]"`` that one of the regexes finds;
    ``cc_log_only`` records no statistics and logs each distinct call stack once per collective."""

    enable: bool = False
    cc_codeline: tuple[str, ...] = ()
    cc_pre_hook: bool = False
    cc_log_only: bool = False


def _cc_distribution(v: Any, path: str) -> CcDistribution:
    if isinstance(v, CcDistribution):
        v = dataclasses.asdict(v)
    m = _mapping(v, path)
    _check_keys(m, _CC_KEYS, path)
    codeline = _str_list(m.get("cc_codeline") or [], f"{path}.cc_codeline")
    for i, expr in enumerate(codeline):
        try:
            re.compile(expr)
        except re.error as e:
            raise ConfigError(
                f"invalid regular expression {expr!r}: {e}", key=f"{path}.cc_codeline[{i}]"
            ) from None
    flags = {
        k: _bool(False if m.get(k) is None else m[k], f"{path}.{k}")
        for k in ("enable", "cc_pre_hook", "cc_log_only")
    }
    return CcDistribution(cc_codeline=tuple(codeline), **flags)


_GRAD_LEVELS = ("L0", "L1", "L2")
_GRAD_PROBE_KEYS = (
    "enable",
    "grad_level",
    "param_list",
    "bounds",
    "sample_size",
    "sign_bitmap",
    "sample_seed",
)
_SAMPLE_SEEDS = ("name", "shape")


@dataclass(frozen=True)
class GradProbe:
    """``grad_probe``: gradient fingerprints per parameter and collected step, for ``trainmon compare``
    (``trainmon.collect.gradprobe``). msprobe's keys ``grad_level``, ``param_list`` and ``bounds`` keep their
    meaning; ``sample_size`` elements (positions seeded by ``sample_seed``: name and shape, or shape only)
    and, with ``sign_bitmap``, every element's sign at 1 bit are the direction sketch of L1 and L2."""

    enable: bool = False
    grad_level: str = "L2"
    param_list: tuple[str, ...] = ()
    bounds: tuple[float, ...] = (-1.0, 0.0, 1.0)
    sample_size: int = 1024
    sign_bitmap: bool = False
    sample_seed: str = "name"


def _grad_probe(v: Any, path: str) -> GradProbe:
    if isinstance(v, GradProbe):
        v = dataclasses.asdict(v)
    m = _mapping(v, path)
    _check_keys(m, _GRAD_PROBE_KEYS, path)
    out: dict[str, Any] = {}
    for key in ("enable", "sign_bitmap"):
        if m.get(key) is not None:
            out[key] = _bool(m[key], f"{path}.{key}")
    for key, allowed in (("grad_level", _GRAD_LEVELS), ("sample_seed", _SAMPLE_SEEDS)):
        if m.get(key) is not None:
            out[key] = _choices(_str(m[key], f"{path}.{key}"), f"{path}.{key}", key, allowed)[0]
    if m.get("param_list") is not None:
        out["param_list"] = _dedupe(_str_list(m["param_list"], f"{path}.param_list"))
    if m.get("sample_size") is not None:
        out["sample_size"] = _int(m["sample_size"], f"{path}.sample_size", 1, 1 << 24)
    if m.get("bounds") is not None:
        items = _list(m["bounds"], f"{path}.bounds")
        bounds = tuple(_number(b, f"{path}.bounds[{i}]", lo=-math.inf) for i, b in enumerate(items))
        if not bounds or any(a >= b for a, b in zip(bounds, bounds[1:], strict=False)):
            raise ConfigError(
                f"expected a non-empty, strictly increasing list, got {items!r}", key=f"{path}.bounds"
            )
        out["bounds"] = bounds
    return GradProbe(**out)


_VALIDATORS: dict[str, Callable[[Any, str], Any]] = {
    "targets": _targets,
    "ops": _ops,
    "eps": _number,
    # None (the default): the shortest text that reads back as the same float32; an int: msprobe's rounding
    "ndigits": lambda v, p: None if v is None else _int(v, p, 0, 20),
    "format": _formats,
    "start_step": lambda v, p: _int(v, p, 0),
    "step_interval": lambda v, p: _int(v, p, 1),
    "collect_times": lambda v, p: _int(v, p, 1),
    "module_ranks": _module_ranks,
    "monitor_mbs_grad": _mbs_grad,
    "alert": _alert,
    "cc_distribution": _cc_distribution,
    "grad_probe": _grad_probe,
}


# ---------------------------------------------------------------------------------------------------------
# Keys accepted and validated, not implemented yet.


def _append_output(v: Any, path: str) -> list[str]:
    items = _str_list(v, path)
    if len(items) not in (0, 2):
        raise ConfigError(f"expected [start_time, end_time] or [], got {len(items)} items", key=path)
    return items


def _l2_targets(v: Any, path: str) -> dict[str, list[str]]:
    m = _mapping(v, path)
    _check_keys(m, _L2_HOOKS, path)
    return {k: _str_list(names, f"{path}.{k}") for k, names in m.items()}


@dataclass(frozen=True)
class _PendingKey:
    validate: Callable[[Any, str], Any]
    default: Any
    # Whether a normalised value asks for behaviour that trainmon does not have yet.
    active: Callable[[Any], bool] | None = None

    def is_active(self, value: Any) -> bool:
        return self.active(value) if self.active else value != self.default


_PENDING: dict[str, _PendingKey] = {
    "mg_direction": _PendingKey(_bool, False),
    "print_struct": _PendingKey(_bool, False),
    "stack_info": _PendingKey(_bool, False),
    "step_count_per_record": _PendingKey(lambda v, p: _int(v, p, 1, 1_000_000), 1),
    "append_output": _PendingKey(_append_output, []),
    "l2_targets": _PendingKey(_l2_targets, {}, bool),
    "recording_l2_features": _PendingKey(_bool, False),
    "sa_order": _PendingKey(_str, "s,b,h,d"),
}
PENDING_KEYS: tuple[str, ...] = tuple(_PENDING)


def _freeze(v: Any) -> Any:
    if isinstance(v, Mapping):
        return MappingProxyType({k: _freeze(x) for k, x in v.items()})
    if isinstance(v, (list, tuple)):
        return tuple(_freeze(x) for x in v)
    return v


def _thaw(v: Any) -> Any:
    if isinstance(v, (CcDistribution, GradProbe)):
        return _thaw(dataclasses.asdict(v))
    if isinstance(v, Mapping):
        return {k: _thaw(x) for k, x in v.items()}
    if isinstance(v, tuple):
        return [_thaw(x) for x in v]
    return v


# ---------------------------------------------------------------------------------------------------------
# The schema.


@dataclass(frozen=True, kw_only=True)
class MonitorConfig:
    """A validated monitor configuration. Build it with :func:`load_config`; direct construction
    validates and normalises too (lists become tuples, ``None`` means the default)."""

    targets: tuple[str, ...] = ()
    all_xy: bool = False
    xy_distribution: bool = False
    forward_only: bool = False
    backward_only: bool = False
    wg_distribution: bool = False
    monitor_mbs_grad: bool = False
    mv_distribution: bool = False
    ur_distribution: bool = False
    param_distribution: bool = False
    squash_name: bool = False
    # msprobe's switch in DYNAMIC_MONITOR mode: read from the watched config file at step boundaries
    dynamic_on: bool = False
    ops: tuple[str, ...] = STATS
    eps: float = 1e-8
    ndigits: int | None = None
    format: tuple[str, ...] = _DEFAULT_FORMAT
    start_step: int = 0
    step_interval: int = 1
    collect_times: int = 100_000_000
    module_ranks: tuple[int, ...] = ()
    # Anomaly rules, alert delivery and the action on NaN (msprobe's ``alert`` plus trainmon's keys).
    alert: Mapping[str, Any] | None = field(default=None, hash=False)
    # Statistics of collective communication (msprobe's ``cc_distribution``).
    cc_distribution: CcDistribution = CcDistribution()
    # Gradient fingerprints for run-vs-run comparison (msprobe's ``grad_probe``; ``trainmon compare``).
    grad_probe: GradProbe = GradProbe()
    # Accepted msprobe keys without an implementation yet, validated and read-only.
    pending: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}), hash=False)

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name == "pending":
                continue
            value = getattr(self, f.name)
            if value is None:
                value = f.default
            validate = _VALIDATORS.get(f.name, _bool)
            object.__setattr__(self, f.name, validate(value, f.name))
        pending = {} if self.pending is None else _mapping(self.pending, "pending")
        _check_keys(pending, PENDING_KEYS, None)
        frozen = {k: _freeze(_PENDING[k].validate(v, k)) for k, v in pending.items() if v is not None}
        object.__setattr__(self, "pending", MappingProxyType(frozen))
        if self.forward_only and self.backward_only:
            raise ConfigError(
                "both are true, so no activation would be collected; set at most one of them",
                key="forward_only/backward_only",
            )

    # --- derived views (msprobe semantics) ---

    @property
    def xy_enabled(self) -> bool:
        """Activations are collected. As in msprobe, ``xy_distribution`` is the switch and ``all_xy``
        only widens the module selection."""
        return self.xy_distribution

    @property
    def xy_forward(self) -> bool:
        return self.xy_enabled and not self.backward_only

    @property
    def xy_backward(self) -> bool:
        return self.xy_enabled and not self.forward_only

    @property
    def monitor_all_modules(self) -> bool:
        """Every module is hooked for activations, whatever ``targets`` says."""
        return self.all_xy or (self.xy_distribution and not self.targets)

    @property
    def kinds(self) -> tuple[str, ...]:
        """Record kinds (``trainmon.records.Kind`` values) this config collects, in record order."""
        enabled = (
            (self.xy_forward, ("actv",)),
            (self.xy_backward, ("actv_grad",)),
            (self.wg_distribution, ("grad_unreduced", "grad_reduced")),
            (self.param_distribution, ("param_origin", "param_updated")),
            (self.mv_distribution, ("exp_avg", "exp_avg_sq")),
            (self.ur_distribution, ("update", "ratio")),
            (self.cc_distribution.enable and not self.cc_distribution.cc_log_only, ("comm",)),
        )
        return tuple(k for on, names in enabled if on for k in names)

    @property
    def pending_active(self) -> tuple[str, ...]:
        """Not-implemented keys whose value asks for something; these are ignored with a warning."""
        return tuple(k for k, v in self.pending.items() if _PENDING[k].is_active(_thaw(v)))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (pending keys included) that :func:`load_config` reads back equal."""
        out: dict[str, Any] = {}
        for f in fields(self):
            if f.name != "pending":
                out[f.name] = _thaw(getattr(self, f.name))
        out.update(_thaw(self.pending))
        return out


_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(MonitorConfig) if f.name != "pending")
_ALL_KEYS: tuple[str, ...] = (*_FIELDS, *PENDING_KEYS)


# ---------------------------------------------------------------------------------------------------------
# The loader.


class _YamlLoader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e-8`` as a float (YAML 1.1 requires a dot, so PyYAML returns the
    string "1e-8"); configs copied from JSON then mean the same in YAML."""


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def _parse_json(text: str, file: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}", file=file) from None


def _parse_yaml(text: str, file: str) -> Any:
    try:
        return yaml.load(text, Loader=_YamlLoader)  # a SafeLoader subclass: no object construction
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"invalid YAML{where}: {problem}", file=file) from None


def read_config_file(file: str) -> Mapping[str, Any]:
    """The raw mapping of a config file, unvalidated. An empty file (or one of comments only) means all
    defaults, as no config does. Raises :class:`ConfigError`."""
    try:
        text = Path(file).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError("config file not found", file=file) from None
    except UnicodeDecodeError:
        raise ConfigError("config file is not UTF-8 text", file=file) from None
    except OSError as e:
        raise ConfigError(f"cannot read config file: {e.strerror or e}", file=file) from None
    if not text.strip():
        return {}
    ext = Path(file).suffix.lower()
    if ext == ".json":
        data = _parse_json(text, file)
    elif ext in (".yaml", ".yml"):
        data = _parse_yaml(text, file)
    else:
        try:
            data = _parse_json(text, file)
        except ConfigError:
            data = _parse_yaml(text, file)
    if data is None:  # YAML of comments only
        return {}
    if not isinstance(data, Mapping):
        got = _describe(data)
        raise ConfigError(f"the top level must be a mapping of config keys, got {got}", file=file)
    return data


def _build(raw: Mapping[Any, Any]) -> MonitorConfig:
    _check_keys(raw, _ALL_KEYS, None)
    known = {k: v for k, v in raw.items() if k in _FIELDS}
    pending = {k: v for k, v in raw.items() if k in _PENDING}
    return MonitorConfig(**known, pending=pending)


def load_config(source: Any = None, /, **overrides: Any) -> MonitorConfig:
    """Load and validate a monitor config.

    ``source`` is None (all defaults), a path to a ``.json`` / ``.yaml`` / ``.yml`` file (other
    extensions: JSON, then YAML), a mapping, or a :class:`MonitorConfig`. ``overrides`` are config keys
    applied on top and validated the same way. ``None`` for any key means its default.
    Raises :class:`ConfigError`.
    """
    file: str | None = None
    if source is None:
        raw: dict[Any, Any] = {}
    elif isinstance(source, MonitorConfig):
        if not overrides:
            return source
        raw = source.to_dict()
    elif isinstance(source, Mapping):
        raw = dict(source)
    elif isinstance(source, (str, os.PathLike)):
        file = os.path.expanduser(os.fspath(source))
        raw = dict(read_config_file(file))
    else:
        raise ConfigError(f"a config source is a path, a mapping or a MonitorConfig, got {_describe(source)}")
    raw.update(overrides)
    try:
        config = _build(raw)
    except ConfigError as e:
        if file is None:
            raise
        # Point at the file unless the bad value came from an override.
        top = re.split(r"[.\[/]", e.key or "", maxsplit=1)[0]
        raise ConfigError(e.reason, key=e.key, file=None if top in overrides else file) from None
    if config.pending_active:
        logger.warning(
            "trainmon: config keys accepted but not implemented yet: %s", ", ".join(config.pending_active)
        )
    return config
