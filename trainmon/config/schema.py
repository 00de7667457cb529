"""The monitor configuration: one typed, immutable schema, every section a dataclass with its defaults.

msprobe monitor config keys keep their meaning. Keys trainmon does not implement yet are validated and kept
in :attr:`MonitorConfig.pending`. :func:`trainmon.config.load.load_config` builds a :class:`MonitorConfig`
from a file, a mapping or keywords. See ``docs/config.md`` for the user-facing reference.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any

from trainmon.anomaly.alerts import (
    DEFAULT_MAX_LINES,
    DEFAULT_MAX_QUEUE,
    DEFAULT_RATE_LIMIT_S,
    sinks_from_config,
)
from trainmon.anomaly.rules import parse_rules
from trainmon.config.check import (
    ConfigError,
    as_bool,
    as_int,
    as_list,
    as_mapping,
    as_number,
    as_str,
    as_str_list,
    check_keys,
    child,
    choices,
    dedupe,
    describe,
    expected,
    unknown,
)
from trainmon.config.targets import parse_target
from trainmon.run.records import STATS

__all__ = [
    "ALLOWED_FORMATS",
    "ALLOWED_OPS",
    "ALL_KEYS",
    "CAPTURE_MODES",
    "FIELDS",
    "NAN_ACTIONS",
    "PENDING_KEYS",
    "AlertConfig",
    "CcDistribution",
    "GradProbe",
    "MonitorConfig",
]

logger = logging.getLogger("trainmon")

# Values msprobe accepts in "ops", plus our "infs". shape/dtype are always written as metadata, so they are
# accepted and dropped; "id" (msprobe's undocumented identity op) is accepted with a warning and dropped.
ALLOWED_OPS: tuple[str, ...] = (*STATS, "id", "shape", "dtype")
ALLOWED_FORMATS: tuple[str, ...] = ("tensorboard", "csv", "api")
_DEFAULT_FORMAT: tuple[str, ...] = ("tensorboard", "csv")
_CC_KEYS = ("enable", "cc_codeline", "cc_pre_hook", "cc_log_only")
_L2_HOOKS = ("linear_hook", "attention_hook", "moe_router_weight_hook", "moe_router_logit_hook")


# ---------------------------------------------------------------------------------------------------------
# Implemented keys.


def _targets(v: Any, path: str) -> tuple[str, ...]:
    # msprobe writes {name: {...}} and ignores the values; a plain list of names is our shorter spelling.
    if isinstance(v, Mapping):
        items = [(child(path, k) if isinstance(k, str) else path, k) for k in v]
    elif isinstance(v, (list, tuple)):
        items = [(f"{path}[{i}]", k) for i, k in enumerate(v)]
    else:
        raise expected(path, "a mapping {name: {}} or a list of names", v)
    out = []
    for item_path, pattern in items:
        if not isinstance(pattern, str):
            raise expected(item_path, "a module or parameter name (string)", pattern)
        try:
            parse_target(pattern)
        except ValueError as e:
            raise ConfigError(str(e), key=item_path) from None
        out.append(pattern)
    return dedupe(out)




def _ops(v: Any, path: str) -> tuple[str, ...]:
    items = choices(v, path, "op", ALLOWED_OPS)
    if "id" in items:
        logger.warning("trainmon: op 'id' in %s is not implemented and is ignored", path)
    stats = [op for op in items if op in STATS]
    # An empty list is msprobe's "default"; ours is every statistic. Same when only metadata ops were given.
    return dedupe(stats) if stats else STATS


def _formats(v: Any, path: str) -> tuple[str, ...]:
    items = choices(v, path, "format", ALLOWED_FORMATS)
    return dedupe(items) if items else _DEFAULT_FORMAT


def _module_ranks(v: Any, path: str) -> tuple[int, ...]:
    if isinstance(v, bool):
        raise expected(path, "a list of ranks", v)
    if isinstance(v, int):
        v = [v]
    elif isinstance(v, str):
        # msprobe's own examples write "0" or "0,1".
        parts = [p.strip() for p in v.split(",") if p.strip()]
        if not all(re.fullmatch(r"\d+", p) for p in parts):
            raise expected(path, "a list of ranks or a string of comma-separated ranks", v)
        v = [int(p) for p in parts]
    ranks = [as_int(r, f"{path}[{i}]") for i, r in enumerate(as_list(v, path))]
    return dedupe(ranks)


TB_RANK_MODES = ("auto", "all")


def _tensorboard_ranks(v: Any, path: str) -> str | tuple[int, ...]:
    """``auto``, ``all``, or the ranks whose TensorBoard events are written (negative: from the last rank)."""
    if isinstance(v, str) and v.strip() in TB_RANK_MODES:
        return v.strip()
    if isinstance(v, bool):
        raise expected(path, "auto, all or a list of ranks", v)
    if isinstance(v, int):
        v = [v]
    elif isinstance(v, str):
        parts = [p.strip() for p in v.split(",") if p.strip()]
        if not parts or not all(re.fullmatch(r"-?\d+", p) for p in parts):
            raise expected(path, "auto, all, a list of ranks or a string of comma-separated ranks", v)
        v = [int(p) for p in parts]
    ranks = [as_int(r, f"{path}[{i}]", lo=-(1 << 31)) for i, r in enumerate(as_list(v, path))]
    return dedupe(ranks)


def _mbs_grad(v: Any, path: str) -> bool:
    # msprobe treats a non-bool monitor_mbs_grad as false with a warning instead of failing.
    if isinstance(v, bool):
        return v
    logger.warning("trainmon: %s should be true or false, got %s; treating it as false", path, describe(v))
    return False


NAN_ACTIONS = ("continue", "raise", "exit", "skip")
CAPTURE_MODES = ("default", "exact")
_ALERT_DELIVERY_KEYS = ("webhooks", "rate_limit_s", "max_queue", "max_lines")


@dataclass(frozen=True, kw_only=True)
class AlertConfig:
    """``alert``: the anomaly rules (msprobe's ``rules``/``dump`` and trainmon's rule forms), where alerts go
    (webhooks, rate limits) and what happens on a NaN (``on_nan``, ``capture``, ``max_skips``).

    Rule entries and webhooks are validated by the modules that run them (``trainmon.anomaly.rules``,
    ``trainmon.anomaly.alerts``), so each has one parser; they are kept here as given (read-only).
    ``given`` lists the keys the config set, in its order: :meth:`to_dict` writes those back, so a
    config read, written to the manifest and read again is the same."""

    # rule entries; none given: NaN/Inf on every kind and statistic
    rules: tuple[Mapping[str, Any], ...] = ()
    # dump the origin module and the flagged tensors when an anomaly starts
    dump: bool = False
    # continue | raise | exit | skip (keep the step's update from landing)
    on_nan: str = "continue"
    exit_code: int = 3  # of on_nan: exit
    max_per_step: int = 50  # anomaly records a step; the rest are summarised in one "suppressed" record
    saturation: bool = False  # flag values at the largest finite value of their dtype
    # default: anomalies are found after the step; exact: before the update, dumping the step's own tensors
    capture: str = "default"
    max_skips: int = 10  # on_nan: skip skips at most this many steps, then raises
    webhooks: tuple[Mapping[str, Any], ...] = ()
    rate_limit_s: float = DEFAULT_RATE_LIMIT_S
    max_queue: int = DEFAULT_MAX_QUEUE
    max_lines: int = DEFAULT_MAX_LINES
    given: tuple[str, ...] = field(default=(), compare=False, repr=False)

    def __post_init__(self) -> None:
        path = "alert"
        parse_rules({"rules": self.rules} if self.rules else {}, path)
        delivery = {k: getattr(self, k) for k in _ALERT_DELIVERY_KEYS if k in self.given}
        if delivery:
            try:
                sinks_from_config(delivery, path=path)
            except ConfigError:
                raise
            except ValueError as e:  # its messages already name the key path
                raise ConfigError(str(e)) from None
        checked = {
            "dump": as_bool(self.dump, f"{path}.dump"),
            "saturation": as_bool(self.saturation, f"{path}.saturation"),
            "on_nan": _one_of(self.on_nan, f"{path}.on_nan", "action", NAN_ACTIONS),
            "capture": _one_of(self.capture, f"{path}.capture", "mode", CAPTURE_MODES),
            "max_skips": as_int(self.max_skips, f"{path}.max_skips", 0),
            "exit_code": as_int(self.exit_code, f"{path}.exit_code", 0, 255),
            "max_per_step": as_int(self.max_per_step, f"{path}.max_per_step", 1),
            "rules": _freeze(list(self.rules)),
            "webhooks": _freeze(list(self.webhooks)),
        }
        for key, value in checked.items():
            object.__setattr__(self, key, value)

    @classmethod
    def parse(cls, v: Any, path: str = "alert") -> AlertConfig:
        """The section from a config mapping (``None`` values mean the default), or as it is."""
        if isinstance(v, AlertConfig):
            return v
        if v is None:
            return cls()
        m = as_mapping(v, path)
        check_keys(m, ALERT_KEYS, path)
        given = {k: val for k, val in m.items() if val is not None}
        return cls(**given, given=tuple(given))

    def to_dict(self) -> dict[str, Any]:
        """The keys the config set, as plain data (what :meth:`parse` reads back equal)."""
        return {k: _thaw(getattr(self, k)) for k in self.given}


ALERT_KEYS: tuple[str, ...] = tuple(f.name for f in fields(AlertConfig) if f.name != "given")


def _one_of(v: Any, path: str, what: str, allowed: tuple[str, ...]) -> str:
    value = as_str(v, path)
    if value not in allowed:
        raise unknown(path, what, value, allowed)
    return value


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
    m = as_mapping(v, path)
    check_keys(m, _CC_KEYS, path)
    codeline = as_str_list(m.get("cc_codeline") or [], f"{path}.cc_codeline")
    for i, expr in enumerate(codeline):
        try:
            re.compile(expr)
        except re.error as e:
            raise ConfigError(
                f"invalid regular expression {expr!r}: {e}", key=f"{path}.cc_codeline[{i}]"
            ) from None
    flags = {
        k: as_bool(False if m.get(k) is None else m[k], f"{path}.{k}")
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
    m = as_mapping(v, path)
    check_keys(m, _GRAD_PROBE_KEYS, path)
    out: dict[str, Any] = {}
    for key in ("enable", "sign_bitmap"):
        if m.get(key) is not None:
            out[key] = as_bool(m[key], f"{path}.{key}")
    for key, allowed in (("grad_level", _GRAD_LEVELS), ("sample_seed", _SAMPLE_SEEDS)):
        if m.get(key) is not None:
            out[key] = choices(as_str(m[key], f"{path}.{key}"), f"{path}.{key}", key, allowed)[0]
    if m.get("param_list") is not None:
        out["param_list"] = dedupe(as_str_list(m["param_list"], f"{path}.param_list"))
    if m.get("sample_size") is not None:
        out["sample_size"] = as_int(m["sample_size"], f"{path}.sample_size", 1, 1 << 24)
    if m.get("bounds") is not None:
        items = as_list(m["bounds"], f"{path}.bounds")
        bounds = tuple(as_number(b, f"{path}.bounds[{i}]", lo=-math.inf) for i, b in enumerate(items))
        if not bounds or any(a >= b for a, b in zip(bounds, bounds[1:], strict=False)):
            raise ConfigError(
                f"expected a non-empty, strictly increasing list, got {items!r}", key=f"{path}.bounds"
            )
        out["bounds"] = bounds
    return GradProbe(**out)


_VALIDATORS: dict[str, Callable[[Any, str], Any]] = {
    "targets": _targets,
    "ops": _ops,
    "eps": as_number,
    # None (the default): the shortest text that reads back as the same float32; an int: msprobe's rounding
    "ndigits": lambda v, p: None if v is None else as_int(v, p, 0, 20),
    "format": _formats,
    "start_step": lambda v, p: as_int(v, p, 0),
    "step_interval": lambda v, p: as_int(v, p, 1),
    "collect_times": lambda v, p: as_int(v, p, 1),
    "module_ranks": _module_ranks,
    "sync_timeout_s": lambda v, p: as_number(v, p, 0.1),
    "tensorboard_ranks": _tensorboard_ranks,
    "csv_ranks": _tensorboard_ranks,  # the same forms: auto, all, a list of ranks
    "monitor_mbs_grad": _mbs_grad,
    "alert": AlertConfig.parse,
    "cc_distribution": _cc_distribution,
    "grad_probe": _grad_probe,
}


# ---------------------------------------------------------------------------------------------------------
# Keys accepted and validated, not implemented yet.


def _append_output(v: Any, path: str) -> list[str]:
    items = as_str_list(v, path)
    if len(items) not in (0, 2):
        raise ConfigError(f"expected [start_time, end_time] or [], got {len(items)} items", key=path)
    return items


def _l2_targets(v: Any, path: str) -> dict[str, list[str]]:
    m = as_mapping(v, path)
    check_keys(m, _L2_HOOKS, path)
    return {k: as_str_list(names, f"{path}.{k}") for k, names in m.items()}


@dataclass(frozen=True)
class _PendingKey:
    validate: Callable[[Any, str], Any]
    default: Any
    # Whether a normalised value asks for behaviour that trainmon does not have yet.
    active: Callable[[Any], bool] | None = None

    def is_active(self, value: Any) -> bool:
        return self.active(value) if self.active else value != self.default


_PENDING: dict[str, _PendingKey] = {
    "mg_direction": _PendingKey(as_bool, False),
    "print_struct": _PendingKey(as_bool, False),
    "stack_info": _PendingKey(as_bool, False),
    "step_count_per_record": _PendingKey(lambda v, p: as_int(v, p, 1, 1_000_000), 1),
    "append_output": _PendingKey(_append_output, []),
    "l2_targets": _PendingKey(_l2_targets, {}, bool),
    "recording_l2_features": _PendingKey(as_bool, False),
    "sa_order": _PendingKey(as_str, "s,b,h,d"),
}
PENDING_KEYS: tuple[str, ...] = tuple(_PENDING)


def _freeze(v: Any) -> Any:
    if isinstance(v, Mapping):
        return MappingProxyType({k: _freeze(x) for k, x in v.items()})
    if isinstance(v, (list, tuple)):
        return tuple(_freeze(x) for x in v)
    return v


def _thaw(v: Any) -> Any:
    if isinstance(v, AlertConfig):
        return v.to_dict()
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
    # In a process group: how long a rank waits for the others when they agree on a config edit or on an
    # on_nan: skip decision (trainmon.step.agree); past it that rank stops agreeing and says so
    sync_timeout_s: float = 60.0
    # Ranks whose TensorBoard events are written: auto (every rank up to 16 ranks; above, rank 0, the last
    # rank and the all_ranks run of cross-rank aggregates), all, or a list (negative: from the last rank).
    tensorboard_ranks: str | tuple[int, ...] = "auto"
    # Ranks whose CSV files are written: auto (every rank up to 16 ranks, or when the statistics store is not
    # written; above, the ranks with TensorBoard events), all, or a list (negative: from the last rank).
    csv_ranks: str | tuple[int, ...] = "auto"
    # Anomaly rules, alert delivery and the action on NaN (msprobe's ``alert`` plus trainmon's keys).
    alert: AlertConfig = field(default=AlertConfig(), hash=False)
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
            validate = _VALIDATORS.get(f.name, as_bool)
            object.__setattr__(self, f.name, validate(value, f.name))
        pending = {} if self.pending is None else as_mapping(self.pending, "pending")
        check_keys(pending, PENDING_KEYS, None)
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
        """Record kinds (``trainmon.run.records.Kind`` values) this config collects, in record order."""
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
    def advice(self) -> tuple[str, ...]:
        """Settings that do nothing as written (msprobe users meet them), each with what to write instead."""
        out = []
        if self.all_xy and not self.xy_distribution:
            out.append(
                "all_xy: true records no activation without xy_distribution: true (as in msprobe, "
                "xy_distribution turns activations on; all_xy widens them to every module)"
            )
        return tuple(out)

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


FIELDS: tuple[str, ...] = tuple(f.name for f in fields(MonitorConfig) if f.name != "pending")
ALL_KEYS: tuple[str, ...] = (*FIELDS, *PENDING_KEYS)
