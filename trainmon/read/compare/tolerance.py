"""How far two runs' statistics of a tensor may lie apart and still count as the same computation.

**The default** (docs/compare.md, "Tolerance", has the measurement behind it). A tensor computed in a dtype of
unit roundoff ``u`` (bfloat16 ``2**-8``, float16 ``2**-11``, float32 ``2**-24``) by kernels that sum in
another order (other thread counts, GPU vs NPU kernels, atomics) differs by a few ``u`` per element, and its
extremes, single elements, by as much; its sums move less. On top, the statistics themselves are float32 sums
over the tensor's ``n`` elements, in blocks whose order differs between kernels. The default relative
tolerance is::

    rtol = F * u + ACCUMULATION * 2**-24 * log2(n)

with ``F`` = :data:`FACTOR` (512) for 32-bit and wider dtypes, whose reductions over long inner dimensions
pile up tens of ulps and whose elementwise functions differ between frameworks by hundreds (MindSpore's and
PyTorch's tanh: 250 ulps near saturation), and :data:`NARROW_FACTOR` (16) for 16-bit and narrower ones,
where rounding every stored result to a few bits dominates. ``u`` is taken from the precision the tensor
is computed in, in each run (:mod:`~trainmon.read.compare.precision`: its own dtype and everything before it
in the step; float32 gradients of a bfloat16 matmul carry bfloat16 noise), the larger of the two runs'.
It is never below :data:`FLOOR` (the statistics are stored as float32).

Parameters (``param_origin``, ``param_updated``, ``update``, ``ratio``) get :data:`PARAM_FACTOR` times more
``F``: Adam divides each element's moment by its own root mean square, so rounding noise in gradient
elements that are zero by construction becomes a whole update of one sign or the other. The zero fraction
may differ by ``max(rtol, 2.5 / n)`` (a couple of elements rounding to or from zero). NaN and Inf counts and
element counts are compared exactly, whatever the tolerance. On top, every tensor gets the slack of the
state its step started from (``state``: :mod:`~trainmon.read.compare.state`).

**Settings** (``--tolerance FILE``, JSON or YAML): a default for every tensor, and rules by kind and name
(``fnmatch`` globs; the first rule that matches a tensor and sets a value wins)::

    rtol: 1e-4             # every tensor (else by dtype and size, as above)
    zeros: 1e-3
    state: 1.0             # slack per unit of state difference (0: judge every step against rounding)
    rules:
      - {kind: actv, name: "*.attn.*", rtol: 5e-3}
      - {kind: exp_avg_sq, rtol: 1e-2}
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

import numpy as np
import yaml

__all__ = [
    "ACCUMULATION",
    "COUPLING",
    "FACTOR",
    "FLOOR",
    "NARROW_FACTOR",
    "PARAM_FACTOR",
    "Rule",
    "Tolerance",
    "ToleranceError",
    "compute_dtype",
    "default_rtol",
    "load_tolerance",
    "unit_roundoff",
]

FACTOR = 512.0  # ulps of a 32-bit (or wider) dtype
NARROW_FACTOR = 16.0  # ulps of a 16-bit (or narrower) dtype
ACCUMULATION = 4.0  # float32 ulps per doubling of the elements a statistic sums
PARAM_FACTOR = 16.0  # times F, for the parameters (Adam: see the module's docstring)
COUPLING = 1.0
FLOOR = 2.0**-20  # ~1e-6: 16 float32 ulps, the stored statistics' own rounding with room
ZERO_ELEMENTS = 2.5  # elements that may round to or from zero beside rtol's fraction
_UNIT_ROUNDOFF = {
    "float64": 2.0**-53,
    "double": 2.0**-53,
    "float32": 2.0**-24,
    "float": 2.0**-24,
    "tfloat32": 2.0**-11,
    "float16": 2.0**-11,
    "half": 2.0**-11,
    "bfloat16": 2.0**-8,
    "float8_e4m3fn": 2.0**-4,
    "float8_e5m2": 2.0**-3,
}


_U32 = 2.0**-24
# what an optimizer step writes into the parameters (Adam's normalisation amplifies rounding noise there)
_PARAMETERS = frozenset({"param_origin", "param_updated", "update", "ratio"})


class ToleranceError(ValueError):
    """A tolerance file that cannot be used; the message names the file and the entry."""


def unit_roundoff(dtype: str | None) -> float | None:
    """The unit roundoff of a floating dtype (``float32``, ``bfloat16``...); None for others and unknowns."""
    if not dtype:
        return None
    return _UNIT_ROUNDOFF.get(dtype.lower().removeprefix("torch."))


def compute_dtype(dtypes: Sequence[str | None]) -> str | None:
    """The lowest-precision floating dtype among ``dtypes`` (a run's activations): its compute dtype."""
    known = [(unit_roundoff(d), d) for d in dtypes if unit_roundoff(d) is not None]
    return max(known)[1] if known else None


def default_rtol(dtype: str | None, numel: float, compute: str | None = None, kind: str = "") -> float:
    """The default relative tolerance of a tensor of ``kind``, ``dtype`` and ``numel`` elements in a run
    computing in ``compute`` (unknown dtypes count as float32)."""
    u = max(unit_roundoff(dtype) or _U32, unit_roundoff(compute) or 0.0)
    n = max(float(numel), 2.0) if numel == numel else 2.0  # NaN: unknown
    factor = FACTOR if u <= _U32 else NARROW_FACTOR
    if kind in _PARAMETERS:
        factor *= PARAM_FACTOR
    return max(FLOOR, factor * u + ACCUMULATION * _U32 * math.log2(n))


@dataclass(frozen=True)
class Rule:
    kind: str = "*"
    name: str = "*"
    rtol: float | None = None
    zeros: float | None = None

    def matches(self, kind: str, name: str) -> bool:
        return fnmatchcase(kind, self.kind) and fnmatchcase(name, self.name)


@dataclass(frozen=True)
class Tolerance:
    """The tolerance settings: defaults (None: by dtype and size) and rules, first match wins."""

    rtol: float | None = None
    zeros: float | None = None
    rules: tuple[Rule, ...] = ()
    scale: float = 1.0  # multiplies every default (not the values set here)
    coupling: float = COUPLING  # slack per unit of state difference (trainmon.read.compare.state)

    def of(
        self, kind: str, name: str, dtype: str | None, numel: float, compute: str | None = None
    ) -> tuple[float, float]:
        """(rtol, ztol) of one tensor."""
        rtol = zeros = None
        for rule in self.rules:
            if rule.matches(kind, name):
                rtol = rule.rtol if rtol is None else rtol
                zeros = rule.zeros if zeros is None else zeros
                if rtol is not None and zeros is not None:
                    break
        if rtol is None:
            rtol = self.rtol
            if rtol is None:
                rtol = self.scale * default_rtol(dtype, numel, compute, kind)
        if zeros is None:
            n = float(numel) if numel == numel and numel > 0 else math.inf
            zeros = self.zeros if self.zeros is not None else max(rtol, ZERO_ELEMENTS / n)
        return rtol, zeros

    def arrays(
        self,
        tensors: Sequence[tuple[str, str]],
        dtypes: Sequence[str | None],
        numel: Sequence[float],
        compute: str | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """(rtol, ztol) per tensor, as float32 arrays."""
        pairs = [self.of(k, n, d, c, compute) for (k, n), d, c in zip(tensors, dtypes, numel, strict=True)]
        rtol = np.asarray([p[0] for p in pairs], dtype=np.float32).reshape(-1)
        ztol = np.asarray([p[1] for p in pairs], dtype=np.float32).reshape(-1)
        return rtol, ztol


def _positive(path: str, where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ToleranceError(f"{path}: {where}: expected a positive number, got {value!r}")
    try:
        number = float(value)
    except ValueError:
        raise ToleranceError(f"{path}: {where}: expected a positive number, got {value!r}") from None
    if not (number > 0 and math.isfinite(number)):
        raise ToleranceError(f"{path}: {where}: expected a positive number, got {value!r}")
    return number


def _glob(path: str, where: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ToleranceError(f"{path}: {where}: expected a name glob (a string), got {value!r}")
    return value


_TOP_KEYS = ("rtol", "zeros", "state", "rules")
_RULE_KEYS = ("kind", "name", "rtol", "zeros")


def parse_tolerance(data: Any, path: str = "tolerance") -> Tolerance:
    """A :class:`Tolerance` from the parsed file."""
    if not isinstance(data, Mapping):
        raise ToleranceError(f"{path}: expected a mapping with {', '.join(_TOP_KEYS)}")
    unknown = sorted(set(data) - set(_TOP_KEYS))
    if unknown:
        keys = ", ".join(_TOP_KEYS)
        raise ToleranceError(f"{path}: unknown key(s) {', '.join(map(str, unknown))}; keys: {keys}")
    rules = []
    found = data.get("rules") or []
    if not isinstance(found, list):
        raise ToleranceError(f"{path}: rules: expected a list of {{kind, name, rtol, zeros}}")
    for i, entry in enumerate(found):
        where = f"rules[{i}]"
        if not isinstance(entry, Mapping):
            raise ToleranceError(f"{path}: {where}: expected a mapping of {', '.join(_RULE_KEYS)}")
        unknown = sorted(set(entry) - set(_RULE_KEYS))
        if unknown:
            keys = ", ".join(_RULE_KEYS)
            found = ", ".join(map(str, unknown))
            raise ToleranceError(f"{path}: {where}: unknown key(s) {found}; keys: {keys}")
        if "rtol" not in entry and "zeros" not in entry:
            raise ToleranceError(f"{path}: {where}: sets neither rtol nor zeros")
        rules.append(
            Rule(
                kind=_glob(path, f"{where}.kind", entry.get("kind", "*")),
                name=_glob(path, f"{where}.name", entry.get("name", "*")),
                rtol=_positive(path, f"{where}.rtol", entry["rtol"]) if "rtol" in entry else None,
                zeros=_positive(path, f"{where}.zeros", entry["zeros"]) if "zeros" in entry else None,
            )
        )
    coupling = data.get("state", COUPLING)
    if isinstance(coupling, bool) or not isinstance(coupling, (int, float)) or not 0 <= coupling < math.inf:
        raise ToleranceError(f"{path}: state: expected a number >= 0, got {coupling!r}")
    return Tolerance(
        rtol=_positive(path, "rtol", data["rtol"]) if data.get("rtol") is not None else None,
        zeros=_positive(path, "zeros", data["zeros"]) if data.get("zeros") is not None else None,
        rules=tuple(rules),
        coupling=float(coupling),
    )


def load_tolerance(path: str | Path) -> Tolerance:
    """Read a tolerance file (JSON or YAML)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        why = getattr(e, "strerror", None) or e
        raise ToleranceError(f"{path}: cannot read the tolerance file: {why}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        raise ToleranceError(f"{path}{where}: not JSON or YAML: {getattr(e, 'problem', None) or e}") from None
    return parse_tolerance(data, str(path))
