"""The precheck's standards on fixed inputs, against numbers worked out by hand (research note 1.4: msprobe
26.2's thresholds)."""

from __future__ import annotations

import math

import pytest
import torch

from trainmon.precheck import standards as std
from trainmon.precheck.judge import (
    Status,
    absolute_threshold_rates,
    benchmark_metrics,
    benchmark_verdict,
    binary_status,
    cosine,
    first_pass,
    relative_error,
    thousandth_status,
    ulp_error,
    ulp_status,
)

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def test_the_table_holds_the_standards_numbers():
    assert std.limits_of(F16).small_value == 2**-10 and std.limits_of(F16).min_err == 2**-11
    assert std.limits_of(BF16).rel_eps == 2**-8 and std.limits_of(BF16).absolute_atol == 1e-16
    assert std.limits_of(F32).small_value == 2**-20 and std.limits_of(F32).absolute_atol == 2**-30
    assert std.RATIO_LIMITS[0]["max_rel_err"] == 10 and std.RATIO_LIMITS[2]["rmse"] == 1.2
    assert std.level_of("matmul") == 2 and std.level_of("embedding") == 1 and std.level_of("silu") == 0
    assert std.standard_for("add", F32) is std.Standard.BENCHMARK
    assert std.standard_for("argmax", torch.int64) is std.Standard.BINARY


def test_relative_error_and_cosine():
    rel = relative_error(t(1.0, 2.0), t(1.0, 1.5), F32)
    assert rel.tolist() == [0.0, 0.5 / (1.5 + 2**-23)]
    assert cosine(t(0, 0), t(0, 0)) == 1.0 and cosine(t(0, 0), t(1, 0)) == 0.0
    assert cosine(t(1, 0), t(0, 1)) == 0.0
    assert cosine(t(1e300, 1e300), t(1, 1)) == pytest.approx(1.0)  # each scaled by its own max first


def test_first_pass():
    bench = torch.full((1000,), 10.0, dtype=torch.float64)
    assert first_pass(bench, bench, BF16) is Status.PASS
    off = bench.clone()
    off[:20] *= 1.02  # 2 % of elements 2 % off: 98 % within 1 %
    assert first_pass(off, bench, BF16) is Status.ERROR
    off = bench.clone()
    off[:5] *= 1.005  # 99.5 % within 0.1 %
    assert first_pass(off, bench, BF16) is Status.WARNING
    big = torch.full((20000,), 10.0, dtype=torch.float64)
    off = big.clone()
    off[:1] *= 1.0005  # fp32: all within 0.1 %, 99.995 % within 0.01 %
    assert first_pass(off, big, F32) is Status.PASS
    off[:10] *= 1.0005  # 99.95 % within 0.01 %
    assert first_pass(off, big, F32) is Status.WARNING
    assert first_pass(-bench, bench, F32) is Status.ERROR  # cosine -1
    nan = bench.clone()
    nan[3] = math.nan
    assert first_pass(nan, bench, F32) is Status.ERROR
    assert first_pass(bench + 1e-4, bench, F32) is Status.PASS  # max abs error below 0.001


def test_benchmark_metrics_by_hand():
    bench, device = t(1.0, 2.0, 4.0, 1e-4), t(1.1, 2.0, 3.6, 1e-4 + 1e-3)
    m = benchmark_metrics(device, bench, F16)
    eps = 2**-10
    assert m.small_value_err_ratio == 1.0  # 1e-4 is small (<= 2^-10); its error 1e-3 > 1e-16
    assert m.max_rel_err == pytest.approx(0.4 / (4 + eps), rel=1e-12)  # 3.6 against 4
    assert m.mean_rel_err == pytest.approx((0.1 / (1 + eps) + 0.4 / (4 + eps)) / 3, rel=1e-12)
    assert m.rmse == pytest.approx(math.sqrt((0.01 + 0.16) / 3), rel=1e-12)
    assert m.error_balance == 0.25  # two above, one below, of four
    assert not m.one_side_nonfinite


def test_benchmark_verdict_ratios_against_the_second_device():
    training = benchmark_metrics(t(1.1, 2.0), t(1.0, 2.0), F32)  # max rel ~0.1
    second = benchmark_metrics(t(1.001, 2.0), t(1.0, 2.0), F32)  # max rel ~0.001
    verdict = benchmark_verdict(training, second, F32, "silu")
    assert verdict.ratios["max_rel_err"] == pytest.approx(100.0, rel=1e-6)
    assert verdict.status is Status.ERROR and "max_rel_err" in verdict.failed
    same = benchmark_verdict(second, second, F32, "matmul")
    assert same.status is Status.PASS
    # a metric of 0 on the second device is floored at min_err (fp32 2^-14)
    tiny = benchmark_metrics(t(1.0 + 2**-16, 2.0), t(1.0, 2.0), F32)
    exact = benchmark_metrics(t(1.0, 2.0), t(1.0, 2.0), F32)
    assert benchmark_verdict(tiny, exact, F32, "silu").status is Status.PASS


def test_ulp():
    assert ulp_error(t(1.0 + 2**-23), t(1.0), F32).tolist() == [1.0]
    assert ulp_error(t(0.75 + 2**-24), t(0.75), F32).tolist() == [1.0]
    assert ulp_error(t(1.0 + 2**-7), t(1.0), BF16).tolist() == [1.0]
    bench = torch.ones(1000, dtype=torch.float64)
    assert ulp_status(bench + 2**-23 * 10, bench, F32) is Status.PASS  # 10 ULP everywhere: mean < 64
    assert ulp_status(bench + 2**-23 * 100, bench, F32) is Status.ERROR
    assert ulp_status(bench + 2**-7 * 2, bench, BF16) is Status.ERROR  # every element > 1 ULP


def test_absolute_threshold_binary_and_thousandth():
    bench = t(1.0, 2.0, 1e-9, math.inf)
    assert absolute_threshold_rates(bench, bench, F32) == (0.0, 0.0, 0.0)
    device = t(1.0 + 1e-5, 2.0, 1e-9 + 1e-8, math.nan)
    nonfinite, relative, absolute = absolute_threshold_rates(device, bench, F32)
    assert (nonfinite, relative, absolute) == (0.25, 0.25, 0.25)
    assert binary_status(torch.tensor([1, 2]), torch.tensor([1, 2])) is Status.PASS
    assert binary_status(torch.tensor([1, 2]), torch.tensor([1, 3])) is Status.ERROR
    bench = torch.ones(2000, dtype=torch.float64)
    off = bench.clone()
    off[:2] = 1.01
    assert thousandth_status(off, bench, F32) is Status.PASS  # 99.9 % within 0.1 %
    off[:3] = 1.01
    assert thousandth_status(off, bench, F32) is Status.ERROR
