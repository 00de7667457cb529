"""The pieces of the statistics comparison (trainmon/read/compare): names, map files, alignment, tolerance,
relative differences, the state slack, and the step-range engine's early stop, on hand-made values whose
answers are worked out here."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from trainmon.read.compare.align import align
from trainmon.read.compare.diff import differences, scores, worst
from trainmon.read.compare.engine import Options, compare
from trainmon.read.compare.mapfile import MapError, load_map
from trainmon.read.compare.names import spelled, unwrapped
from trainmon.read.compare.source import RankReader, open_run, step_ranges
from trainmon.read.compare.state import slack
from trainmon.read.compare.tensors import module_of, phase_of
from trainmon.read.compare.tolerance import (
    ACCUMULATION,
    FACTOR,
    FLOOR,
    NARROW_FACTOR,
    PARAM_FACTOR,
    Tolerance,
    ToleranceError,
    compute_dtype,
    default_rtol,
    load_tolerance,
)
from trainmon.run.records import (
    MAX,
    MIN,
    N_PARTIALS,
    NUMEL,
    SUM,
    SUMSQ,
    Derived,
    Row,
    StepRecord,
    TensorGroups,
)
from trainmon.run.statstore import read_meta
from trainmon.writer.statstore import StatStoreSink

pytestmark = pytest.mark.timeout(120)


# ------------------------------------------------------------------------------------------- names


def test_wrappers_and_chunks_are_stripped_and_mindspore_spellings_mapped():
    assert unwrapped("module.module.layers.0.fc.weight") == "layers.0.fc.weight"
    assert unwrapped("1:module._orig_mod.layers.0._checkpoint_wrapped_module.fc") == "layers.0.fc"
    assert unwrapped("_fsdp_wrapped_module.layers..0.fc.") == "layers.0.fc"
    assert unwrapped("module") == "module"  # a module named "module" alone is kept
    assert unwrapped("encoder.module.fc") == "encoder.module.fc"  # only a leading one is a wrapper
    assert spelled("param_updated", "norm.gamma") == "norm.weight"
    assert spelled("exp_avg", "module.norm.beta") == "norm.bias"
    assert spelled("grad_reduced", "emb.embedding_table") == "emb.weight"
    assert spelled("actv", "gamma.output") == "gamma.output"  # activations are named by module, not parameter


def test_phases_and_modules_of_rows():
    assert [phase_of(k) for k in ("actv", "actv_grad", "grad_unreduced", "grad_reduced", "exp_avg")] == [
        "forward", "backward", "backward", "optimizer", "optimizer"]  # fmt: skip
    assert module_of("actv", "layers.0.attn.output_1#2") == "layers.0.attn"
    assert module_of("actv_grad", "fc.input_grad") == "fc"
    assert module_of("grad_unreduced", "layers.0.fc.weight") == "layers.0.fc"
    assert module_of("scalar", "loss") is None


# ------------------------------------------------------------------------------------------- map files


def test_map_files_in_trainmon_and_msprobe_form(tmp_path):
    path = tmp_path / "map.yaml"
    path.write_text(
        "norm.weight: norm.gamma\n"
        "Cell.network.enc.Dense.forward.0: Module.fc1.Linear.forward.0\n"
        "Module.head.Linear.backward.1.input.0: Cell.out.Dense.backward.1.input.0\n"
        "Functional.gelu.0.forward: Mint.gelu.0.forward\n"
    )
    found = load_map(path)
    assert found.pairs == (("norm.weight", "norm.gamma"), ("network.enc", "fc1"), ("head", "out"))
    assert found.operators == ("Functional.gelu.0.forward",)
    path.write_text('{"a.b": "c.d"}')  # JSON
    assert load_map(path).pairs == (("a.b", "c.d"),)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("- a\n", "expected a mapping"),
        ("a: 1\n", ":1: 'a': names must be strings, got '1'"),
        ("a: b\nc: {d: e}\n", ":2: 'c': names must be strings, got 'MappingNode'"),
        ("a: [b\n", "not JSON or YAML"),
        ("", "the map file is empty"),
        ("Functional.relu.0.forward: Torch.relu.0.forward\n", "no entry names a module or tensor (1 name"),
    ],
)
def test_bad_map_files_name_the_file_and_line(tmp_path, text, message):
    path = tmp_path / "map.yaml"
    path.write_text(text)
    with pytest.raises(MapError, match=None) as e:
        load_map(path)
    assert str(e.value).startswith(str(path)) and message in str(e.value)
    with pytest.raises(MapError, match="cannot read the map file"):
        load_map(tmp_path / "absent.yaml")


# ------------------------------------------------------------------------------------------- alignment


def test_alignment_takes_map_then_exact_then_wrapper_then_framework_then_order(tmp_path):
    a = [("actv", "fc1.input"), ("actv", "fc1.output"), ("grad_reduced", "norm.weight"),
         ("grad_reduced", "fc1.weight"), ("actv", "mid.output"), ("actv", "tail.output"),
         ("actv", "gone.output")]  # fmt: skip
    b = [("actv", "module.fc1.input"), ("actv", "dense.output"), ("grad_reduced", "module.norm.gamma"),
         ("grad_reduced", "fc1.weight"), ("actv", "mid2.output"), ("actv", "tail2.output"),
         ("actv", "new.output")]  # fmt: skip
    shapes_a = ["[2, 8]", "[2, 4]", "[4]", "[4, 8]", "[2, 3]", "[2, 5]", "[7]"]
    shapes_b = ["[2, 8]", "[2, 4]", "[4]", "[4, 8]", "[2, 3]", "[2, 5]", "[9]"]
    path = tmp_path / "map.yaml"
    path.write_text("dense: fc1\nnothing: here\n")  # the map is read both ways: dense is in B
    found = align(a, b, shapes_a, shapes_b, load_map(path))
    pairs = {a[i][1]: (b[j][1], how) for i, j, how in zip(found.a, found.b, found.how, strict=True)}
    assert pairs == {
        "fc1.input": ("module.fc1.input", "wrapper"),
        "fc1.output": ("dense.output", "map"),
        "norm.weight": ("module.norm.gamma", "framework"),
        "fc1.weight": ("fc1.weight", "exact"),
        "mid.output": ("mid2.output", "order"),
        "tail.output": ("tail2.output", "order"),
    }
    assert found.only_a == (("actv", "gone.output"),) and found.only_b == (("actv", "new.output"),)
    assert found.unused_map == ("nothing: here",)


def test_names_two_tensors_of_one_run_share_are_not_paired_by_their_canonical_form():
    a = [("actv", "0:layers.0.output"), ("actv", "1:layers.0.output")]  # two chunks' local layer 0
    b = [("actv", "layers.0.output")]
    found = align(a, b)  # no shapes: no pairing by order either
    assert found.a == () and len(found.only_a) == 2 and found.only_b == (("actv", "layers.0.output"),)


# ------------------------------------------------------------------------------------------- tolerance


def test_default_tolerance_by_dtype_size_and_kind():
    n = 1024  # log2 = 10: the statistics' own float32 sums add 40 float32 ulps
    acc = ACCUMULATION * 2.0**-24 * 10
    assert default_rtol("float32", n) == pytest.approx(FACTOR * 2.0**-24 + acc)
    assert default_rtol("torch.bfloat16", n) == pytest.approx(NARROW_FACTOR * 2.0**-8 + acc)
    assert default_rtol("float16", n) == pytest.approx(NARROW_FACTOR * 2.0**-11 + acc)
    # float32 gradients of a bfloat16 model carry bfloat16 noise
    assert default_rtol("float32", n, compute="bfloat16") == default_rtol("bfloat16", n)
    params = default_rtol("float32", n, kind="param_updated")
    assert params == pytest.approx(PARAM_FACTOR * FACTOR * 2.0**-24 + acc)
    assert default_rtol("float64", 2) == FLOOR  # the stored statistics' own rounding
    # unknown dtype and size: float32, two elements
    assert default_rtol(None, float("nan")) == pytest.approx(FACTOR * 2.0**-24 + ACCUMULATION * 2.0**-24)
    assert compute_dtype(["float32", "bfloat16", None, "int64"]) == "bfloat16"
    rtol, ztol = Tolerance().of("actv", "x", "float32", 4.0)
    assert rtol == pytest.approx((FACTOR + 2 * ACCUMULATION) * 2.0**-24) and ztol == pytest.approx(2.5 / 4)
    assert Tolerance(scale=3.0).of("actv", "x", "float32", 4.0)[0] == pytest.approx(3 * rtol)


def test_tolerance_rules_first_match_wins_and_bad_files_are_named(tmp_path):
    path = tmp_path / "tol.yaml"
    path.write_text("rtol: 1e-3\nstate: 0\nrules:\n  - {kind: actv, name: '*.attn.*', rtol: 5e-3}\n"
                    "  - {kind: 'exp_*', zeros: 0.1}\n  - {kind: 'exp_avg', rtol: 2e-2}\n")  # fmt: skip
    tol = load_tolerance(path)
    assert tol.coupling == 0.0
    assert tol.of("actv", "l.attn.q.output", "float32", 10.0)[0] == 5e-3
    assert tol.of("actv", "l.mlp.output", "float32", 10.0)[0] == 1e-3
    assert tol.of("exp_avg", "w", "float32", 10.0) == (2e-2, 0.1)
    assert tol.of("exp_avg_sq", "w", "float32", 10.0) == (1e-3, 0.1)
    for text, message in [
        ("- 1\n", "expected a mapping"),
        ("rtol: 0\n", "rtol: expected a positive number, got 0"),
        ("rules: [{kind: actv}]\n", "rules[0]: sets neither rtol nor zeros"),
        ("rules: [{kind: actv, rtol: 1, where: x}]\n", "rules[0]: unknown key(s) where"),
        ("speed: 1\n", "unknown key(s) speed"),
        ("state: -1\n", "state: expected a number >= 0"),
    ]:
        path.write_text(text)
        with pytest.raises(ToleranceError) as e:
            load_tolerance(path)
        assert str(e.value).startswith(str(path)) and message in str(e.value), (text, str(e.value))


# ------------------------------------------------------------------------------------------- differences


def _stats(**values) -> dict[str, np.ndarray]:
    base = {"min": -1.0, "max": 2.0, "mean": 0.01, "norm": 10.0, "zeros": 0.0, "nans": 0.0, "infs": 0.0,
            "numel": 100.0}  # fmt: skip
    base.update(values)
    return {k: np.asarray([[v]], dtype=np.float64) for k, v in base.items()}


def test_relative_differences_scale_each_statistic_by_the_tensors_own_magnitude():
    a = _stats()
    # the mean moves by 0.05: 5x its own value, but rms = 10 / sqrt(100) = 1, so 0.05 relative
    diff = differences(a, _stats(mean=0.06))
    assert diff.rel[0, 0] == pytest.approx(0.05, rel=1e-6)
    # min against the largest magnitude (2): 0.01 / 2
    assert differences(a, _stats(min=-1.01)).rel[0, 0] == pytest.approx(0.005, rel=1e-5)
    # norm: symmetric, over the larger (of the float32 values the store holds)
    assert differences(a, _stats(norm=10.1)).rel[0, 0] == pytest.approx(0.1 / 10.1, rel=1e-5)
    # zeros: an absolute difference of fractions, beside rel
    d = differences(a, _stats(zeros=0.02))
    assert d.rel[0, 0] == 0 and d.zeros[0, 0] == pytest.approx(0.02)
    # counts exactly: one NaN more is infinite, whatever the tolerance
    d = differences(a, _stats(nans=1.0))
    assert d.exact[0, 0] and scores(d, np.array([1.0]), np.array([1.0]))[0, 0] == math.inf
    assert differences(a, _stats(numel=99.0)).exact[0, 0]
    # a tensor without finite elements in both runs agrees; in one run only it does not
    nan = {"min": np.nan, "max": np.nan, "mean": np.nan, "norm": np.nan, "nans": 100.0}
    assert differences(_stats(**nan), _stats(**nan)).rel[0, 0] == 0
    assert differences(a, _stats(norm=np.nan)).rel[0, 0] == math.inf
    # zero tensors agree; zero against anything else differs by all of it
    zero = {"min": 0.0, "max": 0.0, "mean": 0.0, "norm": 0.0, "zeros": 1.0}
    assert differences(_stats(**zero), _stats(**zero)).rel[0, 0] == 0
    assert differences(_stats(**zero), _stats(**{**zero, "max": 1e-30, "norm": 1e-30})).rel[0, 0] == 1
    # scores: rel over tolerance plus slack; the worst statistic is named
    d = differences(a, _stats(mean=0.06, zeros=0.001))
    assert scores(d, np.array([0.01]), np.array([0.01]))[0, 0] == pytest.approx(5.0, rel=1e-5)
    with_slack = scores(d, np.array([0.01]), np.array([0.01]), np.float32(0.04))
    assert with_slack[0, 0] == pytest.approx(1.0, rel=1e-5)
    one = {k: v[0, 0] for k, v in a.items()}
    two = {k: v[0, 0] for k, v in _stats(mean=0.06).items()}
    assert worst(one, two, 0.01, 0.01) == ("mean", pytest.approx(5.0, rel=1e-5))


def test_the_state_slack_of_a_step_is_what_its_parameters_and_the_previous_state_differ_by():
    kinds = ["actv", "param_origin", "param_updated", "exp_avg"]
    rel = np.array([[0.0, 0.002, 0.003, 0.001],
                    [0.0, 0.004, 0.005, 0.007],
                    [0.0, 0.0, 0.0, 0.0]], dtype=np.float32)  # fmt: skip
    found, carried = slack(rel, kinds, carried=0.0005, coupling=1.0)
    extra = np.stack([found.of(r) for r in range(3)])
    # row 0: parameters 0.002, the carried state 0.0005; param_origin itself only the carried state
    assert extra[0].tolist() == pytest.approx([0.002, 0.0005, 0.002, 0.002])
    # row 1: parameters 0.004, the state step 0 left 0.003 (param_updated) -> 0.004; param_origin 0.003
    assert extra[1].tolist() == pytest.approx([0.004, 0.003, 0.004, 0.004])
    # row 2: parameters agree, step 1 left 0.007 (exp_avg)
    assert extra[2].tolist() == pytest.approx([0.007, 0.007, 0.007, 0.007])
    assert carried == 0.0
    tol = np.array([1e-5, 2e-5, 3e-5, 4e-5], dtype=np.float32)
    assert np.allclose(found.tolerance(tol), tol[None, :] + extra)
    assert slack(rel, kinds, 0.0, coupling=0.0)[0].rows.max() == 0
    capped, _ = slack(np.array([[np.inf, np.inf]], np.float32), ["actv", "param_origin"], 0.0, 1.0)
    assert capped.of(0).tolist() == [1.0, 0.0]


# ------------------------------------------------------------------------------------------- the engine

TENSORS = [("actv", "fc.input", "forward"), ("actv", "fc.output", "forward"),
           ("grad_unreduced", "fc.weight", "backward"), ("param_origin", "fc.weight", "optimizer"),
           ("param_updated", "fc.weight", "optimizer")]  # fmt: skip


def _write(run: Path, steps: int, change=None) -> None:
    """A rank's statistics store written by the monitor's own sink: 5 tensors, values by step; ``change(step,
    partials)`` alters run B's."""
    sink = StatStoreSink(run, 0)
    rows = tuple(Row(k, n, 0, 0, ph, (10,), "torch.float32") for k, n, ph in TENSORS)
    groups = TensorGroups(rows)
    for step in range(steps):
        p = np.zeros((len(rows), N_PARTIALS))
        p[:, NUMEL] = 10
        p[:, MIN], p[:, MAX] = -1.0 - 0.001 * step, 1.0 + 0.001 * step
        p[:, SUM], p[:, SUMSQ] = 0.5, 4.0 + 0.01 * step
        if change is not None:
            change(step, p)
        record = StepRecord(step, 0, rows, p, 0.0)
        sink.write(record, Derived(record, groups))
    sink.close()


def test_the_engine_reads_step_ranges_stops_early_and_carries_the_state_across_them(tmp_path):
    def changed(step: int, p: np.ndarray) -> None:
        if step >= 999:  # drift: the parameter left by step 999, so the parameters of every later step
            p[4 if step == 999 else 3:, SUMSQ] *= 1.001  # (param_updated at 999, both kinds after)
        if step >= 1500:
            p[1, MAX] += 0.5  # the output of step 1500

    _write(tmp_path / "a", 2200)
    _write(tmp_path / "b", 2200, changed)
    assert step_ranges(0, 2199) == [(0, 999), (1000, 1999), (2000, 2199)]
    meta = read_meta(tmp_path / "a", 0)
    assert meta.dtypes == ("float32",) * 5 and meta.numel == (10,) * 5 and meta.shapes == ("[10]",) * 5
    a, b = RankReader(open_run(tmp_path / "a")), RankReader(open_run(tmp_path / "b"))
    tol = Tolerance(rtol=1e-4, coupling=1.0)
    full = compare(a, b, [0], tol)
    assert (full.ranges_read, full.ranges_total, full.stopped_early) == (3, 3, False)
    first = full.first
    p = first.first_divergent()
    # the parameters' drift from step 999 on is state: carried across the range boundary at 1000, never named
    found = (first.step, first.plan.pairs[p].kind, first.plan.pairs[p].name)
    assert found == (999, "param_updated", "fc.weight")
    assert full.ranks[0].pair_counts == {("param_updated", "fc.weight"): 1, ("actv", "fc.output"): 700}
    early = compare(a, b, [0], tol, options=Options(first_only=True))
    assert (early.ranges_read, early.stopped_early) == (1, True) and early.first.step == 999
    assert full.ranks[0].pair_first[("actv", "fc.output")] == 1500
    # started at step 1000, nothing says the parameters drifted before: they differ as the first step starts
    later = compare(a, b, [0], tol, options=Options(first_only=True, step_lo=1000))
    assert (later.ranges_read, later.first.step) == (1, 1000)
    assert later.first.plan.pairs[later.first.first_divergent()].kind == "param_origin"
    # without the state's slack every later step's parameters would count
    strict = compare(a, b, [0], Tolerance(rtol=1e-4, coupling=0.0))
    assert strict.ranks[0].pair_counts[("param_origin", "fc.weight")] == 1200


def _write_rank(run: Path, rank: int, rows: list[tuple[str, str, float]], steps: int = 3) -> None:
    """One rank's store: (kind, name, scale) per tensor, the same values at every step."""
    sink = StatStoreSink(run, rank)
    layout = tuple(Row(k, n, 0, 0, phase_of(k), (4,), "torch.float32") for k, n, _ in rows)
    groups = TensorGroups(layout)
    for step in range(steps):
        p = np.zeros((len(layout), N_PARTIALS))
        p[:, NUMEL] = 4
        scale = np.asarray([s for _, _, s in rows])
        p[:, MIN], p[:, MAX], p[:, SUM], p[:, SUMSQ] = -scale, scale, 0.1 * scale, 2 * scale**2
        record = StepRecord(step, rank, layout, p, 0.0)
        sink.write(record, Derived(record, groups))
    sink.close()


def test_whole_tensor_statistics_of_two_layouts_and_what_they_leave_out(tmp_path):
    from trainmon.read.compare.source import WholeTensorReader

    # run A: one rank; run B: two ranks (a tensor-parallel pair: the merged statistics on both, each rank's
    # own activations) where a pipeline-like local name, stage.0.w, holds two different tensors
    _write_rank(tmp_path / "a", 0, [("actv", "fc.output", 1.0), ("grad_reduced", "fc.weight", 2.0),
                                    ("param_updated", "fc.weight", 3.0), ("grad_reduced", "stage.0.w", 5.0)])
    _write_rank(tmp_path / "b", 0, [("actv", "fc.output", 0.5), ("grad_reduced", "fc.weight", 2.0),
                                    ("param_updated", "fc.weight", 3.0), ("grad_reduced", "stage.0.w", 5.0)])
    _write_rank(tmp_path / "b", 1, [("actv", "fc.output", 0.7), ("grad_reduced", "fc.weight", 2.0),
                                    ("param_updated", "fc.weight", 3.0), ("grad_reduced", "stage.0.w", 6.0)])
    a, b = WholeTensorReader(open_run(tmp_path / "a")), WholeTensorReader(open_run(tmp_path / "b"))
    assert a.ranks == b.ranks == (0,)
    frame = b.frame(0, 0, 2)
    assert frame.tensors == (("grad_reduced", "fc.weight"), ("param_updated", "fc.weight"))
    assert b.ambiguous == {("grad_reduced", "stage.0.w")}
    result = compare(a, b, [0], Tolerance())
    assert result.first is None and result.ranks[0].steps == 3
    assert [p.name for p in result.ranks[0].plan.pairs] == ["fc.weight", "fc.weight"]
    assert a.kinds_left_out == b.kinds_left_out == {"actv"}
    assert result.ranks[0].plan.alignment.only_a == (("grad_reduced", "stage.0.w"),)
