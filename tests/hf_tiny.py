"""The tiny Hugging Face models and data of the loop tests (no download): a config's shared sizes, a
2-layer Llama, and token batches whose item i is always the same."""

from __future__ import annotations

import torch

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def tiny_llama() -> torch.nn.Module:
    import transformers

    return transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**TINY))


class Tokens(torch.utils.data.Dataset):
    """``length`` sequences of 16 tokens, each its own labels."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(0, TINY["vocab_size"], (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}
