"""A small torchtitan-style Llama and torchtitan-style parallelisation, for CPU/gloo tests.

Self-contained (torch only).  The module tree mirrors torchtitan's llama3 so
parameter names look like a real torchtitan run:

    tok_embeddings.weight
    layers.<i>.attention_norm.weight
    layers.<i>.attention.{wq,wk,wv,wo}.weight
    layers.<i>.ffn_norm.weight
    layers.<i>.feed_forward.{w1,w2,w3}.weight
    norm.weight
    output.weight

Parallelisation helpers follow torchtitan's order: apply_tp -> apply_compile ->
apply_fsdp (per block, then root).  All run on CPU with the gloo backend:

    model, opt = make(dim=64, n_layers=2, ...)               # 1 process
    apply_tp(model, mesh["tp"])                                # tensor parallel
    apply_compile(model, "aot_eager")                          # per-block compile
    apply_fsdp(model, mesh["dp"])                              # FSDP2
    loss = train_step(model, opt, batch(0), dp_group=...)

CPU/gloo notes (verified on torch 2.13.0+cpu, gloo, 2-4 ranks on 2 cores):
  * Plain FSDP2 works on gloo (fp32 grads are reduce-scattered with
    ReduceOp.AVG, which gloo accepts).  But once a gradient divide factor is
    set (torchtitan calls set_gradient_divide_factor(1.0)), FSDP2 switches to
    ReduceOp.PREMUL_SUM and gloo fails with "Cannot use ReduceOp.PREMUL_SUM
    with Gloo"; apply_fsdp(..., force_sum_reduction=True) avoids that (SUM +
    local division, same result).
  * FSDP2 uneven shards are fine (it pads), e.g. vocab 255 over 2 ranks.
  * TP with SequenceParallel shards the sequence dim: seq_len must be divisible
    by the TP degree, otherwise gloo aborts the process ("Received data size
    doesn't match expected size", gloo::EnforceNotMet -> terminate).  n_heads
    and n_kv_heads must be divisible by the TP degree in all TP variants.
  * TP+SequenceParallel combined with per-block compile on backend
    "aot_eager" fails in backward ("'Tensor' object has no attribute
    '_local_tensor'" in DTensor redistribute backward); backend "eager" or
    sequence_parallel=False work.  FSDP2 + aot_eager per-block compile works.
  * FSDP2 on top of TP (2-D mesh) warns that the root returned a view
    (the replicated logits come from DTensor.to_local()); harmless here since
    nothing modifies the logits in place.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "ModelArgs",
    "RMSNorm",
    "Attention",
    "FeedForward",
    "TransformerBlock",
    "Transformer",
    "apply_tp",
    "pipeline_stage",
    "apply_fsdp",
    "apply_compile",
    "make",
    "batch",
    "train_step",
    "init_dist",
]


# --------------------------------------------------------------------------- model


@dataclass
class ModelArgs:
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = 2  # None -> n_heads (plain MHA)
    vocab_size: int = 256
    multiple_of: int = 32  # FFN hidden size is rounded up to this
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 64


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in float32."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        # tests plant a NaN/Inf here (a 0-dim tensor the output is multiplied by), also inside compiled
        # blocks, whose code never sees a hook registered after they were compiled; a tensor, not a float,
        # so that compiled code takes it as an input (a NaN float would fail its guard at every call)
        self.poison: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = y.type_as(x) * self.weight
        if self.poison is not None:
            out = out * self.poison
        return out

    def reset_parameters(self):
        nn.init.ones_(self.weight)


def rope_table(head_dim: int, max_len: int, theta: float) -> torch.Tensor:
    """Rotary table of shape (max_len, head_dim // 2, 2) holding (cos, sin)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    ang = torch.outer(torch.arange(max_len, dtype=torch.float32), inv)
    return torch.stack((ang.cos(), ang.sin()), dim=-1)


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive channel pairs (x0,x1),(x2,x3),... of x (B, L, H, D).

    Same maths as multiplying by exp(i*angle) in a complex view of the pairs,
    but real-valued (plays well with DTensor, compile and gloo)."""
    B, L, H, D = x.shape
    xp = x.float().reshape(B, L, H, D // 2, 2)
    cos = table[:L, None, :, 0]
    sin = table[:L, None, :, 1]
    a, b = xp[..., 0], xp[..., 1]
    out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1)
    return out.reshape(B, L, H, D).type_as(x)


class Attention(nn.Module):
    """Causal grouped-query attention; heads inferred from the (possibly
    tensor-parallel-sharded) projection width, so the same code runs
    unsharded and under ColwiseParallel."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads or args.n_heads
        assert self.n_heads % self.n_kv_heads == 0
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        B, L = x.shape[0], x.shape[1]
        q = self.wq(x).view(B, L, -1, self.head_dim)  # -1: local heads under TP
        k = self.wk(x).view(B, L, -1, self.head_dim)
        v = self.wv(x).view(B, L, -1, self.head_dim)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, L, D)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        return self.wo(o.transpose(1, 2).reshape(B, L, -1))

    def init_weights(self, std: float):
        for lin in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(lin.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=std)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int, multiple_of: int, mult: float | None):
        super().__init__()
        hidden = int(2 * hidden / 3)
        if mult is not None:
            hidden = int(mult * hidden)
        hidden = multiple_of * ((hidden + multiple_of - 1) // multiple_of)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, std: float):
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        for lin in (self.w2, self.w3):
            nn.init.trunc_normal_(lin.weight, mean=0.0, std=std)


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, 4 * args.dim, args.multiple_of, args.ffn_dim_multiplier)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        # depth-scaled init for the output projections, as in torchtitan
        self.weight_init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self):
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)
        self.feed_forward.init_weights(self.weight_init_std)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.register_buffer(
            "rope", rope_table(args.dim // args.n_heads, args.max_seq_len, args.rope_theta), persistent=False
        )
        self.init_weights()

    def init_weights(self):
        nn.init.normal_(self.tok_embeddings.weight)
        for block in self.layers.values():
            block.init_weights()
        self.norm.reset_parameters()
        bound = 3 * self.args.dim**-0.5
        nn.init.trunc_normal_(self.output.weight, mean=0.0, std=self.args.dim**-0.5, a=-bound, b=bound)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # a pipeline stage (pipeline_stage) lacks the modules of the other stages, as in torchtitan
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for block in self.layers.values():
            h = block(h, self.rope)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h).float() if self.output is not None else h


def pipeline_stage(model: Transformer, stage: int, stages: int) -> Transformer:
    """Keep the part of ``model`` that pipeline stage ``stage`` of ``stages`` runs, in place, the way
    torchtitan splits its models: an even share of the blocks (their names unchanged), the embedding on
    the first stage, the final norm and the output on the last."""
    names = list(model.layers)
    share = -(-len(names) // stages)
    for name in names[: stage * share] + names[(stage + 1) * share :]:
        del model.layers[name]
    if stage > 0:
        model.tok_embeddings = None
    if stage < stages - 1:
        model.norm = model.output = None
    return model


# --------------------------------------------------------------------------- parallelism


def apply_tp(
    model: Transformer, tp_mesh, sequence_parallel: bool = True, vocab_parallel: bool = True
) -> Transformer:
    """Megatron-style TP the way torchtitan plans it for llama3.

    Per block: attention.wq/wk/wv ColwiseParallel, attention.wo RowwiseParallel,
    feed_forward.w1/w3 ColwiseParallel, feed_forward.w2 RowwiseParallel.  With
    sequence_parallel (torchtitan's default) the residual stream between blocks
    is sharded on the sequence dim (Shard(1)): the norms run under
    SequenceParallel, PrepareModuleInput all-gathers the normed activations
    (Shard(1) -> Replicate) before attention / feed_forward, and wo / w2
    reduce-scatter back to Shard(1).  Root: tok_embeddings RowwiseParallel
    (vocab-sharded table), norm SequenceParallel, output ColwiseParallel that
    returns replicated full logits (no loss parallel).

    sequence_parallel=False is the simpler variant: no SequenceParallel, the
    residual stream is replicated, wo / w2 all-reduce; tok_embeddings is still
    vocabulary-parallel (its output reduced to Replicate) and output
    column-parallel (replicated logits), as in torchtitan's plan; with
    vocab_parallel=False those two stay plain replicated modules (compiled
    blocks then receive plain tensors: see the module docstring).
    Constraints: n_heads, n_kv_heads divisible by the TP degree; with
    sequence_parallel also seq_len divisible by it.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    tp = tp_mesh.size()
    a = model.args
    assert a.n_heads % tp == 0 and (a.n_kv_heads or a.n_heads) % tp == 0, (
        "n_heads and n_kv_heads must be divisible by the TP degree"
    )

    def present(plan: dict) -> dict:  # a pipeline stage lacks some of the root's modules
        return {name: style for name, style in plan.items() if getattr(model, name) is not None}

    if sequence_parallel:
        parallelize_module(
            model,
            tp_mesh,
            present(
                {
                    "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
                    "norm": SequenceParallel(),
                    "output": ColwiseParallel(
                        input_layouts=Shard(1), output_layouts=Replicate(), use_local_output=True
                    ),
                }
            ),
        )
        for block in model.layers.values():
            parallelize_module(
                block,
                tp_mesh,
                {
                    "attention_norm": SequenceParallel(),
                    "attention": PrepareModuleInput(
                        input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
                    ),
                    "attention.wq": ColwiseParallel(),
                    "attention.wk": ColwiseParallel(),
                    "attention.wv": ColwiseParallel(),
                    "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                    "ffn_norm": SequenceParallel(),
                    "feed_forward": PrepareModuleInput(
                        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                    ),
                    "feed_forward.w1": ColwiseParallel(),
                    "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
                    "feed_forward.w3": ColwiseParallel(),
                },
            )
    else:
        if vocab_parallel:
            parallelize_module(
                model,
                tp_mesh,
                present(
                    {
                        "tok_embeddings": RowwiseParallel(
                            input_layouts=Replicate(), output_layouts=Replicate()
                        ),
                        "output": ColwiseParallel(output_layouts=Replicate(), use_local_output=True),
                    }
                ),
            )
        for block in model.layers.values():
            parallelize_module(
                block,
                tp_mesh,
                {
                    "attention.wq": ColwiseParallel(),
                    "attention.wk": ColwiseParallel(),
                    "attention.wv": ColwiseParallel(),
                    "attention.wo": RowwiseParallel(),
                    "feed_forward.w1": ColwiseParallel(),
                    "feed_forward.w2": RowwiseParallel(),
                    "feed_forward.w3": ColwiseParallel(),
                },
            )
    return model


def apply_compile(model: Transformer, backend: str = "aot_eager", fullgraph: bool = True) -> Transformer:
    """Per-block compile in place (nn.Module.compile), like torchtitan 0.3.

    Module.compile() keeps the block object in model.layers, so parameter names
    stay clean (no '_orig_mod.' segment) and hooks registered on submodules
    keep working.  Call after apply_tp and before apply_fsdp (torchtitan's
    order).  backend "aot_eager" runs on CPU without a C++ toolchain.
    """
    for block in model.layers.values():
        block.compile(backend=backend, fullgraph=fullgraph)
    return model


def apply_fsdp(
    model: Transformer,
    dp_mesh,
    mp_policy=None,
    reshard_after_forward: bool = True,
    force_sum_reduction: bool = False,
) -> Transformer:
    """FSDP2: fully_shard each block, then the root (which picks up
    tok_embeddings, norm and output), like torchtitan (which also leaves the
    last block un-resharded since the root all-gathers right after).

    mp_policy: a torch MixedPrecisionPolicy or a dict of its kwargs (e.g.
    dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)).
    force_sum_reduction: reduce gradients with ReduceOp.SUM and divide locally.
    Not needed for plain FSDP2 on gloo (AVG works), but required on gloo if you
    also call set_gradient_divide_factor(...) like torchtitan does, since FSDP2
    then uses ReduceOp.PREMUL_SUM, which gloo rejects.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kw = {"mesh": dp_mesh}
    if mp_policy is not None:
        kw["mp_policy"] = (
            mp_policy if isinstance(mp_policy, MixedPrecisionPolicy) else MixedPrecisionPolicy(**mp_policy)
        )
    n = len(model.layers)
    for i, block in enumerate(model.layers.values()):
        # like torchtitan: the last block is not resharded after forward
        # (its parameters are needed again right away in backward)
        fully_shard(block, reshard_after_forward=reshard_after_forward and i < n - 1, **kw)
    fully_shard(model, reshard_after_forward=reshard_after_forward, **kw)
    if force_sum_reduction:
        for m in model.modules():
            if hasattr(m, "set_force_sum_reduction_for_comms"):
                m.set_force_sum_reduction_for_comms(True)
    return model


# --------------------------------------------------------------------------- helpers


def init_dist(backend: str = "gloo"):
    """init_process_group from torchrun/spawn env (MASTER_ADDR defaults to
    127.0.0.1 so only loopback is used).  Returns (rank, world_size)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    if not dist.is_initialized():
        dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size()


def make(
    dim: int = 64,
    n_layers: int = 2,
    n_heads: int = 4,
    n_kv_heads: int | None = 2,
    vocab_size: int = 256,
    max_seq_len: int = 64,
    seed: int = 0,
    lr: float = 1e-3,
    tp_mesh=None,
    dp_mesh=None,
    compile_backend: str | None = None,
    mp_policy=None,
    sequence_parallel: bool = True,
    build_optimizer: bool = True,
    **model_kw,
):
    """Build the model with a fixed seed (identical init on every rank), then
    parallelise torchtitan-style (TP -> compile -> FSDP) and build AdamW.
    Returns (model, optimizer or None)."""
    torch.manual_seed(seed)
    args = ModelArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        vocab_size=vocab_size,
        max_seq_len=max_seq_len,
        **model_kw,
    )
    model = Transformer(args)
    if tp_mesh is not None:
        apply_tp(model, tp_mesh, sequence_parallel=sequence_parallel)
    if compile_backend is not None:
        apply_compile(model, compile_backend)
    if dp_mesh is not None:
        apply_fsdp(model, dp_mesh, mp_policy=mp_policy)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, foreach=False) if build_optimizer else None
    return model, opt


def batch(
    i: int,
    batch_size: int = 4,
    seq_len: int = 32,
    vocab_size: int = 256,
    dp_rank: int = 0,
    dp_size: int = 1,
    seed: int = 1234,
):
    """Deterministic global batch number i (same on every rank), sliced to this
    DP rank.  Returns (inputs, labels), each (batch_size // dp_size, seq_len)."""
    assert batch_size % dp_size == 0, "batch_size must be divisible by the DP size"
    g = torch.Generator().manual_seed(seed + i)
    toks = torch.randint(0, vocab_size, (batch_size, seq_len + 1), generator=g)
    per = batch_size // dp_size
    toks = toks[dp_rank * per : (dp_rank + 1) * per]
    return toks[:, :-1].contiguous(), toks[:, 1:].contiguous()


def train_step(model: nn.Module, opt, data, dp_group=None, max_norm: float | None = None):
    """One step: forward, mean cross entropy, backward, (clip), step, zero_grad.

    Returns the loss as a float averaged over dp_group (equal-size shards make
    this the global-batch mean, comparable with a single-process run)."""
    inputs, labels = data
    logits = model(inputs)
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    loss.backward()
    if max_norm is not None:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, foreach=True)
        if hasattr(norm, "full_tensor"):
            norm.full_tensor()
    opt.step()
    opt.zero_grad(set_to_none=True)
    out = loss.detach().clone()
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=dp_group)
        out /= dist.get_world_size(dp_group)
    return out.item()
