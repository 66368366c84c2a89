"""``PrismForCausalLM``: our :class:`PRISM` module as a Hugging Face causal language model.

The wrapper holds no tensors of its own: PRISM's sub-modules (``wte``, ``wpe``, ``blocks``, ``ln_f``,
``head``) are registered on it under their own names, so its state-dict keys are a PRISM checkpoint's
(``model.safetensors`` reads both ways) and ``forward`` is :meth:`PRISM.forward`.

- **No KV cache.** PRISM's attention keeps none, so ``generate`` recomputes the whole context at
  every step (``_supports_default_dynamic_cache`` is False; ``use_cache`` is accepted and ignored).
  That costs one forward over at most ``block_size`` tokens per new token.
- **Context.** ``generate`` crops the context to its last ``block_size`` tokens, as ``PRISM.generate``
  does; ``forward`` refuses longer inputs (positions are learned up to ``block_size``).
- **Padding.** There is no padding mask inside the model: an ``attention_mask`` may only pad on the
  right (causal attention never lets a real token see those positions).
- **Prototypes.** ``output_prototypes=True`` returns each position's active prototype ids and
  activations; :meth:`PrismForCausalLM.suppress` (a context manager) or ``suppress_prototypes=[...]``
  zero prototypes' contributions to the logits, exactly as ``PRISM.forward(suppress=...)``;
  ``suppress(ids, alpha=a)`` scales them by ``a`` instead (0 removes, 1 leaves, above 1 boosts), and
  ``suppress(ids, gate=g)`` only where the context carries them (``PRISM.suppression_gate``).

This module imports only torch, transformers and the PRISM module: an export ships a standalone
copy of it (``prism_tda/hf/standalone.py``) as ``modeling_prism.py``.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from prism_tda.model.model import PRISM, check_gate

from .configuration import PrismConfig
from .convert import model_config

# Files of an export directory that save_pretrained carries over from the directory the model was loaded
# from: the training record (which documents the weights were trained on) and the standalone code.
CARRIED_FILES = ("training_record.safetensors", "configuration_prism.py", "modeling_prism.py")


@dataclass
class PrismCausalLMOutput(CausalLMOutputWithPast):
    """``CausalLMOutputWithPast`` plus the prototype code of every position (``output_prototypes=True``).

    ``prototype_ids`` (B, T, k): the active prototypes, by descending similarity; ``prototype_acts``
    (B, T, k): their activations ``a_{t,i} >= 0`` (0 where the similarity was not positive). They are the
    unsuppressed model's: suppression removes contributions from the logits, not prototypes from the code.
    """

    prototype_ids: torch.LongTensor | None = None
    prototype_acts: torch.FloatTensor | None = None


class PrismForCausalLM(PreTrainedModel, GenerationMixin):
    """A PRISM decoder for ``AutoModelForCausalLM``, ``generate`` and the ``Trainer``.

    ``PrismForCausalLM(config)`` builds a fresh PRISM; ``PrismForCausalLM(config, prism=module)`` wraps an
    existing one (its tensors, not a copy). With ``labels`` the loss is PRISM's training loss
    ``L_CE + lam_rec L_REC + lam_1 L_R1 + lam_2 L_R2``, so fine-tuning keeps the prototypes grounded.
    """

    config_class = PrismConfig
    main_input_name = "input_ids"
    _no_split_modules = ["Block"]
    _supports_cache_class = False  # no KV cache (transformers 4.x)
    _supports_static_cache = False
    # The loss is a mean over the batch's tokens: the Trainer divides it by the accumulation steps itself
    # (rather than passing num_items_in_batch, which this forward would ignore).
    accepts_loss_kwargs = False
    prism: PRISM  # the wrapped module (in __dict__, not a sub-module)

    def __init__(self, config: PrismConfig, prism: PRISM | None = None) -> None:
        super().__init__(config)
        prism = prism if prism is not None else PRISM(model_config(config))
        for name, module in prism.named_children():
            self.add_module(name, module)
        self.__dict__["prism"] = prism  # not a sub-module: its modules are registered above
        self._alphas: dict[int, float] = {}  # prototype id -> its activations' factor, inside suppress()
        self._gate: tuple[float, int] | None = None  # (share, window) of the innermost gated block
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # no KV cache: generate passes the whole (cropped) context every step

    def _init_weights(self, module: torch.nn.Module) -> None:
        """Nothing: PRISM initialises its own weights when built, and a checkpoint holds every tensor."""

    def train(self, mode: bool = True) -> PrismForCausalLM:
        super().train(mode)
        self.prism.training = mode
        return self

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.prism.wte

    def set_input_embeddings(self, value: torch.nn.Module) -> None:
        self.prism.wte = value  # type: ignore[assignment]
        self.wte = value

    def get_output_embeddings(self) -> None:
        return None  # the unembedding W is the input embedding itself

    # ------------------------------------------------------------------------------ suppression
    @property
    def suppressed_prototypes(self) -> tuple[int, ...]:
        """The prototypes the enclosing :meth:`suppress` blocks zero, ascending."""
        return tuple(sorted(i for i, a in self._alphas.items() if a == 0.0))

    @property
    def prototype_alphas(self) -> dict[int, float]:
        """Every prototype the enclosing :meth:`suppress` blocks scale, with its factor."""
        return dict(sorted(self._alphas.items()))

    @contextmanager
    def suppress(self, prototype_ids: Iterable[int], alpha: float = 0.0, *, gate: float | None = None,
                 gate_window: int = 16) -> Iterator[PrismForCausalLM]:
        """Inside the block, every forward (and so ``generate`` or a hand-written loop) scales these
        prototypes' activations by ``alpha`` before mixing: ``l_t = W z_t + sum_{i in K_t & S} (alpha - 1)
        a_{t,i} W p_i``. ``alpha`` 0 (the default) gives them no part in the logits, 1 leaves the model as it
        is, above 1 boosts them. Nested blocks multiply. ``gate`` (conditional steering): every scaled
        prototype is scaled only where their share of the activation mass, averaged over the last
        ``gate_window`` positions, is at least ``gate`` (``PRISM.suppression_gate``); the innermost gated
        block's gate holds. The state is the model's: do not share one model between threads while
        suppressing."""
        ids = self._check_prototypes(prototype_ids)
        alpha = float(alpha)
        if not (alpha >= 0.0 and alpha < float("inf")):
            raise ValueError(f"alpha: must be finite and >= 0, got {alpha}")
        before, gate_before = dict(self._alphas), self._gate
        for i in set(ids):
            self._alphas[i] = self._alphas.get(i, 1.0) * alpha
        self._set_gate(gate, gate_window)
        try:
            yield self
        finally:
            self._alphas, self._gate = before, gate_before

    def _set_gate(self, gate: float | None, window: int) -> None:
        if gate is None:
            return
        check_gate(float(gate), int(window))
        self._gate = (float(gate), int(window))

    @contextmanager
    def steer(self, prototype_alphas: dict[int, float], *, gate: float | None = None,
              gate_window: int = 16) -> Iterator[PrismForCausalLM]:
        """Like :meth:`suppress`, with a strength per prototype: ``{id: alpha}``, e.g. a controller's (the
        ``alpha`` of a ``prism control fit`` file, keys as ints). Nested blocks multiply; ``gate`` as there."""
        ids = self._check_prototypes(list(prototype_alphas))
        alphas = {i: float(prototype_alphas[i]) for i in ids}
        if any(not (a >= 0.0 and a < float("inf")) for a in alphas.values()):
            raise ValueError("alpha: must be finite and >= 0")
        before, gate_before = dict(self._alphas), self._gate
        for i, a in alphas.items():
            self._alphas[i] = self._alphas.get(i, 1.0) * a
        self._set_gate(gate, gate_window)
        try:
            yield self
        finally:
            self._alphas, self._gate = before, gate_before

    def _check_prototypes(self, prototype_ids: Iterable[int] | torch.Tensor) -> list[int]:
        if self.prism.head is None:
            raise ValueError("suppress_prototypes: this is the dense baseline, it has no prototypes")
        ids = [int(i) for i in (prototype_ids.reshape(-1).tolist() if torch.is_tensor(prototype_ids)
                                else prototype_ids)]
        K = self.prism.head.n_prototypes
        bad = [i for i in ids if not 0 <= i < K]
        if bad:
            raise ValueError(f"suppress_prototypes: ids {bad[:5]} are not in [0, {K})")
        return ids

    def _suppress_tensor(self, extra: Iterable[int] | torch.Tensor | None,
                         device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(ids, alphas) of every scaled prototype: the enclosing blocks', and ``extra`` at 0."""
        alphas = dict(self._alphas)
        alphas.update(dict.fromkeys(self._check_prototypes(extra) if extra is not None else (), 0.0))
        alphas = {i: a for i, a in alphas.items() if a != 1.0}
        if not alphas:
            return None
        ids = sorted(alphas)
        return (torch.tensor(ids, dtype=torch.long, device=device),
                torch.tensor([alphas[i] for i in ids], dtype=torch.float32))

    # ------------------------------------------------------------------------------ forward
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        *,
        output_prototypes: bool | None = None,
        suppress_prototypes: Iterable[int] | torch.Tensor | None = None,
        logits_to_keep: int = 0,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> PrismCausalLMOutput | tuple:
        """Logits (B, T, V) of ``input_ids`` (B, T), T <= block_size.

        ``labels`` (B, T): the inputs themselves, -100 where ignored (shifted inside, as every HF causal
        LM); the loss is PRISM's training loss. ``logits_to_keep``: only the last n positions' logits (0:
        all). ``output_hidden_states``: ``hidden_states`` is ``(z,)``, the final hidden state after the final
        norm (the one the prototype head reads). ``use_cache`` and other generation arguments are ignored.
        """
        if inputs_embeds is not None or input_ids is None:
            raise ValueError("PRISM takes input_ids (inputs_embeds are not supported)")
        if kwargs.get("position_ids") is not None:
            raise ValueError("position_ids: PRISM's positions are 0..T-1 of each row (learned, absolute); "
                             "pass one sequence per row instead of packed ones")
        _check_right_padded(attention_mask)
        suppress = self._suppress_tensor(suppress_prototypes, input_ids.device)
        if suppress is not None and labels is not None:
            raise ValueError("suppress_prototypes is for inference: no labels while prototypes are suppressed")
        want_protos = bool(output_prototypes)
        if want_protos and self.prism.head is None:
            raise ValueError("output_prototypes: this is the dense baseline, it has no prototypes")
        targets = None
        if labels is not None:
            # PRISM's targets are the next tokens (ignore_index -1): shift, and ignore the last position
            targets = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), -100)], dim=1)
            targets = targets.masked_fill(targets == -100, -1)
        last_only = logits_to_keep == 1 and targets is None and not want_protos
        out = self.prism(input_ids, targets, last_only=last_only, return_head=want_protos and suppress is None,
                         suppress=suppress[0] if suppress is not None else None,
                         alpha=suppress[1] if suppress is not None else 0.0,
                         gate=self._gate[0] if self._gate is not None else None,
                         gate_window=self._gate[1] if self._gate is not None else 16)
        logits = out.logits
        assert logits is not None and out.z is not None
        if logits_to_keep and not last_only:
            logits = logits[:, -logits_to_keep:]
        result = PrismCausalLMOutput(loss=out.loss, logits=logits)
        if output_hidden_states:
            result.hidden_states = (out.z,)
        if want_protos:
            B, T, d = out.z.shape
            assert self.prism.head is not None
            head = out.head if out.head is not None else self.prism.head(out.z.reshape(-1, d))
            result.prototype_ids = head.proto_idx.view(B, T, -1)  # (N, k) -> (B, T, k)
            result.prototype_acts = head.acts.view(B, T, -1)
        if return_dict is False:
            return result.to_tuple()
        return result

    # ------------------------------------------------------------------------------ generation
    def prepare_inputs_for_generation(
        self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None, **kwargs: Any
    ) -> dict[str, Any]:
        """The whole context, cropped to its last ``block_size`` tokens (no cache to continue from)."""
        T = self.config.block_size
        inputs: dict[str, Any] = {"input_ids": input_ids[:, -T:]}
        if attention_mask is not None:
            inputs["attention_mask"] = attention_mask[:, -T:]
        for key in ("suppress_prototypes", "logits_to_keep"):
            if kwargs.get(key) is not None:
                inputs[key] = kwargs[key]
        return inputs

    # ------------------------------------------------------------------------------ saving
    def save_pretrained(self, save_directory: str | os.PathLike, *args: Any, **kwargs: Any) -> Any:
        """``PreTrainedModel.save_pretrained``, then the :data:`CARRIED_FILES` of the directory this model was
        loaded from (when it is a local directory) that the new one lacks: the training record (the
        documents the weights were trained on before; fine-tuning data is not added to it) and the
        standalone code its ``auto_map`` names."""
        out = super().save_pretrained(save_directory, *args, **kwargs)
        source = str(getattr(self.config, "_name_or_path", "") or "")
        if kwargs.get("is_main_process", True) and source and os.path.isdir(source):
            for name in CARRIED_FILES:
                src, dst = os.path.join(source, name), os.path.join(save_directory, name)
                if os.path.isfile(src) and not os.path.exists(dst) and os.path.abspath(src) != os.path.abspath(dst):
                    shutil.copyfile(src, dst)
        return out


def _check_right_padded(attention_mask: torch.Tensor | None) -> None:
    """PRISM has no padding mask: allow only masks that are ones, then zeros, along each row."""
    if attention_mask is None or attention_mask.shape[1] < 2:
        return
    m = attention_mask.bool()
    if bool((m[:, 1:] & ~m[:, :-1]).any()):
        raise ValueError("attention_mask: PRISM has no padding mask; pad on the right only "
                         "(tokenizer.padding_side='right'), or pass unpadded sequences (batch of 1)")
