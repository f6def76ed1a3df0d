"""BSPF-ViT: block-based symmetric pruning and fusion (arXiv 2507.12125), as vitexp reads it.

The paper's full text was not available; each decision below is a named config key
(``conf/method/bspf.yaml``) and is repeated in the README's "Reading of the papers".

1. **Chunk attention** (``chunk_size`` = Ω). Patch tokens, in raster order, are split into C
   chunks of Ω consecutive tokens. A patch query attends to the keys of its own chunk and to the
   prefix tokens (CLS, registers). A prefix query attends to every token. This is computed as
   batched per-chunk attention (q of shape B×H×C×Ω×d), so its cost is O(N·Ω), not a masked N×N
   product. The chunk count C is fixed by the first layer. Pruning keeps the same number of tokens
   in every chunk, so later layers chunk the surviving tokens with Ω' = ⌈ρΩ⌉. ``chunk_size: null``
   means one chunk spanning every patch token: full attention, and Table 8's "BSPF without
   chunking".
2. **Block-based 2D pruning** at ``prune_layers``, after that layer's attention, before its MLP.
   - Scoring: each chunk's head-averaged patch-to-patch attention block A_{m,m} (Ω×Ω) is scored by
     a 3×3 convolution, S = conv(A). ``score: local3x3`` is learnable and initialised to the 3×3
     average. ``score: single`` is the fixed identity kernel, Table 6's single-token score.
   - Selection: the top ⌈ρΩ²⌉ entries of each block are kept (mask M). A token's importance
     counts its kept entries as a query (its row of M) and as a key (its column of M); this is the
     joint Q/K decision. The ⌈ρΩ⌉ most important tokens of each chunk survive, so chunks stay
     balanced. Ties are broken by the token's summed score.
   - Gradient (straight-through): each surviving token is multiplied by g = 1 + s − sg(s). Here s
     is its soft importance, the row plus column sum of M⊙S divided by Ω, and sg is stop-gradient.
     The forward value is unchanged (g = 1), while the scorer receives ∂L/∂s = ⟨∂L/∂x, x⟩ through
     every kept token.
3. **Fusion** (``fusion``).
   - ``similarity``: each pruned token i is merged into the kept token j of its chunk that
     maximises cos(x_i, x_j)·(1 − Hamming(m_i, m_j)/Ω), where m is a token's row of M. The merge
     is a similarity-weighted average: x_j ← (x_j + Σ w_i x_i) / (1 + Σ w_i), with w_i the
     positive part of that similarity.
   - ``none``: pruned tokens are dropped.
   - ``paper_literal``: Eq. 8 / Algorithm 1 line 14 as the public review reads it. Pruned values
     are added only where the kept mask is non-zero, x ← x⊙k + (x⊙(1−k))⊙k, which adds exactly
     zero. It is implemented, and the audit shows it equals ``none``.
4. **Symmetric Q/K** (``symmetric: true``).
   - Queries and keys share one projection W_qk, computed once per token. When the method starts
     from a model with separate weights, W_qk is initialised from (W_q + W_k)/2 (and likewise the
     biases).
   - ``mirror: upper`` scores only the upper triangle of each block, with the kernel symmetrised
     to (w + wᵀ)/2, and mirrors it: S ← triu(S) + triu(S, 1)ᵀ.
   - ``mirror: none`` scores the full block.
5. Tokens are removed by gather, so later layers, MLPs included, run on fewer tokens. CLS and the
   other prefix tokens are always kept. The surviving tokens stay in raster order.

The method patches a live timm ``VisionTransformer`` in place, ToMe-style: each block's and
attention's class is swapped for a subclass, so LayerScale, drop path and the norms stay timm's
own.
"""
from __future__ import annotations

import math
from typing import Any, ClassVar, Mapping, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.models.metaformer import Attention as MetaAttention
from timm.models.metaformer import MetaFormer, MetaFormerBlock
from timm.models.vision_transformer import Attention, Block

from vitexp.methods.base import Method

SCORES = ("local3x3", "single")
FUSIONS = ("similarity", "none", "paper_literal")
MIRRORS = ("none", "upper")


class BlockScorer(nn.Module):
    """Scores a batch of Ω×Ω attention blocks with one 3×3 kernel (padding 1)."""

    def __init__(self, score: str = "local3x3", mirror: str = "none"):
        super().__init__()
        if score not in SCORES:
            raise ValueError(f"method.score={score!r}: valid scores are {SCORES}")
        if mirror not in MIRRORS:
            raise ValueError(f"method.mirror={mirror!r}: valid mirrors are {MIRRORS}")
        self.score, self.mirror = score, mirror
        kernel = torch.full((1, 1, 3, 3), 1.0 / 9.0) if score == "local3x3" else F.pad(torch.ones(1, 1, 1, 1), (1, 1, 1, 1))
        self.weight = nn.Parameter(kernel, requires_grad=score == "local3x3")

    def kernel(self) -> torch.Tensor:
        w = self.weight
        if self.mirror == "upper":
            w = 0.5 * (w + w.transpose(-1, -2))
        return w

    def forward(self, blocks: torch.Tensor) -> torch.Tensor:
        """blocks: (..., Ω, Ω) -> scores of the same shape."""
        lead, (n, m) = blocks.shape[:-2], blocks.shape[-2:]
        s = F.conv2d(blocks.reshape(-1, 1, n, m), self.kernel(), padding=1).reshape(*lead, n, m)
        if self.mirror == "upper":
            upper = torch.triu(s)
            s = upper + torch.triu(s, 1).transpose(-1, -2)
        return s


class ChunkAttention(Attention):
    """timm ``Attention`` computed per chunk (class swapped onto a live module).

    Set by :func:`patch_attention`: ``num_prefix``, ``num_chunks`` (None: one chunk),
    ``shared_qk`` (symmetric Q/K), ``keep_probs`` (store the patch-to-patch attention blocks of
    the last call in ``last_blocks``, shape B×C×Ω×Ω, head-averaged)."""

    num_prefix: int
    num_chunks: int | None
    keep_probs: bool

    def _qkv(self, x: torch.Tensor):
        B, N, _ = x.shape
        H, d = self.num_heads, self.head_dim
        if getattr(self, "qk", None) is not None:  # shared projection: one matmul for q and k
            q = self.qk(x).reshape(B, N, H, d).transpose(1, 2)
            v = self.v(x).reshape(B, N, H, d).transpose(1, 2)
            k = q
        else:
            q, k, v = self.qkv(x).reshape(B, N, 3, H, d).permute(2, 0, 3, 1, 4).unbind(0)
        return self.q_norm(q), self.k_norm(k), v

    def forward(self, x: torch.Tensor, attn_mask=None, is_causal: bool = False) -> torch.Tensor:
        B, N, _ = x.shape
        P = self.num_prefix
        q, k, v = self._qkv(x)
        H, d = q.shape[1], q.shape[-1]
        chunks = self.num_chunks or 1
        drop = self.attn_drop.p if self.training else 0.0
        if chunks == 1 and not self.keep_probs:  # one chunk is full attention: timm's single fused call
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=drop, scale=self.scale)
            out = self.norm(out.transpose(1, 2).reshape(B, N, H * d))
            return self.proj_drop(self.proj(out))
        L = (N - P) // chunks
        if L * chunks != N - P:
            raise RuntimeError(f"{N - P} patch tokens do not split into {chunks} equal chunks")
        qp = q[:, :, P:].reshape(B, H, chunks, L, d)
        kp = k[:, :, P:].reshape(B, H, chunks, L, d)
        vp = v[:, :, P:].reshape(B, H, chunks, L, d)
        kc = torch.cat([k[:, :, :P].unsqueeze(2).expand(B, H, chunks, P, d), kp], dim=3)
        vc = torch.cat([v[:, :, :P].unsqueeze(2).expand(B, H, chunks, P, d), vp], dim=3)
        if self.keep_probs:
            attn = (qp * self.scale) @ kc.transpose(-2, -1)
            attn = attn.softmax(dim=-1)
            self.last_blocks = attn[..., P:].mean(dim=1)  # B, C, Ω, Ω (head-averaged)
            out_p = self.attn_drop(attn) @ vc
        else:
            out_p = F.scaled_dot_product_attention(qp, kc, vc, dropout_p=drop, scale=self.scale)
        out_p = out_p.reshape(B, H, N - P, d)
        if P:
            out_pre = F.scaled_dot_product_attention(q[:, :, :P], k, v, dropout_p=drop, scale=self.scale)
            out = torch.cat([out_pre, out_p], dim=2)
        else:
            out = out_p
        out = out.transpose(1, 2).reshape(B, N, H * d)
        out = self.norm(out)
        out = self.proj(out)
        return self.proj_drop(out)


class PruneBlock(Block):
    """timm ``Block`` whose tokens are pruned (and fused) between attention and MLP. A block that
    divides its residual branches (LV-ViT's ``skip_lam``) keeps doing so."""

    pruner: "TokenPruner"

    def forward(self, x: torch.Tensor, attn_mask=None, is_causal: bool = False) -> torch.Tensor:
        lam = getattr(self, "skip_lam", 1.0)
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x)))) / lam
        x = self.pruner(x, self.attn.last_blocks)
        x = x + self.drop_path2(self.ls2(self.mlp(self.norm2(x)))) / lam
        return x


class PruneMetaBlock(MetaFormerBlock):
    """timm ``MetaFormerBlock`` (CaFormer) pruned between its attention mixer and its MLP."""

    pruner: "TokenPruner"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.res_scale1(x) + self.layer_scale1(self.drop_path1(self.token_mixer(self.norm1(x))))
        x = self.pruner(x, self.token_mixer.last_blocks)
        return self.res_scale2(x) + self.layer_scale2(self.drop_path2(self.mlp(self.norm2(x))))


class RestoringSequential(nn.Sequential):
    """A MetaFormer stage's blocks run on pruned tokens, then the full grid is restored for the
    next stage's strided downsampling: every pruned position takes the value of the token it was
    fused into (its similarity target), every kept position its own. The restore is a gather: no MACs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, D = x.shape
        where = torch.arange(N, device=x.device).expand(B, N)
        for block in self:
            x = block(x)
            pruner = getattr(block, "pruner", None)
            if pruner is not None:
                where = pruner.last["assign"].gather(1, where)
        if x.shape[1] == N:
            return x
        return x.gather(1, where.unsqueeze(-1).expand(B, N, D))


class TokenPruner(nn.Module):
    """Block-based 2D pruning and fusion of one layer (see the module docstring, steps 2–3)."""

    def __init__(self, keep_ratio: float, num_prefix: int, num_chunks: int, score: str, mirror: str, fusion: str):
        super().__init__()
        if fusion not in FUSIONS:
            raise ValueError(f"method.fusion={fusion!r}: valid fusions are {FUSIONS}")
        self.keep_ratio, self.num_prefix, self.num_chunks, self.fusion = keep_ratio, num_prefix, num_chunks, fusion
        self.scorer = BlockScorer(score, mirror)
        self.track = False  # record where every token went (for restoring a full grid)
        self.last: dict[str, torch.Tensor] = {}

    def select(self, blocks: torch.Tensor):
        """blocks (B, C, Ω, Ω) -> (kept token indices per chunk (B, C, Ω'), entry mask M, scores S, soft importance)."""
        B, C, L, _ = blocks.shape
        scores = self.scorer(blocks)
        flat = scores.reshape(B, C, L * L)
        n_entries = max(1, math.ceil(self.keep_ratio * L * L))
        top = flat.topk(n_entries, dim=-1).indices
        mask = torch.zeros_like(flat).scatter_(-1, top, 1.0).reshape(B, C, L, L)
        count = mask.sum(-1) + mask.sum(-2)  # as query (row) + as key (column)
        kept_scores = mask * scores
        soft = (kept_scores.sum(-1) + kept_scores.sum(-2)) / L
        tie = soft.detach() / (soft.detach().abs().amax(-1, keepdim=True) + 1e-12)  # in [-1, 1]
        n_keep = max(1, math.ceil(self.keep_ratio * L))
        keep = (count + 0.25 * tie).topk(n_keep, dim=-1).indices.sort(dim=-1).values
        return keep, mask, scores, soft

    def forward(self, x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        B, N, D = x.shape
        P, C = self.num_prefix, self.num_chunks
        L = (N - P) // C
        keep, mask, scores, soft = self.select(blocks)
        n_keep = keep.shape[-1]
        patches = x[:, P:].reshape(B, C, L, D)
        source = self._fuse_paper_literal(patches, keep) if self.fusion == "paper_literal" else patches
        kept = source.gather(2, keep.unsqueeze(-1).expand(B, C, n_keep, D))
        # straight-through: forward value 1, gradient to the scorer through every kept token
        g = 1.0 + soft - soft.detach()
        kept = kept * g.gather(2, keep).unsqueeze(-1)
        match = self._match(patches, kept, keep, mask) if n_keep < L and (self.fusion == "similarity" or self.track) else None
        if self.fusion == "similarity" and match is not None:
            kept = self._merge(kept, *match)
        self.last = {"keep": keep.detach(), "mask": mask.detach()}
        if self.track:  # where each input token went: its own slot, or its fusion target's
            self.last["assign"] = self._assignment(keep, match, L)
        return torch.cat([x[:, :P], kept.reshape(B, C * n_keep, D)], dim=1)

    @staticmethod
    def _fuse_paper_literal(patches: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """x⊙k + (x⊙(1−k))⊙k over a chunk's tokens (k: kept-token mask): the second term is 0."""
        B, C, L, _ = patches.shape
        k = torch.zeros(B, C, L, device=patches.device, dtype=patches.dtype).scatter_(2, keep, 1.0).unsqueeze(-1)
        return patches * k + (patches * (1 - k)) * k

    @staticmethod
    def _match(patches, kept, keep, mask):
        """Each pruned token's best kept token of its chunk by cos(x_i, x_j)·(1 − Hamming(m_i, m_j)/Ω):
        (pruned indices, pruned tokens, target slot, similarity)."""
        B, C, L, D = patches.shape
        n_keep = keep.shape[-1]
        is_kept = torch.zeros(B, C, L, dtype=patches.dtype, device=patches.device).scatter_(2, keep, 1.0)
        pruned_idx = is_kept.argsort(dim=-1, stable=True)[..., : L - n_keep]  # ascending: pruned first, in order
        pruned = patches.gather(2, pruned_idx.unsqueeze(-1).expand(B, C, L - n_keep, D))
        cos = F.normalize(pruned, dim=-1) @ F.normalize(kept, dim=-1).transpose(-1, -2)  # B,C,R,K
        m_pruned = mask.gather(2, pruned_idx.unsqueeze(-1).expand(B, C, L - n_keep, L))
        m_kept = mask.gather(2, keep.unsqueeze(-1).expand(B, C, n_keep, L))
        inter = m_pruned @ m_kept.transpose(-1, -2)
        hamming = m_pruned.sum(-1, keepdim=True) + m_kept.sum(-1).unsqueeze(-2) - 2 * inter
        best, target = (cos * (1.0 - hamming / L)).max(dim=-1)  # B,C,R
        return pruned_idx, pruned, target, best

    @staticmethod
    def _merge(kept, pruned_idx, pruned, target, best) -> torch.Tensor:
        """x_j ← (x_j + Σ w_i x_i) / (1 + Σ w_i) over the pruned tokens i matched to j, w = max(sim, 0)."""
        B, C, n_keep, _ = kept.shape
        w = best.clamp(min=0).unsqueeze(-1)
        num = kept.scatter_add(2, target.unsqueeze(-1).expand_as(pruned), w * pruned)
        den = torch.ones(B, C, n_keep, 1, dtype=kept.dtype, device=kept.device).scatter_add(2, target.unsqueeze(-1), w)
        return num / den

    @classmethod
    def _fuse_similarity(cls, patches, kept, keep, mask) -> torch.Tensor:
        return cls._merge(kept, *cls._match(patches, kept, keep, mask))

    @staticmethod
    def _assignment(keep: torch.Tensor, match, L: int) -> torch.Tensor:
        """(B, C·L) index of the output patch token that stands for each input patch token."""
        B, C, n_keep = keep.shape
        base = (torch.arange(C, device=keep.device) * n_keep).view(1, C, 1)
        assign = torch.zeros(B, C, L, dtype=torch.long, device=keep.device)
        assign.scatter_(2, keep, (base + torch.arange(n_keep, device=keep.device).view(1, 1, n_keep)).expand(B, C, n_keep))
        if match is not None:
            pruned_idx, _, target, _ = match
            assign.scatter_(2, pruned_idx, base.expand_as(target) + target)
        return assign.reshape(B, C * L)


def _chunk_count(num_patches: int, chunk_size: int | None) -> int:
    if chunk_size is None:
        return 1
    if num_patches % chunk_size:
        divisors = [d for d in range(1, num_patches + 1) if num_patches % d == 0]
        raise ValueError(f"method.chunk_size={chunk_size} does not divide the {num_patches} patch tokens; "
                         f"valid chunk sizes: {divisors} (or null for one chunk)")
    return num_patches // chunk_size


def patch_attention(attn: nn.Module, num_prefix: int, num_chunks: int, symmetric: bool) -> ChunkAttention:
    """Swap a timm ``Attention``'s class to :class:`ChunkAttention`; with ``symmetric``, replace
    its qkv projection by a shared q/k projection initialised from (W_q + W_k)/2 and a v projection.
    timm's MetaFormer attention (CaFormer) is given the ViT attention's identity norms first."""
    if isinstance(attn, MetaAttention):
        attn.q_norm, attn.k_norm, attn.norm = nn.Identity(), nn.Identity(), nn.Identity()
        attn.attn_dim, attn.gate = attn.num_heads * attn.head_dim, None
    elif not isinstance(attn, Attention) or getattr(attn, "gate", None) is not None:
        raise TypeError(f"BSPF patches timm's vision_transformer or metaformer Attention, got {type(attn).__name__}")
    attn.__class__ = ChunkAttention
    attn.num_prefix, attn.num_chunks, attn.keep_probs = num_prefix, num_chunks, False
    attn.qk = None
    if symmetric:
        dim_in, a = attn.qkv.in_features, attn.attn_dim
        w, b = attn.qkv.weight.data, attn.qkv.bias
        qk = nn.Linear(dim_in, a, bias=b is not None).to(w)
        v = nn.Linear(dim_in, a, bias=b is not None).to(w)
        qk.weight.data.copy_(0.5 * (w[:a] + w[a:2 * a]))
        v.weight.data.copy_(w[2 * a:])
        if b is not None:
            qk.bias.data.copy_(0.5 * (b.data[:a] + b.data[a:2 * a]))
            v.bias.data.copy_(b.data[2 * a:])
        del attn.qkv
        attn.qk, attn.v = qk, v
    return attn


class BSPF(Method):
    """``method=bspf``: chunk attention in every layer, pruning + fusion at ``prune_layers``."""

    objective = "classify"
    budget_kinds: ClassVar[tuple[str, ...]] = ("keep_ratio",)

    def __init__(self, name: str = "bspf", chunk_size: int | None = 49, prune_layers: Sequence[int] = (4, 6, 9),
                 score: str = "local3x3", fusion: str = "similarity", symmetric: bool = False, mirror: str = "none"):
        super().__init__(name)
        if score not in SCORES:
            raise ValueError(f"method.score={score!r}: valid scores are {SCORES}")
        if fusion not in FUSIONS:
            raise ValueError(f"method.fusion={fusion!r}: valid fusions are {FUSIONS}")
        if mirror not in MIRRORS:
            raise ValueError(f"method.mirror={mirror!r}: valid mirrors are {MIRRORS}")
        self.chunk_size = None if chunk_size in (None, "null") else int(chunk_size)
        self.prune_layers = sorted(int(i) for i in prune_layers)
        self.score, self.fusion, self.symmetric, self.mirror = score, fusion, bool(symmetric), mirror

    def keep_ratio(self, budget: Mapping[str, Any]) -> float:
        return float(budget["keep_ratio"]) if budget["kind"] == "keep_ratio" else 1.0

    def validate_budget(self, budget: Mapping[str, Any], arch: Mapping[str, Any]) -> None:
        from vitexp.errors import ConfigError

        super().validate_budget(budget, arch)
        if budget["kind"] == "keep_ratio" and not 0 < float(budget["keep_ratio"]) <= 1:
            raise ConfigError(f"budget.keep_ratio: {budget['keep_ratio']} must be in (0, 1]")
        depth = int(arch["depth"])
        bad = [i for i in self.prune_layers if not 0 <= i < depth]
        if bad:
            raise ConfigError(f"method.prune_layers: {bad} outside the backbone's layers 0..{depth - 1}")
        if "img_size" in arch and "patch_size" in arch:
            try:
                _chunk_count((int(arch["img_size"]) // int(arch["patch_size"])) ** 2, self.chunk_size)
            except ValueError as err:
                raise ConfigError(str(err)) from None

    def apply(self, backbone: nn.Module, budget: Mapping[str, Any]) -> nn.Module:
        if isinstance(backbone, MetaFormer):
            return self._apply_metaformer(backbone, budget)
        blocks = getattr(backbone, "blocks", None)
        if blocks is None or not len(blocks):
            raise TypeError(f"BSPF needs a ViT with .blocks; {type(backbone).__name__} has none")
        P = int(getattr(backbone, "num_prefix_tokens", 1))
        num_patches = backbone.patch_embed.num_patches
        chunks = _chunk_count(num_patches, self.chunk_size)
        rho = self.keep_ratio(budget)
        for i, block in enumerate(blocks):
            patch_attention(block.attn, P, chunks, self.symmetric)
            if i in self.prune_layers:
                block.__class__ = PruneBlock
                block.attn.keep_probs = True
                block.pruner = TokenPruner(rho, P, chunks, self.score, self.mirror, self.fusion)
        return backbone


    def _apply_metaformer(self, model: MetaFormer, budget: Mapping[str, Any]) -> MetaFormer:
        """CaFormer (decision, README "Reading of the papers"): chunk attention in every attention
        stage (a stage whose token count Ω does not divide attends as one chunk); pruning and
        fusion at ``prune_layers``, counted within the first attention stage (stage 3, 14×14
        tokens at 224 px); before that stage hands its tokens to the strided downsampling of
        stage 4, :class:`RestoringSequential` puts the full grid back from the fused tokens.
        Stage 4 (7×7) runs unpruned."""
        size = int(model.pretrained_cfg["input_size"][-1])
        attn_stages = [i for i, st in enumerate(model.stages) if isinstance(st.blocks[0].token_mixer, MetaAttention)]
        if not attn_stages:
            raise TypeError("BSPF on a MetaFormer needs attention stages (CaFormer)")
        rho = self.keep_ratio(budget)
        for i in attn_stages:
            side = size // (4 * 2 ** i)
            tokens = side * side
            chunks = tokens // self.chunk_size if self.chunk_size and tokens % self.chunk_size == 0 else 1
            stage = model.stages[i]
            for j, block in enumerate(stage.blocks):
                patch_attention(block.token_mixer, 0, chunks, self.symmetric)
                if i == attn_stages[0] and j in self.prune_layers:
                    block.__class__ = PruneMetaBlock
                    block.token_mixer.keep_probs = True
                    block.pruner = TokenPruner(rho, 0, chunks, self.score, self.mirror, self.fusion)
                    block.pruner.track = True
            if i == attn_stages[0]:
                stage.blocks.__class__ = RestoringSequential
        return model


class ChunkOnly(BSPF):
    """``method=chunk``: chunk attention in every layer; no pruning, no fusion (Table 8)."""

    budget_kinds: ClassVar[tuple[str, ...]] = ("none",)

    def __init__(self, name: str = "chunk", chunk_size: int | None = 49, symmetric: bool = False):
        super().__init__(name=name, chunk_size=chunk_size, prune_layers=(), symmetric=symmetric)
