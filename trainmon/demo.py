"""A small GPT-style model trained on a learnable synthetic task, with an injected loss spike.

Used by ``trainmon demo`` and by tests; pure PyTorch, runs on the CPU in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        q, k, v = (
            t.view(batch, seq, self.heads, dim // self.heads).transpose(1, 2)
            for t in self.qkv(x).split(dim, dim=-1)
        )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(batch, seq, dim))


class MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    def __init__(
        self, vocab: int = 128, dim: int = 64, heads: int = 4, layers: int = 4, seq: int = 32
    ) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, dim)
        self.position = nn.Embedding(seq, dim)
        self.layers = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.final_norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embedding(tokens) + self.position(positions)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.final_norm(x))


@dataclass(frozen=True)
class DemoSetup:
    vocab: int = 128
    seq: int = 32
    batch: int = 16
    layers: int = 4
    dim: int = 64
    lr: float = 3e-3
    spike_step: int = 40
    spike_lr_factor: float = 50.0


def synthetic_batch(setup: DemoSetup, generator: torch.Generator) -> torch.Tensor:
    """Sequences with a per-sequence stride: learnable, so the loss falls before the spike."""
    start = torch.randint(0, setup.vocab, (setup.batch, 1), generator=generator)
    stride = torch.randint(1, 4, (setup.batch, 1), generator=generator)
    return (start + stride * torch.arange(setup.seq + 1)) % setup.vocab


def lm_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def build(setup: DemoSetup, seed: int = 0) -> tuple[TinyGPT, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = TinyGPT(setup.vocab, setup.dim, 4, setup.layers, setup.seq)
    return model, torch.optim.AdamW(model.parameters(), lr=setup.lr)


def learning_rate(setup: DemoSetup, step: int) -> float:
    """A constant rate, except at the spike step, whose rate is blown up: the injected loss spike."""
    return setup.lr * (setup.spike_lr_factor if step == setup.spike_step else 1.0)
