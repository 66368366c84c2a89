"""Text in, text out: one generation helper for the CLI, the service and attribution queries."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from tokenizers import Tokenizer

from prism_tda.errors import check_stop

from .model import PRISM
from .tokenizer import eos_id


@dataclass
class Generation:
    token_ids: list[int]  # the new tokens (the end-of-text token included when generation stopped on it)
    text: str  # the new tokens as text, without the end-of-text token
    stopped: bool  # generation ended on the end-of-text token


def generate(model: PRISM, tokenizer: Tokenizer, prompt_ids: list[int], max_new_tokens: int, *,
             temperature: float = 0.0, sample_top_k: int | None = None, seed: int = 0,
             suppress: list[int] | dict[int, float] | None = None, alpha: float = 0.0,
             gate: float | None = None, gate_window: int = 16, stop: threading.Event | None = None) -> Generation:
    """Continue ``prompt_ids`` (the model sees their last ``block_size``): greedy at temperature 0,
    else sampled (seeded). ``suppress``: prototypes whose activations are scaled by ``alpha`` (0: they
    contribute nothing to the logits), or a mapping of prototype id to its own alpha. ``gate``: scale them only
    where the context carries them, their share of the activation mass over the last ``gate_window``
    positions at least ``gate`` (:meth:`PRISM.suppression_gate`); None: everywhere. ``stop``: checked
    before each new token (``Cancelled``)."""
    eos = eos_id(tokenizer)
    x = torch.tensor([prompt_ids[-model.cfg.block_size:] or [eos]])
    scale = suppress if isinstance(suppress, dict) else dict.fromkeys(suppress or (), float(alpha))
    scale = {i: a for i, a in scale.items() if a != 1.0}  # alpha 1 is the model as it is
    sup = torch.tensor(sorted(scale), dtype=torch.long) if scale else None
    alphas = torch.tensor([scale[i] for i in sorted(scale)], dtype=torch.float32) if scale else 0.0
    temperature = temperature if temperature >= 1e-3 else 0.0  # 1/temperature must stay finite
    y = model.generate(x, max_new_tokens, temperature=temperature, sample_top_k=sample_top_k,
                       generator=torch.Generator().manual_seed(seed), stop_token=eos, suppress=sup, alpha=alphas,
                       gate=gate, gate_window=gate_window,
                       on_step=None if stop is None else lambda _: check_stop(stop, "the generation"))
    new = y[0, x.shape[1]:].tolist()
    return Generation(new, tokenizer.decode([i for i in new if i != eos]), bool(new and new[-1] == eos))
