"""The record schema shared by the collector, the writers, the CLI and the TensorBoard plugin.

A collected step is a table: one row per (tensor, hook firing), described by a :class:`Row` and an
8-element *partial statistics* vector. Partials are mergeable (SUM for counts and sums, MAX for max
and -min), so micro-batches, shards and ranks combine exactly. Every user-facing statistic is derived
from them in one place, :func:`derive`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:  # numpy is imported where it is used: the readers of records (``analyze``) never need it
    import numpy as np

    from trainmon.run.timing import StepTiming

SCHEMA_VERSION = 1


class Kind(str, Enum):
    """What a row measures (msprobe's file names where msprobe has one)."""

    ACTV = "actv"
    ACTV_GRAD = "actv_grad"
    GRAD_UNREDUCED = "grad_unreduced"
    GRAD_REDUCED = "grad_reduced"
    PARAM_ORIGIN = "param_origin"
    PARAM_UPDATED = "param_updated"
    EXP_AVG = "exp_avg"
    EXP_AVG_SQ = "exp_avg_sq"
    UPDATE = "update"
    RATIO = "ratio"
    COMM = "comm"
    SCALAR = "scalar"


class Phase(str, Enum):
    """Where in the step a row was produced; with ``seq`` it orders rows within a rank."""

    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"
    COMM = "comm"


# Layout of the partial statistics vector produced by the stats kernel.
PARTIALS = ("numel", "nans", "infs", "zeros", "min", "max", "sum", "sumsq")
N_PARTIALS = len(PARTIALS)
NUMEL, NANS, INFS, ZEROS, MIN, MAX, SUM, SUMSQ = range(N_PARTIALS)

# User-facing statistics, in the order CSV columns and TB tags use by default.
STATS = ("min", "max", "mean", "norm", "zeros", "nans", "infs")


class Row(NamedTuple):
    """Metadata of one collected tensor. Built in hooks, so it holds raw objects (shape, dtype);
    writers format them."""

    kind: str
    name: str
    vpp_stage: int
    micro_step: int
    phase: str
    shape: tuple[int, ...]
    dtype: Any


@dataclass(frozen=True)
class StepRecord:
    """One collected step of one rank, on the host. ``rows[i]`` describes ``partials[i]``;
    ``seq`` of a row is its index: the order in which hooks fired on this rank."""

    step: int
    rank: int
    rows: tuple[Row, ...]
    partials: np.ndarray  # shape (len(rows), N_PARTIALS), float64
    wall_time: float
    skipped: bool = False  # the optimizer skipped this step (loss-scale overflow found by a GradScaler)
    # per row: collectives this rank had issued in the step when the row was taken (None: not distributed)
    collectives: np.ndarray | None = None
    # why the monitor itself kept the update from landing (alert.on_nan: skip); "" when it did not
    skip_reason: str = ""
    # the step's tensors merged over every rank (the ``all_ranks`` TensorBoard run); None on other ranks
    all_ranks: RankAggregate | None = None
    # where the step's time went, on this rank and (exchanged) on every rank; None when timing is off
    timing: StepTiming | None = None
    # per row: the NaN + Inf elements of this rank's own piece, before the row was merged over ranks (a
    # sharded DTensor, ZeRO); for a row not merged, its own count. ``partials`` hold the whole tensor's. None
    # when no row of the step was merged (then every row is this rank's own)
    own_nonfinite: np.ndarray | None = None

    def stats(self) -> dict[str, np.ndarray]:
        return derive(self.partials)


@dataclass(frozen=True)
class RankAggregate:
    """One step's tensors merged over every rank of the job (and over micro-steps): ``partials[i]`` holds
    the partials of the tensor ``keys[i]`` = (kind, vpp_stage, name) combined with :func:`merge` over the
    ranks that have it (``numel`` 0: no rank had it this step). What the ``all_ranks`` TensorBoard run shows:
    min over ranks of min, max of max, NaN/Inf counts summed, the norm and mean of all ranks' elements."""

    keys: tuple[tuple[str, int, str], ...]
    partials: np.ndarray  # (len(keys), N_PARTIALS), float64


def derive(partials: np.ndarray) -> dict[str, np.ndarray]:
    """Vectorised derived statistics for an (n, 8) partials array.

    min/max/mean/norm are over finite elements; they are NaN when a tensor has no finite element.
    ``zeros`` is the fraction of elements with ``|x| <= eps``; ``nans``/``infs`` are counts.
    """
    import numpy as np

    p = np.asarray(partials, dtype=np.float64).reshape(-1, N_PARTIALS)
    numel = p[:, NUMEL]
    finite = numel - p[:, NANS] - p[:, INFS]
    has_finite = finite > 0
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(has_finite, p[:, SUM] / np.where(has_finite, finite, 1.0), np.nan)
        zeros = np.where(numel > 0, p[:, ZEROS] / np.where(numel > 0, numel, 1.0), 0.0)
    return {
        "min": np.where(has_finite, p[:, MIN], np.nan),
        "max": np.where(has_finite, p[:, MAX], np.nan),
        "mean": mean,
        "norm": np.where(has_finite, np.sqrt(np.maximum(p[:, SUMSQ], 0.0)), np.nan),
        "zeros": zeros,
        "nans": p[:, NANS].copy(),
        "infs": p[:, INFS].copy(),
    }


def merge(partials: np.ndarray) -> np.ndarray:
    """Combine partials of pieces of one tensor (micro-batches, shards, ranks) into one vector."""
    import numpy as np

    p = np.asarray(partials, dtype=np.float64).reshape(-1, N_PARTIALS)
    out = p.sum(axis=0)
    if len(p):
        out[MIN] = p[:, MIN].min()
        out[MAX] = p[:, MAX].max()
    else:
        out[MIN], out[MAX] = np.inf, -np.inf
    return out


def grad_norm(sumsq: np.ndarray) -> float:
    """The norm of several tensors' finite elements from their sums of squares (NaN for no tensor): the
    steps table's ``grad_norm`` and TensorBoard's ``step/grad_norm``."""
    import numpy as np

    return float(np.sqrt(max(float(np.sum(sumsq)), 0.0))) if len(sumsq) else float("nan")


def tag(kind: str, name: str, stat: str) -> str:
    """TensorBoard tag of one statistic."""
    return f"{kind}/{name}/{stat}"


def kind_name(kind: object) -> str:
    """``"actv"`` for ``"actv"`` and for ``Kind.ACTV`` (whose ``str()`` is ``"Kind.ACTV"``)."""
    return str(kind.value) if isinstance(kind, Enum) else str(kind)


def dtype_name(dtype: object) -> str:
    """A dtype as the statistics store writes it, the same for every framework: ``float32``, ``bfloat16``
    (``torch.bfloat16``, MindSpore's ``BFloat16``, numpy's ``float32`` alike)."""
    text = str(dtype).strip().lower()
    for prefix in ("torch.", "mindspore.", "numpy.", "np."):
        text = text.removeprefix(prefix)
    return text


def shape_text(shape: object) -> str:
    """A shape as msprobe writes it: ``[8, 32]`` (``[]`` for a scalar)."""
    try:
        return "[" + ", ".join(str(int(d)) for d in shape) + "]"  # type: ignore[attr-defined]
    except TypeError:
        return str(shape)


def chunk_name(vpp_stage: int, name: str, multi_chunk: bool) -> str:
    """A tensor's name as TensorBoard, the manifest and ``Monitor.latest()`` show it:
    ``"{vpp_stage}:{name}"`` when the model has several chunks (virtual pipeline stages), else ``name``."""
    return f"{vpp_stage}:{name}" if multi_chunk else name


class TensorGroups:
    """The rows of a step grouped per tensor, (kind, vpp_stage, name), in order of first appearance.

    A tensor seen in several micro-batches has several rows; :meth:`merge` gives one step-level partials
    vector per group, which is what TensorBoard and ``Monitor.latest()`` show (the CSV keeps every row).
    """

    __slots__ = ("keys", "_order", "_starts")

    def __init__(self, rows: tuple[Row, ...]) -> None:
        import numpy as np

        groups: dict[tuple[str, int, str], list[int]] = {}
        for i, r in enumerate(rows):
            groups.setdefault((kind_name(r.kind), r.vpp_stage, r.name), []).append(i)
        self.keys = tuple(groups)
        if len(groups) == len(rows):  # no micro-step duplicates: groups are the rows themselves
            self._order = self._starts = None
        else:
            self._order = np.asarray([i for members in groups.values() for i in members], dtype=np.intp)
            sizes = [len(members) for members in groups.values()]
            self._starts = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.intp)

    def first_rows(self) -> list[int]:
        """The row of each group's first appearance (its shape and dtype stand for the group's)."""
        if self._order is None:
            return list(range(len(self.keys)))
        return self._order[self._starts].tolist()

    @property
    def identity(self) -> bool:
        """Every group is one row (no micro-step duplicates): the tensors are the rows, in their order."""
        return self._order is None

    def merge(self, partials: np.ndarray) -> np.ndarray:
        """(len(keys), 8) partials: each group's rows combined as :func:`merge` does."""
        import numpy as np

        p = np.asarray(partials, dtype=np.float64).reshape(-1, N_PARTIALS)
        if self._order is None:
            return p
        p = p[self._order]
        merged = np.add.reduceat(p, self._starts, axis=0)
        merged[:, MIN] = np.minimum.reduceat(p[:, MIN], self._starts)
        merged[:, MAX] = np.maximum.reduceat(p[:, MAX], self._starts)
        return merged


class Derived:
    """The user-facing statistics of one step record, derived once (on the writer thread) and shared by every
    sink: ``rows`` per row (what the CSV writes), ``tensors`` per tensor with its micro-steps merged (what
    TensorBoard, the statistics store and the rules see); ``merged`` holds the tensors' partials."""

    __slots__ = ("rows", "groups", "_partials", "_merged", "_tensors")

    def __init__(self, record: StepRecord, groups: TensorGroups | None = None) -> None:
        import numpy as np

        self.groups = groups if groups is not None else TensorGroups(record.rows)
        self._partials = np.asarray(record.partials, dtype=np.float64).reshape(-1, N_PARTIALS)
        self.rows = derive(self._partials)
        self._merged: np.ndarray | None = None
        self._tensors: dict[str, np.ndarray] | None = None

    @property
    def merged(self) -> np.ndarray:
        if self._merged is None:
            self._merged = self.groups.merge(self._partials)
        return self._merged

    @property
    def tensors(self) -> dict[str, np.ndarray]:
        if self._tensors is None:
            self._tensors = self.rows if self.groups.identity else derive(self.merged)
        return self._tensors


ANOMALY_SCHEMA_VERSION = 1

# The rule names anomaly records carry (``Anomaly.rule``).
NAN_RULE = "nan"  # a tensor held NaN
INF_RULE = "inf"  # a tensor held +-Inf (and no NaN)
NON_FINITE_RULES = frozenset((NAN_RULE, INF_RULE))
TURBULENCE_RULE = "turbulence"  # a value beyond an EMA of its history (msprobe's AnomalyTurbulence)
ZSCORE_RULE = "zscore"  # a value far from its running mean, in running standard deviations
MAX_RATIO_RULE = "max_ratio"  # a value above a multiple of the running max of earlier values
THRESHOLD_RULE = "threshold"  # a value beyond fixed bounds
LOSS_SCALE_RULE = "loss_scale_overflow"  # NaN/Inf in a step the loss scaler skipped (expected under fp16)
SKIPPED_RULE = "step_skipped"  # the monitor kept a NaN step's update from landing (alert.on_nan: skip)
SUPPRESSED_RULE = "suppressed"  # one record for the anomalies of a step beyond the per-step cap
STRAGGLER_RULE = "straggler"  # a rank slower than the ranks' median in a part of its step, for a while
# every rule a record may carry, in the order `trainmon analyze --rule` lists them
RECORDED_RULES = (
    NAN_RULE,
    INF_RULE,
    TURBULENCE_RULE,
    ZSCORE_RULE,
    MAX_RATIO_RULE,
    THRESHOLD_RULE,
    LOSS_SCALE_RULE,
    SKIPPED_RULE,
    STRAGGLER_RULE,
)

# Order of phases within a step, for "which came first" across ranks.
PHASE_ORDER = {Phase.FORWARD.value: 0, Phase.BACKWARD.value: 1, Phase.COMM.value: 2, Phase.OPTIMIZER.value: 3}


@dataclass(frozen=True)
class Anomaly:
    """One anomaly: a statistic of one tensor at one step on one rank that a rule flagged.

    Written one JSON object a line to ``RUN/plugins/trainmon/anomalies/rank_<r>.jsonl``; read back by the
    CLI (``trainmon analyze``) and the TensorBoard plugin. ``seq`` is the row's position in the rank's step
    (hook firing order); with ``phase``, ``micro_step``, the pipeline stage and ``collectives`` (collectives
    this rank had issued so far in the step) it orders anomalies across ranks.
    """

    step: int
    rank: int
    kind: str  # the record kind: actv, grad_reduced, scalar, ...
    name: str
    stat: str
    value: float
    rule: str  # nan, inf, turbulence, zscore, max_ratio, threshold, overflow, suppressed, ...
    seq: int = 0
    micro_step: int = 0
    vpp_stage: int = 0
    pp_stage: int = 0
    phase: str = Phase.FORWARD.value
    baseline: float | None = None
    origin: bool = False  # first module whose output went non-finite while its inputs were clean
    propagated: bool = False  # downstream of an origin in the same step
    collectives: int = 0
    wall_time: float = 0.0
    dump: str | None = None  # path of a tensor dump, relative to the run directory
    message: str = ""
    v: int = ANOMALY_SCHEMA_VERSION

    def order_key(self) -> tuple:
        """Cross-rank "first occurrence" order: step, collectives seen, phase, micro-step, stage, seq."""
        phase = PHASE_ORDER.get(self.phase, len(PHASE_ORDER))
        # forward runs the pipeline stages in ascending order, backward in descending order
        stage = -self.pp_stage if self.phase == Phase.BACKWARD.value else self.pp_stage
        return (self.step, self.collectives, phase, self.micro_step, stage, self.seq, self.rank)
