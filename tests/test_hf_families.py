"""Hugging Face's decoder models train bitwise with every statistic on (issue 51, point 4): tiny configs of
each family in ``FAMILIES`` (no download), two micro-batches a step, the losses and the final parameters
equal bit for bit to the same run without the monitor, and the input gradients of their RMSNorms (which
use their input twice on the residual stream) recorded."""

from __future__ import annotations

import pytest
import torch

import trainmon
from tests.conftest import FULL_COVERAGE
from tests.hf_tiny import TINY

transformers = pytest.importorskip("transformers")

STEPS, MICRO = 4, 2
COMMON = TINY
# family -> (config, a module whose input gradient is recorded)
FAMILIES = {
    "llama": (lambda: transformers.LlamaConfig(**COMMON), "model.layers.1.input_layernorm"),
    "qwen2": (lambda: transformers.Qwen2Config(**COMMON), "model.layers.1.post_attention_layernorm"),
    "qwen3": (lambda: transformers.Qwen3Config(**COMMON, head_dim=16), "model.layers.0.self_attn.q_norm"),
    "mistral": (lambda: transformers.MistralConfig(**COMMON), "model.layers.1.input_layernorm"),
    "gemma": (lambda: transformers.GemmaConfig(**COMMON, head_dim=16), "model.layers.1.input_layernorm"),
    "gpt2": (
        lambda: transformers.GPT2Config(
            vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0
        ),
        "transformer.h.1.ln_1",
    ),
    "mixtral": (
        lambda: transformers.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2),
        "model.layers.1.input_layernorm",
    ),
    "qwen3_moe": (
        lambda: transformers.Qwen3MoeConfig(
            **COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, head_dim=16
        ),
        "model.layers.1.input_layernorm",
    ),
}


def train(family: str, run=None, checkpointing: bool | None = None):
    """``checkpointing``: Hugging Face's gradient checkpointing, reentrant (True) or not (False)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(FAMILIES[family][0]())
    model.train()
    if checkpointing is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    monitor = None
    if run is not None:
        monitor = trainmon.attach(model, optimizer, config=FULL_COVERAGE, logdir=run, grad_acc_steps=MICRO)
    losses, rows = [], set()
    for step in range(STEPS):
        for micro in range(MICRO):
            ids = torch.randint(
                0, 128, (2, 16), generator=torch.Generator().manual_seed(step * MICRO + micro)
            )
            loss = model(input_ids=ids, labels=ids).loss
            if monitor is not None:
                monitor.track("loss", loss)
            (loss / MICRO).backward()
            losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
        if monitor is not None:
            rows |= set(monitor.latest().keys())
    if monitor is not None:
        monitor.close()
    return losses, [p.detach().clone() for p in model.parameters()], rows


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_family_trains_bitwise_with_every_statistic(tmp_path, family):
    losses, params, _ = train(family)
    monitored_losses, monitored_params, rows = train(family, tmp_path / "run")
    assert monitored_losses == losses
    assert all(torch.equal(a, b) for a, b in zip(params, monitored_params, strict=True))
    norm = FAMILIES[family][1]
    assert {f"actv_grad/{norm}.input_grad", f"actv/{norm}.input", f"grad_reduced/{norm}.weight"} <= rows


@pytest.mark.slow
@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_gradient_checkpointing_stays_bitwise_with_input_gradients(tmp_path, reentrant):
    """The layers' forward runs again inside backward: the input gradients are read from the recomputed
    graph's nodes."""
    losses, params, _ = train("llama", checkpointing=reentrant)
    monitored_losses, monitored_params, rows = train("llama", tmp_path / "run", checkpointing=reentrant)
    assert monitored_losses == losses
    assert all(torch.equal(a, b) for a, b in zip(params, monitored_params, strict=True))
    assert {f"actv_grad/model.layers.{i}.input_layernorm.input_grad" for i in (0, 1)} <= rows
