"""``PrismConfig``: the Hugging Face configuration of a PRISM model (``model_type`` "prism").

It carries the fields of ``prism_tda.model.config.ModelConfig`` under the same names and with the
same defaults (``tests/test_hf.py`` holds them equal), plus the standard Hugging Face aliases
(``hidden_size``, ``num_attention_heads``, ``num_hidden_layers``, ``max_position_embeddings``).

This module imports only ``transformers``: an export ships it verbatim as ``configuration_prism.py``,
so that ``trust_remote_code=True`` loads a PRISM model in a process without ``prism_tda``.
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig


class PrismConfig(PretrainedConfig):
    """Architecture of a PRISM decoder (``ModelConfig``'s fields) as a ``PretrainedConfig``.

    Extra keys an export adds (``prism_training``: the training run's summary; ``prism_training_record``:
    the summary of its training record) are kept as attributes and written back by ``save_pretrained``.
    """

    model_type = "prism"
    attribute_map = {
        "hidden_size": "d_model",
        "num_attention_heads": "n_head",
        "num_hidden_layers": "n_layer",
        "max_position_embeddings": "block_size",
    }

    def __init__(
        self,
        vocab_size: int = 4096,
        block_size: int = 128,
        n_layer: int = 4,
        n_head: int = 4,
        d_model: int = 256,
        dropout: float = 0.0,
        head: str = "prism",
        n_prototypes: int = 1024,
        n_active: int = 8,
        act_scale: str = "lsq",
        lam_rec: float = 1.0,
        lam_r1: float = 0.1,
        lam_r2: float = 0.1,
        backbone_aux_scale: float = 0.25,
        **kwargs: Any,
    ) -> None:
        self.vocab_size = vocab_size
        self.block_size = block_size  # the context: generation keeps the last block_size tokens
        self.n_layer = n_layer
        self.n_head = n_head
        self.d_model = d_model
        self.dropout = dropout
        self.head = head  # "prism": the prototype head; "dense": the baseline (plain W z head)
        self.n_prototypes = n_prototypes  # K
        self.n_active = n_active  # k, active prototypes per token
        self.act_scale = act_scale  # "lsq" or "none" (model/config.py)
        self.lam_rec = lam_rec
        self.lam_r1 = lam_r1
        self.lam_r2 = lam_r2
        self.backbone_aux_scale = backbone_aux_scale
        # The unembedding W is the token embedding itself (one tensor): there is no output layer to tie.
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)
