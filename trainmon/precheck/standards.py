"""The accuracy standards of API precheck: every threshold in one table (msprobe 26.2's numbers, facts in
``shared/research/precheck_and_setup_check.md`` part 1.4), and which standard judges an API."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch


class Standard(str, Enum):
    BENCHMARK = "benchmark"  # metrics against the benchmark, as ratios to a second device's (the default)
    ABSOLUTE = "absolute_threshold"  # three error rates, each must be 0
    BINARY = "binary"  # bit-for-bit equality
    ULP = "ulp"  # units in the last place (matmul family)
    THOUSANDTH = "thousandth"  # 99.9 % of elements within 0.1 % (convolutions)


@dataclass(frozen=True)
class DtypeLimits:
    """Per-dtype constants of the standards."""

    rel_eps: float  # added to |benchmark| in the relative error (the dtype's machine epsilon; bf16: 2^-8)
    small_value: float  # |benchmark| at or below it is a small value
    benchmark_atol: float  # a small value's abs error above it counts in the small-value error ratio
    absolute_atol: float  # the absolute-threshold standard's abs error on small values
    absolute_rtol: float  # the absolute-threshold standard's rel error on normal values
    min_err: float  # the floor of a ratio's denominator (the second device's metric)
    ulp_mantissa: int  # mantissa bits
    ulp_min_exponent: int
    ulp_large: float  # an element whose |ULP error| exceeds it counts in the ULP proportion


LIMITS: dict[torch.dtype, DtypeLimits] = {
    torch.float16: DtypeLimits(2.0**-10, 2.0**-10, 1e-16, 2.0**-16, 2.0**-10, 2.0**-11, 10, -14, 1.0),
    torch.bfloat16: DtypeLimits(2.0**-8, 2.0**-10, 1e-16, 1e-16, 2.0**-8, 2.0**-8, 7, -126, 1.0),
    torch.float32: DtypeLimits(2.0**-23, 2.0**-20, 2.0**-30, 2.0**-30, 2.0**-20, 2.0**-14, 23, -126, 32.0),
}  # fmt: skip

# The first pass (``Status`` in msprobe's details table)
COSINE_ERROR_AT_OR_BELOW = 0.99
MAX_ABS_PASS_BELOW = 0.001
# fp16/bf16: share of elements with rel err < 1 % must exceed 99 % (else error); with rel err < 0.1 %, 99.9 %
# (else warning). fp32/fp64: < 0.1 % on 99.9 % (else error), < 0.01 % on 99.99 % (else warning)
HALF_SHARES = ((0.01, 0.99), (0.001, 0.999))
FULL_SHARES = ((0.001, 0.999), (0.0001, 0.9999))

# The benchmark method: metric ratio (training device / benchmark device) above which an API fails, by the
# API's level; the error balance is reported, never counted
_RATIO_NAMES = ("max_rel_err", "mean_rel_err", "rmse", "small_value_err_ratio", "error_balance")
RATIO_LIMITS: dict[int, dict[str, float]] = {
    level: dict(zip(_RATIO_NAMES, limits, strict=True))
    for level, limits in {
        0: (10.0, 2.0, 2.0, 2.0, 2.0),
        1: (5.0, 1.5, 1.5, 2.0, 2.0),
        2: (2.0, 1.2, 1.2, 2.0, 2.0),
    }.items()
}
COUNTED_RATIOS = ("max_rel_err", "mean_rel_err", "rmse", "small_value_err_ratio")

LEVEL_1 = frozenset(
    {"embedding", "scatter_", "scatter_add_", "npu_fusion_attention", "npu_fusion_attention_grad"}
)
LEVEL_2 = frozenset({
    "addmm", "matmul", "mm", "layer_norm", "gelu", "sum", "index", "one_hot", "nonzero", "npu_rms_norm",
    "npu_rms_norm_backward", "npu_cross_entropy_loss", "npu_cross_entropy_loss_backward",
})  # fmt: skip

# ULP: pass for fp32 if the mean |ULP error| is below it (or the large share below ULP_FP32_SHARE)
ULP_FP32_MEAN = 64.0
ULP_FP32_SHARE = 0.05
ULP_HALF_SHARE = 0.001
THOUSANDTH_REL, THOUSANDTH_SHARE = 0.001, 0.999

# Which standard a non-float output or a named API takes (float outputs take the benchmark method, as
# msprobe 26.2 does; these lists apply to the outputs it names and to integer ones)
ABSOLUTE_APIS = frozenset({
    "mul", "mul_", "__mul__", "__imul__", "__rmul__", "add", "add_", "__add__", "__iadd__", "__radd__",
    "div", "div_", "__div__", "__idiv__", "__truediv__", "__itruediv__", "divide", "sub", "sub_", "__sub__",
    "__isub__", "__rsub__", "rsub", "leaky_relu", "prelu", "reciprocal", "rsqrt", "square",
})  # fmt: skip
ULP_APIS = frozenset({
    "__matmul__", "addbmm", "addmm", "baddbmm", "bilinear", "bmm", "chain_matmul", "hspmm", "linear",
    "matmul", "mm", "mv", "smm", "sspaddmm",
})  # fmt: skip
THOUSANDTH_APIS = frozenset({"conv1d", "conv2d"})


def level_of(api: str) -> int:
    return 1 if api in LEVEL_1 else 2 if api in LEVEL_2 else 0


def standard_for(api: str, dtype: torch.dtype) -> Standard:
    """The standard that judges an output of ``api`` of ``dtype``: not a float -> binary; a float -> the
    benchmark method (msprobe 26.2's order)."""
    if not dtype.is_floating_point:
        return Standard.BINARY
    return Standard.BENCHMARK


def limits_of(dtype: torch.dtype) -> DtypeLimits:
    """The constants of ``dtype`` (float64 and others are judged with float32's)."""
    return LIMITS.get(dtype, LIMITS[torch.float32])
