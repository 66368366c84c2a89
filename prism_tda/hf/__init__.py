"""PRISM in Hugging Face transformers: ``PrismConfig``, ``PrismForCausalLM``, export to a model directory.

Importing this package registers ``model_type`` "prism" with ``AutoConfig`` and
``AutoModelForCausalLM`` (``import prism_tda`` does it too when transformers is already imported), so
``AutoModelForCausalLM.from_pretrained(DIR)`` loads an export (``prism export --format hf``) in-process.
An export also ships standalone code, for ``trust_remote_code=True`` without prism_tda. See
docs/huggingface.md.
"""

from __future__ import annotations

from transformers import AutoConfig, AutoModelForCausalLM

from .configuration import PrismConfig
from .convert import hf_tokenizer, model_config, prism_config, wrap
from .export import export_hf
from .modeling import PrismCausalLMOutput, PrismForCausalLM

__all__ = ["PrismCausalLMOutput", "PrismConfig", "PrismForCausalLM", "export_hf", "hf_tokenizer",
           "model_config", "prism_config", "register", "wrap"]

_registered = False


def register() -> None:
    """Register "prism" with ``AutoConfig`` and ``AutoModelForCausalLM`` (once per process)."""
    global _registered
    if _registered:
        return
    AutoConfig.register(PrismConfig.model_type, PrismConfig, exist_ok=True)
    AutoModelForCausalLM.register(PrismConfig, PrismForCausalLM, exist_ok=True)
    _registered = True


register()
