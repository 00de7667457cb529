"""Accelerate (issue 51): ``trainmon.attach`` takes the optimizer ``accelerator.prepare`` hands back (an
``AcceleratedOptimizer``, which torch's step hooks cannot be put on) and watches the torch optimizer inside
it. Under ``accelerator.accumulate`` with 2 micro-batches a step: every optimizer step recorded, its
``grad_reduced`` norms those the update used, losses and parameters bitwise those without trainmon."""

from __future__ import annotations

import pytest
import torch

import trainmon
from tests.conftest import FULL_COVERAGE

accelerate = pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

STEPS, ACCUMULATE = 4, 2


def train(run=None):
    from accelerate.utils import set_seed

    set_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = transformers.AutoModelForCausalLM.from_config(config)
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATE)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert type(optimizer).__name__ == "AcceleratedOptimizer"
    monitor = None
    if run is not None:
        monitor = trainmon.attach(
            model, optimizer, config=FULL_COVERAGE, logdir=run, grad_acc_steps=ACCUMULATE
        )
    losses, used, recorded = [], [], []
    for i in range(STEPS * ACCUMULATE):
        ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(i))
        with accelerator.accumulate(model):
            loss = model(input_ids=ids, labels=ids).loss
            if monitor is not None:
                monitor.track("loss", loss)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                used.append({n: p.grad.double().norm().item() for n, p in model.named_parameters()})
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
        if monitor is not None and accelerator.sync_gradients:
            latest = monitor.latest()
            recorded.append((latest.step, dict(latest.items())))
    if monitor is not None:
        monitor.close()
    return losses, [p.detach().clone() for p in model.parameters()], used, recorded


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
