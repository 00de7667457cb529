"""The GPU yardstick, kept in the repository so that bench/gpu_check.sh runs from it alone (a GPU machine gets
the repository, not ../shared/): the same model and steps as ../shared/bench/gpt_cuda.py, where the GPU
overhead goals are stated. A GPT-style model trained in bf16 autocast with AdamW (16 layers, d=1024, 16
heads, seq 1024, vocab 32768, ~270M parameters: ~50 ms a step on an H100).

    from gpt_cuda import make, batch, step
    model, opt = make()
    for i in range(n): step(model, opt, batch(i))
"""

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.ln2 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.h = h

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(D, dim=-1)
        q, k, v = (t.view(B, T, self.h, D // self.h).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, D))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab=32768, d=1024, h=16, layers=16, T=1024):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(T, d)
        self.blocks = nn.ModuleList(Block(d, h) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.emb(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


def make(layers=16, device="cuda", seed=0):
    torch.manual_seed(seed)
    m = GPT(layers=layers).to(device)
    return m, torch.optim.AdamW(m.parameters(), lr=1e-4)


def batch(i, B=8, T=1024, vocab=32768, device="cuda"):
    g = torch.Generator(device=device).manual_seed(i)
    return torch.randint(0, vocab, (B, T + 1), generator=g, device=device)


def step(m, opt, b):
    """One training step; the caller synchronises (torch.cuda.synchronize) around it when timing."""
    with torch.autocast(b.device.type, dtype=torch.bfloat16):
        logits = m(b[:, :-1])
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), b[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss
