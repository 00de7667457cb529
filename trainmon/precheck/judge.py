"""An output the training computed against its benchmark (the same API re-run on upcast inputs): the
metrics of each standard and the verdicts they give (thresholds: :mod:`trainmon.precheck.standards`). All
arithmetic in float64 on the CPU; ``dtype`` is the training output's dtype, whose limits apply."""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

import torch

from trainmon.precheck import standards as std


class Status(str, Enum):
    PASS = "pass"
    WARNING = "warning"
    ERROR = "error"


def _pair(device: torch.Tensor, bench: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return device.detach().to("cpu", torch.float64).reshape(-1), bench.detach().to(
        "cpu", torch.float64
    ).reshape(-1)


def relative_error(device: torch.Tensor, bench: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """|device - bench| / (|bench| + eps), eps the dtype's ``rel_eps``."""
    d, b = _pair(device, bench)
    return (d - b).abs() / (b.abs() + std.limits_of(dtype).rel_eps)


def cosine(device: torch.Tensor, bench: torch.Tensor) -> float:
    """Cosine similarity, each vector first scaled by its own max |x| (no overflow); 1.0 when both are all
    zero, 0.0 when only one is."""
    d, b = _pair(device, bench)
    dm, bm = d.abs().max() if d.numel() else 0.0, b.abs().max() if b.numel() else 0.0
    if dm == 0 and bm == 0:
        return 1.0
    if dm == 0 or bm == 0:
        return 0.0
    d, b = d / dm, b / bm
    return float((d @ b) / (d.norm() * b.norm()))


def first_pass(device: torch.Tensor, bench: torch.Tensor, dtype: torch.dtype) -> Status:
    """msprobe's first-pass ``Status``: cosine, then max abs error, then the shares of elements within
    relative-error bounds (two for each dtype class)."""
    if device.shape != bench.shape:
        return Status.ERROR
    d, b = _pair(device, bench)
    if not torch.equal(d.isnan(), b.isnan()) or not torch.equal(d.isinf(), b.isinf()):
        return Status.ERROR
    finite = d.isfinite() & b.isfinite()
    d, b = d[finite], b[finite]
    if d.numel() > 1 and cosine(d, b) <= std.COSINE_ERROR_AT_OR_BELOW:
        return Status.ERROR
    if d.numel() == 0 or float((d - b).abs().max()) < std.MAX_ABS_PASS_BELOW:
        return Status.PASS
    rel = relative_error(d, b, dtype)
    (error_bound, error_share), (warning_bound, warning_share) = (
        std.HALF_SHARES if dtype in (torch.float16, torch.bfloat16) else std.FULL_SHARES
    )
    if float((rel < error_bound).double().mean()) <= error_share:
        return Status.ERROR
    if float((rel < warning_bound).double().mean()) <= warning_share:
        return Status.WARNING
    return Status.PASS


@dataclass(frozen=True)
class BenchmarkMetrics:
    """The benchmark method's metrics of one output (over finite elements; small values apart)."""

    small_value_err_ratio: float
    rmse: float
    max_rel_err: float
    mean_rel_err: float
    error_balance: float
    one_side_nonfinite: bool


def benchmark_metrics(device: torch.Tensor, bench: torch.Tensor, dtype: torch.dtype) -> BenchmarkMetrics:
    lim = std.limits_of(dtype)
    d, b = _pair(device, bench)
    one_side = bool(((d.isfinite() != b.isfinite()) | (d.isnan() != b.isnan())).any())
    finite = d.isfinite() & b.isfinite()
    d, b = d[finite], b[finite]
    small = b.abs() <= lim.small_value
    abs_err = (d - b).abs()
    small_ratio = float((abs_err[small] > lim.benchmark_atol).double().mean()) if small.any() else 0.0
    normal = ~small
    rel = abs_err[normal] / (b[normal].abs() + lim.rel_eps)
    n = d.numel()
    return BenchmarkMetrics(
        small_value_err_ratio=small_ratio,
        rmse=float(((d[normal] - b[normal]) ** 2).mean().sqrt()) if normal.any() else 0.0,
        max_rel_err=float(rel.max()) if rel.numel() else 0.0,
        mean_rel_err=float(rel.mean()) if rel.numel() else 0.0,
        error_balance=abs(int((d > b).sum()) - int((d < b).sum())) / n if n else 0.0,
        one_side_nonfinite=one_side,
    )


@dataclass(frozen=True)
class BenchmarkVerdict:
    status: Status
    ratios: dict[str, float]  # training device's metric / the benchmark device's (floored at min_err)
    failed: tuple[str, ...]  # the counted ratios above their limit


def benchmark_verdict(
    training: BenchmarkMetrics, second: BenchmarkMetrics, dtype: torch.dtype, api: str
) -> BenchmarkVerdict:
    """The benchmark method: each counted metric of the training device against the second device's (both
    measured against the same high-precision benchmark), a ratio above the API level's limit fails; a
    non-finite value on one side only fails."""
    limits = std.RATIO_LIMITS[std.level_of(api)]
    floor = std.limits_of(dtype).min_err
    ratios = {name: getattr(training, name) / max(getattr(second, name), floor) for name in limits}
    failed = tuple(name for name in std.COUNTED_RATIOS if ratios[name] > limits[name])
    if training.one_side_nonfinite and not second.one_side_nonfinite:
        failed = (*failed, "nonfinite")
    return BenchmarkVerdict(Status.ERROR if failed else Status.PASS, ratios, failed)


def ulp_error(device: torch.Tensor, bench: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(device - bench) in units of the last place of ``bench`` at ``dtype``'s precision:
    (d - b) * 2^(m - e), e = max(floor(log2 |b|), e_min)."""
    lim = std.limits_of(dtype)
    d, b = _pair(device, bench)
    exponent = torch.floor(torch.log2(b.abs())).clamp(min=lim.ulp_min_exponent)
    exponent = torch.where(b == 0, torch.full_like(b, lim.ulp_min_exponent), exponent)
    return (d - b) * torch.pow(2.0, lim.ulp_mantissa - exponent)


def ulp_status(device: torch.Tensor, bench: torch.Tensor, dtype: torch.dtype) -> Status:
    ulp = ulp_error(device, bench, dtype).abs()
    lim = std.limits_of(dtype)
    share = float((ulp > lim.ulp_large).double().mean()) if ulp.numel() else 0.0
    if dtype in (torch.float16, torch.bfloat16):
        return Status.PASS if share < std.ULP_HALF_SHARE else Status.ERROR
    mean = float(ulp.mean()) if ulp.numel() else 0.0
    return Status.PASS if mean < std.ULP_FP32_MEAN or share < std.ULP_FP32_SHARE else Status.ERROR


def absolute_threshold_rates(
    device: torch.Tensor, bench: torch.Tensor, dtype: torch.dtype
) -> tuple[float, float, float]:
    """(non-finite error rate, relative error rate on normal values, absolute error rate on small values)
    over all elements; the standard passes only when all three are 0."""
    lim = std.limits_of(dtype)
    d, b = _pair(device, bench)
    n = d.numel() or 1
    top = torch.finfo(dtype).max if dtype.is_floating_point else math.inf
    nonfinite = ~(d.isfinite() & b.isfinite())
    both_nan = d.isnan() & b.isnan()
    dc, bc = d.clamp(-top, top), b.clamp(-top, top)
    inf_rel = (dc - bc).abs() / (bc.abs() + lim.rel_eps)
    inf_errors = int((nonfinite & ~both_nan & ~(inf_rel <= lim.absolute_rtol)).sum())
    finite = ~nonfinite
    small = finite & (b.abs() < lim.small_value)
    normal = finite & ~small
    rel = (d - b).abs() / (b.abs() + lim.rel_eps)
    return (
        inf_errors / n,
        int((normal & (rel > lim.absolute_rtol)).sum()) / n,
        int((small & ((d - b).abs() > lim.absolute_atol)).sum()) / n,
    )


def binary_status(device: torch.Tensor, bench: torch.Tensor) -> Status:
    same = device.shape == bench.shape and torch.equal(
        device.detach().cpu(), bench.detach().cpu().to(device.dtype)
    )
    return Status.PASS if same else Status.ERROR


def thousandth_status(device: torch.Tensor, bench: torch.Tensor, dtype: torch.dtype) -> Status:
    rel = relative_error(device, bench, dtype)
    share = float((rel < std.THOUSANDTH_REL).double().mean()) if rel.numel() else 1.0
    return Status.PASS if share >= std.THOUSANDTH_SHARE else Status.ERROR
