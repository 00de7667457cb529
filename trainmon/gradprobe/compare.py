"""Run-vs-run comparison of gradient fingerprints: per step and parameter, how alike the two gradients are,
and the first step at which they part ways.

Per (step, parameter) pair:

* ``sign_agreement``: fraction of the *significant* elements whose ``grad > 0`` agrees (the sampled elements;
  with the sign bitmap in both runs, also every element, see :func:`_bitmap_agreement`);
* ``cosine``: cosine of the sampled values;
* ``norm_ratio``: norm in run B / norm in run A (whole tensor, finite elements);
* ``bin_distance``: total variation distance of the interval fractions (L2), or the difference of the exact
  zero fractions when that is larger, less what elements within float noise of a bound (of zero) explain;
* ``similarity``: the smallest of ``sign_agreement``, ``cosine``, ``min(r, 1/r)`` of the norm ratio and
  ``1 - bin_distance`` (those available); 0 when the two runs' NaN or Inf counts differ.

A pair is divergent when its similarity is below ``Thresholds.first`` at the parameter's first compared step,
or drops by more than ``Thresholds.drop`` from one compared step to the next (msprobe's rule of thumb).

Why "significant": two runs that differ only in reduction order (thread count, GPU vs NPU, a library version)
give bitwise different gradients. Elements that are analytically zero (the key part of an attention
``qkv.bias`` gradient: softmax does not change when every score of a row shifts by the same amount) hold
rounding noise whose sign is a coin toss, so counting their signs reports a divergence at the first step
where there is none. An element is negligible when its magnitude in both runs is at most the *noise floor*:
``Thresholds.noise`` (by default :func:`relative_noise` of the gradient's dtype) times the tensor's RMS,
which the stored statistics give for the whole tensor. Cosine and norm ratio weigh every element by its
magnitude already; only the sign and bin figures, which count elements, leave the negligible ones out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml

from trainmon.gradprobe.reader import Fingerprint, FingerprintError, RankFingerprints
from trainmon.run.records import INFS, NANS, NUMEL, SUMSQ, chunk_name

METRICS = ("sign_agreement", "cosine", "norm_ratio", "bin_distance", "similarity")


@dataclass(frozen=True)
class Thresholds:
    first: float = 0.97  # similarity below this at a parameter's first compared step is a divergence
    drop: float = 0.03  # so is a drop of more than this between two consecutive compared steps
    noise: float | None = None  # noise floor / the tensor's RMS; None: relative_noise() of the dtype


# Rounding noise of a gradient relative to its RMS, by dtype: 8 machine epsilons for 16-bit floats; for wider
# ones 1e-3, the precision of TF32 matmuls that compute float32 gradients on GPUs (and what NPUs do alike).
_EPS = {"bfloat16": 2.0**-7, "float16": 2.0**-10}
_WIDE_NOISE = 1e-3


def relative_noise(dtype: str) -> float:
    """The default noise floor of a gradient of ``dtype`` (``float32``, ``bfloat16``...) over its RMS."""
    eps = _EPS.get(dtype.lower().removeprefix("torch."))
    return max(_WIDE_NOISE, 8.0 * eps) if eps is not None else _WIDE_NOISE


@dataclass(frozen=True)
class PairRow:
    rank: int
    step: int
    name: str  # as run A names it
    name_b: str  # as run B names it
    sign_agreement: float
    cosine: float
    norm_ratio: float
    bin_distance: float
    similarity: float
    divergent: bool


@dataclass
class RankResult:
    rank: int
    steps: list[int]
    rows: list[PairRow]
    only_a: list[str] = field(default_factory=list)  # parameters run B does not have
    only_b: list[str] = field(default_factory=list)
    unaligned_samples: list[str] = field(default_factory=list)  # sampled at different positions
    first_step: int | None = None
    first_params: list[str] = field(default_factory=list)  # divergent at first_step, least similar first


@dataclass
class Comparison:
    ranks: list[RankResult]
    thresholds: Thresholds

    @property
    def first_step(self) -> int | None:
        steps = [r.first_step for r in self.ranks if r.first_step is not None]
        return min(steps) if steps else None


def _norm(fp: Fingerprint) -> float:
    return math.sqrt(max(float(fp.partials[SUMSQ]), 0.0))


def _rms(fp: Fingerprint) -> float:
    finite = float(fp.partials[NUMEL] - fp.partials[NANS] - fp.partials[INFS])
    return _norm(fp) / math.sqrt(finite) if finite > 0 else 0.0


def noise_floor(a: Fingerprint, b: Fingerprint, relative: float | None = None) -> float:
    """Magnitudes at or below this are rounding noise against the scale of the two gradients."""
    if relative is None:
        relative = max(relative_noise(a.layout.dtype), relative_noise(b.layout.dtype))
    return relative * max(_rms(a), _rms(b))


def _sample_signs(sa: np.ndarray, sb: np.ndarray, floor: float) -> tuple[float, float]:
    """(agreement of ``x > 0`` over the significant sampled elements, fraction of negligible ones)."""
    with np.errstate(invalid="ignore"):
        significant = np.maximum(np.abs(sa), np.abs(sb)) > floor  # NaN: neither, as in the statistics
    n = int(significant.sum())
    agree = float(np.mean((sa[significant] > 0) == (sb[significant] > 0))) if n else 1.0
    return agree, 1.0 - n / len(sa)


def _bitmap_agreement(bits_a: np.ndarray, bits_b: np.ndarray, negligible: float) -> float:
    """Sign agreement over every element, from the bitmaps, which hold no magnitudes: the sample's share of
    negligible elements, scaled to the tensor, is taken as noise that may disagree, and the remaining
    disagreements are counted against the significant elements (an optimistic bound: the sample's own figure
    stands beside it in the similarity)."""
    numel = len(bits_a)
    if not numel:
        return 1.0
    noisy = negligible * numel
    disagree = float(np.count_nonzero(bits_a != bits_b))
    significant = numel - noisy
    if significant <= 0:
        return 1.0
    return 1.0 - min(max(disagree - noisy, 0.0) / significant, 1.0)


def _bin_allowance(
    sa: np.ndarray, sb: np.ndarray, bounds: tuple[float, ...], floor: float
) -> tuple[float, float]:
    """(fraction of the elements within the noise floor of a bound, summed over the bounds; fraction within
    the floor of zero, which decides the exact-zero count): estimated on the sample (exact when the sample is
    the whole tensor). Moving such elements across their bound changes the interval fractions by as much."""
    with np.errstate(invalid="ignore"):
        near = sum(float(np.mean((np.abs(sa - b) <= floor) | (np.abs(sb - b) <= floor))) for b in bounds)
        zero = float(np.mean((np.abs(sa) <= floor) | (np.abs(sb) <= floor)))
    return near, zero


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    keep = np.isfinite(a) & np.isfinite(b)
    if np.array_equal(a[keep], b[keep]):  # exactly 1 for identical runs, not 1 - rounding
        return 1.0
    a, b = a[keep].astype(np.float64), b[keep].astype(np.float64)
    na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    if na == 0.0 or nb == 0.0:
        return 1.0 if na == nb else 0.0
    return float(np.dot(a, b) / (na * nb))


def compare_pair(
    a: Fingerprint, b: Fingerprint, noise: float | None = None
) -> tuple[float, float, float, float, float, bool]:
    """(sign_agreement, cosine, norm_ratio, bin_distance, similarity, samples_aligned) of one pair;
    ``noise``: the noise floor relative to the tensors' RMS (None: by dtype, see :func:`relative_noise`)."""
    la, lb = a.layout, b.layout
    aligned = la.numel == lb.numel and la.k == lb.k and la.seed == lb.seed
    sampled = aligned and a.sample is not None and b.sample is not None and la.k > 0
    sign = cosine = bins = math.nan
    floor = noise_floor(a, b, noise)
    negligible = 0.0  # share of the elements below the floor, estimated on the sample
    if sampled:
        sa, sb = a.sample.astype(np.float64), b.sample.astype(np.float64)
        sign, negligible = _sample_signs(sa, sb, floor)
        cosine = _cosine(a.sample, b.sample)
    elif aligned and a.sample is not None and b.sample is not None:
        sign = 1.0  # an empty tensor
    bits_a, bits_b = a.sign_bits(), b.sign_bits()
    whole = sampled and la.k >= la.numel  # the sample is the tensor: the bitmap adds nothing
    if bits_a is not None and bits_b is not None and la.numel == lb.numel and not whole:
        bitmap = _bitmap_agreement(bits_a, bits_b, negligible)
        sign = bitmap if math.isnan(sign) else min(sign, bitmap)
    na, nb = _norm(a), _norm(b)
    ratio = 1.0 if na == nb else (math.inf if na == 0.0 else nb / na)
    fa, fb = a.bins(), b.bins()
    if fa is not None and fb is not None and len(fa) == len(fb) and la.bounds == lb.bounds:
        near, zero = _bin_allowance(sa, sb, la.bounds, floor) if sampled else (0.0, 0.0)
        tv = 0.5 * float(np.abs(fa[:-1] - fb[:-1]).sum())
        bins = max(tv - near, abs(float(fa[-1] - fb[-1])) - zero, 0.0)
    if a.partials[NUMEL] != b.partials[NUMEL] or any(a.partials[i] != b.partials[i] for i in (NANS, INFS)):
        similarity = 0.0
    else:
        figures = [sign, cosine, min(ratio, 1.0 / ratio) if ratio > 0 else 0.0, 1.0 - bins]
        known = [f for f in figures if not math.isnan(f)]
        similarity = min(known) if known else math.nan
    return sign, cosine, ratio, bins, similarity, aligned


def load_mapping(path: str | Path) -> dict[str, str]:
    """A JSON or YAML mapping ``{name in run A: name in run B}``."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise FingerprintError(f"{path}: cannot read the mapping file: {e.strerror or e}") from None
    try:
        data = yaml.safe_load(text)  # JSON is YAML
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        raise FingerprintError(f"{path}{where}: not JSON or YAML: {getattr(e, 'problem', e)}") from None
    if not isinstance(data, Mapping):
        raise FingerprintError(f"{path}: expected a mapping {{name in run A: name in run B}}")
    for k, v in data.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise FingerprintError(f"{path}: key {k!r}: names must be strings, got {v!r}")
    return dict(data)


def _names(run: RankFingerprints) -> dict[tuple[int, str], str]:
    multi = any(layout.vpp_stage for layout in run.params.values())
    return {
        (layout.vpp_stage, layout.name): chunk_name(layout.vpp_stage, layout.name, multi)
        for layout in run.params.values()
    }


def compare_rank(
    run_a: RankFingerprints,
    run_b: RankFingerprints,
    mapping: Mapping[str, str] | None = None,
    thresholds: Thresholds = Thresholds(),
) -> RankResult:
    mapping = mapping or {}
    names_a, names_b = _names(run_a), _names(run_b)
    key_b = {shown: key for key, shown in names_b.items()}
    pairs = {}  # key in A -> key in B
    for key, shown in names_a.items():
        other = key_b.get(mapping.get(shown, shown))
        if other is not None:
            pairs[key] = other
    matched_b = set(pairs.values())
    result = RankResult(
        run_a.rank,
        sorted(set(run_a.steps) & set(run_b.steps)),
        [],
        only_a=sorted({names_a[k] for k in names_a if k not in pairs}),
        only_b=sorted({names_b[k] for k in names_b if k not in matched_b}),
    )
    previous: dict[tuple[int, str], float] = {}
    unaligned: set[str] = set()
    for step in result.steps:
        fa, fb = run_a.step(step), run_b.step(step)
        diverged: list[tuple[float, str]] = []
        for key, fp_a in fa.items():
            other = pairs.get(key)
            fp_b = fb.get(other) if other is not None else None
            if fp_b is None:
                continue
            sign, cosine, ratio, bins, sim, aligned = compare_pair(fp_a, fp_b, thresholds.noise)
            if not aligned and fp_a.sample is not None:
                unaligned.add(names_a[key])
            before = previous.get(key)
            divergent = (before is None and sim < thresholds.first) or (
                before is not None and before - sim > thresholds.drop
            )
            if not math.isnan(sim):
                previous[key] = sim
            row = PairRow(
                run_a.rank, step, names_a[key], names_b[other], sign, cosine, ratio, bins, sim, divergent
            )
            result.rows.append(row)
            if divergent:
                diverged.append((sim, names_a[key]))
        if diverged and result.first_step is None:
            result.first_step = step
            result.first_params = [name for _, name in sorted(diverged)]
    result.unaligned_samples = sorted(unaligned)
    return result


def compare_runs(
    run_a: str | Path,
    run_b: str | Path,
    ranks: list[int],
    mapping: Mapping[str, str] | None = None,
    thresholds: Thresholds = Thresholds(),
) -> Comparison:
    results = [
        compare_rank(RankFingerprints(run_a, r), RankFingerprints(run_b, r), mapping, thresholds)
        for r in ranks
    ]
    return Comparison(results, thresholds)
