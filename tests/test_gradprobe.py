"""grad_probe: fingerprints written during real training runs, read back exactly, and ``trainmon compare``
finding the first divergent step and parameter."""

from __future__ import annotations

import contextlib
import json
import math
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import assert_matches, reference_partials
from tbparse import SummaryReader
from torch import nn

import trainmon
from trainmon import stats
from trainmon.cli import main
from trainmon.collect.gradprobe import bin_counts, pack_signs, sample_positions, sample_seed
from trainmon.config import ConfigError, load_config
from trainmon.gradprobe.compare import compare_pair, relative_noise
from trainmon.gradprobe.reader import Fingerprint, FingerprintError, RankFingerprints
from trainmon.gradprobe.writer import FingerprintWriter
from trainmon.run.gradprobe import ParamLayout
from trainmon.run.layout import probe_bin_file, probe_index_file
from trainmon.run.records import SUMSQ


def make_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


class Renamed(nn.Module):
    """The same network as make_model() with other parameter names (another framework's wrapper)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc, self.mid, self.head = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.mid(torch.relu(self.enc(x)))))


RENAMES = {"0": "enc", "2": "mid", "4": "head"}


@contextlib.contextmanager
def deterministic():
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


def train(run_dir, steps=6, probe=None, perturb=None, renamed=False, keep_grads=None) -> None:
    """A seeded, deterministic run: same initial weights and data order every time. ``perturb=(name, k)``
    adds noise to that parameter's gradient from step k on; ``keep_grads`` collects every gradient."""
    model = make_model()
    if renamed:
        state = model.state_dict()
        model = Renamed()
        model.load_state_dict({RENAMES[k.split(".")[0]] + "." + k.split(".")[1]: v for k, v in state.items()})
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(1)
    noise = torch.Generator().manual_seed(2)
    params = dict(model.named_parameters())
    cfg = {"enable": True, "sample_size": 64, **(probe or {})}
    with deterministic(), trainmon.attach(model, opt, logdir=run_dir, grad_probe=cfg, format="csv"):
        for step in range(steps):
            x = torch.randn(8, 16, generator=data)
            y = torch.randn(8, 4, generator=data)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            if perturb is not None and step >= perturb[1]:
                g = params[perturb[0]].grad
                g += 2 * g.std() * torch.randn(g.shape, generator=noise)
            if keep_grads is not None:
                keep_grads.append({n: p.grad.clone() for n, p in params.items()})
            opt.step()


def compare(capsys, a, b, out, *extra) -> tuple[int, dict]:
    rc = main(["compare", str(a), str(b), "--out", str(out), "--json", *extra])
    return rc, json.loads(capsys.readouterr().out)


# ---------------------------------------------------------------------------------------------------------
# the pieces


def test_sample_positions_are_fixed_distinct_and_depend_only_on_the_seed():
    pos = sample_positions(10_000, 100, 12345)
    assert len(pos) == 100 and len(set(pos.tolist())) == 100
    assert np.all(np.diff(pos) > 0) and pos[0] >= 0 and pos[-1] < 10_000
    assert np.array_equal(pos, sample_positions(10_000, 100, 12345))
    assert not np.array_equal(pos, sample_positions(10_000, 100, 12346))
    assert np.array_equal(sample_positions(50, 100, 7), np.arange(50))
    assert sample_seed("fc.weight", (4, 8)) == zlib.crc32(b"fc.weight|4x8")
    assert sample_seed("fc.weight", (4, 8), by="shape") == sample_seed("other", (4, 8), by="shape")


def test_pack_signs_is_numpy_packbits_of_positive():
    x = torch.tensor([1.0, -2.0, 0.0, 3.0, 5.0, -0.5, 2.0, 1.0, 4.0, -1.0, 0.0])
    assert pack_signs(x).tolist() == np.packbits(x.numpy() > 0).tolist()


def test_bins_are_msprobe_interval_fractions_plus_exact_zeros():
    x = torch.tensor([-3.0, -1.0, -0.5, 0.0, 0.0, 0.25, 1.0, 2.0, math.inf, -math.inf, math.nan, 0.5])
    bounds = (-1.0, 0.0, 1.0)
    from trainmon.run.gradprobe import ParamLayout

    layout = ParamLayout("x", 0, (12,), "float32", "L2", bounds, 0, "name", 0, False)
    fp = Fingerprint(layout, reference_partials(x.numpy()), bin_counts(x, bounds).numpy(), None, None)
    # (-inf,-1]: -3,-1,-inf  (-1,0]: -0.5,0,0  (0,1]: 0.25,1,0.5  (1,inf): 2,inf  (NaN in none); ==0: 2
    assert fp.bins().tolist() == [3 / 12, 3 / 12, 3 / 12, 2 / 12, 2 / 12]


def test_config_section_validates_and_names_the_allowed_keys():
    c = load_config({"grad_probe": {"enable": True, "grad_level": "L1", "bounds": [-0.1, 0, 0.1]}})
    assert c.grad_probe.grad_level == "L1" and c.grad_probe.bounds == (-0.1, 0.0, 0.1)
    assert load_config(c.to_dict()) == c
    with pytest.raises(ConfigError) as e:
        load_config({"grad_probe": {"level": "L1"}})
    assert str(e.value) == (
        "grad_probe.level: unknown key 'level'; did you mean 'grad_level'? "
        "(allowed: bounds, enable, grad_level, param_list, sample_seed, sample_size, sign_bitmap)"
    )
    with pytest.raises(ConfigError, match=r"grad_probe\.bounds: expected a non-empty, strictly increasing"):
        load_config({"grad_probe": {"bounds": [0, 0]}})
    with pytest.raises(ConfigError, match=r"grad_probe\.grad_level: unknown grad_level 'L3'"):
        load_config({"grad_probe": {"grad_level": "L3"}})


# ---------------------------------------------------------------------------------------------------------
# what a training run writes


def test_fingerprints_hold_the_exact_statistics_bins_sample_and_signs(tmp_path):
    grads: list[dict[str, torch.Tensor]] = []
    train(tmp_path / "run", steps=3, probe={"sign_bitmap": True}, keep_grads=grads)
    run = RankFingerprints(tmp_path / "run", 0)
    assert run.steps == [0, 1, 2]
    for step in run.steps:
        fps = run.step(step)
        assert [name for _, name in fps] == ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]
        for (_, name), fp in fps.items():
            g = grads[step][name].reshape(-1)
            positions = sample_positions(g.numel(), 64, sample_seed(name, grads[step][name].shape))
            assert np.array_equal(fp.partials, stats.partials(g).numpy())  # the stats kernel's vector
            assert_matches(fp.partials, reference_partials(g.numpy()), g.numpy())
            assert np.array_equal(fp.sample, g.numpy()[positions])
            assert np.array_equal(fp.sign_bits(), g.numpy() > 0)
            cum = [(g <= b).sum().item() for b in (-1.0, 0.0, 1.0)] + [(g == 0).sum().item()]
            assert fp.counts.tolist() == cum
    assert fps[(0, "2.weight")].layout.k == 64 and fps[(0, "4.bias")].layout.k == 4  # numel 4 <= 64: all


def test_levels_param_list_and_storage_formula(tmp_path):
    train(tmp_path / "l0", steps=2, probe={"grad_level": "L0", "param_list": ["2.*"]})
    train(tmp_path / "l1", steps=2, probe={"grad_level": "L1"})
    l0, l1 = RankFingerprints(tmp_path / "l0", 0), RankFingerprints(tmp_path / "l1", 0)
    fp0 = l0.step(1)
    assert list(fp0) == [(0, "2.weight"), (0, "2.bias")]
    assert all(fp.counts is None and fp.sample is None and fp.signs is None for fp in fp0.values())
    fp1 = l1.step(1)[(0, "2.weight")]
    assert fp1.counts is None and fp1.sample.shape == (64,)
    # L0 record: 8 float64 partials; L1: + 64 float32 samples (bias of 32 elements: 32)
    assert probe_bin_file(tmp_path / "l0", 0).stat().st_size == 2 * (64 + 64)
    l1_size = probe_bin_file(tmp_path / "l1", 0).stat().st_size
    assert l1_size == 2 * 6 * 64 + 2 * 4 * (64 + 32 + 64 + 32 + 64 + 4)


# ---------------------------------------------------------------------------------------------------------
# compare


def test_identical_seeded_runs_do_not_diverge(tmp_path, capsys):
    for name in ("a", "b"):
        train(tmp_path / name, probe={"sign_bitmap": True})
    rc, summary = compare(capsys, tmp_path / "a", tmp_path / "b", tmp_path / "out")
    assert rc == 0
    assert summary["first_divergent_step"] is None
    assert summary["ranks"][0]["steps_compared"] == 6 and summary["ranks"][0]["params_compared"] == 6
    rows = (tmp_path / "out" / "similarity.csv").read_text().splitlines()
    assert len(rows) == 1 + 6 * 6
    for line in rows[1:]:
        _, _, name, name_b, sign, cosine, ratio, bins, sim, div = line.split(",")
        assert (name == name_b, sign, cosine, ratio, bins, sim, div) == (
            True,
            "1.0",
            "1.0",
            "1.0",
            "0.0",
            "1.0",
            "0",
        )


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_perturbed_layer_is_named_at_the_step_it_starts(tmp_path, capsys):
    train(tmp_path / "a")
    train(tmp_path / "b", perturb=("2.weight", 3))
    rc, summary = compare(capsys, tmp_path / "a", tmp_path / "b", tmp_path / "out")
    assert rc == 1
    assert summary["first_divergent_step"] == 3
    assert summary["ranks"][0]["first_divergent_params"] == ["2.weight"]
    # before step 3 every pair is identical; at step 3 only the perturbed gradient differs
    reader = SummaryReader(str(tmp_path / "out" / "rank_0")).scalars
    sim = reader[reader.tag.str.endswith("/similarity")]
    assert set(sim[sim.step < 3].value) == {1.0}
    at3 = sim[sim.step == 3].set_index("tag").value
    assert at3["compare/2.weight/similarity"] < 0.97
    assert {
        v for t, v in at3.items() if t not in ("compare/2.weight/similarity", "compare/min/similarity")
    } == {1.0}
    assert at3["compare/min/similarity"] == at3["compare/2.weight/similarity"]
    # the plots are real PNGs
    import matplotlib.image

    overview = matplotlib.image.imread(tmp_path / "out" / "plots" / "rank_0_similarity.png")
    assert overview.shape[:2] == (500, 900)
    assert (tmp_path / "out" / "plots" / "rank_0" / "2.weight.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a stricter drop threshold still names step 3 first; the text output says so
    rc = main(
        ["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "o2"), "--no-plots"]
    )
    assert rc == 1
    assert "first divergent step 3: 2.weight" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_renamed_parameters_compare_through_a_mapping_file(tmp_path, capsys):
    train(tmp_path / "a", probe={"sample_seed": "shape"})
    train(tmp_path / "b", probe={"sample_seed": "shape"}, renamed=True)
    mapping = tmp_path / "map.yaml"
    mapping.write_text("".join(f"{a}.{p}: {b}.{p}\n" for a, b in RENAMES.items() for p in ("weight", "bias")))
    rc, summary = compare(capsys, tmp_path / "a", tmp_path / "b", tmp_path / "out", "--map", str(mapping))
    assert rc == 0 and summary["first_divergent_step"] is None
    assert summary["ranks"][0]["params_compared"] == 6 and summary["ranks"][0]["only_in_b"] == []
    assert (
        "0,0,0.weight,enc.weight,1.0,1.0,1.0,0.0,1.0,0" in (tmp_path / "out" / "similarity.csv").read_text()
    )
    # without the mapping nothing matches
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "o2")]) == 2
    assert "no parameter matches between the two runs" in capsys.readouterr().err


def test_renamed_parameters_sampled_by_name_are_reported_unaligned(tmp_path, capsys):
    train(tmp_path / "a", steps=2)
    train(tmp_path / "b", steps=2, renamed=True)
    mapping = tmp_path / "map.json"
    mapping.write_text(json.dumps({"2.weight": "mid.weight"}))
    rc, summary = compare(capsys, tmp_path / "a", tmp_path / "b", tmp_path / "out", "--map", str(mapping))
    assert summary["ranks"][0]["unaligned_samples"] == ["2.weight"]
    line = (tmp_path / "out" / "similarity.csv").read_text().splitlines()[1]
    assert line == "0,0,2.weight,mid.weight,,,1.0,0.0,1.0,0"  # no sign/cosine: different positions
    assert rc == 0


# ---------------------------------------------------------------------------------------------------------
# storage, crash safety, errors


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_storage_is_under_two_percent_of_msprobe_sign_files(tmp_path):
    """A 4.2M-parameter MLP (4 x Linear(1024, 1024)), default grad_probe (L2, 1024 samples): msprobe's L1
    writes one bool .npy per parameter and step (128-byte header + 1 byte an element)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(4)])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    steps = 3
    with trainmon.attach(model, opt, logdir=tmp_path / "run", grad_probe={"enable": True}, format="csv"):
        for _ in range(steps):
            opt.zero_grad()
            model(torch.randn(4, 1024)).square().mean().backward()
            opt.step()
    n = sum(p.numel() for p in model.parameters())
    run = tmp_path / "run"
    ours = probe_bin_file(run, 0).stat().st_size + probe_index_file(run, 0).stat().st_size
    msprobe = steps * sum(128 + p.numel() for p in model.parameters())
    # per parameter and step: 64 B partials + 32 B counts + 4 KiB samples (biases: 1024 elements, all)
    assert probe_bin_file(tmp_path / "run", 0).stat().st_size == steps * 8 * (64 + 32 + 4096)
    assert n == 4_198_400
    assert ours / msprobe < 0.02, (ours, msprobe)


def test_partial_last_index_line_is_ignored_and_cut_on_reopen(tmp_path):
    train(tmp_path / "run", steps=2)
    index = probe_index_file(tmp_path / "run", 0)
    whole = index.read_text()
    index.write_text(whole + '{"type":"step","ste')  # killed mid-line
    assert RankFingerprints(tmp_path / "run", 0).steps == [0, 1]
    FingerprintWriter(tmp_path / "run", 0).close()
    assert index.read_text() == whole


def test_corrupt_index_line_is_an_error_naming_file_and_line(tmp_path, capsys):
    train(tmp_path / "a", steps=2)
    train(tmp_path / "b", steps=2)
    index = probe_index_file(tmp_path / "b", 0)
    lines = index.read_text().splitlines()
    lines[2] = "not json"
    index.write_text("\n".join(lines) + "\n")
    with pytest.raises(FingerprintError, match=rf"^{index}:3: not a fingerprint index line"):
        RankFingerprints(tmp_path / "b", 0)
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "o")]) == 2
    assert f"{index}:3: not a fingerprint index line" in capsys.readouterr().err


def test_compare_errors(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    train(tmp_path / "a", steps=1)
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "nope")]) == 2
    assert f"run directory not found: {tmp_path / 'nope'}" in capsys.readouterr().err
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "empty")]) == 2
    assert f"{tmp_path / 'empty'} is not a trainmon run" in capsys.readouterr().err
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "empty"), "--source", "gradprobe"]) == 2
    assert f"no grad_probe fingerprints in {tmp_path / 'empty'}" in capsys.readouterr().err
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "a"), "--rank", "3"]) == 2
    assert "rank 3 has no fingerprints in" in capsys.readouterr().err
    bad = tmp_path / "map.yaml"
    bad.write_text("- a\n- b\n")
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "a"), "--map", str(bad)]) == 2
    assert f"{bad}: expected a mapping" in capsys.readouterr().err


def test_no_files_without_grad_probe(tmp_path):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with trainmon.attach(model, opt, logdir=tmp_path / "run", format="csv"):
        model(torch.randn(2, 16)).sum().backward()
        opt.step()
    assert not (Path(tmp_path / "run") / "plugins" / "trainmon" / "gradprobe").exists()


def test_fingerprint_format_writer_and_sampling_import_without_torch():
    """The MindSpore collector shares these modules: importing them must not import torch."""
    modules = ", ".join(f"trainmon.gradprobe.{m}" for m in ("sampling", "writer", "reader", "compare"))
    code = f"import sys, {modules}; sys.exit('torch' in sys.modules)"
    import subprocess
    import sys

    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# ---------------------------------------------------------------------------------------------------------
# float noise is not a divergence (issue 15, point 5a)


def fingerprint(g: np.ndarray, k: int, sign_bitmap: bool = False, dtype: str = "float32") -> Fingerprint:
    """What the collector stores for the gradient ``g`` (L2, bounds -1, 0, 1)."""
    g = np.asarray(g, dtype=np.float32)
    bounds = (-1.0, 0.0, 1.0)
    layout = ParamLayout("p", 0, (g.size,), dtype, "L2", bounds, 7, "name", min(k, g.size), sign_bitmap)
    counts = np.array([(g <= b).sum() for b in bounds] + [(g == 0).sum()], dtype=np.float64)
    signs = np.packbits(g > 0) if sign_bitmap else None
    return Fingerprint(layout, reference_partials(g), counts, g[sample_positions(g.size, k, 7)], signs)


def qkv_bias_pair(parts: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """An attention qkv.bias gradient in two runs that differ in reduction order only: the query and value
    parts agree to float32 rounding, the key part is analytically zero and holds independent noise."""
    rng = np.random.default_rng(seed)
    q, v = rng.normal(0.0, 1e-3, parts), rng.normal(0.0, 1e-3, parts)
    a = np.concatenate((q, rng.normal(0.0, 1e-10, parts), v))
    b = np.concatenate((q, rng.normal(0.0, 1e-10, parts), v)) * (1.0 + rng.normal(0.0, 1e-7, 3 * parts))
    return a, b


def test_relative_noise_by_dtype():
    dtypes = ("float32", "torch.float32", "float64", "bfloat16", "torch.float16")
    assert [relative_noise(d) for d in dtypes] == [1e-3, 1e-3, 1e-3, 0.0625, 0.0078125]


def test_noise_in_analytically_zero_elements_is_not_a_divergence():
    a, b = qkv_bias_pair(64)  # 192 elements: the sample is the whole tensor
    fa, fb = fingerprint(a, 1024), fingerprint(b, 1024)
    flips = int(np.count_nonzero((fa.sample > 0) != (fb.sample > 0)))
    assert flips > 20  # what compare used to count: sign agreement 1 - flips/192 < 0.9
    sign, cosine, ratio, bins, similarity, aligned = compare_pair(fa, fb)
    assert aligned and (sign, bins) == (1.0, 0.0)
    assert similarity == min(cosine, min(ratio, 1 / ratio)) and similarity > 1 - 1e-6
    # with the sign bitmap of a tensor larger than the sample: the disagreements the sample's share of
    # negligible elements explains are noise
    a, b = qkv_bias_pair(2048)
    sign, _, _, bins, similarity, _ = compare_pair(fingerprint(a, 1024, True), fingerprint(b, 1024, True))
    assert np.count_nonzero((a > 0) != (b > 0)) > 900
    assert (sign, bins) == (1.0, 0.0) and similarity > 1 - 1e-6


def test_flipped_signs_of_significant_elements_still_count():
    a, _ = qkv_bias_pair(64)
    b = a.copy()
    b[:13] = -b[:13]  # a bug: 13 of the 128 significant elements change sign
    sign, cosine, *_, similarity, _ = compare_pair(fingerprint(a, 1024), fingerprint(b, 1024))
    assert sign == 115 / 128 and similarity == min(sign, cosine) < 0.97
    # 6144 elements, 1024 sampled: the bug flips 10 % of the value part, besides the key part's noise
    a, b = qkv_bias_pair(2048)
    b[4096 : 4096 + 205] *= -1
    fa, fb = fingerprint(a, 1024, True), fingerprint(b, 1024, True)
    sign, *_ = compare_pair(fa, fb)
    floor = 1e-3 * max(math.sqrt(fa.partials[SUMSQ] / 6144), math.sqrt(fb.partials[SUMSQ] / 6144))
    significant = np.maximum(np.abs(fa.sample), np.abs(fb.sample)) > floor
    assert 600 < significant.sum() < 770  # about two thirds of the sample
    expected = np.mean((fa.sample > 0)[significant] == (fb.sample > 0)[significant])
    assert sign == expected < 0.99


def gpt_run(run_dir, threads: int, bug_step: int | None = None, steps: int = 4) -> None:
    """The demo GPT from one seed; ``threads`` changes only the order of float reductions. ``bug_step``:
    from that step layer 1's attention drops its causal mask (a real bug)."""
    from trainmon.demo import DemoSetup, build, lm_loss, synthetic_batch

    setup = DemoSetup(layers=2)
    model, opt = build(setup)
    attn = model.layers[1].attn
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with trainmon.attach(model, opt, logdir=run_dir, grad_probe={"enable": True}, format="csv"):
            generator = torch.Generator().manual_seed(0)
            for step in range(steps):
                if step == bug_step:
                    attn.forward = _with_sdpa(attn, _unmasked)
                loss = lm_loss(model, synthetic_batch(setup, generator))
                opt.zero_grad()
                loss.backward()
                opt.step()
    finally:
        torch.set_num_threads(before)


_SDPA = torch.nn.functional.scaled_dot_product_attention


def _unmasked(q, k, v, is_causal=False):
    return _SDPA(q, k, v)


def _with_sdpa(attn, sdpa):
    """``attn.forward`` with ``sdpa`` in place of scaled_dot_product_attention."""
    import trainmon.demo as demo

    forward = type(attn).forward

    def patched(x):
        saved = demo.F.scaled_dot_product_attention
        demo.F.scaled_dot_product_attention = sdpa
        try:
            return forward(attn, x)
        finally:
            demo.F.scaled_dot_product_attention = saved

    return patched


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gpt_runs_differing_in_reduction_order_do_not_diverge_and_a_bug_is_named_at_its_step(
    tmp_path, capsys
):
    gpt_run(tmp_path / "one", threads=1)
    gpt_run(tmp_path / "two", threads=2)
    rc, summary = compare(capsys, tmp_path / "one", tmp_path / "two", tmp_path / "out", "--no-plots")
    rows = (tmp_path / "out" / "similarity.csv").read_text().splitlines()[1:]
    bias = [r.split(",") for r in rows if ",layers.1.attn.qkv.bias," in r and not r.startswith("0,0,")]
    assert bias and all(float(r[4]) == 1.0 and float(r[8]) > 0.9999 for r in bias)  # signs no longer noise
    assert (rc, summary["first_divergent_step"]) == (0, None)
    gpt_run(tmp_path / "bug", threads=2, bug_step=2)
    rc, summary = compare(capsys, tmp_path / "one", tmp_path / "bug", tmp_path / "out2", "--no-plots")
    assert (rc, summary["first_divergent_step"]) == (1, 2)
    assert "layers.1.attn.qkv.weight" in summary["ranks"][0]["first_divergent_params"]
