"""Accelerate (issue 51): ``trainmon.attach`` takes the optimizer ``accelerator.prepare`` hands back (an
``AcceleratedOptimizer``, which torch's step hooks cannot be put on) and watches the torch optimizer inside
it. Under ``accelerator.accumulate`` with 2 micro-batches a step: every optimizer step recorded, its
``grad_reduced`` norms those the update used, losses and parameters bitwise those without trainmon; a NaN
in micro-batch 0 or in the last one, with ``raise`` and ``skip``, never lands (the hashes of the parameters
and Adam's state)."""

from __future__ import annotations

import pytest
import torch

import trainmon
from tests.conftest import FULL_COVERAGE
from tests.hf_tiny import tiny_llama
from trainmon.anomaly.alerts import TrainingNaNError

accelerate = pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")
from tests.test_loops_huggingface import digest  # noqa: E402 - after the skips

STEPS, ACCUMULATE, NAN_STEP = 4, 2, 1


def train(run=None, nan_micro: int | None = None, on_nan: str = "continue"):
    from accelerate.utils import set_seed

    set_seed(0)
    model = tiny_llama()
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATE)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert type(optimizer).__name__ == "AcceleratedOptimizer"
    monitor = None
    if run is not None:
        config = {**FULL_COVERAGE, "alert": {"on_nan": on_nan, "rate_limit_s": 0}}
        monitor = trainmon.attach(model, optimizer, config=config, logdir=run, grad_acc_steps=ACCUMULATE)
    losses, used, recorded, hashes = [], [], [], []
    for i in range(STEPS * ACCUMULATE):
        ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(i))
        if i % ACCUMULATE == 0:
            hashes.append(digest(model, optimizer.optimizer))
        planted = (i // ACCUMULATE, i % ACCUMULATE) == (NAN_STEP, nan_micro)
        with accelerator.accumulate(model):
            embeds = model.model.embed_tokens(ids) * (float("nan") if planted else 1.0)
            loss = model(inputs_embeds=embeds, labels=ids).loss
            if monitor is not None:
                monitor.track("loss", loss)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                used.append({n: p.grad.double().norm().item() for n, p in model.named_parameters()})
            try:
                optimizer.step()
            except TrainingNaNError as error:
                monitor.close()
                return error, hashes, digest(model, optimizer.optimizer)
            optimizer.zero_grad()
        losses.append(loss.item())
        if monitor is not None and accelerator.sync_gradients:
            latest = monitor.latest()
            recorded.append((latest.step, dict(latest.items())))
    if monitor is not None:
        monitor.close()
    if nan_micro is not None:
        return None, hashes, digest(model, optimizer.optimizer)
    return losses, [p.detach().clone() for p in model.parameters()], used, recorded


@pytest.mark.slow
@pytest.mark.parametrize("micro", [0, ACCUMULATE - 1], ids=["micro_batch_0", "last_micro_batch"])
@pytest.mark.parametrize("action", ["raise", "skip"])
def test_a_nan_update_never_lands(tmp_path, micro, action):
    raised, hashes, last = train(tmp_path / "run", nan_micro=micro, on_nan=action)
    if action == "raise":
        assert raised is not None and "not applied" in str(raised)
        assert last == hashes[NAN_STEP] and len(hashes) == NAN_STEP + 1
    else:
        assert raised is None and len(hashes) == STEPS
        assert hashes[NAN_STEP + 1] == hashes[NAN_STEP]  # the NaN step changed nothing
        assert last != hashes[STEPS - 1]  # and the steps after it trained


@pytest.mark.slow
def test_the_wrapped_optimizer_is_watched_and_training_is_bitwise(tmp_path):
    losses, params, _, _ = train()
    monitored_losses, monitored_params, used, recorded = train(tmp_path / "run")
    assert monitored_losses == losses
    assert all(torch.equal(a, b) for a, b in zip(params, monitored_params, strict=True))
    assert [step for step, _ in recorded] == list(range(STEPS))
    for (_, rows), norms in zip(recorded, used, strict=True):
        for name, norm in norms.items():
            assert rows[f"grad_reduced/{name}"]["norm"] == pytest.approx(norm, rel=1e-5), name
