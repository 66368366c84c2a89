"""Configuration dataclasses for the PRISM model and its trainer.

Every config is a frozen dataclass validated in ``__post_init__`` and serialised with
``to_dict()``; ``from_dict()`` refuses unknown fields so a typo never passes silently.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from prism_tda.config import Config
from prism_tda.config import check as _check

HeadKind = Literal["prism", "dense"]
ActScale = Literal["lsq", "none"]


@dataclass(frozen=True)
class ModelConfig(Config):
    """Architecture of the decoder and its output head.

    ``head="prism"`` puts the prototype head of DESIGN §1 on the backbone;
    ``head="dense"`` is the baseline: same backbone, plain ``W z`` head, CE loss only.
    """

    LEGACY_FIELDS = {"top_k": "n_active"}  # checkpoints written before the rename

    vocab_size: int = 4096
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 256
    dropout: float = 0.0
    head: HeadKind = "prism"
    n_prototypes: int = 1024  # K
    n_active: int = 8  # k, active prototypes per token (the top-k of the similarities)
    # Rescaling of the activations a = c_t * s_t: "lsq" picks the non-negative scalar c_t that
    # makes zhat the least-squares fit of z along the mixture direction; "none" keeps a = s.
    act_scale: ActScale = "lsq"
    lam_rec: float = 1.0
    lam_r1: float = 0.1
    lam_r2: float = 0.1
    # Scale of the auxiliary losses' gradient into the backbone (1.0: full pull of the token states
    # toward the prototypes; 0.0: the backbone learns from CE alone, the prototypes follow it).
    backbone_aux_scale: float = 0.25

    def __post_init__(self) -> None:
        _check(self.vocab_size > 0, f"model.vocab_size must be > 0, got {self.vocab_size}")
        _check(self.block_size > 0, f"model.block_size must be > 0, got {self.block_size}")
        _check(self.n_layer > 0, f"model.n_layer must be > 0, got {self.n_layer}")
        _check(
            self.d_model % self.n_head == 0,
            f"model.d_model ({self.d_model}) must be divisible by model.n_head ({self.n_head})",
        )
        _check(0.0 <= self.dropout < 1.0, f"model.dropout must be in [0, 1), got {self.dropout}")
        _check(self.head in ("prism", "dense"), f"model.head must be 'prism' or 'dense', got {self.head!r}")
        _check(self.act_scale in ("lsq", "none"), f"model.act_scale must be 'lsq' or 'none', got {self.act_scale!r}")
        if self.head == "prism":
            _check(self.n_prototypes > 0, f"model.n_prototypes must be > 0, got {self.n_prototypes}")
            _check(
                0 < self.n_active <= self.n_prototypes,
                f"model.n_active must be in [1, n_prototypes={self.n_prototypes}], got {self.n_active}",
            )
        for name in ("lam_rec", "lam_r1", "lam_r2", "backbone_aux_scale"):
            _check(getattr(self, name) >= 0, f"model.{name} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class TrainConfig(Config):
    """Optimisation, schedule, evaluation and checkpointing of one training run."""

    LEGACY_FIELDS = {"extra": None}  # an unused free-form field of older checkpoints

    seed: int = 1337
    batch_size: int = 16  # sequences per micro-batch per process
    grad_accum: int = 1
    max_steps: int = 1000
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 50
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    eval_every: int = 200
    eval_tokens: int = 65536
    ckpt_every: int = 500
    keep_checkpoints: int = 2
    val_fraction: float = 0.05
    dtype: Literal["auto", "fp32", "bf16"] = "auto"  # auto: bf16 autocast on CUDA and on CPUs with native bf16
    compile: bool = False
    # Prototype usage: every `reseed_every` steps, prototypes whose running share of the
    # activation mass is below `reseed_min_share / K` are moved onto poorly reconstructed token
    # states of the current batch (0 disables).
    reseed_every: int = 25
    reseed_min_share: float = 0.1
    reseed_until: float = 0.8  # fraction of max_steps after which prototypes are left alone
    usage_ema: float = 0.9
    proto_init: Literal["data", "random"] = "data"  # data: on token states of the untrained model

    def __post_init__(self) -> None:
        for name in ("batch_size", "grad_accum", "max_steps", "eval_every", "ckpt_every", "keep_checkpoints"):
            _check(getattr(self, name) > 0, f"train.{name} must be > 0, got {getattr(self, name)}")
        _check(self.lr > 0 and self.min_lr >= 0, "train.lr must be > 0 and train.min_lr >= 0")
        _check(self.warmup_steps >= 0, f"train.warmup_steps must be >= 0, got {self.warmup_steps}")
        _check(0 < self.val_fraction < 1, f"train.val_fraction must be in (0, 1), got {self.val_fraction}")
        _check(self.dtype in ("auto", "fp32", "bf16"), f"train.dtype must be auto|fp32|bf16, got {self.dtype!r}")
        _check(self.reseed_every >= 0, "train.reseed_every must be >= 0")
        _check(0 <= self.usage_ema < 1, "train.usage_ema must be in [0, 1)")
        _check(self.proto_init in ("data", "random"), f"train.proto_init must be data|random, got {self.proto_init!r}")
