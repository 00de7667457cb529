"""The anomaly rules of the ``alert`` section: one typed section per rule, parsed from the config once.

A rule is selected by ``kinds``, ``names`` (glob patterns) and ``stats``; ``warmup`` is the steps of history
a tensor needs before the rule may fire for it. ``trainmon.anomaly.rules`` evaluates them.

- :class:`NanRule` (``"nan"``, msprobe ``AnomalyNan``): NaN / Inf elements (reported apart, as rules
  ``"nan"`` and ``"inf"``), and with ``threshold`` any selected statistic with ``|value| > threshold``.
- :class:`TurbulenceRule` (``"turbulence"``, msprobe ``AnomalyTurbulence``): value beyond an EMA of its
  history by a relative ``threshold``.
- :class:`ZScoreRule` (``"zscore"``): ``|value - ema_mean| / ema_std > threshold``.
- :class:`MaxRatioRule` (``"max_ratio"``): value above ``threshold`` x the running max of earlier values.
- :class:`ThresholdRule` (``"threshold"``): absolute bounds ``above`` / ``below``.
- :class:`StragglerRule` (``"straggler"``): a rank whose step, or a part of it, is slower than the ranks'
  median by ``factor`` over a ``window`` of collected steps (per-rank time, not tensor statistics:
  ``trainmon.anomaly.straggler`` evaluates it).

A config writes a rule in msprobe's form (``{"rule_name": "AnomalyNan", "args": {"threshold": x}}``) or in
trainmon's (``{"rule": "zscore", ...}``); a parsed rule keeps the entry as written (``written``), so a config
written back (the manifest) reads as it was given.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from fnmatch import fnmatchcase
from typing import Any, ClassVar, Literal

from trainmon.config.check import ConfigError, as_list, as_mapping, check_keys, dedupe, unknown
from trainmon.config.keys import Section, freeze, key, one_of, plain
from trainmon.run.records import (
    MAX_RATIO_RULE,
    NAN_RULE,
    STATS,
    STRAGGLER_RULE,
    THRESHOLD_RULE,
    TURBULENCE_RULE,
    ZSCORE_RULE,
    Kind,
    kind_name,
)
from trainmon.run.timing import STRAGGLER_PHASES

__all__ = [
    "KINDS",
    "RULES",
    "MaxRatioRule",
    "NanRule",
    "Rule",
    "RuleBase",
    "StragglerRule",
    "ThresholdRule",
    "TurbulenceRule",
    "ZScoreRule",
    "default_rules",
    "msprobe_rules",
    "parse_rules",
    "straggler_rules",
    "tensor_rules",
    "with_nan_detection",
]

KINDS: tuple[str, ...] = tuple(k.value for k in Kind)
RecordKind = Literal[KINDS]  # type: ignore[valid-type]
Stat = Literal[STATS]  # type: ignore[valid-type]
Direction = Literal["up", "down", "both"]
_VALUE_STATS = ("min", "max", "mean", "norm")
_NON_FINITE_STATS = ("nans", "infs")


def _kinds(v: Any, path: str) -> tuple[str, ...]:
    """Record kinds, as names (Python callers may pass ``Kind`` members)."""
    single = isinstance(v, str)
    items = [v] if single else as_list(v, path)
    kinds = [kind_name(k) if isinstance(k, Kind) else k for k in items]
    return dedupe([one_of(k, path if single else f"{path}[{i}]", "kind", KINDS) for i, k in enumerate(kinds)])


@dataclass(frozen=True, kw_only=True)
class RuleBase(Section):
    """What every entry of ``alert.rules`` is: a rule name and the entry as the config wrote it."""

    rule: ClassVar[str] = ""
    # the entry as the config wrote it (msprobe's form or trainmon's), what to_dict writes back
    written: Mapping[str, Any] | None = field(default=None, compare=False, repr=False)

    def to_dict(self) -> dict[str, Any]:
        """The entry as the config wrote it; trainmon's form of the keys that differ from the rule's defaults
        for a rule built in Python."""
        if self.written is not None:
            return plain(self.written)
        defaults = {d.name: d.default for d in self.declared()}
        changed = {d.name: plain(getattr(self, d.name)) for d in self.declared()}
        return {"rule": self.rule, **{k: v for k, v in changed.items() if v != plain(defaults[k])}}

    def msprobe_dict(self) -> dict[str, Any]:
        """msprobe's form where msprobe has the rule, else trainmon's (trainmon reads a mix of both)."""
        return self.to_dict()


@dataclass(frozen=True, kw_only=True)
class Rule(RuleBase):
    """A rule on tensor statistics; what it selects. Empty ``kinds`` / ``names`` select everything; ``names``
    are :func:`fnmatch.fnmatchcase` patterns matched against the tensor name (without the vpp prefix)."""

    kinds: tuple[RecordKind, ...] = key((), "record kinds the rule looks at; [] = every kind", check=_kinds)
    names: tuple[str, ...] = key((), "tensor names, glob patterns; [] = every tensor")
    stats: tuple[Stat, ...] = key(STATS, "statistics the rule looks at")
    warmup: int = key(0, "steps of history a tensor needs before the rule may fire for it")

    def _check(self, path: str | None) -> None:
        if not self.stats:
            raise ConfigError("at least one statistic is required", key=_at(path, "stats"))

    def selects(self, kind: str, name: str) -> bool:
        if self.kinds and kind not in self.kinds:
            return False
        return not self.names or any(fnmatchcase(name, p) for p in self.names)


def _at(path: str | None, name: str) -> str:
    return f"{path}.{name}" if path else name


@dataclass(frozen=True, kw_only=True)
class NanRule(Rule):
    """NaN / Inf elements (``nans`` / ``infs`` in ``stats``: rules ``"nan"`` / ``"inf"``, value = count);
    with ``threshold``, also ``|value| > threshold`` for the other selected stats (rule ``"nan"``)."""

    rule: ClassVar[str] = NAN_RULE
    threshold: float | None = key(None, "also flag |value| above this (any selected statistic)")

    def msprobe_dict(self) -> dict[str, Any]:
        if self.written is None and (self.kinds, self.names, self.stats, self.warmup) == ((), (), STATS, 0):
            args = {} if self.threshold is None else {"threshold": self.threshold}
            return {"rule_name": _MSPROBE_NAMES[NAN_RULE], "args": args}
        return self.to_dict()


@dataclass(frozen=True, kw_only=True)
class TurbulenceRule(Rule):
    """Relative jump against an EMA of the history (``beta``; initialised with the first value).
    ``up``: ``|v| > |ema| * (1 + threshold)``; ``down``: ``v < ema * (1 - threshold)``; ``both``."""

    rule: ClassVar[str] = TURBULENCE_RULE
    threshold: float = key(0.5, "relative deviation from the average that fires")
    direction: Direction = key("up", "up, down or both")
    beta: float = key(0.99, "EMA weight of the history", hi=1.0)
    stats: tuple[Stat, ...] = ("norm", "mean")

    def msprobe_dict(self) -> dict[str, Any]:
        msprobe = (self.kinds, self.names, self.stats, self.warmup, self.direction, self.beta)
        if self.written is None and msprobe == ((), (), ("norm", "mean"), 0, "up", 0.99):
            return {"rule_name": _MSPROBE_NAMES[TURBULENCE_RULE], "args": {"threshold": self.threshold}}
        return self.to_dict()


@dataclass(frozen=True, kw_only=True)
class ZScoreRule(Rule):
    """``|v - ema_mean| / sqrt(ema_var) > threshold`` (EMA mean and variance with ``beta``)."""

    rule: ClassVar[str] = ZSCORE_RULE
    threshold: float = key(6.0, "standard deviations from the average that fire")
    beta: float = key(0.99, "EMA weight of the history", hi=1.0)
    warmup: int = 20
    stats: tuple[Stat, ...] = ("norm",)


@dataclass(frozen=True, kw_only=True)
class MaxRatioRule(Rule):
    """``v > threshold * max(previous values)`` (Megatron's spiky-loss check), for tracked scalars."""

    rule: ClassVar[str] = MAX_RATIO_RULE
    threshold: float = key(10.0, "multiple of the running max that fires")
    kinds: tuple[RecordKind, ...] = (Kind.SCALAR.value,)
    stats: tuple[Stat, ...] = ("mean",)


@dataclass(frozen=True, kw_only=True)
class ThresholdRule(Rule):
    """Absolute bounds: fires when ``v > above`` or ``v < below``."""

    rule: ClassVar[str] = THRESHOLD_RULE
    above: float | None = key(None, "fire above this value", lo=-math.inf)
    below: float | None = key(None, "fire below this value", lo=-math.inf)
    stats: tuple[Stat, ...] = _VALUE_STATS

    def _check(self, path: str | None) -> None:
        super()._check(path)
        if self.above is None and self.below is None:
            raise ConfigError("threshold rule needs 'above' and/or 'below'", key=path)


def _phases(v: Any, path: str) -> tuple[str, ...]:
    """``all``, a part of the step, or a list of them."""
    if v == "all":
        return STRAGGLER_PHASES
    single = isinstance(v, str)
    items = [v] if single else as_list(v, path)
    phases = [
        one_of(p, path if single else f"{path}[{i}]", "phase", STRAGGLER_PHASES) for i, p in enumerate(items)
    ]
    if not phases:
        raise ConfigError("at least one phase is required (or all)", key=path)
    return dedupe(phases)


@dataclass(frozen=True, kw_only=True)
class StragglerRule(RuleBase):
    """A rank whose step, or a part of it (``phase``), takes longer than the ranks' median: its typical time
    over the last ``window`` collected steps (their mean without the slowest one) is above ``factor`` x the
    median of the ranks' typical times, and above it by at least ``min_share`` of the ranks' median step
    (ranks of one pipeline stage are compared with each other). One record per episode: at its first step;
    an episode ends after ``window`` steps without it.
    Judged on the step times the ranks exchange (docs/timing.md), in the writer thread."""

    rule: ClassVar[str] = STRAGGLER_RULE
    phase: tuple[str, ...] = key(
        STRAGGLER_PHASES,
        "parts of the step judged: all, or step, data, forward, backward, optimizer, comm, gc, other",
        check=_phases,
        type_doc="`all`, a string or a list of strings",
        default_doc="all",
    )
    factor: float = key(1.5, "slower than the ranks' median by this factor", lo=1.0)
    window: int = key(
        5, "collected steps a rank's time is averaged over (without its slowest)", lo=1, hi=10_000
    )
    min_share: float = key(
        0.2, "and slower by at least this share of the ranks' median step time", lo=0.0, hi=10.0
    )
    warmup: int = key(2, "collected steps not judged at the start (start-up differs between ranks)")


RULES: dict[str, type[RuleBase]] = {
    c.rule: c for c in (NanRule, TurbulenceRule, ZScoreRule, MaxRatioRule, ThresholdRule, StragglerRule)
}


def straggler_rules(rules: Sequence[RuleBase]) -> tuple[StragglerRule, ...]:
    """The straggler rules of a rule list (judged on per-rank time)."""
    return tuple(r for r in rules if isinstance(r, StragglerRule))


def tensor_rules(rules: Sequence[RuleBase]) -> tuple[Rule, ...]:
    """The rules of a rule list judged on tensor statistics."""
    return tuple(r for r in rules if isinstance(r, Rule))


def default_rules() -> tuple[RuleBase, ...]:
    """What a run gets without rules: NaN/Inf on every kind and statistic, and stragglers (judged only when
    the ranks exchange their step times: ``timing``)."""
    return (NanRule(), StragglerRule())


def _detects_every_non_finite(rule: Rule) -> bool:
    return (
        isinstance(rule, NanRule)
        and not rule.kinds
        and not rule.names
        and not rule.warmup
        and all(s in rule.stats for s in _NON_FINITE_STATS)
    )


def with_nan_detection(rules: Sequence[RuleBase]) -> tuple[RuleBase, ...]:
    """``rules`` with NaN/Inf counted in every tensor from the first step.

    An ``on_nan`` action can only act on what a rule reports: a rule list that leaves ``nan`` out (or narrows
    it to some kinds, names or later steps) would let a NaN run through with no alert and exit code 0. So a
    full NaN/Inf rule goes first, and the NaN/Inf part of narrower ``nan`` rules is dropped (their
    ``threshold`` part stays), so no tensor is reported twice."""
    if any(_detects_every_non_finite(r) for r in rules):
        return tuple(rules)
    out: list[RuleBase] = [NanRule(stats=_NON_FINITE_STATS)]
    for r in rules:
        if isinstance(r, NanRule):
            rest = tuple(s for s in r.stats if s not in _NON_FINITE_STATS)
            if r.threshold is None or not rest:
                continue  # nothing left that the full rule does not report already
            r = replace(r, stats=rest)
        out.append(r)
    return tuple(out)


# ---------------------------------------------------------------------------------------------------------
# Parsing: msprobe's {"rule_name": ..., "args": {...}} and trainmon's {"rule": ..., key: value}

_MSPROBE_NAMES = {NAN_RULE: "AnomalyNan", TURBULENCE_RULE: "AnomalyTurbulence"}
_MSPROBE = {v: k for k, v in _MSPROBE_NAMES.items()}


def _parse_msprobe(entry: Mapping[str, Any], path: str) -> Rule:
    check_keys(entry, ("rule_name", "args"), path)
    name = entry["rule_name"]
    if name not in _MSPROBE:
        raise unknown(f"{path}.rule_name", "rule", name, list(_MSPROBE))
    args = entry.get("args")
    args = {} if args is None else as_mapping(args, f"{path}.args")
    check_keys(args, ("threshold",), f"{path}.args")
    threshold = args.get("threshold")
    written = freeze(entry)
    if name == "AnomalyNan":
        return NanRule.build({"threshold": threshold}, f"{path}.args", written=written)
    if threshold is None:
        raise ConfigError("required by AnomalyTurbulence", key=f"{path}.args.threshold")
    values = {"threshold": threshold, "direction": "up", "stats": ("norm", "mean"), "warmup": 0}
    return TurbulenceRule.build(values, f"{path}.args", written=written)


def _parse_native(entry: Mapping[str, Any], path: str) -> Rule:
    name = entry["rule"]
    if name not in RULES:
        raise unknown(f"{path}.rule", "rule", str(name), list(RULES))
    cls = RULES[name]
    check_keys(entry, ("rule", *cls.key_names()), path)
    values = {k: v for k, v in entry.items() if k != "rule" and v is not None}
    return cls.build(values, path, written=freeze(entry))


def parse_rules(v: Any, path: str = "alert.rules") -> tuple[Rule, ...]:
    """The rules of an ``alert.rules`` list: msprobe's entries, trainmon's, or a mix (rules built in Python
    are kept as they are). Errors are :class:`ConfigError` naming the key path, e.g.
    ``alert.rules[1].thresold``. An empty list is empty: the run then evaluates :func:`default_rules`."""
    if not isinstance(v, (list, tuple)):
        raise ConfigError(f"expected a list of rules, got {v!r}", key=path)
    rules: list[Rule] = []
    for i, entry in enumerate(v):
        rpath = f"{path}[{i}]"
        if isinstance(entry, RuleBase):
            rules.append(entry)
            continue
        entry = as_mapping(entry, rpath)
        if "rule_name" in entry and "rule" in entry:
            raise ConfigError("give either 'rule_name' (msprobe) or 'rule', not both", key=rpath)
        if "rule_name" in entry:
            rules.append(_parse_msprobe(entry, rpath))
        elif "rule" in entry:
            rules.append(_parse_native(entry, rpath))
        else:
            allowed = ", ".join([*RULES, *_MSPROBE])
            raise ConfigError(f"missing 'rule' (one of: {allowed})", key=f"{rpath}.rule")
    return tuple(rules)


def msprobe_rules(rules: Sequence[Rule]) -> list[dict[str, Any]]:
    """``alert.rules`` in msprobe's spelling (rules msprobe lacks in trainmon's)."""
    return [r.msprobe_dict() for r in rules]
