"""The surgery that puts BSPF-ViT into a live timm model, ToMe-style: each attention's and pruned block's
class is swapped for a subclass, so LayerScale, drop path and the norms stay timm's own.

Its reasoning: docs/reading-bspf.md, "vitexp/methods/bspf/surgery.py".
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.models.metaformer import Attention as MetaAttention
from timm.models.metaformer import MetaFormerBlock
from timm.models.vision_transformer import Attention, Block

from vitexp.methods.bspf.pruning import TokenPruner


class ChunkAttention(Attention):
    """timm ``Attention`` computed per chunk (class swapped onto a live module by
    :func:`patch_attention`, which sets ``num_prefix``, ``num_chunks`` (None: one chunk),
    ``chunk_layout``, ``keep_probs`` (compute the softmax explicitly and keep the head-averaged
    patch-to-patch blocks, B×C×Ω×Ω, detached in ``last_blocks``) and ``qk`` (shared projection))."""

    num_prefix: int
    num_chunks: int | None
    chunk_layout: str
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
        out, blocks = self.attend(x, need_blocks=self.keep_probs)
        if blocks is not None:
            self.last_blocks = blocks.detach()
        return out

    def attend(self, x: torch.Tensor, need_blocks: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(output, head-averaged patch-to-patch blocks B×C×Ω×Ω or None). The blocks carry the
        graph (the scorer's straight-through gradient reaches q and k through them)."""
        B, N, _ = x.shape
        P = self.num_prefix
        q, k, v = self._qkv(x)
        H, d = q.shape[1], q.shape[-1]
        chunks = self.num_chunks or 1
        drop = self.attn_drop.p if self.training else 0.0
        if chunks == 1 and not need_blocks:  # one chunk is full attention: timm's single fused call
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=drop, scale=self.scale)
            return self._project(out, B, N), None
        L = (N - P) // chunks
        if L * chunks != N - P:
            raise RuntimeError(f"{N - P} patch tokens do not split into {chunks} equal chunks")
        qp = q[:, :, P:].reshape(B, H * chunks, L, d)
        kc = self._with_prefix(k, P, chunks, L)
        vc = self._with_prefix(v, P, chunks, L)
        blocks = None
        if need_blocks:
            attn = ((qp * self.scale) @ kc.transpose(-2, -1)).softmax(dim=-1)
            blocks = attn[..., P:].reshape(B, H, chunks, L, L).mean(dim=1)
            out_p = self.attn_drop(attn) @ vc
        else:
            out_p = F.scaled_dot_product_attention(qp, kc, vc, dropout_p=drop, scale=self.scale)
        out_p = out_p.reshape(B, H, N - P, d)
        if P:
            out_pre = F.scaled_dot_product_attention(q[:, :, :P], k, v, dropout_p=drop, scale=self.scale)
            out = torch.cat([out_pre.to(out_p.dtype), out_p], dim=2)
        else:
            out = out_p
        return self._project(out, B, N), blocks

    @staticmethod
    def _with_prefix(t: torch.Tensor, P: int, chunks: int, L: int) -> torch.Tensor:
        """(B, H, P + C·Ω, d) -> (B, H·C, P + Ω, d): each chunk's tokens after the prefix tokens."""
        B, H, _, d = t.shape
        patches = t[:, :, P:].reshape(B, H, chunks, L, d)
        prefix = t[:, :, :P].unsqueeze(2).expand(B, H, chunks, P, d)
        return torch.cat([prefix, patches], dim=3).reshape(B, H * chunks, P + L, d)

    def _project(self, out: torch.Tensor, B: int, N: int) -> torch.Tensor:
        out = self.norm(out.transpose(1, 2).reshape(B, N, -1))
        return self.proj_drop(self.proj(out))


class PruneBlock(Block):
    """timm ``Block`` whose tokens are pruned (and fused) between attention and MLP. A block that
    divides its residual branches (LV-ViT's ``skip_lam``) keeps doing so."""

    pruner: TokenPruner

    def forward(self, x: torch.Tensor, attn_mask=None, is_causal: bool = False) -> torch.Tensor:
        lam = getattr(self, "skip_lam", 1.0)
        out, blocks = self.attn.attend(self.norm1(x), need_blocks=True)
        self.attn.last_blocks = blocks.detach()
        x = x + self.drop_path1(self.ls1(out)) / lam
        x = self.pruner(x, blocks)
        x = x + self.drop_path2(self.ls2(self.mlp(self.norm2(x)))) / lam
        return x


class PruneMetaBlock(MetaFormerBlock):
    """timm ``MetaFormerBlock`` (CaFormer) pruned between its attention mixer and its MLP."""

    pruner: TokenPruner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, blocks = self.token_mixer.attend(self.norm1(x), need_blocks=True)
        self.token_mixer.last_blocks = blocks.detach()
        x = self.res_scale1(x) + self.layer_scale1(self.drop_path1(out))
        x = self.pruner(x, blocks)
        return self.res_scale2(x) + self.layer_scale2(self.drop_path2(self.mlp(self.norm2(x))))


class WindowOrder(nn.Module):
    """Reorders the patch tokens (after ``num_prefix`` prefix tokens) by ``order`` (a
    non-persistent buffer: raster index of the token at each window-order position)."""

    def __init__(self, order: torch.Tensor, num_prefix: int):
        super().__init__()
        self.num_prefix = num_prefix
        self.register_buffer("order", order, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        P = self.num_prefix
        return torch.cat([x[:, :P], x[:, P:].index_select(1, self.order)], dim=1)


def _enter_window_order(block: nn.Module, args: tuple) -> tuple:
    """Forward pre-hook of a ViT's first block: its input in window order."""
    return (block.window_order(args[0]), *args[1:])


def put_in_window_order(first_block: nn.Module, order: torch.Tensor, num_prefix: int) -> None:
    """Reorder the tokens entering ``first_block`` (and so every later block) into window order."""
    first_block.window_order = WindowOrder(order, num_prefix)
    first_block.register_forward_pre_hook(_enter_window_order)


class RestoringSequential(nn.Sequential):
    """A MetaFormer stage's blocks run on window-ordered and pruned tokens; then the full raster
    grid is restored for the next stage's strided downsampling: every position takes the value of
    the token that stands for it (its own, or the kept token it was fused into, found by composing
    the window order with each pruner's assignment). The restore is a gather: no MACs.
    ``window_order`` (a non-persistent buffer, or None) is set by the surgery."""

    window_order: torch.Tensor | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, D = x.shape
        order = getattr(self, "window_order", None)
        if order is not None and order.numel() != N:
            raise RuntimeError(
                "BSPF on a MetaFormer fixes its windows for the grid of backbone.img_size "
                f"({order.numel()} tokens); this input gives {N}: run it at backbone.img_size "
                "(SHViT's token stages take any grid)"
            )
        if order is not None:
            x = x.index_select(1, order)
            where = torch.argsort(order).expand(B, N)  # raster position -> its window-order slot
        else:
            where = torch.arange(N, device=x.device).expand(B, N)
        for block in self:
            x = block(x)
            pruner = getattr(block, "pruner", None)
            if pruner is not None:
                where = pruner.last["assign"].gather(1, where)
        if order is None and x.shape[1] == N:
            return x
        return x.gather(1, where.unsqueeze(-1).expand(B, N, D))


def patch_attention(
    attn: nn.Module, num_prefix: int, num_chunks: int, symmetric: bool, chunk_layout: str = "window"
) -> ChunkAttention:
    """Swap a timm ``Attention``'s class to :class:`ChunkAttention`; with ``symmetric``, replace
    its qkv projection by a shared q/k projection initialised from (W_q + W_k)/2 and a v projection.
    timm's MetaFormer attention (CaFormer) is given the ViT attention's identity norms first."""
    if isinstance(attn, MetaAttention):
        attn.q_norm, attn.k_norm, attn.norm = nn.Identity(), nn.Identity(), nn.Identity()
        attn.attn_dim, attn.gate = attn.num_heads * attn.head_dim, None
    elif not isinstance(attn, Attention) or getattr(attn, "gate", None) is not None:
        raise TypeError(
            f"BSPF patches timm's vision_transformer or metaformer Attention, got {type(attn).__name__}"
        )
    attn.__class__ = ChunkAttention
    attn.num_prefix, attn.num_chunks, attn.keep_probs = num_prefix, num_chunks, False
    attn.chunk_layout = chunk_layout
    attn.qk = None
    if symmetric:
        dim_in, a = attn.qkv.in_features, attn.attn_dim
        w, b = attn.qkv.weight.data, attn.qkv.bias
        qk = nn.Linear(dim_in, a, bias=b is not None).to(w)
        v = nn.Linear(dim_in, a, bias=b is not None).to(w)
        qk.weight.data.copy_(0.5 * (w[:a] + w[a : 2 * a]))
        v.weight.data.copy_(w[2 * a :])
        if b is not None:
            qk.bias.data.copy_(0.5 * (b.data[:a] + b.data[a : 2 * a]))
            v.bias.data.copy_(b.data[2 * a :])
        del attn.qkv
        attn.qk, attn.v = qk, v
    return attn
