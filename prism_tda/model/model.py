"""The PRISM language model: a GPT-style decoder with a sparse prototype output head.

Notation follows DESIGN §1: ``d`` hidden size, ``K`` prototypes, ``k`` active per token,
``V`` vocabulary, ``W`` (V, d) the unembedding (tied to the token embedding), ``z_t`` the final
hidden state after the final norm, ``P`` the prototype bank, stored as rows ``(K, d)``.

    s_{t,i} = ReLU(cos(z_t, p_i));  K_t = top-k of s_t;  a_t = c_t * s_t on K_t
    zhat_t  = sum_{i in K_t} a_{t,i} p_i;  r_t = z_t - zhat_t
    l_t     = W r_t + sum_{i in K_t} a_{t,i} W p_i  ( = W z_t exactly)

Because the logits equal ``W z_t``, training computes them that way; :meth:`PRISM.decompose`
returns the additive split. The prototype head never keeps a dense (N, K) tensor for backward:
similarities are computed without autograd and the selected (N, k) entries get their gradients
through sparse products (``model/sparse.py``): O(N k d) instead of O(N K d).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import ModelConfig
from .sparse import gather_dot, sparse_mix

_EPS = 1e-6


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # (B, T, C) -> (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, nh, T, hs) -> (B, T, C)
        return F.dropout(self.proj(y), self.dropout, self.training)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=False)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model, bias=False)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.proj(F.gelu(self.fc(x))), self.dropout, self.training)


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model, bias=False)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model, bias=False)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def check_gate(gate: float, window: int) -> None:
    """Raise ValueError unless ``gate`` is a share in [0, 1] and ``window`` at least one position (the
    conditional steering of :meth:`PRISM.suppression_gate`)."""
    if not (math.isfinite(gate) and 0.0 <= gate <= 1.0):
        raise ValueError(f"gate: a share of the activation mass, in [0, 1]; got {gate}")
    if window < 1:
        raise ValueError(f"gate_window: at least 1 position; got {window}")


@dataclass
class HeadOutput:
    """Sparse prototype code of N token states (flattened over batch and time)."""

    proto_idx: torch.Tensor  # (N, k) int64, sorted by similarity, descending
    acts: torch.Tensor  # (N, k) >= 0; 0 where the similarity was not positive
    zhat: torch.Tensor  # (N, d)
    losses: dict[str, torch.Tensor] = field(default_factory=dict)  # rec, r1, r2
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)  # R1bar, R2 (detached)
    mass: torch.Tensor | None = None  # (K,) activation mass per prototype (detached)


class PrototypeHead(nn.Module):
    """Sparse, non-negative prototype reconstruction of the final hidden state."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.k = cfg.n_active
        self.act_scale = cfg.act_scale
        # Unit-norm rows: with Adam, a prototype's angular step is ~ lr * sqrt(d) / ||p||, so the
        # norm sets how fast prototypes can follow the token states (see docs/design.md).
        self.prototypes = nn.Parameter(F.normalize(torch.randn(cfg.n_prototypes, cfg.d_model), dim=-1))  # (K, d)

    @property
    def n_prototypes(self) -> int:
        return self.prototypes.shape[0]

    def similarities(self, z: torch.Tensor) -> torch.Tensor:
        """Cosine similarities (N, K) in fp32 without autograd (ReLU not applied)."""
        with torch.no_grad(), torch.autocast(z.device.type, enabled=False):
            zn = F.normalize(z.detach().float(), dim=-1)
            pn = F.normalize(self.prototypes.detach().float(), dim=-1)
            return zn @ pn.T  # (N, d) @ (d, K) -> (N, K)

    def forward(self, z: torch.Tensor, *, with_losses: bool = False, exclude: torch.Tensor | None = None) -> HeadOutput:
        """Encode z (N, d). With ``with_losses`` also return L_REC, L_R1, L_R2 and R1bar/R2.
        ``exclude`` (inference only): prototype ids never chosen, so each token's active set is its
        ``k`` nearest among the others (re-routed suppression, :meth:`PRISM.steered_hidden`).

        The head always runs in fp32 (autocast off), so the active sets do not depend on the
        backbone's precision.
        """
        if exclude is not None and with_losses:
            raise ValueError("exclude is for inference, not with losses")
        with torch.autocast(z.device.type, enabled=False):
            return self._forward(z.float(), with_losses, exclude)

    def _forward(self, z: torch.Tensor, with_losses: bool, exclude: torch.Tensor | None = None) -> HeadOutput:
        P = self.prototypes.float()
        zn = F.normalize(z, dim=-1)  # (N, d)
        pn = F.normalize(P, dim=-1)  # (K, d)
        with torch.no_grad():
            sim = zn.detach() @ pn.detach().T  # (N, K) cosines, no autograd
            if exclude is not None and len(exclude):
                if not (0 <= int(exclude.min()) and int(exclude.max()) < self.n_prototypes):
                    raise ValueError(f"exclude: prototype ids must be in [0, {self.n_prototypes})")
                if self.n_prototypes - len(exclude.unique()) < self.k:
                    raise ValueError(f"exclude: at least {self.k} prototypes must stay, the number active per token")
                sim = sim.index_fill(1, exclude.to(sim.device), -2.0)  # below every cosine: never in the top k
            top_s, top_i = sim.topk(self.k, dim=-1)  # (N, k)

        # The selected cosines get gradients through sparse products: O(N k d), no (N, K) tensor.
        cos = gather_dot(zn, pn, top_i, top_s)  # (N, k), equal to top_s, differentiable
        s = cos.clamp_min(0.0)  # ReLU
        m = sparse_mix(s, P, top_i)  # (N, d) mixture sum_i s_i p_i
        if self.act_scale == "lsq":
            # c_t = max(0, <z, m>) / ||m||^2: the non-negative least-squares scale along m.
            c = (z * m).sum(-1).clamp_min(0.0) / (m.pow(2).sum(-1) + _EPS)  # (N,)
            acts = s * c.unsqueeze(-1)
            zhat = m * c.unsqueeze(-1)
        else:
            acts = s
            zhat = m
        out = HeadOutput(proto_idx=top_i, acts=acts, zhat=zhat)
        if not with_losses:
            return out

        r = z - zhat
        out.losses["rec"] = (r.pow(2).sum(-1) / (z.pow(2).sum(-1) + _EPS)).mean()
        # L_R1: each prototype pulled to its nearest token state (token states held fixed).
        near_t = _argmax_dim0(sim)  # (K,)
        out.losses["r1"] = 1.0 - (pn * zn.detach()[near_t]).sum(-1).mean()
        # L_R2: each token state and its nearest prototype pulled together.
        out.losses["r2"] = 1.0 - cos[:, 0].mean()
        with torch.no_grad():
            out.metrics["R1bar"] = sim[near_t, torch.arange(len(near_t), device=sim.device)].mean()
            out.metrics["R2"] = top_s[:, 0].mean()
            out.mass = torch.zeros(self.n_prototypes, device=z.device).index_add_(
                0, top_i.reshape(-1), acts.detach().reshape(-1)
            )
        return out


def _argmax_dim0(x: torch.Tensor, block: int = 64) -> torch.Tensor:
    """``x.argmax(0)`` for a (N, K) matrix, several times faster on CPU.

    A column-wise argmax strides through memory; block maxima (``amax`` is vectorised) find the
    winning block of rows per column, then a small gather finds the row inside it.
    """
    N, K = x.shape
    pad = (-N) % block
    if pad:
        x = torch.cat([x, x.new_full((pad, K), -float("inf"))])
    b = x.view(-1, block, K)  # (N / block, block, K)
    best_block = b.amax(1).argmax(0)  # (K,)
    rows = b[best_block, :, torch.arange(K, device=x.device)]  # (K, block)
    return best_block * block + rows.argmax(-1)


@dataclass
class ModelOutput:
    logits: torch.Tensor | None  # (B, T, V), or (B, 1, V) when only the last position is asked
    loss: torch.Tensor | None = None
    losses: dict[str, torch.Tensor] = field(default_factory=dict)  # ce (+ rec, r1, r2 for PRISM)
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    z: torch.Tensor | None = None  # (B, T, d) final hidden states
    head: HeadOutput | None = None


@dataclass
class Decomposition:
    """Additive split of chosen logits: ``logit == contrib.sum(-1) + residual``."""

    proto_idx: torch.Tensor  # (n, k)
    acts: torch.Tensor  # (n, k)
    contrib: torch.Tensor  # (n, k)  a_{t,i} (W p_i)_y
    residual: torch.Tensor  # (n,)    (W r_t)_y
    logit: torch.Tensor  # (n,)    the model's logit l_t[y]


class PRISM(nn.Module):
    """GPT-style decoder; ``cfg.head`` selects the prototype head or the dense baseline."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.block_size, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model, bias=False)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):  # GPT-2 scaled init of residual projections
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))
        # Created last, so PRISM and the dense baseline start from the same backbone weights.
        self.head = PrototypeHead(cfg) if cfg.head == "prism" else None

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    @property
    def W(self) -> torch.Tensor:
        """Unembedding (V, d), tied to the token embedding."""
        return self.wte.weight

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def hidden(self, idx: torch.Tensor) -> torch.Tensor:
        """Final hidden states z (B, T, d), after the final norm."""
        B, T = idx.shape
        if T > self.cfg.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.cfg.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, d)
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)

    def hidden_at(self, idx: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Final hidden states (N, d) at the positions ``(rows[n], pos[n])`` only, equal to
        ``hidden(idx)[rows, pos]`` up to rounding: every block but the last runs on every position (the
        last one's keys and values need them), the last block's attention, projection and MLP only at
        the positions asked for. Costs about one block less than ``hidden`` when few positions are
        asked for (the re-rank's handful per sequence)."""
        B, T = idx.shape
        if T > self.cfg.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.cfg.block_size}")
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(T, device=idx.device)))
        for block in self.blocks[:-1]:
            x = block(x)
        last = self.blocks[-1]
        assert isinstance(last, Block)
        attn = last.attn
        C, nh = x.shape[-1], attn.n_head
        q, k, v = attn.qkv(last.ln1(x)).split(C, dim=2)
        # the wanted positions of each sequence, padded to the most any sequence has (Tq)
        counts = torch.bincount(rows, minlength=B)
        Tq = int(counts.max()) if len(rows) else 0
        slot = torch.arange(len(rows), device=idx.device) - torch.repeat_interleave(
            torch.cumsum(counts, 0) - counts, counts)  # rows are grouped by sequence
        qpos = torch.zeros(B, Tq, dtype=torch.long, device=idx.device)
        qpos[rows, slot] = pos
        qq = q.gather(1, qpos[..., None].expand(B, Tq, C))  # (B, Tq, C)
        allowed = torch.arange(T, device=idx.device)[None, None, :] <= qpos[:, :, None]  # (B, Tq, T): causal

        def heads(t: torch.Tensor) -> torch.Tensor:  # (B, n, C) -> (B, nh, n, hs)
            return t.view(B, -1, nh, C // nh).transpose(1, 2)

        y = F.scaled_dot_product_attention(heads(qq), heads(k), heads(v), attn_mask=allowed[:, None])
        y = y.transpose(1, 2).reshape(B, Tq, C)[rows, slot]  # (N, C)
        h = x[rows, pos] + attn.proj(y)
        h = h + last.mlp(last.ln2(h))
        return self.ln_f(h)

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        last_only: bool = False,
        return_head: bool = False,
        suppress: torch.Tensor | None = None,
        alpha: torch.Tensor | float = 0.0,
        project: bool = False,
        reroute: bool = False,
        gate: float | None = None,
        gate_window: int = 16,
    ) -> ModelOutput:
        """Logits and, given targets (B, T), the training loss ``L_CE + sum lam * L_aux``.

        ``suppress`` (inference only): prototype ids S whose activations are scaled by ``alpha`` (one
        value, or one per id) before mixing: ``l_t = W z_t + sum_{i in K_t & S} (alpha_i - 1) a_{t,i} W p_i``.
        ``alpha`` 0 (the default) removes their part of the logits, 1 leaves the model as it is, above 1
        boosts them. The active sets and the residual ``r_t`` stay those of the unscaled model, unless
        ``project``: then the residual's component in the span of the listed prototypes is scaled by the
        same (single) alpha, ``r_t + (alpha - 1) Pi_S r_t``, so the listed directions leave the residual too
        (the logits stay ``W r'_t + sum_i a'_{t,i} W p_i``: the decomposition holds with ``r'``). With
        ``reroute`` (``alpha`` 0 only) the listed prototypes are removed and each token's active set is
        chosen again without them, so the next-nearest prototypes take their place; the residual ``r_t``
        is kept, so the logits stay ``W r_t + sum_{i in K'_t} a'_{t,i} W p_i``.

        ``gate`` (conditional steering): the listed prototypes are scaled only at positions where their
        share of the activation mass, averaged over the last ``gate_window`` positions (the position
        itself included), is at least ``gate`` (:meth:`suppression_gate`); elsewhere the logits are the
        unscaled model's. Either way each position's logits decompose exactly.
        """
        z = self.hidden(idx)  # (B, T, d)
        if suppress is not None:
            if targets is not None or self.head is None:
                raise ValueError("suppress is for inference with a PRISM head (no targets)")
            where = None
            if gate is not None:
                where = self.suppression_gate(z[:, -gate_window:] if last_only else z, suppress, gate, gate_window)
                where = where[:, -1:] if last_only else where
            zs = z[:, -1:] if last_only else z
            return ModelOutput(logits=F.linear(self.steered_hidden(zs, suppress, alpha, project, reroute, where),
                                               self.W), z=z)
        if last_only and targets is None:
            return ModelOutput(logits=F.linear(z[:, -1:], self.W), z=z)
        logits = F.linear(z, self.W)  # (B, T, V) == W r + sum a W p
        out = ModelOutput(logits=logits, z=z)
        want_head = self.head is not None and (targets is not None or return_head)
        if want_head:
            assert self.head is not None
            zh = z.reshape(-1, z.shape[-1])
            a = self.cfg.backbone_aux_scale
            if targets is not None and a != 1.0:
                # same values, gradient into the backbone scaled by a
                zh = zh.detach() if a == 0.0 else zh.detach() + a * (zh - zh.detach())
            out.head = self.head(zh, with_losses=targets is not None)
        if targets is None:
            return out
        ce = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        out.losses["ce"] = ce
        loss = ce
        if out.head is not None:
            c = self.cfg
            h = out.head.losses
            out.losses.update(h)
            loss = loss + c.lam_rec * h["rec"] + c.lam_r1 * h["r1"] + c.lam_r2 * h["r2"]
            out.metrics.update(out.head.metrics)
        out.loss = loss
        return out

    @torch.no_grad()
    def signatures(self, proto_ids: torch.Tensor | None = None, n: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``n`` tokens each prototype's logit signature ``W p_i`` favours most: (values, token ids),
        each (len(proto_ids) or K, n)."""
        if self.head is None:
            raise ValueError("signatures() needs a PRISM head; this is the dense baseline")
        P = self.head.prototypes.float()
        P = P if proto_ids is None else P[proto_ids]
        return (P @ self.W.float().T).topk(min(n, self.cfg.vocab_size), dim=-1)  # (K', V) -> (K', n)

    def prototype_scale(self, ids: torch.Tensor, alpha: torch.Tensor | float = 0.0) -> torch.Tensor:
        """(K,) the factor each prototype's activation is multiplied by: ``alpha`` (one value, or one per
        id) at ``ids``, 1 elsewhere. Raises on ids outside the bank, alphas that are negative or not
        finite, and an id listed twice with two values."""
        assert self.head is not None
        K = self.head.n_prototypes
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1).cpu()
        a = torch.as_tensor(alpha, dtype=torch.float32).reshape(-1).cpu()
        if a.numel() == 1:
            a = a.expand(len(ids))
        if a.numel() != len(ids):
            raise ValueError(f"alpha: {a.numel()} values for {len(ids)} prototype ids")
        if len(ids) and not (0 <= int(ids.min()) and int(ids.max()) < K):
            raise ValueError(f"suppress: prototype ids must be in [0, {K})")
        if not bool(torch.isfinite(a).all()) or bool((a < 0).any()):
            raise ValueError("alpha: must be finite and >= 0")
        scale = torch.ones(K)
        scale[ids] = a
        if not torch.equal(scale[ids], a):
            raise ValueError("alpha: a prototype id is given twice with different values")
        return scale

    @torch.no_grad()
    def suppression_gate(self, z: torch.Tensor, suppress: torch.Tensor, gate: float, window: int = 16) -> torch.Tensor:
        """(B, T) where conditional steering acts on hidden states z (B, T, d): the listed prototypes' share
        of each position's activation mass, ``sum_{i in K_t & S} a_{t,i} / sum_{i in K_t} a_{t,i}``, averaged
        over the last ``window`` positions up to and including t (fewer at the start), is at least ``gate``.
        Causal: a position's gate never depends on a later one."""
        assert self.head is not None
        check_gate(gate, window)
        B, T, d = z.shape
        h = self.head(z.reshape(-1, d))
        ids = torch.as_tensor(suppress, dtype=torch.long).reshape(-1).to(z.device)
        acts = h.acts.float()
        share = ((acts * torch.isin(h.proto_idx, ids)).sum(1) / acts.sum(1).clamp_min(1e-12)).view(B, T)
        c = F.pad(share.double().cumsum(1), (1, 0))  # (B, T + 1): c[:, t] = sum of the first t shares
        t = torch.arange(T, device=z.device)
        lo = (t + 1 - window).clamp_min(0)
        mean = (c[:, t + 1] - c[:, lo]) / (t + 1 - lo).double()
        return mean >= gate - 1e-12

    @torch.no_grad()
    def steered_hidden(self, z: torch.Tensor, suppress: torch.Tensor, alpha: torch.Tensor | float = 0.0,
                    project: bool = False, reroute: bool = False, where: torch.Tensor | None = None) -> torch.Tensor:
        """z (B, T, d) with the listed prototypes' part of its reconstruction scaled by ``alpha`` (and with
        ``project``, the residual's part in their span); with ``reroute``, the reconstruction chosen again
        without them (``alpha`` must be 0). ``where`` (B, T) bool: only those positions change (the gate
        of :meth:`suppression_gate`)."""
        out = self._steered(z, suppress, alpha, project, reroute)
        if where is None:
            return out
        return torch.where(where.to(z.device).reshape(*z.shape[:-1], 1), out, z)

    def _steered(self, z: torch.Tensor, suppress: torch.Tensor, alpha: torch.Tensor | float,
                 project: bool, reroute: bool) -> torch.Tensor:
        assert self.head is not None
        flat = z.reshape(-1, z.shape[-1])  # (N, d)
        h = self.head(flat)
        scale = self.prototype_scale(suppress, alpha).to(flat.device)
        if reroute:
            ids = torch.as_tensor(suppress, dtype=torch.long).reshape(-1).unique()
            if project:
                raise ValueError("reroute and project: choose one")
            if bool((scale[ids.to(scale.device)] != 0).any()):
                raise ValueError("reroute: removes the listed prototypes; alpha must be 0 for every one")
            h2 = self.head(flat, exclude=ids)
            return (flat.float() - h.zhat.float() + h2.zhat.float()).to(z.dtype).view_as(z)
        factor = scale[h.proto_idx] - 1.0  # (N, k): alpha_i - 1 on listed prototypes, 0 elsewhere
        P_sel = F.embedding(h.proto_idx, self.head.prototypes.float())  # (N, k, d)
        change = torch.einsum("nk,nkd->nd", h.acts * factor, P_sel)  # sum over listed (alpha_i - 1) a_i p_i
        if project:
            ids = torch.as_tensor(suppress, dtype=torch.long).reshape(-1).unique()
            a = scale[ids.to(scale.device)]
            if len(ids) and not bool((a == a[0]).all()):
                raise ValueError("project: needs one alpha for every listed prototype")
            if len(ids):
                basis, _ = torch.linalg.qr(self.head.prototypes.float()[ids.to(flat.device)].T)  # (d, S) orthonormal
                r = flat.float() - h.zhat.float()
                change = change + (float(a[0]) - 1.0) * (r @ basis) @ basis.T
        return (flat.float() + change).to(z.dtype).view_as(z)

    @torch.no_grad()
    def decompose(
        self, idx: torch.Tensor, positions: torch.Tensor | None = None, tokens: torch.Tensor | None = None,
        hidden: torch.Tensor | None = None,
    ) -> Decomposition:
        """Split the logit of ``tokens`` at ``positions`` of one sequence idx (T,) or (1, T).

        ``positions`` (n,) defaults to every position; ``tokens`` (n,) defaults to the greedy
        next token at each position; ``hidden`` (n, d): the final hidden states at ``positions`` when
        the caller has them (no forward pass then). Returns each active prototype's share
        ``a_{t,i} (W p_i)_y`` and the residual's share ``(W r_t)_y``; they add up to ``l_t[y]``.
        """
        if self.head is None:
            raise ValueError("decompose() needs a PRISM head; this is the dense baseline")
        if hidden is not None:
            zp = hidden.float()
        else:
            z = self.hidden(idx.reshape(1, -1))[0].float()  # (T, d)
            if positions is None:
                positions = torch.arange(z.shape[0], device=z.device)
            zp = z[positions]  # (n, d)
        logits = F.linear(zp, self.W.float())  # (n, V)
        if tokens is None:
            tokens = logits.argmax(-1)
        h = self.head(zp)
        W_y = self.W.float()[tokens]  # (n, d) rows of W for the chosen tokens
        P_sel = F.embedding(h.proto_idx, self.head.prototypes.float())  # (n, k, d)
        contrib = h.acts * torch.einsum("nkd,nd->nk", P_sel, W_y)  # a_{t,i} (W p_i)_y
        residual = ((zp - h.zhat) * W_y).sum(-1)  # (W r_t)_y
        logit = logits.gather(1, tokens[:, None])[:, 0]
        return Decomposition(h.proto_idx, h.acts, contrib, residual, logit)

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        sample_top_k: int | None = None,
        generator: torch.Generator | None = None,
        stop_token: int | None = None,
        suppress: torch.Tensor | None = None,
        alpha: torch.Tensor | float = 0.0,
        project: bool = False,
        reroute: bool = False,
        gate: float | None = None,
        gate_window: int = 16,
        on_step: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Greedy (temperature 0) or sampled continuation of idx (1, T); returns (1, T + n).

        ``on_step(i)``: called before the i-th new token (a caller's stop check raises from it).

        ``sample_top_k``: sample from the most likely tokens only; ``suppress``, ``alpha``: prototype ids
        whose activations are scaled by alpha (0: they contribute nothing to the logits; see :meth:`forward`);
        ``gate``, ``gate_window``: only where the context carries them (:meth:`suppression_gate`).
        """
        for step in range(max_new_tokens):
            if on_step is not None:
                on_step(step)
            ctx = idx[:, -self.cfg.block_size :]
            logits = self(ctx, last_only=True, suppress=suppress, alpha=alpha, project=project, reroute=reroute,
                          gate=gate, gate_window=gate_window).logits[:, -1, :].float()  # (1, V)
            if temperature <= 0:
                nxt = logits.argmax(-1, keepdim=True)
            else:
                logits = logits / temperature
                if sample_top_k is not None:
                    v, _ = torch.topk(logits, min(sample_top_k, logits.size(-1)))
                    logits[logits < v[:, [-1]]] = -float("inf")
                nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            idx = torch.cat([idx, nxt], dim=1)
            if stop_token is not None and int(nxt) == stop_token:
                break
        return idx
