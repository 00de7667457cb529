"""``alert.capture: exact`` and ``alert.on_nan: skip`` with a plain torch optimizer: the tensors that explain
a NaN are dumped at the step it appears, and with ``skip`` the poisoned update never lands."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import trainmon
from trainmon.anomaly.alerts import TrainingNaNError
from trainmon.read.dump_contents import load_dump
from trainmon.run.dumps import list_dumps

NAN_STEP = 3


class Faulty(nn.Module):
    """A module whose own code (not its child) turns one output element into NaN when ``poisoned``."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.poisoned = False
        self.spiked = False  # a finite blow-up instead of a NaN

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if self.spiked:
            y = y * 1e4
        if self.poisoned:
            y = y.clone()
            y[0, 1] = float("nan")
        return y


def make(inplace_after: bool = False):
    torch.manual_seed(0)
    tail = [nn.ReLU(inplace=True)] if inplace_after else [nn.Tanh()]
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), Faulty(16), *tail, nn.Linear(16, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model, optimizer, monitor, steps: int, poison_from: int | None, poison_to: int | None = None):
    """Returns the parameters after every step, and the losses."""
    after, losses = [], []
    for step in range(steps):
        faulty = model[2]
        faulty.poisoned = poison_from is not None and poison_from <= step <= (poison_to or poison_from)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        loss = model(x).pow(2).mean()
        monitor.track("loss", loss)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        after.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        losses.append(loss.detach())
    return after, losses


FULL = {
    "xy_distribution": True,
    "all_xy": True,
    "wg_distribution": True,
    "mv_distribution": True,
    "param_distribution": True,
    "format": "csv",
}


def test_exact_capture_dumps_the_origin_module_input_and_output_at_the_nan_step(tmp_path):
    model, optimizer = make()
    before_nan_step = None
    config = {**FULL, "alert": {"capture": "exact"}}
    with trainmon.attach(model, optimizer, config=config, logdir=tmp_path / "run") as mon:
        after, _ = train(model, optimizer, mon, NAN_STEP, None)
        before_nan_step = {k: v.clone() for k, v in after[-1].items()}
        train_more = train(model, optimizer, mon, 1, 0)  # step NAN_STEP, poisoned
        del train_more
        mon.flush()
    entries = [e for e in list_dumps(tmp_path / "run")]
    assert entries, "no dump written"
    assert {e.step for e in entries} == {NAN_STEP}  # the step of the NaN, not a later one
    assert all(e.reason == "exact: nan in actv 2.output" for e in entries), {e.reason for e in entries}
    by_key = {(e.kind, e.name): e for e in entries}
    x, _ = load_dump(tmp_path / "run" / by_key[("actv", "2.input")].path)
    y, _ = load_dump(tmp_path / "run" / by_key[("actv", "2.output")].path)
    assert torch.isfinite(x).all()  # the input was fine ...
    assert torch.isnan(y[0, 1]) and torch.isfinite(y).sum() == y.numel() - 1  # ... the module made the NaN
    # the loss of that step, and the origin module's parameters as they were before the update
    loss, _ = load_dump(tmp_path / "run" / by_key[("scalar", "loss")].path)
    assert torch.isnan(loss)
    weight, _ = load_dump(tmp_path / "run" / by_key[("param_origin", "2.lin.weight")].path)
    assert torch.equal(weight, before_nan_step["2.lin.weight"])
    grad, _ = load_dump(tmp_path / "run" / by_key[("grad_reduced", "2.lin.weight")].path)
    assert torch.isnan(grad).any()
    assert ("exp_avg", "2.lin.weight") in by_key and ("exp_avg_sq", "2.lin.weight") in by_key
    # activations of modules that did not make the NaN are not dumped
    assert ("actv", "4.output") not in by_key and ("actv", "0.output") not in by_key
    assert all(e.note == "" for e in entries)


def test_anomalies_of_an_exactly_captured_step_link_to_its_dumps_and_request_no_later_ones(tmp_path):
    """With ``alert.dump`` too, the NaN's anomalies point at the step's own dump folder (alert lines and
    ``trainmon analyze`` show it) instead of requesting dumps of the same tensors at a later, NaN-weighted,
    step."""
    from trainmon.run.anomaly_table import read_anomalies

    model, optimizer = make()
    config = {**FULL, "alert": {"capture": "exact", "dump": True}}
    with trainmon.attach(model, optimizer, config=config, logdir=tmp_path / "run") as mon:
        train(model, optimizer, mon, NAN_STEP + 3, NAN_STEP, NAN_STEP + 1)  # two poisoned steps in a row
        mon.flush()
    assert {e.step for e in list_dumps(tmp_path / "run")} == {NAN_STEP}
    found = list(read_anomalies(tmp_path / "run", 0))
    at_step = [a for a in found if a.step == NAN_STEP]
    assert at_step and {a.dump for a in at_step} == {f"plugins/trainmon/dumps/step_{NAN_STEP}/rank_0"}
    assert any(a.origin and a.name == "2.output" for a in at_step)
    assert all(a.dump is None for a in found if a.step > NAN_STEP)  # not the onset: nothing captured


def test_a_tensor_changed_in_place_after_its_hook_is_dumped_with_that_fact(tmp_path):
    model, optimizer = make(inplace_after=True)  # ReLU(inplace=True) rewrites Faulty's output
    config = {**FULL, "alert": {"capture": "exact"}}
    with trainmon.attach(model, optimizer, config=config, logdir=tmp_path / "run") as mon:
        train(model, optimizer, mon, NAN_STEP + 1, NAN_STEP)
        mon.flush()
    by_key = {(e.kind, e.name): e for e in list_dumps(tmp_path / "run")}
    out = by_key[("actv", "2.output")]
    assert out.note.startswith("modified in place after its hook (version")
    assert by_key[("actv", "2.input")].note == ""
    _, meta = load_dump(tmp_path / "run" / out.path)
    assert meta["note"] == out.note


def test_default_capture_holds_nothing_and_dumps_nothing_at_the_step(tmp_path):
    model, optimizer = make()
    with trainmon.attach(model, optimizer, config=FULL, logdir=tmp_path / "run") as mon:
        assert mon._guard.check is None and mon.buffer.hold is None
        train(model, optimizer, mon, NAN_STEP + 1, NAN_STEP)
        mon.flush()
    assert list_dumps(tmp_path / "run") == []


def _skip_run(tmp_path, steps: int, poison_from: int, poison_to: int | None = None, **alert):
    model, optimizer = make()
    config = {**FULL, "alert": {"on_nan": "skip", **alert}}
    with trainmon.attach(model, optimizer, config=config, logdir=tmp_path / "run") as mon:
        after, losses = train(model, optimizer, mon, steps, poison_from, poison_to)
        mon.flush()
    return model, optimizer, after, losses


def test_on_nan_skip_keeps_the_poisoned_update_from_landing(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="trainmon")
    model, optimizer, after, losses = _skip_run(tmp_path, NAN_STEP + 3, NAN_STEP)
    for name, value in after[NAN_STEP].items():  # bitwise the weights of the step before
        assert torch.equal(value, after[NAN_STEP - 1][name]), name
    for name, value in after[NAN_STEP + 1].items():  # and training goes on
        assert not torch.equal(value, after[NAN_STEP][name]), name
        assert torch.isfinite(value).all()
    assert torch.isnan(losses[NAN_STEP]) and torch.isfinite(losses[NAN_STEP + 1])
    assert all(s["step"] == NAN_STEP + 2 for s in optimizer.state.values())  # 6 steps, one skipped
    assert "step 3: nan in actv 2.output; the update is skipped" in caplog.text
    # the step is recorded as skipped, with its reason, after its NaN anomalies
    from trainmon.run.anomaly_table import read_anomalies

    records = list(read_anomalies(tmp_path / "run", 0))
    skipped = [a for a in records if a.rule == "step_skipped"]
    assert [(a.step, a.message) for a in skipped] == [
        (NAN_STEP, "update skipped (alert.on_nan: skip): nan in actv 2.output")
    ]
    assert any(a.rule == "nan" for a in records)


def test_skipped_run_matches_a_run_that_never_saw_the_bad_batch(tmp_path):
    """Skipping step k leaves every parameter and Adam moment as a run in which step k did not happen:
    the grads were hidden for that one call and handed back (the user may still read them)."""
    model, optimizer, after, _ = _skip_run(tmp_path, NAN_STEP + 1, NAN_STEP)
    assert all(p.grad is not None for p in model.parameters())
    torch.manual_seed(0)
    reference, ref_opt = make()
    for step in range(NAN_STEP):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        ref_opt.zero_grad()
        reference(x).pow(2).mean().backward()
        ref_opt.step()
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        assert torch.equal(p, q), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(optimizer.state[p][key], ref_opt.state[q][key]), (name, key)


def test_max_skips_then_raises(tmp_path):
    with pytest.raises(TrainingNaNError, match=r"alert.max_skips=2 steps were skipped already"):
        _skip_run(tmp_path, 10, 2, 9, max_skips=2)


def test_losses_unchanged_by_exact_capture_without_nan(tmp_path):
    model, optimizer = make()
    plain = []
    for step in range(4):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        plain.append(loss.detach())
    model, optimizer = make()
    config = {**FULL, "alert": {"capture": "exact", "on_nan": "skip"}}
    with trainmon.attach(model, optimizer, config=config, logdir=tmp_path / "run") as mon:
        _, monitored = train(model, optimizer, mon, 4, None)
    assert torch.equal(torch.stack(plain), torch.stack(monitored))


def test_config_rejects_unknown_capture_mode():
    from trainmon.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"alert.capture.*'exact'"):
        load_config({"alert": {"capture": "exactly"}})


def test_boundary_check_mid_step_keeps_every_row_right_on_the_triton_path(tmp_path, triton_tiling):
    """The check completes the rows deferred so far (one finalize launch) in the middle of the step; the
    rows added after it and the step's record must equal those of the default capture, row for row."""
    from trainmon import stats

    previous = stats.get_backend()
    stats.set_backend("triton")
    try:
        records = {}
        for capture in ("default", "exact"):
            model, optimizer = make()
            config = {**FULL, "alert": {"capture": capture}}
            with trainmon.attach(model, optimizer, config=config, logdir=tmp_path / capture) as mon:
                train(model, optimizer, mon, NAN_STEP + 1, NAN_STEP)
                mon.flush()
                records[capture] = mon.latest()
    finally:
        stats.set_backend(previous)
    assert records["exact"].keys() == records["default"].keys()
    for key, want in records["default"].items():
        got = records["exact"][key]
        for stat, value in want.items():
            assert got[stat] == value or (value != value and got[stat] != got[stat]), (key, stat)
    entries = list_dumps(tmp_path / "exact")
    assert {e.step for e in entries} == {NAN_STEP}
    assert {(e.kind, e.name) for e in entries} >= {("actv", "2.input"), ("actv", "2.output")}


def test_a_threshold_rule_is_decided_at_the_boundary_and_captured_at_its_step(tmp_path):
    """Threshold (and max_ratio) rules need only the step's own values: the boundary read has them, so a
    finite blow-up is dumped at its step too; the update is not skipped (only NaN/Inf are)."""
    model, optimizer = make()
    rules = [
        {"rule": "nan"},
        {"rule": "threshold", "kinds": ["actv"], "names": ["2.output"], "stats": ["max"], "above": 100.0},
    ]
    config = {**FULL, "alert": {"capture": "exact", "on_nan": "skip", "rules": rules}}
    with trainmon.attach(model, optimizer, config=config, logdir=tmp_path / "run") as mon:
        before, _ = train(model, optimizer, mon, NAN_STEP, None)
        model[2].spiked = True
        after, _ = train(model, optimizer, mon, 1, None)
        model[2].spiked = False
        train(model, optimizer, mon, 2, None)
        mon.flush()
    entries = list_dumps(tmp_path / "run")
    assert {e.step for e in entries} == {NAN_STEP}
    by_key = {(e.kind, e.name): e for e in entries}
    reason = by_key[("actv", "2.output")].reason
    assert reason.startswith("exact: threshold: ") and "2.output" in reason and "100" in reason, reason
    x, _ = load_dump(tmp_path / "run" / by_key[("actv", "2.input")].path)
    y, _ = load_dump(tmp_path / "run" / by_key[("actv", "2.output")].path)
    assert float(x.max()) < 100.0 < float(y.max())
    w, b = before[-1]["2.lin.weight"], before[-1]["2.lin.bias"]
    assert torch.equal(y, nn.functional.linear(x, w, b) * 1e4)  # the values of that step's call
    assert ("actv", "4.output") not in by_key  # another module's activations are not the origin's
    # a large value is not a poisoned update: the step was applied
    assert not torch.equal(after[-1]["2.lin.weight"], before[-1]["2.lin.weight"])


def test_value_rules_off_without_exact_capture(tmp_path):
    model, optimizer = make()
    rules = [{"rule": "threshold", "kinds": ["actv"], "names": ["2.output"], "stats": ["max"], "above": 1e-9}]
    config = {**FULL, "alert": {"on_nan": "skip", "rules": rules}}
    with trainmon.attach(model, optimizer, config=config, logdir=tmp_path / "run") as mon:
        train(model, optimizer, mon, 2, None)
        mon.flush()
    assert list_dumps(tmp_path / "run") == []
