"""Compressed token vectors: what the index stores of ``Q^T u_t`` for the approximate stage.

``u_t = W^T (p_t - e_{y_t})`` is the model's expected output embedding ``m_t = W^T p_t`` minus the
target token's row ``W[y_t]``. The index stores the target token anyway, so only ``m_t`` is
quantised and the target's row is added back exactly when decoding: for tokens the model gets
wrong (most of the gradient energy) the exact part dominates, which keeps more of the ranking than
quantising ``u_t`` itself (measured in docs/benchmarks.md).

``m_t`` (in the curvature basis ``Q``) is scaled by a diagonal preconditioner ``D^{-1/2}`` (the
mean over prototypes of ``lambda_i + lam``, so the quantiser spends its bits where scores are
sensitive) and product-quantised: ``n_sub`` sub-vectors, each the index of its nearest of
``2^bits`` centroids. Codes of 12 bits are packed two to three bytes. Encoding runs on the
indexing device: FAISS's product quantiser on a CPU (its SIMD scan of the centroids beats a dense
distance matrix there), batched products and an argmin in torch on an accelerator, where the
token vectors already are (the same nearest centroids, float ties aside; tested). Decoding runs in
torch; the codebooks are trained with FAISS's k-means.

**Direction codes.** A token the model predicts confidently (a memorised fact, say) has ``p_t``
close to ``e_{y_t}``, so ``u_t`` is tiny beside ``m_t``: quantising ``m_t`` leaves an error that
dwarfs ``u_t`` itself, and the token's approximate cosine with a query is noise. Such a token
stores instead the codes of its direction ``D^{-1/2} u_t / ||D^{-1/2} u_t||`` in a second codebook
(trained on the sample's unit directions); its length is not stored: the index keeps ``I(t, t)``
exactly, and the length is what makes the decoded direction's ``I(t, t)`` equal it
(``engine/reader.py``). The encoder writes, per token, whichever of the two codes reconstructs
``D^{-1/2} u_t`` better, and one bit per token says which (``code_dir``).
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save

from .layout import atomic_write_bytes


def code_bytes(n_sub: int, bits: int) -> int:
    """Bytes per token of ``n_sub`` codes of ``bits`` bits (8, 12 or 16)."""
    if bits not in (8, 12, 16):
        raise ValueError(f"code bits must be 8, 12 or 16, got {bits}")
    if bits == 12 and n_sub % 2:
        raise ValueError("12-bit codes pack in pairs: the number of sub-quantisers must be even")
    return n_sub * bits // 8


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """(N, n_sub) integer codes -> (N, code_bytes) uint8."""
    n = codes.shape[0]
    if bits == 8:
        return codes.astype(np.uint8)
    if bits == 16:
        return codes.astype("<u2").view(np.uint8).reshape(n, -1)
    c = codes.astype(np.uint32).reshape(n, -1, 2)  # 12 bits: a pair of codes in 3 bytes
    v = c[..., 0] | (c[..., 1] << 12)  # 24 bits
    out = np.stack([v & 0xFF, (v >> 8) & 0xFF, v >> 16], axis=-1).astype(np.uint8)
    return out.reshape(n, -1)


def unpack(packed: np.ndarray, bits: int, n_sub: int) -> np.ndarray:
    """(N, code_bytes) uint8 -> (N, n_sub) int64 codes."""
    return unpack_torch(packed, bits, n_sub).numpy()


def unpack_torch(packed: np.ndarray, bits: int, n_sub: int) -> torch.Tensor:
    """(N, code_bytes) uint8 -> (N, n_sub) int64 codes, in torch (multithreaded)."""
    n = packed.shape[0]
    b = torch.from_numpy(np.ascontiguousarray(packed))
    if bits == 8:
        return b.long()
    if bits == 16:
        return torch.from_numpy(np.ascontiguousarray(packed).view("<u2").reshape(n, n_sub).astype(np.int64))
    b = b.view(n, -1, 3).int()
    v = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
    return torch.stack([v & 0xFFF, v >> 12], dim=-1).reshape(n, n_sub).long()


ENCODE_BLOCK_BYTES = 256 << 20  # the (n_sub, rows, 2^bits) distance block of one chunk of the torch encoder
# lookup tables kept for the next call with the same columns (0.5 MB per column): a query's first stage
# and shortlist ask for the same ones, and a 16-token completion reaches ~128 columns, 64 MB
TABLES_BYTES = 96 << 20


@dataclass
class TokenCodec:
    """Product quantiser of ``D^{-1/2} m_t`` with the target row added back on decode."""

    centroids: torch.Tensor  # (n_sub, 2^bits, d_sub)
    scale: torch.Tensor  # (d,) D^{-1/2}
    W: torch.Tensor  # (V, d) the unembedding (shared with the model, not copied)
    Q: torch.Tensor  # (d, d) the curvature basis
    bits: int
    dir_centroids: torch.Tensor | None = None  # (n_sub, 2^bits, d_sub) unit directions of D^{-1/2} u_t
    _tables: OrderedDict = field(default_factory=OrderedDict, init=False, repr=False, compare=False)
    _tables_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)
    _books_on: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # codebooks per device

    @functools.cached_property
    def _WQ(self) -> torch.Tensor:
        """(V, d) every token's ``Q^T W[y]``, computed once, in float64 and then rounded: a float32 product's
        last bits depend on how many threads computed it, and the index stores values decoded with it
        (``indexer/shard.py``, ``stored_self``) that a resumed or compacted build reproduces to the bit."""
        with torch.no_grad():
            return (self.W.detach().double() @ self.Q.to(self.W.device).double()).float()

    @functools.cached_property
    def _flat_centroids(self) -> torch.Tensor:
        """(n_sub * 2^bits, d_sub) the centroids with the diagonal scale divided out, for one gather."""
        n_sub, k, ds = self.centroids.shape
        return (self.centroids / self.scale.view(n_sub, 1, ds)).reshape(n_sub * k, ds).contiguous()

    @functools.cached_property
    def flat_dir_centroids(self) -> torch.Tensor | None:
        """As :attr:`_flat_centroids`, of the direction codebook (None: the codec has none): rows
        ``s * 2^bits + code`` of unit directions, the scale divided out (what the compiled scoring
        decodes a direction from)."""
        if self.dir_centroids is None:
            return None
        n_sub, k, ds = self.dir_centroids.shape
        return (self.dir_centroids / self.scale.view(n_sub, 1, ds)).reshape(n_sub * k, ds).contiguous()

    @property
    def has_directions(self) -> bool:
        return self.dir_centroids is not None

    def lookup_tables(self, Wq: torch.Tensor, directions: bool = True
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """For query columns ``Wq`` (P, d): (n_sub, P, 2^bits) each column's product with every centroid
        of each sub-vector (so ``Wq_p . m_t`` is the sum over s of ``[s, p, code_s]``), (P, V) each
        column's product with every target row ``Q^T W[y]``, and (n_sub, P, 2^bits) the same as the
        first for the direction codebook (None without one, or unless ``directions``). Contiguous, as
        the batched products leave them."""
        Wq = Wq.float().contiguous()
        key = (Wq.numpy().tobytes(), directions)  # a query's first stage and shortlist ask for the same
        with self._tables_lock:
            hit = self._tables.get(key)
        if hit is not None:
            return hit[0]
        n_sub, k, ds = self.centroids.shape
        Wv = Wq.view(len(Wq), n_sub, ds).transpose(0, 1).contiguous()  # (n_sub, P, d_sub)
        m_tab = torch.bmm(Wv, self._books_t[0])
        d_tab = None
        if directions and self._books_t[1] is not None:
            d_tab = torch.bmm(Wv, self._books_t[1])
        out = m_tab, Wq @ self._WQ.T, d_tab
        size = sum(t.numel() * t.element_size() for t in out if t is not None)
        if size <= TABLES_BYTES:
            with self._tables_lock:
                self._tables[key] = (out, size)
                while sum(v[1] for v in self._tables.values()) > TABLES_BYTES:
                    self._tables.popitem(last=False)
        return out

    @functools.cached_property
    def _books_t(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The flattened codebooks as (n_sub, d_sub, 2^bits), contiguous: the right operand of the
        lookup tables' batched product."""
        n_sub, k, ds = self.centroids.shape

        def t(flat: torch.Tensor) -> torch.Tensor:
            return flat.view(n_sub, k, ds).transpose(1, 2).contiguous()

        return t(self._flat_centroids), None if self.flat_dir_centroids is None else t(self.flat_dir_centroids)

    def target_rows(self, targets: torch.Tensor) -> torch.Tensor:
        """(N, d) ``Q^T W[y]``: the exact part of ``Q^T u_t`` for target tokens ``y``."""
        return self._WQ[targets.to(self._WQ.device)]

    @property
    def n_sub(self) -> int:
        return self.centroids.shape[0]

    @property
    def code_bytes(self) -> int:
        return code_bytes(self.n_sub, self.bits)

    @classmethod
    def train(cls, m: torch.Tensor, scale: torch.Tensor, W: torch.Tensor, Q: torch.Tensor, *, n_sub: int,
              bits: int, seed: int = 0, iters: int = 12, points_per_centroid: int = 32,
              u: torch.Tensor | None = None) -> TokenCodec:
        """Fit the codebooks on a sample of ``m = Q^T W^T p_t`` (N, d) (in the Q basis, unscaled) and,
        given the sample's token vectors ``u = Q^T u_t`` (N, d), the direction codebook."""
        code_bytes(n_sub, bits)
        d = m.shape[1]
        if d % n_sub:
            raise ValueError(f"{n_sub} sub-quantisers do not divide the token vector's {d} dimensions")
        cents = _kmeans_subspaces((m.float() * scale).numpy(), n_sub, bits, seed, iters, points_per_centroid)
        dirs = None
        if u is not None:
            x = u.float() * scale
            x = x / x.norm(dim=1, keepdim=True).clamp_min(1e-30)
            dirs = _kmeans_subspaces(x.numpy(), n_sub, bits, seed + n_sub, iters, points_per_centroid)
        return cls(cents, scale.float(), W, Q.float(), bits, dirs)

    @functools.cached_property
    def _pq(self):
        """FAISS's product quantiser over these codebooks: the same nearest-centroid codes, packed the
        same way (tested), an order of magnitude faster than a dense distance matrix in torch."""
        return _faiss_pq(self.centroids, self.bits)

    @functools.cached_property
    def _pq_dir(self):
        assert self.dir_centroids is not None
        return _faiss_pq(self.dir_centroids, self.bits)

    def encode(self, u: torch.Tensor, targets: torch.Tensor, backend: str | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Packed codes (N, code_bytes) of token vectors ``u`` (N, u_dim) with target ids (N,), and
        (N,) bool: which tokens' codes are of their direction (the better reconstruction).
        ``backend``: "faiss" (the default on a CPU) or "torch" (the default on an accelerator: the
        search runs where ``u`` is)."""
        backend = backend or ("faiss" if u.device.type == "cpu" else "torch")
        if backend not in ("faiss", "torch"):
            raise ValueError(f"backend: 'faiss' or 'torch', got {backend!r}")
        if backend == "torch":
            return self._encode_torch(u, targets)
        dev = u.device
        scale = self.scale.to(dev)
        m = (u.float() + self.target_rows(targets.to(self.W.device)).to(dev)) * scale  # D^{-1/2} m_t
        x = np.ascontiguousarray(m.cpu().numpy(), dtype=np.float32)
        codes = self._pq.compute_codes(x)
        is_dir = np.zeros(len(x), dtype=bool)
        if self.dir_centroids is None or not len(x):
            return codes, is_dir
        xs = (u.float() * scale).cpu().numpy().astype(np.float32)  # D^{-1/2} u_t
        r = np.linalg.norm(xs, axis=1, keepdims=True)
        unit = np.ascontiguousarray(xs / np.maximum(r, 1e-30))
        codes_d = self._pq_dir.compute_codes(unit)
        err_m = np.linalg.norm(self._pq.decode(codes) - x, axis=1)
        err_d = np.linalg.norm(self._pq_dir.decode(codes_d) * r - xs, axis=1)
        is_dir = err_d < err_m
        codes[is_dir] = codes_d[is_dir]
        return codes, is_dir

    def _encode_torch(self, u: torch.Tensor, targets: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`encode` on ``u``'s device: per sub-vector ``argmin_c ||c||^2 - 2 x.c`` from batched
        products, in chunks of rows that keep the distance block within ``ENCODE_BLOCK_BYTES``; the
        reconstruction errors that choose between the two codebooks from the same centroids."""
        dev = u.device
        with torch.no_grad():
            scale = self.scale.to(dev)
            x = (u.float() + self.target_rows(targets).to(dev)) * scale  # D^{-1/2} m_t
            codes, err = _nearest(x, self._device_books(dev, direction=False))
            is_dir = torch.zeros(len(x), dtype=torch.bool, device=dev)
            if self.dir_centroids is not None and len(x):
                xs = u.float() * scale
                r = xs.norm(dim=1, keepdim=True)
                codes_d, err_d = _nearest(xs / r.clamp_min(1e-30), self._device_books(dev, direction=True))
                is_dir = err_d * r[:, 0] < err
                codes = torch.where(is_dir[:, None], codes_d, codes)
        return pack(codes.cpu().numpy(), self.bits), is_dir.cpu().numpy()

    def _device_books(self, dev: torch.device, direction: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(codebook (n_sub, 2^bits, d_sub), its squared norms (n_sub, 2^bits)) on ``dev``, kept."""
        key = (str(dev), direction)
        books = self._books_on.get(key)
        if books is None:
            c = (self.dir_centroids if direction else self.centroids)
            assert c is not None
            c = c.float().to(dev).contiguous()
            books = self._books_on[key] = (c, (c * c).sum(-1))
        return books

    def decode(self, packed: np.ndarray, targets: np.ndarray, is_dir: np.ndarray | None = None) -> torch.Tensor:
        """Approximate ``Q^T u_t`` (N, u_dim) from packed codes and target ids; the rows ``is_dir``
        (direction codes) come back as the direction at unit length in the scaled space, their length
        to be set by the caller (:meth:`IndexReader.token_vectors`)."""
        codes = unpack_torch(packed, self.bits, self.n_sub)  # (N, n_sub)
        k = self.centroids.shape[1]
        idx = codes + torch.arange(self.n_sub) * k  # rows of the flattened codebooks
        out = torch.empty(len(codes), len(self.scale))
        dirs = np.zeros(len(codes), dtype=bool) if is_dir is None else np.asarray(is_dir, dtype=bool)
        with torch.no_grad():
            if not dirs.all():
                at = torch.from_numpy(np.nonzero(~dirs)[0])
                m = torch.nn.functional.embedding(idx[at], self._flat_centroids).reshape(len(at), -1)
                out[at] = m - self.target_rows(torch.from_numpy(targets[~dirs].astype(np.int64))).cpu()
            if dirs.any():
                assert self.flat_dir_centroids is not None, "direction codes without a direction codebook"
                at = torch.from_numpy(np.nonzero(dirs)[0])
                out[at] = torch.nn.functional.embedding(idx[at], self.flat_dir_centroids).reshape(len(at), -1)
        return out

    def save(self, path: Path) -> None:
        t = {"centroids": self.centroids.contiguous(), "scale": self.scale.contiguous(), "bits": torch.tensor([self.bits])}
        if self.dir_centroids is not None:
            t["dir_centroids"] = self.dir_centroids.contiguous()
        atomic_write_bytes(path, save(t))

    @classmethod
    def load(cls, path: Path, W: torch.Tensor, Q: torch.Tensor) -> TokenCodec:
        t = load_file(str(path))
        return cls(t["centroids"], t["scale"], W, Q.float(), int(t["bits"][0]), t.get("dir_centroids"))


def _nearest(x: torch.Tensor, books: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, n_sub) the nearest centroid of each sub-vector of the rows of ``x`` (N, d), and (N,) the
    distance from each row to its reconstruction."""
    cents, norms = books
    n_sub, k, ds = cents.shape
    N = len(x)
    codes = torch.empty(N, n_sub, dtype=torch.int64, device=x.device)
    err2 = torch.empty(N, device=x.device)
    step = max(1, ENCODE_BLOCK_BYTES // (4 * n_sub * k))
    for a in range(0, N, step):
        xs = x[a : a + step].reshape(-1, n_sub, ds).transpose(0, 1)  # (n_sub, n, d_sub)
        dist = torch.baddbmm(norms[:, None, :], xs, cents.transpose(1, 2), alpha=-2.0)  # (n_sub, n, k)
        best = dist.argmin(-1)  # (n_sub, n)
        codes[a : a + step] = best.T
        rec = torch.gather(cents, 1, best[:, :, None].expand(-1, -1, ds))  # (n_sub, n, d_sub)
        err2[a : a + step] = (rec - xs).pow(2).sum((0, 2))
    return codes, err2.sqrt()


def _kmeans_subspaces(x: np.ndarray, n_sub: int, bits: int, seed: int, iters: int,
                      points_per_centroid: int) -> torch.Tensor:
    """(n_sub, 2^bits, d / n_sub) k-means centroids of each sub-vector of the rows of ``x`` (N, d)."""
    import faiss

    x = np.ascontiguousarray(x, dtype=np.float32)
    ds, k = x.shape[1] // n_sub, 1 << bits
    cents = np.empty((n_sub, k, ds), dtype=np.float32)
    for j in range(n_sub):
        sub = np.ascontiguousarray(x[:, j * ds : (j + 1) * ds])
        km = faiss.Kmeans(ds, k, niter=iters, seed=seed + j, max_points_per_centroid=points_per_centroid,
                          min_points_per_centroid=1, verbose=False)
        km.train(sub if len(sub) >= k else np.repeat(sub, -(-k // len(sub)), axis=0))
        cents[j] = km.centroids
    return torch.from_numpy(cents)


def _faiss_pq(centroids: torch.Tensor, bits: int):
    import faiss

    n_sub, _, ds = centroids.shape
    pq = faiss.ProductQuantizer(n_sub * ds, n_sub, bits)
    faiss.copy_array_to_vector(centroids.float().numpy().reshape(-1), pq.centroids)
    pq.sync_transposed_centroids()  # the faster assignment (same codes)
    return pq
