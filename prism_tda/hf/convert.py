"""Between our objects and Hugging Face's: configs, the tokenizer, a PRISM module as an HF model."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from prism_tda.errors import CheckpointError, ConfigError
from prism_tda.model.config import ModelConfig
from prism_tda.model.tokenizer import EOS, eos_id

from .configuration import PrismConfig

if TYPE_CHECKING:
    from prism_tda.model.model import PRISM

    from .modeling import PrismForCausalLM

MODEL_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig))


def model_config(config: PrismConfig) -> ModelConfig:
    """The validated ``ModelConfig`` of a ``PrismConfig`` (errors name the field)."""
    return ModelConfig.from_dict({name: getattr(config, name) for name in MODEL_FIELDS},
                                 where=f"PrismConfig {config.name_or_path or ''}".strip())


def prism_config(cfg: ModelConfig, **extra: Any) -> PrismConfig:
    """A ``PrismConfig`` carrying ``cfg``'s fields; ``extra``: further keys (token ids, summaries)."""
    return PrismConfig(**cfg.to_dict(), **extra)


def hf_tokenizer(tokenizer: Tokenizer, block_size: int) -> PreTrainedTokenizerFast:
    """Our tokenizer as a ``PreTrainedTokenizerFast``: ``<|endoftext|>`` is its bos, eos and pad token
    (as GPT-2's), it pads on the right (PRISM has no padding mask) and decodes bytes as they are."""
    eos_id(tokenizer)  # raises CheckpointError when the tokenizer lacks <|endoftext|>
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=EOS, eos_token=EOS, pad_token=EOS, model_max_length=block_size,
        padding_side="right", clean_up_tokenization_spaces=False,
    )


def wrap(model: PRISM, tokenizer: Tokenizer | None = None, **extra: Any) -> PrismForCausalLM:
    """``model`` as a ``PrismForCausalLM`` over the same tensors (in ``model``'s train/eval mode). With
    ``tokenizer``, its ``<|endoftext|>`` id becomes the bos, eos and pad token id of config and
    generation config."""
    from transformers import GenerationConfig

    from .modeling import PrismForCausalLM

    if tokenizer is not None:
        eos = eos_id(tokenizer)
        if eos >= model.cfg.vocab_size:
            raise CheckpointError(f"tokenizer: {EOS} has id {eos}, beyond the model's vocab_size {model.cfg.vocab_size}")
        extra = {"bos_token_id": eos, "eos_token_id": eos, "pad_token_id": eos, **extra}
    unknown = sorted(set(extra) & set(MODEL_FIELDS))
    if unknown:
        raise ConfigError(f"wrap(): {unknown} are the model's own fields, given by model.cfg")
    hf = PrismForCausalLM(prism_config(model.cfg, **extra), prism=model)
    hf.train(model.training)
    if tokenizer is not None:
        hf.generation_config = GenerationConfig(
            bos_token_id=extra["bos_token_id"], eos_token_id=extra["eos_token_id"],
            pad_token_id=extra["pad_token_id"], do_sample=False, use_cache=False,
        )
    return hf
