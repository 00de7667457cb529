"""What ``attach`` tells a user about their own mistakes: targets that match nothing, a second monitor on a
model or optimizer that has one, misspelt keyword arguments of attach itself."""

from __future__ import annotations

import csv
import json
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import trainmon
from trainmon.config import ConfigError
from trainmon.config.targets import Unmatched, parse_target, unmatched_targets

# these tests read the CSV of the tensors a run recorded: asked for (issue 33 made it a choice)
CSV = {"format": ["tensorboard", "csv"]}

class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def make_toy() -> tuple[Toy, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Toy()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    loss = F.mse_loss(model(torch.ones(2, 4)), torch.zeros(2, 2))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "trainmon"]


def csv_rows(path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


# ------------------------------------------------------------------------- targets that match nothing
def test_unmatched_targets_with_closest_names():
    names = [{"", "fc1", "act", "fc2", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}]
    patterns = [parse_target(t) for t in ("fc1", "fc2.weigth", "re:fc[3-9]", "1:fc1", "zzz", "fc*.bias", "")]
    assert unmatched_targets(patterns, names) == [
        Unmatched("fc2.weigth", ("fc2.weight", "fc1.weight")),
        Unmatched("re:fc[3-9]", ()),
        Unmatched("1:fc1", ("fc1", "fc2")),  # no chunk 1: names of every chunk
        Unmatched("zzz", ()),
    ]
    # a chunk-limited pattern is looked up in that chunk only
    two_chunks = [{"layers.0"}, {"layers.1"}]
    want = [Unmatched("1:layers.0", ("layers.1",))]
    assert unmatched_targets([parse_target("1:layers.0")], two_chunks) == want
    assert unmatched_targets([parse_target("1:layers.1")], two_chunks) == []


def test_a_misspelt_target_warns_once_at_attach_with_the_closest_names(tmp_path, caplog):
    model, optimizer = make_toy()
    config = {"xy_distribution": True, "wg_distribution": True, "targets": ["fc1", "fc2.weigth"], **CSV}
    with (
        caplog.at_level(logging.WARNING, logger="trainmon"),
        trainmon.attach(model, optimizer, config=config, logdir=tmp_path / "run"),
    ):
        for _ in range(3):
            train_step(model, optimizer)
    assert warnings_of(caplog) == [
        "trainmon: target 'fc2.weigth' matches no module or parameter of the model; "
        "closest names: 'fc2.weight', 'fc1.weight'"
    ]
    # fc1 still monitored: the run is not empty, and its manifest carries the warning
    names = {r["name"] for r in csv_rows(tmp_path / "run" / "rank_0" / "grad_reduced.csv")}
    assert names == {"fc1.weight", "fc1.bias"}
    manifest = json.loads((tmp_path / "run" / "plugins" / "trainmon" / "manifest.json").read_text())
    assert manifest["warnings"] == [warnings_of(caplog)[0].removeprefix("trainmon: ")]


def test_an_empty_run_says_why(tmp_path, caplog):
    model, optimizer = make_toy()
    config = {"xy_distribution": True, "wg_distribution": True, "targets": ["layers.0.mlp"], **CSV}
    with (
        caplog.at_level(logging.WARNING, logger="trainmon"),
        trainmon.attach(model, optimizer, config=config, logdir=tmp_path / "run"),
    ):
        train_step(model, optimizer)
    why = [
        "target 'layers.0.mlp' matches no module or parameter of the model; "
        "closest names: none (print([n for n, _ in model.named_modules()]))",
        "no target matches a module or parameter of the model, so this run records no statistics of the "
        "model (only scalars given to monitor.track())",
    ]
    assert warnings_of(caplog) == [f"trainmon: {w}" for w in why]
    assert not (tmp_path / "run" / "rank_0" / "grad_reduced.csv").exists()
    manifest = json.loads((tmp_path / "run" / "plugins" / "trainmon" / "manifest.json").read_text())
    assert manifest["warnings"] == why


def test_matching_targets_and_all_xy_say_nothing(tmp_path, caplog):
    model, optimizer = make_toy()
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        for config in (
            {"xy_distribution": True, "targets": ["fc1", "fc*.bias", "re:fc\\d", ""]},
            {"xy_distribution": True},
        ):
            with trainmon.attach(model, optimizer, config=config, logdir=tmp_path / "run"):
                train_step(model, optimizer)
    assert warnings_of(caplog) == []
    manifest = json.loads((tmp_path / "run" / "plugins" / "trainmon" / "manifest.json").read_text())
    assert "warnings" not in manifest


# ---------------------------------------------------------------------- one monitor per model and optimizer
def _hook_counts(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, ...]:
    modules = [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()]
    return (*modules, len(optimizer._optimizer_step_pre_hooks), len(optimizer._optimizer_step_post_hooks))


def test_a_second_attach_replaces_the_first_with_a_warning(tmp_path, caplog):
    model, optimizer = make_toy()
    config = {"xy_distribution": True, "all_xy": True, "wg_distribution": True, **CSV}
    with trainmon.attach(model, optimizer, config=config, logdir=tmp_path / "alone"):
        once = _hook_counts(model, optimizer)
    assert _hook_counts(model, optimizer) == (0,) * len(once)

    first = trainmon.attach(model, optimizer, config=config, logdir=tmp_path / "first")
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        second = trainmon.attach(model, optimizer, config=config, logdir=tmp_path / "second")
    assert warnings_of(caplog) == [
        f"trainmon: this model or optimizer already has a monitor (run {tmp_path / 'first'}); closing it and "
        "attaching the new one. Call monitor.close() before attaching another."
    ]
    assert _hook_counts(model, optimizer) == once  # not twice
    for _ in range(2):
        train_step(model, optimizer)
    assert second.step == 2 and first.step == 0
    second.close()
    rows = csv_rows(tmp_path / "second" / "rank_0" / "grad_reduced.csv")
    assert sorted((r["name"], r["step"]) for r in rows) == sorted(
        (name, str(step)) for name in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias") for step in (0, 1)
    )
    assert not (tmp_path / "first" / "rank_0" / "grad_reduced.csv").exists()


def test_the_same_optimizer_with_another_model_replaces_too(tmp_path, caplog):
    model, optimizer = make_toy()
    other = Toy()
    first = trainmon.attach(model, optimizer, logdir=tmp_path / "first")
    with (
        caplog.at_level(logging.WARNING, logger="trainmon"),
        trainmon.attach(other, optimizer, logdir=tmp_path / "second"),
    ):
        assert first._closed
        assert len(optimizer._optimizer_step_post_hooks) == 1
    assert len(warnings_of(caplog)) == 1


def test_attaching_after_close_is_silent(tmp_path, caplog):
    model, optimizer = make_toy()
    trainmon.attach(model, optimizer, logdir=tmp_path / "first").close()
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        trainmon.attach(model, optimizer, logdir=tmp_path / "second").close()
    assert warnings_of(caplog) == []


# ---------------------------------------------------------------------------- attach's own keyword arguments
@pytest.mark.parametrize(
    ("keyword", "meant"),
    [
        ("logdri", "'logdir'"),
        ("log_dir", "'logdir'"),
        ("grad_acc", "'grad_acc_steps'"),
        ("gradscaler", "'grad_scaler'"),
        ("on_alrt", "'on_alert'"),
        ("start_iter", "'start_iteration' (or the config key 'start_step')"),
    ],
)
def test_a_misspelt_attach_argument_is_named(tmp_path, keyword, meant):
    model, optimizer = make_toy()
    with pytest.raises(ConfigError) as e:
        trainmon.attach(model, optimizer, **{keyword: 1})
    assert str(e.value) == (
        f"{keyword}: unknown keyword argument {keyword!r}; did you mean attach's argument {meant}? "
        "(attach's arguments: config, logdir, grad_acc_steps, start_iteration, grad_scaler, on_alert; "
        "any other keyword is a config key)"
    )
    assert _hook_counts(model, optimizer) == (0,) * (len(list(model.modules())) + 2)


def test_a_misspelt_config_key_still_suggests_the_config_key():
    model, optimizer = make_toy()
    with pytest.raises(ConfigError, match="unknown key 'xy_distrbution'; did you mean 'xy_distribution'"):
        trainmon.attach(model, optimizer, xy_distrbution=True)
    with pytest.raises(ConfigError, match="unknown key 'strat_step'; did you mean 'start_step'"):
        trainmon.attach(model, optimizer, strat_step=1)
