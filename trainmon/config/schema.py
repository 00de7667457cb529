"""The monitor configuration: every key declared once (``trainmon.config.keys``), in typed, immutable
sections.

msprobe monitor config keys keep their meaning. Keys trainmon does not implement yet are validated and kept
in :attr:`MonitorConfig.pending`. :func:`trainmon.config.load.load_config` builds a :class:`MonitorConfig`
from a file, a mapping or keywords. ``docs/config.md`` shows these declarations as its key tables.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar, Literal, get_args

from trainmon.config.alert import AlertConfig
from trainmon.config.check import (
    ConfigError,
    as_int,
    as_list,
    as_mapping,
    as_number,
    as_str_list,
    check_keys,
    child,
    dedupe,
    describe,
    expected,
)
from trainmon.config.keys import Section, freeze, key, one_of, plain
from trainmon.config.rules import Stat
from trainmon.config.targets import parse_target
from trainmon.config.timing import TimingConfig
from trainmon.joblog import job_wide
from trainmon.run.records import STATS

__all__ = [
    "ALLOWED_FORMATS",
    "ALLOWED_OPS",
    "ALL_KEYS",
    "FIELDS",
    "PENDING_KEYS",
    "AlertConfig",
    "CcDistribution",
    "GradProbe",
    "MonitorConfig",
    "PendingKeys",
    "TimingConfig",
]

logger = logging.getLogger("trainmon")

# Values msprobe accepts in "ops", plus our "infs". shape/dtype are always written as metadata, so they are
# accepted and dropped; "id" (msprobe's undocumented identity op) is accepted with a warning and dropped.
ALLOWED_OPS: tuple[str, ...] = (*STATS, "id", "shape", "dtype")
Format = Literal["tensorboard", "csv", "api"]
ALLOWED_FORMATS: tuple[str, ...] = get_args(Format)
_DEFAULT_FORMAT: tuple[str, ...] = ("tensorboard",)
RankMode = Literal["auto", "all"]
TB_RANK_MODES: tuple[str, ...] = get_args(RankMode)
# What the TensorBoard runs show: the summary figures (the default), every tensor, or the summary plus the
# tensors a list of patterns names (trainmon.writer.tbview)
TensorView = Literal["summary", "all"]
TB_TENSOR_VIEWS: tuple[str, ...] = get_args(TensorView)


# ---------------------------------------------------------------------------------------------------------
# Validators of the keys whose forms the type alone does not say


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


def _choices(v: Any, path: str, what: str, allowed: tuple[str, ...]) -> list[str]:
    """A string or a list of strings, each one of ``allowed``."""
    if isinstance(v, str):
        return [one_of(v, path, what, allowed)]
    return [one_of(item, f"{path}[{i}]", what, allowed) for i, item in enumerate(as_list(v, path))]


def _ops(v: Any, path: str) -> tuple[str, ...]:
    items = _choices(v, path, "op", ALLOWED_OPS)
    if "id" in items:
        job_wide(logger).warning("trainmon: op 'id' in %s is not implemented and is ignored", path)
    stats = [op for op in items if op in STATS]
    # An empty list is msprobe's "default"; ours is every statistic. Same when only metadata ops were given.
    return dedupe(stats) if stats else STATS


def _formats(v: Any, path: str) -> tuple[str, ...]:
    items = _choices(v, path, "format", ALLOWED_FORMATS)
    return dedupe(items) if items else _DEFAULT_FORMAT


def _msprobe_format(formats: tuple[str, ...]) -> str | list[str]:
    # msprobe reads one format, as a string
    return formats[0] if len(formats) == 1 else list(formats)


def _ranks(v: Any, path: str, *, modes: tuple[str, ...], negative: bool, what: str) -> Any:
    if modes and isinstance(v, str) and v.strip() in modes:
        return v.strip()
    if isinstance(v, bool):
        raise expected(path, what, v)
    if isinstance(v, int):
        v = [v]
    elif isinstance(v, str):
        # msprobe's own examples write "0" or "0,1".
        parts = [p.strip() for p in v.split(",") if p.strip()]
        pattern = r"-?\d+" if negative else r"\d+"
        if (modes and not parts) or not all(re.fullmatch(pattern, p) for p in parts):
            raise expected(path, f"{what} or a string of comma-separated ranks", v)
        v = [int(p) for p in parts]
    lo = -(1 << 31) if negative else 0
    return dedupe([as_int(r, f"{path}[{i}]", lo=lo) for i, r in enumerate(as_list(v, path))])


def _module_ranks(v: Any, path: str) -> tuple[int, ...]:
    return _ranks(v, path, modes=(), negative=False, what="a list of ranks")


def _tensorboard_ranks(v: Any, path: str) -> str | tuple[int, ...]:
    """``auto``, ``all``, or the ranks whose files are written (negative: from the last rank)."""
    return _ranks(v, path, modes=TB_RANK_MODES, negative=True, what="auto, all, a list of ranks")


def _tensorboard_tensors(v: Any, path: str) -> str | tuple[str, ...]:
    """``summary``, ``all``, or patterns naming the tensors TensorBoard shows in full besides the summary (a
    pattern matches a tensor's name or ``kind/name``: exact, a glob, or ``re:`` and a regex)."""
    if isinstance(v, str) and v.strip() in TB_TENSOR_VIEWS:
        return v.strip()
    items = [v] if isinstance(v, str) else as_list(v, path)
    out = []
    for i, item in enumerate(items):
        item_path = path if isinstance(v, str) else f"{path}[{i}]"
        if not isinstance(item, str) or not item:
            raise expected(item_path, "summary, all, or a tensor name pattern (a non-empty string)", item)
        if item.startswith("re:"):
            try:
                re.compile(item[3:])
            except re.error as e:
                raise ConfigError(f"invalid regular expression {item[3:]!r}: {e}", key=item_path) from None
        out.append(item)
    return dedupe(out) if out else "summary"


def _mbs_grad(v: Any, path: str) -> bool:
    # msprobe treats a non-bool monitor_mbs_grad as false with a warning instead of failing.
    if isinstance(v, bool):
        return v
    job_wide(logger).warning(
        "trainmon: %s should be true or false, got %s; treating it as false", path, describe(v)
    )
    return False


def _regexes(v: Any, path: str) -> tuple[str, ...]:
    codeline = as_str_list(v, path)
    for i, expr in enumerate(codeline):
        try:
            re.compile(expr)
        except re.error as e:
            raise ConfigError(f"invalid regular expression {expr!r}: {e}", key=f"{path}[{i}]") from None
    return tuple(codeline)


def _bounds(v: Any, path: str) -> tuple[float, ...]:
    items = as_list(v, path)
    bounds = tuple(as_number(b, f"{path}[{i}]", lo=float("-inf")) for i, b in enumerate(items))
    if not bounds or any(a >= b for a, b in zip(bounds, bounds[1:], strict=False)):
        raise ConfigError(f"expected a non-empty, strictly increasing list, got {items!r}", key=path)
    return bounds


def _targets_msprobe(targets: tuple[str, ...]) -> dict[str, dict]:
    return {name: {} for name in targets}


# ---------------------------------------------------------------------------------------------------------
# Sections


@dataclass(frozen=True)
class CcDistribution(Section):
    """``cc_distribution``: statistics of the tensors collectives move (``trainmon.collect.comm``)."""

    PATH = "cc_distribution"

    enable: bool = key(False, "switch the collector on", msprobe=True)
    cc_codeline: tuple[str, ...] = key(
        (),
        "regexes: record only calls with a stack frame '<file>[<line>]' one of them finds",
        check=_regexes,
        msprobe=True,
        type_doc="list of regexes",
        doc='Record only calls whose Python stack has a frame `"<file>[<line>]"` that one of the regexes '
        "finds (`re.search`), e.g. `train\\.py\\[23\\]`; calls not matching are still counted.",
    )
    cc_pre_hook: bool = key(
        False, "also record the inputs (msprobe records outputs only by default)", msprobe=True
    )
    cc_log_only: bool = key(
        False,
        "record no statistics; log each distinct call stack once per collective",
        msprobe=True,
        doc="Record no statistics and log each distinct call stack once per collective, to help write "
        "`cc_codeline`. Unlike msprobe it does not stop training.",
    )


@dataclass(frozen=True)
class GradProbe(Section):
    """``grad_probe``: gradient fingerprints per parameter and collected step, for ``trainmon compare``
    (``trainmon.collect.gradprobe``). msprobe's keys ``grad_level``, ``param_list`` and ``bounds`` keep their
    meaning; ``sample_size`` elements (positions seeded by ``sample_seed``: name and shape, or shape only)
    and, with ``sign_bitmap``, every element's sign at 1 bit are the direction sketch of L1 and L2."""

    PATH = "grad_probe"

    enable: bool = key(
        False,
        "write fingerprints of every parameter's gradient at collected steps",
        doc="Record fingerprints.",
    )
    grad_level: Literal["L0", "L1", "L2"] = key(
        "L2",
        "L0: statistics; L1: + direction sketch (sampled values); L2: + bins",
        doc="msprobe's levels: `L0` statistics only; `L1` adds the direction sketch (sampled values, "
        "optional sign bitmap); `L2` adds bin fractions over `bounds` and the fraction of exact zeros.",
    )
    param_list: tuple[str, ...] = key(
        (),
        "parameter names or globs; [] = every parameter the optimizer updates",
        doc="Parameter names (or globs) to probe, as msprobe's `param_list`; empty: every parameter the "
        "optimizer updates.",
    )
    bounds: tuple[float, ...] = key(
        (-1.0, 0.0, 1.0),
        "histogram bin edges of L2",
        check=_bounds,
        type_doc="list of numbers, strictly increasing",
        doc="L2 bin edges: intervals `(-inf, b0], (b0, b1], ..., (bn, inf)`.",
    )
    sample_size: int = key(
        1024,
        "sampled elements per parameter (L1, L2)",
        lo=1,
        hi=1 << 24,
        doc="Elements sampled per parameter (all of them when the tensor is smaller).",
    )
    sign_bitmap: bool = key(
        False,
        "also every element's sign, 1 bit each (L1, L2)",
        doc="Also store every element's sign (`grad > 0`) at 1 bit (L1, L2).",
    )
    sample_seed: Literal["name", "shape"] = key(
        "name",
        "name | shape: what the sample positions are seeded by",
        doc="What seeds the sample positions: the parameter's name and shape, or its shape only (for runs "
        "compared through a `--map` of renamed parameters).",
    )


def _append_output(v: Any, path: str) -> tuple[str, ...]:
    items = as_str_list(v, path)
    if len(items) not in (0, 2):
        raise ConfigError(f"expected [start_time, end_time] or [], got {len(items)} items", key=path)
    return tuple(items)


_L2_HOOKS = ("linear_hook", "attention_hook", "moe_router_weight_hook", "moe_router_logit_hook")


def _l2_targets(v: Any, path: str) -> Mapping[str, tuple[str, ...]]:
    m = as_mapping(v, path)
    check_keys(m, _L2_HOOKS, path)
    return MappingProxyType({k: tuple(as_str_list(names, f"{path}.{k}")) for k, names in m.items()})


@dataclass(frozen=True, kw_only=True)
class PendingKeys(Section):
    """msprobe keys trainmon accepts and validates without an implementation yet (``MonitorConfig.pending``
    holds the ones a config set). A value other than the default asks for something: it is reported."""

    mg_direction: bool = key(False, "msprobe's direction of the update", msprobe=True, used_when="true")
    print_struct: bool = key(False, "msprobe's model structure print", msprobe=True, used_when="true")
    stack_info: bool = key(False, "msprobe's call stacks of the modules", msprobe=True, used_when="true")
    step_count_per_record: int = key(
        1, "msprobe's steps per record file", lo=1, hi=1_000_000, msprobe=True, used_when="not 1"
    )
    append_output: tuple[str, ...] = key(
        (),
        "msprobe's [start_time, end_time] of outputs to append to",
        check=_append_output,
        msprobe=True,
        type_doc="`[]` or `[start_time, end_time]` (two strings)",
        used_when="not empty",
    )
    l2_targets: Mapping[str, tuple[str, ...]] = key(
        MappingProxyType({}),
        "msprobe's L2 feature hooks",
        check=_l2_targets,
        msprobe=True,
        type_doc="mapping from `linear_hook`, `attention_hook`, `moe_router_weight_hook`, "
        "`moe_router_logit_hook` to lists of module names",
        used_when="not empty",
    )
    recording_l2_features: bool = key(False, "msprobe's L2 feature recording", msprobe=True, used_when="true")
    sa_order: str = key(
        "s,b,h,d",
        "msprobe's order of attention dimensions",
        msprobe=True,
        type_doc='string (`"s,b,h,d"` or `"b,s,h,d"`)',
        used_when='not `"s,b,h,d"`',
    )
    given: tuple[str, ...] = field(default=(), compare=False, repr=False)

    def asked_for(self) -> tuple[str, ...]:
        """The keys the config set to a value that asks for something."""
        defaults = {d.name: d.default for d in self.declared()}
        return tuple(k for k in self.given if getattr(self, k) != defaults[k])


@dataclass(frozen=True, kw_only=True)
class MonitorConfig(Section):
    """A validated monitor configuration. Build it with :func:`load_config`; direct construction
    validates and normalises too (lists become tuples, ``None`` means the default)."""

    PENDING: ClassVar[type[PendingKeys]] = PendingKeys

    targets: tuple[str, ...] = key(
        (),
        "module / parameter names; globs (*?[) and 're:' regexes allowed; [] = everything",
        check=_targets,
        msprobe=_targets_msprobe,
        group="collect",
        type_doc="mapping or list of strings",
        default_doc="`{}`",
        doc="Which modules (activations) and parameters (gradients, optimizer state, parameters) to monitor. "
        "See [Targets](#targets).",
    )
    all_xy: bool = key(
        False,
        "hook every module for activations, whatever targets says",
        msprobe=True,
        group="collect",
        doc="With `xy_distribution`, hook every module for activations, whatever `targets` says. On its own "
        "it collects nothing (as in msprobe), and says so: a warning at attach and a `note:` line in "
        "`trainmon config check`.",
    )
    xy_distribution: bool = key(
        False,
        "activations: module inputs/outputs (actv) and their gradients (actv_grad)",
        msprobe=True,
        group="collect",
        doc="Activations: statistics of every tensor in a module's forward inputs and outputs (kind `actv`) "
        "and of the gradients flowing through it in backward (kind `actv_grad`), per micro-batch.",
    )
    forward_only: bool = key(
        False,
        "activations: forward only",
        msprobe=True,
        group="collect",
        doc="Activations: forward (`actv`) only.",
    )
    backward_only: bool = key(
        False,
        "activations: backward only",
        msprobe=True,
        group="collect",
        doc="Activations: backward (`actv_grad`) only. Setting both `forward_only` and `backward_only` is an "
        "error.",
    )
    wg_distribution: bool = key(
        False,
        "weight gradients before (grad_unreduced) and after (grad_reduced) the reduction",
        msprobe=True,
        group="collect",
        doc="Weight gradients: before the data-parallel reduction (`grad_unreduced`) and after it "
        "(`grad_reduced`).",
    )
    monitor_mbs_grad: bool = key(
        False,
        "unreduced gradients per micro-batch",
        check=_mbs_grad,
        msprobe=True,
        group="collect",
        doc="Record unreduced gradients per micro-batch instead of once per step. A value that is not a bool "
        "is treated as `false` with a warning, as msprobe does.",
    )
    mv_distribution: bool = key(
        False,
        "Adam moments exp_avg / exp_avg_sq, after the optimizer step",
        msprobe=True,
        group="collect",
        doc="Adam moments `exp_avg` and `exp_avg_sq`.",
    )
    ur_distribution: bool = key(
        False,
        "Adam update m/(sqrt(v)+eps) and ratio m/sqrt(v)",
        msprobe=True,
        group="collect",
        doc="Adam update `m̂ / (√v̂ + eps)` (kind `update`) and ratio `m̂ / √v̂` (kind `ratio`), recorded as "
        "statistics like every other kind.",
    )
    param_distribution: bool = key(
        False,
        "parameters before (param_origin) and after (param_updated) the optimizer step",
        msprobe=True,
        group="collect",
        doc="Parameters before the optimizer step (`param_origin`) and after it (`param_updated`).",
    )
    squash_name: bool = key(
        False,
        "shorten long Megatron names to the part from 'layers.' / 'embedding.' / ... on",
        msprobe=True,
        group="output",
        doc="Shorten long names in the output. See [Name squashing](#name-squashing).",
    )
    # msprobe's switch in DYNAMIC_MONITOR mode: read from the watched config file at step boundaries
    dynamic_on: bool = key(
        False,
        "with DYNAMIC_MONITOR=true: the switch that turns monitoring on and off",
        msprobe=True,
        group="schedule",
        doc="With `DYNAMIC_MONITOR=true` in the environment and the config given as a file: the switch that "
        "turns monitoring on and off from the next step. See [Changing the config during "
        "training](#changing-the-config-during-training).",
    )
    ops: tuple[Stat, ...] = key(
        STATS,
        "statistics written: min, max, mean, norm, zeros, nans, infs",
        check=_ops,
        msprobe=True,
        group="output",
        type_doc="list of strings",
        default_doc="all seven: `[min, max, mean, norm, zeros, nans, infs]`",
        doc="Statistics written, in this order. Allowed: `min`, `max`, `mean`, `norm`, `zeros`, `nans`, "
        "`infs`, plus msprobe's `shape`, `dtype` and `id`. `shape` and `dtype` are accepted and ignored: "
        "they are always written as metadata. `id` is accepted with a warning and ignored. An empty list "
        "means the default. Duplicates are dropped; a single string is read as a one-element list.",
    )
    eps: float = key(
        1e-8,
        "|x| <= eps counts as zero",
        msprobe=True,
        group="output",
        doc="Threshold of the `zeros` statistic. An int is accepted.",
    )
    # None (the default): the shortest text that reads back as the same float32; an int: msprobe's rounding
    ndigits: int | None = key(
        None,
        "CSV floats: null = every digit of the float32; N = rounded to N decimal places (msprobe)",
        hi=20,
        msprobe=True,
        group="output",
        type_doc="int 0..20, or `null`",
        doc="CSV floats. `null`: every float written as the shortest text that reads back as the same "
        "float32 (`-0.0014557712`, `3.6e-15`). An int: rounded to that many decimal places, as msprobe does "
        "(`ndigits: 6` writes `-0.001456` and `0.0`). See [Output](output.md#csv).",
    )
    format: tuple[Format, ...] = key(
        _DEFAULT_FORMAT,
        "outputs: tensorboard, csv, api (in memory only)",
        check=_formats,
        msprobe=_msprobe_format,
        group="output",
        type_doc="string or list of strings",
        doc="Outputs: `tensorboard` (event files with the figures `tensorboard_tensors` chooses, and the "
        "statistics store: every statistic of every tensor and step, ~4 KB per rank and step for ~300 "
        "tensors), `csv` (msprobe-compatible CSV files, one row per tensor and micro-step: ~30 KB per rank "
        "and step for ~300 tensors; `trainmon export` writes the same files from the statistics store after "
        "the fact), `api` (nothing on disk: the last finished step is available in memory through "
        "`Monitor.latest()`). An empty list means the default. msprobe configs say `format: csv` and keep "
        "their CSV.",
    )
    start_step: int = key(0, "first step collected", msprobe=True, group="schedule")
    step_interval: int = key(
        1, "collect every N steps", lo=1, msprobe=True, group="schedule",
        doc="Collect every N-th step from `start_step` on.",
    )  # fmt: skip
    collect_times: int = key(
        100_000_000, "stop after this many collected steps", lo=1, msprobe=True, group="schedule"
    )
    module_ranks: tuple[int, ...] = key(
        (),
        "ranks that collect; [] = all",
        check=_module_ranks,
        msprobe=True,
        group="schedule",
        type_doc="list of ints >= 0",
        doc="Ranks that collect; `[]` means all ranks. A single int, or a string of comma-separated ranks "
        'such as `"0"` or `"0,1"` (as some msprobe examples write it), is accepted too. With a sharded '
        "optimizer (DeepSpeed ZeRO, Megatron's distributed optimizer) every rank still computes its shard's "
        "statistics, because the merge is a collective; only the listed ranks record activations and write "
        "([distributed.md](distributed.md)).",
    )
    # In a process group: how long a rank waits for the others when they agree on a config edit or on an
    # on_nan: skip decision (trainmon.step.agree); past it that rank stops agreeing and says so
    sync_timeout_s: float = key(
        60.0,
        "process group: seconds a rank waits when the ranks agree on a config edit or a skip",
        lo=0.1,
        live=False,
        group="schedule",
        doc="In a process group: how long a rank waits for the others when the ranks agree on a config edit "
        "or on whether a NaN step's update is held back (`alert.on_nan`: `skip`, `raise`, `exit`) (small "
        "collectives on a gloo group of the monitor's own). A rank that waited this long stops agreeing for "
        "the rest of the run and says so once: config edits are no longer applied, and `on_nan: skip` turns "
        "into reporting. See [reliability.md](reliability.md#config-edits-alerts-and-storage-waits).",
    )
    # Ranks whose TensorBoard events are written: auto (every rank up to 16 ranks; above, rank 0, the last
    # rank and the all_ranks run of cross-rank aggregates), all, or a list (negative: from the last rank).
    tensorboard_ranks: RankMode | tuple[int, ...] = key(
        "auto",
        "ranks with TensorBoard events: auto | all | [ranks] (-1 = last); + all_ranks run",
        check=_tensorboard_ranks,
        group="output",
        type_doc="`auto`, `all`, or a list of ints",
        doc="Ranks that write their own TensorBoard events (`RUN/rank_<r>/events...`). `auto`: every rank in "
        "a job of up to 16 ranks; above 16, rank 0 and the last rank, plus the `all_ranks` run (below). "
        "`all`: every rank (the statistics store is written by every rank whatever this says). A list names "
        "the ranks; a negative entry counts from the last rank (`-1` is the last), ranks outside the job are "
        'ignored, `[]` writes no rank\'s own events. A single int, or a string such as `"0,-1"`, is accepted '
        "too. See [TensorBoard at scale](#tensorboard-at-scale).",
    )
    # Ranks whose CSV files are written: auto (every rank up to 16 ranks, or when the statistics store is not
    # written; above, the ranks with TensorBoard events), all, or a list (negative: from the last rank).
    csv_ranks: RankMode | tuple[int, ...] = key(
        "auto",
        "ranks with CSV files: auto (above 16 ranks: those with events) | all | [ranks]",
        check=_tensorboard_ranks,
        group="output",
        type_doc="`auto`, `all`, or a list of ints",
        doc="Ranks that write CSV files (`RUN/rank_<r>/<kind>.csv`). `auto`: every rank in a job of up to 16 "
        "ranks, and every rank when `tensorboard` is not an output (then the CSV is the only record of the "
        "statistics); above 16 ranks, the ranks that write TensorBoard events (rank 0 and the last rank by "
        "default, or the `tensorboard_ranks` list): every rank's statistics are in the statistics store "
        "([output.md](output.md#columnar-tables-statistics-anomaly-records-steps)), readable with DuckDB, "
        "pandas, Polars or Spark, and the CSV of ~300 tensors costs ~30 KB per rank and step, twice what a "
        "1024-rank job can afford for everything. `all`: every rank, as msprobe does. A list names the ranks "
        "(negative: from the last rank).",
    )
    # What each TensorBoard run shows: summary figures (per kind and layer, the step's gradient norm and
    # NaN/Inf counts, tracked scalars), every tensor x statistic, or the summary plus the tensors named.
    tensorboard_tensors: TensorView | tuple[str, ...] = key(
        "summary",
        "TensorBoard: summary (per-layer and per-kind figures) | all (every tensor) | [name patterns]",
        check=_tensorboard_tensors,
        group="output",
        type_doc="`summary`, `all`, or a list of name patterns",
        doc="What each TensorBoard run shows. `summary`: the figures a person reads in TensorBoard's own "
        "dashboards, a few hundred tags whatever the model: the tracked scalars (`Monitor.track`, every "
        "statistic of `ops`), the step's gradient norm and NaN/Inf counts, each kind's statistics over all "
        "its tensors and the norm of each layer (or module) per kind "
        "([output.md](output.md#the-summary-view)). `all`: every statistic of `ops` for every tensor (7 tags "
        "a tensor: thousands of tags for a large model, ~90 KB per rank and step for ~300 tensors, and "
        "TensorBoard slows to minutes to load them). A list of patterns: the summary, plus every statistic "
        "of `ops` of the tensors named (a pattern matches a tensor's name or `kind/name`, as TensorBoard "
        "tags show them: an exact name, a glob such as `layers.0.*` or `grad_reduced/*`, or `re:` and a "
        "regular expression). Every statistic of every tensor is in the statistics store whatever this "
        "says (the trainmon tab; `trainmon export`).",
    )
    # Anomaly rules, alert delivery and the action on NaN (msprobe's ``alert`` plus trainmon's keys).
    alert: AlertConfig = key(
        AlertConfig(),
        "anomaly rules, where alerts go and what happens on a NaN (docs/alerts.md)",
        msprobe=True,
        hash=False,
        doc="Anomaly rules, alert delivery and the action on NaN: [below](#alert-anomaly-rules-alerts-and-"
        "the-action-on-nan).",
    )
    # Statistics of collective communication (msprobe's ``cc_distribution``).
    cc_distribution: CcDistribution = key(
        CcDistribution(),
        "statistics of the tensors torch.distributed collectives move (docs/collectives.md)",
        msprobe=True,
        group="collect",
        type_doc="mapping (below)",
        default_doc="off",
        doc="Statistics of the inputs (with `cc_pre_hook`) and outputs of torch.distributed collectives "
        "(kind `comm`, rows `{op}.{group}.input/output`). Keys [below](#cc_distribution); see "
        "[collectives.md](collectives.md).",
    )
    # Gradient fingerprints for run-vs-run comparison (msprobe's ``grad_probe``; ``trainmon compare``).
    grad_probe: GradProbe = key(
        GradProbe(),
        "gradient fingerprints for trainmon compare (docs/grad_probe.md)",
        type_doc="mapping (below)",
        default_doc="off",
        doc="Gradient fingerprints per parameter and collected step: [below](#grad_probe).",
    )
    # Per-rank time of every collected step (docs/timing.md).
    timing: TimingConfig = key(
        TimingConfig(),
        "per-rank time of each collected step: its parts, waits at collectives, gc (docs/timing.md)",
        group="collect",
        type_doc="mapping (below)",
        default_doc="on",
        doc="Per-rank time of each collected step: [below](#timing).",
    )
    # Accepted msprobe keys without an implementation yet, validated and read-only.
    pending: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}), hash=False)

    def _check(self, path: str | None) -> None:
        given = {} if self.pending is None else as_mapping(self.pending, "pending")
        check_keys(given, self.PENDING.key_names(), None)
        pending = self.PENDING.parse({k: v for k, v in given.items() if v is not None})
        object.__setattr__(
            self, "pending", MappingProxyType({k: freeze(getattr(pending, k)) for k in pending.given})
        )
        if self.forward_only and self.backward_only:
            raise ConfigError(
                "both are true, so no activation would be collected; set at most one of them",
                key="forward_only/backward_only",
            )

    @classmethod
    def all_keys(cls) -> tuple[str, ...]:
        """Every key a config file may hold: the schema's and the accepted, not implemented ones."""
        return (*cls.key_names(), *cls.PENDING.key_names())

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
        return self.PENDING.parse(dict(self.pending)).asked_for()

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (pending keys included) that :func:`load_config` reads back equal."""
        return {**super().to_dict(), **plain(self.pending)}

    def msprobe_dict(self) -> dict[str, Any]:
        """The config in msprobe's spelling: every msprobe key, the accepted-not-implemented ones included."""
        pending = self.PENDING.parse(dict(self.pending))
        return {**super().msprobe_dict(), **pending.msprobe_dict()}


FIELDS: tuple[str, ...] = MonitorConfig.key_names()
PENDING_KEYS: tuple[str, ...] = PendingKeys.key_names()
ALL_KEYS: tuple[str, ...] = MonitorConfig.all_keys()
