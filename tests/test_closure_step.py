"""``optimizer.step(closure)``: the closure's forward and backward run inside the step, after torch's step
pre-hooks (Lightning's automatic optimization runs the last micro-batch there; LBFGS calls it several
times). The gradients are read, and the NaN decision made, after the closure's backward and before the
update: the recorded gradients are the ones the update uses, and ``raise``/``skip`` keep a NaN update from
landing whichever micro-batch made the NaN (issue 51, point 1)."""

from __future__ import annotations

import math

import pytest
import torch

import trainmon
from tests.test_on_nan_before_update import Net, bitwise_equal, state_of
from trainmon.anomaly.alerts import TrainingNaNError

STEPS, MICRO = 4, 2
CONFIG = {"wg_distribution": True, "mv_distribution": True, "xy_distribution": True, "all_xy": True}


def batch(step: int, micro: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * step + micro))


def train(run=None, nan_at: tuple[int, int] | None = None, on_nan: str = "continue"):
    """Lightning's order: micro-batch 0 outside the step, the last one in the closure. Returns the losses,
    the gradient norms the update used (read at the closure's end), each step's state before and after it,
    the step at which TrainingNaNError arrived, and the monitor."""
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    monitor = None
    if run is not None:
        config = {**CONFIG, "alert": {"on_nan": on_nan, "rate_limit_s": 0}}
        monitor = trainmon.attach(model, optimizer, config=config, logdir=run, grad_acc_steps=MICRO)
    losses, norms, states, raised, recorded = [], [], [], None, []

    def micro_batch(step: int, micro: int) -> torch.Tensor:
        model.poison.armed = nan_at == (step, micro)
        loss = model(batch(step, micro)).pow(2).mean() / MICRO
        model.poison.armed = False
        if monitor is not None:
            monitor.track("loss", loss)
        loss.backward()
        losses.append(loss.item())
        return loss

    for step in range(STEPS):
        micro_batch(step, 0)

        def closure(step: int = step) -> torch.Tensor:
            loss = micro_batch(step, MICRO - 1)
            norms.append({n: p.grad.norm().item() for n, p in model.named_parameters()})
            return loss

        before = state_of(model, optimizer)
        try:
            optimizer.step(closure)
        except TrainingNaNError:
            raised = step
            states.append((before, state_of(model, optimizer)))
            break
        states.append((before, state_of(model, optimizer)))
        optimizer.zero_grad()
        if monitor is not None:
            latest = monitor.latest()
            recorded.append(
                {k.split("/", 1)[1]: v["norm"] for k, v in latest.items() if k.startswith("grad_reduced/")}
            )
    if monitor is not None:
        monitor.close()
    return losses, norms, states, raised, recorded


def test_the_gradients_read_are_the_ones_the_update_uses_and_training_is_unchanged(tmp_path):
    plain_losses, plain_norms, plain_states, _, _ = train()
    losses, norms, states, _, recorded = train(tmp_path / "run")
    assert losses == plain_losses  # bitwise
    assert bitwise_equal(states[-1][1], plain_states[-1][1])
    assert len(recorded) == STEPS
    for step in range(STEPS):  # both micro-batches in the gradients, as the update takes them
        assert recorded[step] == pytest.approx(norms[step], rel=1e-6), step


@pytest.mark.parametrize("micro", [0, MICRO - 1], ids=["micro_batch_0", "last_micro_batch"])
def test_raise_keeps_the_nan_update_from_landing(tmp_path, micro):
    _, _, states, raised, _ = train(tmp_path / "run", nan_at=(2, micro), on_nan="raise")
    assert raised == 2
    before, after = states[-1]
    assert bitwise_equal(before, after)  # parameters, Adam's moments and step count as before the step


@pytest.mark.parametrize("micro", [0, MICRO - 1], ids=["micro_batch_0", "last_micro_batch"])
def test_skip_leaves_the_nan_step_out_and_training_goes_on(tmp_path, micro):
    _, _, states, raised, _ = train(tmp_path / "run", nan_at=(2, micro), on_nan="skip")
    assert raised is None and len(states) == STEPS
    assert bitwise_equal(*states[2])  # the NaN step: nothing changed
    for step in (0, 1, 3):  # the others updated, Adam counting 1, 2, then 3 again after the skip
        before, after = states[step]
        assert not bitwise_equal(before["params"], after["params"])
        counts = {float(s["step"]) for s in after["optim"]["state"].values()}
        assert counts == {min(step, 2) + 1.0}, step


def test_lbfgs_calls_its_closure_again_and_a_skipped_step_stays_skipped(tmp_path):
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=4)
    config = {"wg_distribution": True, "alert": {"on_nan": "skip", "rate_limit_s": 0}}
    calls = []
    with trainmon.attach(model, optimizer, config=config, logdir=tmp_path / "run") as monitor:
        for step in range(3):

            def closure(step: int = step) -> torch.Tensor:
                optimizer.zero_grad()
                model.poison.armed = step == 1
                loss = model(batch(step, 0)).pow(2).mean()
                model.poison.armed = False
                loss.backward()
                calls.append(step)
                return loss

            before = state_of(model, optimizer)
            optimizer.step(closure)
            if step == 1:
                assert bitwise_equal(before["params"], state_of(model, optimizer)["params"])
            else:
                assert not bitwise_equal(before["params"], state_of(model, optimizer)["params"])
            latest = monitor.latest()
            assert latest.step == step
            norm = latest["grad_reduced/fc1.weight"]["norm"]
            assert math.isnan(norm) or step == 1 or norm > 0
    assert calls.count(0) > 1  # LBFGS evaluated the closure several times in a step
