"""Rules engine: golden anomalies on hand-built step records."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from trainmon.anomaly.rules import RuleEngine
from trainmon.config import AlertConfig, ConfigError
from trainmon.config.rules import (
    MaxRatioRule,
    NanRule,
    StragglerRule,
    ThresholdRule,
    TurbulenceRule,
    ZScoreRule,
    default_rules,
    tensor_rules,
)
from trainmon.run.records import STATS, Anomaly, Derived, Kind, Row, StepRecord

INF = float("inf")
NAN = float("nan")


def row(name: str, kind: str | Kind = "actv", micro: int = 0, phase: str = "forward", vpp: int = 0) -> Row:
    return Row(kind, name, vpp, micro, phase, (1,), "float32")


def p_of(*xs: float) -> np.ndarray:
    """Partials of a tensor holding the values ``xs`` (NaN/Inf counted, the rest as finite elements)."""
    a = np.asarray(xs, dtype=np.float64)
    f = a[np.isfinite(a)]
    return np.array(
        [
            a.size,
            np.isnan(a).sum(),
            np.isinf(a).sum(),
            (f == 0).sum(),
            f.min() if f.size else INF,
            f.max() if f.size else -INF,
            f.sum(),
            (f * f).sum(),
        ]
    )


EMPTY = np.array([0, 0, 0, 0, INF, -INF, 0, 0], dtype=np.float64)


def rec(step: int, rows: list[Row], parts: list[np.ndarray], rank: int = 0) -> StepRecord:
    return StepRecord(step, rank, tuple(rows), np.stack(parts).astype(np.float64), 1000.0 + step)


def run(engine: RuleEngine, record: StepRecord) -> list[Anomaly]:
    return engine.evaluate(record, Derived(record))


def short(anoms: list[Anomaly]) -> list[tuple]:
    return [(a.rule, a.name, a.stat, a.value, a.baseline, a.seq, a.micro_step) for a in anoms]


def series(
    engine: RuleEngine, values: list[float], name: str = "w", kind: str = "actv"
) -> list[list[Anomaly]]:
    return [run(engine, rec(s, [row(name, kind)], [p_of(v)])) for s, v in enumerate(values)]


# ---------------------------------------------------------------------------------------------------------
# nan


def test_nan_and_inf_counted_apart():
    engine = RuleEngine(tensor_rules(default_rules()))
    r = rec(
        7,
        [row("a"), row("b", Kind.GRAD_REDUCED, phase="backward"), row("c"), row("d")],
        [p_of(NAN, NAN, 1.0), p_of(INF, -INF, INF), p_of(NAN, INF, 2.0), p_of(1.0, 2.0)],
        rank=3,
    )
    got = run(engine, r)
    assert short(got) == [
        ("nan", "a", "nans", 2.0, None, 0, 0),
        ("inf", "b", "infs", 3.0, None, 1, 0),
        ("nan", "c", "nans", 1.0, None, 2, 0),
        ("inf", "c", "infs", 1.0, None, 2, 0),
    ]
    b = got[1]
    assert (b.step, b.rank, b.kind, b.phase, b.wall_time) == (7, 3, "grad_reduced", "backward", 1007.0)
    assert "3 Inf" in b.message and "grad_reduced/b" in b.message
    assert run(engine, rec(8, [row("d")], [p_of(1.0)])) == []


def test_msprobe_anomaly_nan_threshold():
    rules = _rules({"rules": [{"rule_name": "AnomalyNan", "args": {"threshold": 1e10}}], "dump": False})
    assert rules == (NanRule(threshold=1e10),)
    engine = RuleEngine(rules)
    got = run(engine, rec(0, [row("ok"), row("big")], [p_of(1e9, -1e9), p_of(-3e10)]))
    assert short(got) == [
        ("nan", "big", "min", -3e10, 1e10, 1, 0),
        ("nan", "big", "max", -3e10, 1e10, 1, 0),
        ("nan", "big", "mean", -3e10, 1e10, 1, 0),
        ("nan", "big", "norm", 3e10, 1e10, 1, 0),
    ]
    # NaN elements are still reported by count
    assert short(run(engine, rec(1, [row("ok")], [p_of(NAN, 1.0)]))) == [
        ("nan", "ok", "nans", 1.0, None, 0, 0)
    ]


def test_nan_warmup_and_stats():
    engine = RuleEngine([NanRule(stats=("infs",), warmup=1)])
    assert run(engine, rec(0, [row("a")], [p_of(INF)])) == []  # first step of this tensor: warming up
    got = run(engine, rec(1, [row("a")], [p_of(INF, NAN)]))
    assert short(got) == [("inf", "a", "infs", 1.0, None, 0, 0)]  # nans not selected


# ---------------------------------------------------------------------------------------------------------
# turbulence


def test_turbulence_up_warmup_and_exact_robust_ema():
    engine = RuleEngine([TurbulenceRule(threshold=0.5, beta=0.9, warmup=2, stats=("norm",))])
    out = series(engine, [1.0, 2.0, 1.2, 10.0, 1.7, 1.0])
    # step 0 initialises the EMA (1.0); step 1 (2.0 > 1.5) is still warming up: EMA 0.9*1 + 0.1*2 = 1.1
    assert out[0] == out[1] == out[2] == []  # step 2: 1.2 <= 1.1*1.5; EMA -> 0.99 + 0.12 = 1.11
    assert [(a.rule, a.stat, a.value) for a in out[3]] == [("turbulence", "norm", 10.0)]
    assert out[3][0].baseline == pytest.approx(1.11)
    # the spike was not folded in: 1.7 > 1.11*1.5 = 1.665 fires against the same baseline
    assert [a.value for a in out[4]] == [1.7]
    assert out[4][0].baseline == pytest.approx(1.11)
    assert out[5] == []
    (state,) = engine.state_dict()["rules"]
    assert state["keys"] == [["actv", 0, "w"]]
    assert state["mean"][0][0] == pytest.approx(0.9 * 1.11 + 0.1 * 1.0)
    assert state["count"][0][0] == 4  # 1.0, 2.0, 1.2, 1.0


def test_turbulence_msprobe_default_from_first_value():
    engine = RuleEngine(_rules({"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}}]}))
    out = series(engine, [-2.0, -3.5, 1.0])
    # mean -2: up compares |v| > |mean| * 1.5 = 3; norm 2 -> 3.5 fires too (in the rule's stats order)
    assert short(out[1]) == [
        ("turbulence", "w", "norm", 3.5, 2.0, 0, 0),
        ("turbulence", "w", "mean", -3.5, -2.0, 0, 0),
    ]
    assert out[0] == out[2] == []


def test_turbulence_down_and_both():
    down = RuleEngine([TurbulenceRule(threshold=0.5, direction="down", beta=0.5, stats=("mean",))])
    both = RuleEngine([TurbulenceRule(threshold=0.5, direction="both", beta=0.5, stats=("mean",))])
    up = RuleEngine([TurbulenceRule(threshold=0.5, direction="up", beta=0.5, stats=("mean",))])
    values = [4.0, 4.0, 1.0, 10.0]
    d, b, u = series(down, values), series(both, values), series(up, values)
    assert [short(x) for x in d] == [[], [], [("turbulence", "w", "mean", 1.0, 4.0, 0, 0)], []]
    assert [short(x) for x in b] == [
        [],
        [],
        [("turbulence", "w", "mean", 1.0, 4.0, 0, 0)],
        [("turbulence", "w", "mean", 10.0, 4.0, 0, 0)],  # 1.0 was not folded in
    ]
    assert [short(x) for x in u] == [[], [], [], [("turbulence", "w", "mean", 10.0, 2.5, 0, 0)]]


def test_history_ignores_non_finite_and_tensors_with_nan():
    engine = RuleEngine([TurbulenceRule(threshold=0.5, beta=0.5, stats=("norm",))])
    w = row("w")
    assert run(engine, rec(0, [w], [p_of(2.0)])) == []
    assert run(engine, rec(1, [w], [p_of(NAN)])) == []  # norm is NaN: no history update, no fire
    assert run(engine, rec(2, [w], [p_of(100.0, INF)])) == []  # holds Inf: left to the nan rule
    assert engine.state_dict()["rules"][0]["mean"] == [[2.0]]
    assert short(run(engine, rec(3, [w], [p_of(3.5)]))) == [("turbulence", "w", "norm", 3.5, 2.0, 0, 0)]


# ---------------------------------------------------------------------------------------------------------
# zscore, max_ratio, threshold


def test_zscore_exact():
    engine = RuleEngine([ZScoreRule(threshold=3.0, beta=0.5, warmup=3, stats=("norm",))])
    out = series(engine, [1.0, 2.0, 1.0, 2.0, 10.0, 2.0])
    # mean/var: (1, 0) -> (1.5, .25) -> (1.25, .1875) -> (1.625, .234375); z(10) = 8.375 / .4841 = 17.3
    assert out[:4] == [[], [], [], []]
    assert short(out[4]) == [("zscore", "w", "norm", 10.0, 1.625, 0, 0)]
    assert out[5] == []  # z(2) = .375 / .4841: the spike was not folded in
    st = engine.state_dict()["rules"][0]
    assert st["mean"][0][0] == pytest.approx(1.8125)
    assert st["var"][0][0] == pytest.approx(0.5 * (0.234375 + 0.5 * 0.375**2))


def test_zscore_default_warmup():
    engine = RuleEngine([ZScoreRule(threshold=3.0)])
    assert engine.rules[0].warmup == 20
    out = series(engine, [1.0] * 5 + [50.0])
    assert all(x == [] for x in out)


def test_max_ratio_on_loss_spike():
    engine = RuleEngine([MaxRatioRule(threshold=10.0)])
    out = series(engine, [5.0, 4.0, 3.0, 60.0, 49.0, 500.0, 2.0], name="loss", kind="scalar")
    fired = [(s, short(x)) for s, x in enumerate(out) if x]
    assert fired == [
        (3, [("max_ratio", "loss", "mean", 60.0, 5.0, 0, 0)]),
        # 60 was not folded into the running max: 49 < 50 passes and becomes the max, so 500 > 490 fires
        (5, [("max_ratio", "loss", "mean", 500.0, 49.0, 0, 0)]),
    ]
    # only scalars by default
    assert series(RuleEngine([MaxRatioRule()]), [1.0, 100.0]) == [[], []]


def test_threshold_bounds():
    engine = RuleEngine([ThresholdRule(above=100.0, below=-1.0, stats=("max", "min"))])
    got = run(engine, rec(0, [row("ok"), row("bad")], [p_of(0.0, 5.0), p_of(-5.0, 150.0)]))
    assert short(got) == [
        ("threshold", "bad", "max", 150.0, 100.0, 1, 0),
        ("threshold", "bad", "min", -5.0, -1.0, 1, 0),
    ]
    assert "above" in got[0].message and "below" in got[1].message


def test_selection_by_kind_glob_and_stat():
    rule = ThresholdRule(above=0.0, kinds=("grad_reduced",), names=("layers.*",), stats=("norm",))
    engine = RuleEngine([rule])
    rows = [
        row("layers.0.w", "grad_reduced"),
        row("embed.w", "grad_reduced"),
        row("layers.0.w", "actv"),
        row("layers.1.w", Kind.GRAD_REDUCED),
    ]
    got = run(engine, rec(0, rows, [p_of(1.0)] * 4))
    assert [(a.kind, a.name, a.stat, a.seq) for a in got] == [
        ("grad_reduced", "layers.0.w", "norm", 0),
        ("grad_reduced", "layers.1.w", "norm", 3),
    ]


def test_vpp_stages_keep_separate_history():
    engine = RuleEngine([MaxRatioRule(threshold=2.0, kinds=(), stats=("max",))])
    r0 = rec(0, [row("w", vpp=0), row("w", vpp=1)], [p_of(1.0), p_of(10.0)])
    r1 = rec(1, [row("w", vpp=0), row("w", vpp=1)], [p_of(5.0), p_of(12.0)])
    assert run(engine, r0) == []
    got = run(engine, r1)
    assert [(a.vpp_stage, a.value, a.baseline) for a in got] == [(0, 5.0, 1.0)]


# ---------------------------------------------------------------------------------------------------------
# micro-step groups, empty tensors


def test_micro_step_groups_history_per_tensor_and_first_bad_row():
    engine = RuleEngine([NanRule(), TurbulenceRule(threshold=0.5, beta=0.9, stats=("norm",))])
    rows = [
        row("a", micro=0),
        row("b", micro=0),
        row("a", micro=1, phase="backward"),
        row("b", micro=1),
        row("a", micro=2),
    ]
    # step 0: a = {3}, {4}, {} -> norm 5; b = {1}, {1} -> norm sqrt(2)
    assert run(engine, rec(0, rows, [p_of(3.0), p_of(1.0), p_of(4.0), p_of(1.0), EMPTY])) == []
    assert run(engine, rec(1, rows, [p_of(4.0), p_of(1.0), p_of(3.0), p_of(1.0), EMPTY])) == []
    st = engine.state_dict()["rules"][1]
    assert st["keys"] == [["actv", 0, "a"], ["actv", 0, "b"]]  # one history per tensor, not per micro-step
    assert st["mean"] == [[pytest.approx(5.0)], [pytest.approx(math.sqrt(2))]]
    # step 2: NaN in a's second and third micro-steps; b spikes in micro-step 1
    got = run(engine, rec(2, rows, [p_of(3.0), p_of(1.0), p_of(NAN, NAN, 4.0), p_of(40.0), p_of(NAN)]))
    assert short(got) == [
        ("turbulence", "b", "norm", pytest.approx(math.sqrt(1601)), pytest.approx(math.sqrt(2)), 1, 0),
        ("nan", "a", "nans", 2.0, None, 2, 1),  # micro-step 1's count: 2 of the step's 3 NaNs
    ]
    assert got[1].phase == "backward"
    # a record says which value it holds: one micro-step's, or the step's over its micro-steps
    assert got[1].message == "actv/a has 2 NaN element(s) at micro-step 1 (3 in the step's 3 micro-steps)"
    assert got[0].message.endswith(" (step total: its 2 micro-steps merged)")


def test_empty_tensors_never_fire():
    engine = RuleEngine(
        [NanRule(threshold=0.0), ThresholdRule(below=0.5, stats=("zeros",)), TurbulenceRule(stats=("norm",))]
    )
    weird_empty = EMPTY.copy()
    weird_empty[1] = 1  # a malformed row: numel 0 but a NaN count
    for step in range(3):
        assert run(engine, rec(step, [row("e"), row("e2")], [EMPTY, weird_empty])) == []
    got = run(engine, rec(3, [row("e"), row("x")], [EMPTY, p_of(1.0)]))
    assert {(a.name, a.rule) for a in got} == {("x", "nan"), ("x", "threshold")}


# ---------------------------------------------------------------------------------------------------------
# state


def test_state_dict_round_trip_is_json():
    rules = [TurbulenceRule(threshold=0.5, beta=0.9), ZScoreRule(warmup=2), MaxRatioRule(kinds=())]
    a = RuleEngine(rules)
    vals = [1.0, 1.1, 0.9, 1.05, 1.0]
    series(a, vals)
    state = json.loads(json.dumps(a.state_dict(), allow_nan=False))
    b = RuleEngine(rules)
    b.load_state_dict(state)
    for step, v in enumerate([1.02, 30.0, 1.0]):
        r = rec(10 + step, [row("w")], [p_of(v)])
        assert short(run(a, r)) == short(run(b, r))
    with pytest.raises(ValueError, match="rules"):
        RuleEngine(rules[:1]).load_state_dict(state)


# ---------------------------------------------------------------------------------------------------------
# config


def _rules(alert) -> tuple:
    """The rules a run of this ``alert`` section evaluates (parsed once, by the config)."""
    return AlertConfig.parse(alert).evaluated_rules


def test_parse_rules_forms():
    assert _rules(None) == default_rules() == (NanRule(), StragglerRule())
    assert _rules({"rules": [], "dump": False}) == default_rules()
    msprobe = {
        "rules": [
            {"rule_name": "AnomalyNan", "args": {"threshold": 1e10}},
            {"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}},
        ],
        "dump": False,
    }
    assert _rules(msprobe) == (
        NanRule(threshold=1e10, stats=STATS),
        TurbulenceRule(threshold=0.5, direction="up", stats=("norm", "mean")),
    )
    assert _rules({"rules": [{"rule_name": "AnomalyNan"}]}) == (NanRule(),)
    native = {
        "rules": [
            {
                "rule": "zscore",
                "kinds": ["grad_reduced"],
                "names": ["layers.*"],
                "stats": ["norm"],
                "threshold": 6,
                "warmup": 20,
            },
            {"rule": "turbulence", "threshold": 1.0, "direction": "both", "beta": 0.9},
            {"rule": "max_ratio", "threshold": 5},
            {"rule": "threshold", "above": 1e4, "stats": "norm"},
            {"rule": "nan", "kinds": "actv"},
        ]
    }
    assert _rules(native) == (
        ZScoreRule(kinds=("grad_reduced",), names=("layers.*",), stats=("norm",), threshold=6, warmup=20),
        TurbulenceRule(threshold=1.0, direction="both", beta=0.9),
        MaxRatioRule(threshold=5),
        ThresholdRule(above=1e4, stats=("norm",)),
        NanRule(kinds=("actv",)),
    )
    # each entry is written back as the config spelled it (the manifest keeps the user's config)
    assert [r.to_dict() for r in AlertConfig.parse({**native, **msprobe}).rules] == msprobe["rules"]
    assert [r.to_dict() for r in AlertConfig.parse(native).rules] == native["rules"]


@pytest.mark.parametrize(
    ("cfg", "key", "words"),
    [
        (
            {"rules": [{"rule": "nan"}, {"rule": "zscore", "thresold": 3}]},
            "alert.rules[1].thresold",
            ["threshold", "warmup"],
        ),
        ({"rules": [{"rule": "spike"}]}, "alert.rules[0].rule", ["nan", "turbulence", "zscore", "max_ratio"]),
        (
            {"rules": [{"rule_name": "AnomalyFoo"}]},
            "alert.rules[0].rule_name",
            ["AnomalyNan", "AnomalyTurbulence"],
        ),
        ({"rules": [{"rule_name": "AnomalyTurbulence"}]}, "alert.rules[0].args.threshold", ["required"]),
        (
            {"rules": [{"rule_name": "AnomalyNan", "args": {"thr": 1}}]},
            "alert.rules[0].args.thr",
            ["threshold"],
        ),
        (
            {"rules": [{"rule_name": "AnomalyNan", "args": {"threshold": -1}}]},
            "alert.rules[0].args.threshold",
            [">= 0"],
        ),
        ({"rules": [{"rule": "nan", "stats": ["norms"]}]}, "alert.rules[0].stats[0]", ["norm", "infs"]),
        ({"rules": [{"rule": "nan", "kinds": ["grad"]}]}, "alert.rules[0].kinds[0]", ["grad_reduced"]),
        ({"rules": [{"rule": "turbulence", "direction": "sideways"}]}, "alert.rules[0].direction", ["both"]),
        ({"rules": [{"rule": "zscore", "threshold": "6"}]}, "alert.rules[0].threshold", ["number"]),
        ({"rules": [{"rule": "zscore", "warmup": -1}]}, "alert.rules[0].warmup", [">= 0"]),
        ({"rules": [{"rule": "threshold"}]}, "alert.rules[0]", ["above", "below"]),
        ({"rules": [{"kinds": ["actv"]}]}, "alert.rules[0].rule", ["nan", "AnomalyNan"]),
        ({"rules": [{"rule": "nan", "rule_name": "AnomalyNan"}]}, "alert.rules[0]", ["not both"]),
        ({"rules": [], "dmup": True}, "alert.dmup", ["dump", "rules"]),
        ({"rules": "nan"}, "alert.rules", ["list"]),
    ],
)
def test_parse_rules_errors(cfg, key, words):
    with pytest.raises(ValueError) as ei:
        AlertConfig.parse(cfg)
    assert isinstance(ei.value, ConfigError)
    assert ei.value.key == key
    for w in words:
        assert w in str(ei.value)


# ---------------------------------------------------------------------------------------------------------
# performance sanity (no timing asserts; see bench/rules.py)


def test_many_rows_many_steps():
    rng = np.random.default_rng(0)
    n = 1000
    engine = RuleEngine([NanRule(), TurbulenceRule(threshold=0.5, stats=STATS), ZScoreRule(stats=STATS)])
    kinds = ("actv", "actv_grad", "grad_reduced")
    found = []
    for step in range(20):
        rows = tuple(row(f"layers.{i}.w", kinds[i % 3]) for i in range(n))  # fresh, equal tuple
        p = np.zeros((n, 8))
        p[:, 0] = 4096
        p[:, 4], p[:, 5] = -1.0, 1.0
        p[:, 6] = 100.0 * (1 + 0.001 * rng.random(n))
        p[:, 7] = 1e4 * (1 + 0.001 * rng.random(n))
        if step == 13:
            p[417, 1] = 2
        found += run(engine, StepRecord(step, 0, rows, p, 0.0))
    assert [(a.step, a.rule, a.seq, a.value) for a in found] == [(13, "nan", 417, 2.0)]
