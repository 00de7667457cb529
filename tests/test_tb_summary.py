"""TensorBoard's summary view (issue 33): the default writes the figures a person reads in TensorBoard
(tracked scalars, the step's gradient norm and NaN/Inf counts, each kind over all its tensors, each layer's
norm), a few hundred tags whatever the model; ``tensorboard_tensors: all`` writes every tensor as before, a
list of patterns the summary plus those tensors. Values are checked against figures computed from the tensors'
elements."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch
from conftest import reference_partials
from poison_model import make_model, train_step

import trainmon
from trainmon.config import load_config
from trainmon.csvtb.tb2csv import read_scalars
from trainmon.run import records
from trainmon.run.layout import rank_dir
from trainmon.run.records import RankAggregate, Row, StepRecord
from trainmon.run.statstore import read_stats
from trainmon.run.steptable import read_steps
from trainmon.run.timing import TIMES
from trainmon.writer.outputs import format_sinks, plan_sinks
from trainmon.writer.tbview import MAX_LAYER_FIGURES, SummaryLayout, TensorPatterns, group_labels
from trainmon.writer.tensorboard import AllRanksSink, TensorBoardSink

OPS = records.STATS


def f32(x: float) -> float:
    return float(np.float32(x))


# ---------------------------------------------------------------------------------------------- groups


def test_layers_are_grouped_by_their_first_numeric_part():
    names = [
        "layers.0.mlp.fc1.weight", "layers.0.attn.qkv.bias", "layers.11.mlp.fc2.weight",
        "decoder.layers.3.mlp.experts.7.fc1.weight", "0.weight", "embedding.word_embeddings.weight",
        "final_norm.output", "lm_head.output#1", "loss",
    ]  # fmt: skip
    assert group_labels(names) == [
        "layers.0", "layers.0", "layers.11", "decoder.layers.3", "0", "embedding.word_embeddings",
        "final_norm", "lm_head", "loss",
    ]  # fmt: skip


def test_a_deep_stack_is_shown_in_at_most_sixteen_ranges():
    names = [f"layers.{i}.mlp.fc1.weight" for i in range(40)] + ["layers.7.mlp.fc2.weight"]
    labels = group_labels(names)
    assert len(set(labels)) == 14 <= MAX_LAYER_FIGURES  # ceil(40 / 16) = 3 layers a range
    assert labels[:7] == ["layers.0-2"] * 3 + ["layers.3-5"] * 3 + ["layers.6-8"]
    assert labels[39] == "layers.39" and labels[40] == "layers.6-8"
    assert len(set(group_labels([f"h.{i}.w" for i in range(96)]))) == 16


def test_many_modules_outside_the_layers_are_grouped_by_their_first_part():
    names = [f"block{i // 4}.conv{i % 4}.weight" for i in range(80)]  # 80 modules, 20 first parts
    labels = group_labels(names)
    assert labels[:5] == ["block0"] * 4 + ["block1"] and len(set(labels)) == 20


def test_patterns_match_a_name_or_kind_slash_name():
    p = TensorPatterns(["layers.0.*", "grad_reduced/*", "re:emb\\w+\\.weight", "loss"])
    assert p.matches("actv", "layers.0.output") and p.matches("grad_reduced", "fc.weight")
    assert p.matches("param_origin", "embed.weight") and p.matches("scalar", "loss")
    assert not p.matches("actv", "layers.1.output") and not p.matches("grad_unreduced", "fc.weight")
    assert not p.matches("param_origin", "embed.bias")


# ---------------------------------------------------------------------------------------------- values

# a step of two layers and a module outside them; kind, name, elements (NaN and Inf included)
RNG = np.random.default_rng(7)
TENSORS = [
    ("actv", "embedding.output", RNG.normal(size=12)),
    ("actv", "layers.0.fc.output", RNG.normal(size=6)),
    ("actv", "layers.0.fc.input", np.array([1.0, np.nan, -3.0, np.inf])),
    ("actv", "layers.1.fc.output", RNG.normal(size=5) * 100),
    ("grad_reduced", "layers.0.fc.weight", RNG.normal(size=8) * 1e-3),
    ("grad_reduced", "layers.1.fc.weight", np.array([0.5, -np.inf, 0.0, 2.0])),
    ("grad_unreduced", "layers.1.fc.weight", RNG.normal(size=4)),
    ("scalar", "loss", np.array([2.5])),
]


def _step(step: int = 3) -> StepRecord:
    rows = tuple(Row(k, n, 0, 0, "forward", (len(a),), "torch.float32") for k, n, a in TENSORS)
    partials = np.stack([reference_partials(a) for _, _, a in TENSORS])
    return StepRecord(step, 0, rows, partials, 1000.0 + step)


def _expected() -> dict[str, float]:
    """Every summary figure from the elements themselves (not from the partials the sink merges)."""
    def figures(arrays):
        x = np.concatenate(arrays)
        finite = x[np.isfinite(x)]
        return {
            "min": finite.min(), "max": finite.max(), "mean": finite.mean(),
            "norm": math.sqrt(float((finite * finite).sum())), "zeros": float((np.abs(x) <= 1e-8).mean()),
            "nans": float(np.isnan(x).sum()), "infs": float(np.isinf(x).sum()),
        }  # fmt: skip

    by = lambda kind, prefix="": [a for k, n, a in TENSORS if k == kind and n.startswith(prefix)]  # noqa: E731
    out: dict[str, float] = {}
    grads = figures(by("grad_reduced"))  # grad_reduced present: the step's gradients
    out["step/grad_norm"] = grads["norm"]
    out["step/grad_nans"], out["step/grad_infs"] = grads["nans"], grads["infs"]
    out["step/nan_tensors"] = sum(bool(np.isnan(a).any()) for _, _, a in TENSORS)
    out["step/inf_tensors"] = sum(bool(np.isinf(a).any()) for _, _, a in TENSORS)
    for kind in ("actv", "grad_reduced", "grad_unreduced"):
        for stat, value in figures(by(kind)).items():
            out[f"{kind}/*/{stat}"] = value
    for kind, group in [("actv", "embedding"), ("actv", "layers.0"), ("actv", "layers.1"),
                        ("grad_reduced", "layers.0"), ("grad_reduced", "layers.1"),
                        ("grad_unreduced", "layers.1")]:  # fmt: skip
        out[f"{kind}/{group}.*/norm"] = figures(by(kind, group + "."))["norm"]
    for stat, value in figures(by("scalar")).items():
        out[f"scalar/loss/{stat}"] = value
    return out


def _check(got: dict[str, float], want: dict[str, float]) -> None:
    assert set(got) == set(want)
    for tag_, value in want.items():
        if tag_.endswith(("/mean", "/norm")) and math.isfinite(value):  # sums in another order: float32 near
            assert got[tag_] == pytest.approx(value, rel=1e-6), tag_
        else:
            assert got[tag_] == f32(value), tag_


def test_the_summary_figures_are_those_of_the_elements(tmp_path):
    sink = TensorBoardSink(tmp_path, OPS, tensors="summary")
    record = _step()
    sink.write(record, records.Derived(record))
    sink.close()
    scalars = read_scalars(tmp_path)
    assert all(list(series) == [3] for series in scalars.values())
    got = {t: series[3] for t, series in scalars.items()}
    _check(got, _expected())
    assert got["step/nan_tensors"] == 1 and got["step/inf_tensors"] == 2 and got["step/grad_infs"] == 1


def test_the_all_ranks_summary_is_made_of_the_merged_partials(tmp_path):
    """The all_ranks run's summary: the same figures over the tensors merged over every rank (here: each
    tensor's elements split between two ranks)."""
    halves = [(a[: len(a) // 2], a[len(a) // 2 :]) for _, _, a in TENSORS]
    merged = np.stack([records.merge(np.stack([reference_partials(h) for h in pair])) for pair in halves])
    keys = tuple((k, 0, n) for k, n, _ in TENSORS)
    record = StepRecord(3, 0, (), np.zeros((0, 8)), 1003.0, all_ranks=RankAggregate(keys, merged))
    sink = AllRanksSink(tmp_path, OPS, tensors="summary")
    sink.write(record, None)  # type: ignore[arg-type]
    sink.close()
    _check({t: s[3] for t, s in read_scalars(tmp_path).items()}, _expected())


def test_a_list_of_patterns_adds_those_tensors_to_the_summary(tmp_path):
    record = _step()
    sink = TensorBoardSink(tmp_path, ("max", "nans"), tensors=("layers.0.*",))
    tags, values = sink.values(record, records.Derived(record))
    summary = SummaryLayout(records.TensorGroups(record.rows).keys, ("max", "nans"), False).tags
    extra = [t for t in tags if t not in summary]
    assert [t for t in tags if t in summary] == list(summary) and len(tags) == len(summary) + len(extra)
    assert extra == [
        "actv/layers.0.fc.output/max", "actv/layers.0.fc.output/nans", "actv/layers.0.fc.input/max",
        "actv/layers.0.fc.input/nans", "grad_reduced/layers.0.fc.weight/max",
        "grad_reduced/layers.0.fc.weight/nans",
    ]  # fmt: skip
    by_tag = dict(zip(tags, values, strict=True))
    assert by_tag["actv/layers.0.fc.input/max"] == 1.0 and by_tag["actv/layers.0.fc.input/nans"] == 1.0
    sink.close()


def test_all_writes_every_tensor_and_statistic_as_before(tmp_path):
    record = _step()
    sink = TensorBoardSink(tmp_path, OPS, tensors="all")
    tags, _ = sink.values(record, records.Derived(record))
    assert tags == tuple(records.tag(k, n, op) for k, n, _ in TENSORS for op in OPS)
    sink.close()


# ---------------------------------------------------------------------------------------------- a run


def _train(run, config, steps=4, poison_at=None):
    model, optimizer = make_model()
    with trainmon.attach(model, optimizer, config=config, logdir=run) as mon:
        for step in range(steps):
            mon.track("loss", torch.tensor([float(step), 0.5]))  # no forward pass of its own
            train_step(model, optimizer, step, poison=step == poison_at)


KINDS = {"xy_distribution": True, "all_xy": True, "wg_distribution": True, "mv_distribution": True,
         "param_distribution": True}  # fmt: skip


@pytest.mark.timeout(120)
def test_a_default_run_writes_the_summary_and_the_store_and_no_csv(tmp_path, caplog):
    run = tmp_path / "run"
    with caplog.at_level(logging.INFO, "trainmon"):
        _train(run, KINDS, poison_at=2)
    first = next(r.getMessage() for r in caplog.records if r.name == "trainmon")
    assert first.startswith(f"trainmon: run {run}: TensorBoard shows the summary")
    assert f"{run}/plugins/trainmon/stats" in first and f"trainmon export {run} --format csv" in first
    assert not list(rank_dir(run, 0).glob("*.csv"))
    scalars = read_scalars(rank_dir(run, 0))
    kinds = ["actv", "actv_grad", "grad_unreduced", "grad_reduced", "param_origin", "param_updated",
             "exp_avg", "exp_avg_sq"]  # fmt: skip
    groups = {"actv": ["fc1", "fc2"], "actv_grad": ["fc2", "fc1"]}
    want = [
        "step/grad_norm", "step/grad_nans", "step/grad_infs", "step/nan_tensors", "step/inf_tensors",
        *(f"{k}/*/{op}" for k in kinds for op in OPS),
        *(f"{k}/{g}.*/norm" for k in kinds for g in groups.get(k, ["fc1", "fc2"])),
        *(f"scalar/loss/{op}" for op in OPS),
        *(f"time/{t}_ms" for t in TIMES),
    ]  # fmt: skip
    assert sorted(scalars) == sorted(want), set(scalars) ^ set(want)
    assert len(scalars) == 94  # 5 + 8 kinds x 7 + 8 kinds x 2 layers + 7, and the step's 10 times
    assert all(sorted(series) == [0, 1, 2, 3] for series in scalars.values())
    # the step's figures are those of the steps table and of the statistics store
    table = read_steps(run, 0)
    norms = dict(zip(table.column("step").to_pylist(), table.column("grad_norm").to_pylist(), strict=True))
    assert {s: v for s, v in scalars["step/grad_norm"].items() if math.isfinite(v)} == {
        s: f32(v) for s, v in norms.items() if math.isfinite(v)
    }
    frame = read_stats(run, 0, ("nans", "max"))
    nan_tensors = (frame.values["nans"] > 0).sum(axis=1)
    assert [scalars["step/nan_tensors"][s] for s in range(4)] == nan_tensors.tolist()
    assert nan_tensors[2] > 0 and nan_tensors[1] == 0  # the poisoned step
    actv = [j for j, (k, _) in enumerate(frame.tensors) if k == "actv"]
    assert [scalars["actv/*/max"][s] for s in range(4)] == np.nanmax(frame.values["max"][:, actv], 1).tolist()


@pytest.mark.timeout(120)
def test_the_summary_is_the_same_from_the_writer_process_and_thread(tmp_path, monkeypatch):
    scalars = []
    for mode in ("process", "thread"):
        monkeypatch.setenv("TRAINMON_WRITER", mode)
        _train(tmp_path / mode, KINDS, poison_at=1)
        scalars.append(read_scalars(rank_dir(tmp_path / mode, 0)))
    assert len(scalars[0]) == 94 and list(scalars[0]) == list(scalars[1])
    for tag_, series in scalars[0].items():
        assert list(series) == list(scalars[1][tag_]) == [0, 1, 2, 3]
        if not tag_.startswith("time/"):  # the step times are two runs' own
            np.testing.assert_array_equal(list(series.values()), list(scalars[1][tag_].values()), tag_)


@pytest.mark.timeout(120)
def test_tensorboard_tensors_all_and_csv_say_what_they_cost(tmp_path, caplog):
    run = tmp_path / "run"
    with caplog.at_level(logging.INFO, "trainmon"):
        _train(run, {**KINDS, "format": ["tensorboard", "csv"], "tensorboard_tensors": "all"}, steps=2)
    said = [r.getMessage() for r in caplog.records if r.name == "trainmon"]
    tb = [m for m in said if "(tensorboard_tensors: all)" in m and "tags," in m]
    assert len(tb) == 1 and "the summary would be 84 tags" in tb[0]
    tensors = len(read_stats(run, 0, ("max",)).tensors)
    assert f": {tensors * 7} tags," in tb[0]
    csv = [m for m in said if m.startswith("trainmon: CSV in")]
    assert len(csv) == 1 and f"{tensors} rows" in csv[0]
    assert len(read_scalars(rank_dir(run, 0))) == tensors * 7 + len(TIMES)  # and the step's times
    assert (rank_dir(run, 0) / "actv.csv").exists()


def test_the_plan_carries_the_view_to_every_tensorboard_sink(tmp_path):
    config = load_config({"tensorboard_tensors": ["layers.0.*"]})
    plan = plan_sinks(config, tmp_path, 0, False, world=64, aggregates=True, all_ranks_writer=True)
    assert [(s.kind, s.tensors) for s in plan] == [
        ("tensorboard", ("layers.0.*",)), ("all_ranks", ("layers.0.*",)), ("statstore", "all"),
    ]  # fmt: skip
    sinks = format_sinks(load_config({}), tmp_path, 0, False, world=1)
    try:
        assert [(type(s).__name__, getattr(s, "view", None)) for s in sinks] == [
            ("TensorBoardSink", "summary"), ("StatStoreSink", None),
        ]  # fmt: skip
    finally:
        for s in sinks:
            s.close()


# ---------------------------------------------------------------------------------------------- the budget


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_generated_long_run_takes_at_most_16_kb_per_rank_step_with_nothing_lost(tmp_path):
    """``bench/scale.py build`` (the monitor's write path, the default config, an 8-layer GPT's 289 tensors):
    at most 16 KB per rank and step on disk, every statistic of every tensor and step in the store, and a
    TensorBoard run of a few dozen tags."""
    import importlib.util
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("bench_scale", root / "bench" / "scale.py")
    scale = sys.modules["bench_scale"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(scale)
    run = tmp_path / "run"
    build = [sys.executable, str(root / "bench" / "scale.py"), "build", str(run), "--ranks", "2", "--steps",
             "1200", "--nan-rank", "1", "--nan-step", "1100", "--jobs", "1"]  # fmt: skip
    subprocess.run(build, check=True, capture_output=True, timeout=540)
    sizes = scale._sizes(run)
    per_rank_step = sum(sizes.values()) / (2 * 1200)
    assert per_rank_step <= 16_000, sizes
    assert sizes["csv"] == 0 and sizes["events"] <= 3_000 * 2 * 1200 and sizes["stats"] <= 5_000 * 2 * 1200
    frame = read_stats(run, 1, ("max", "nans"))
    assert frame.values["max"].shape == (1200, 289)  # every tensor of every step, nothing lost
    assert not np.isnan(frame.values["nans"]).any()
    tags = read_scalars(rank_dir(run, 0))
    assert len(tags) == 73 and all(len(series) == 1200 for series in tags.values())
