"""Text in, text out: one generation helper for the CLI, the service and attribution queries."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tokenizers import Tokenizer

from .model import PRISM
from .tokenizer import eos_id


@dataclass
class Generation:
    token_ids: list[int]  # the new tokens (the end-of-text token included when generation stopped on it)
    text: str  # the new tokens as text, without the end-of-text token
    stopped: bool  # generation ended on the end-of-text token


def generate(model: PRISM, tokenizer: Tokenizer, prompt_ids: list[int], max_new_tokens: int, *,
             temperature: float = 0.0, sample_top_k: int | None = None, seed: int = 0,
             suppress: list[int] | None = None) -> Generation:
    """Continue ``prompt_ids`` (the model sees their last ``block_size``): greedy at temperature 0,
    else sampled (seeded); ``suppress``: prototypes that contribute nothing to the logits."""
    eos = eos_id(tokenizer)
    x = torch.tensor([prompt_ids[-model.cfg.block_size:] or [eos]])
    sup = torch.tensor(sorted(set(suppress)), dtype=torch.long) if suppress else None
    temperature = temperature if temperature >= 1e-3 else 0.0  # 1/temperature must stay finite
    y = model.generate(x, max_new_tokens, temperature=temperature, sample_top_k=sample_top_k,
                       generator=torch.Generator().manual_seed(seed), stop_token=eos, suppress=sup)
    new = y[0, x.shape[1]:].tolist()
    return Generation(new, tokenizer.decode([i for i in new if i != eos]), bool(new and new[-1] == eos))
