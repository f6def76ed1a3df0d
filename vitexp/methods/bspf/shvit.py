"""BSPF-ViT on SHViT (timm ``shvit_*``), patched onto a live model ToMe-style.

SHViT keeps its tokens as NCHW maps. A block is a residual depthwise 3×3 convolution, a residual
single-head attention (SHSA) on the first ``pdim`` channels (the other channels pass through to
its 1×1 projection) and a residual FFN of 1×1 convolutions; SHSA blocks form stages 2 and 3.
Decisions (docs/reading-backbones.md, SHViT):

- **Where**: every SHSA stage becomes a :class:`TokenStage`. Its blocks' attention is chunk
  attention (:class:`ChunkSHSA`); pruning and fusion happen at ``prune_layers``, counted within
  the first SHSA stage (stage 2), between a block's attention and its FFN, as in ViT blocks.
- **What runs on the kept tokens**: the positions of the stage are gathered into a token sequence
  (window order for ``chunk_layout=window``), and the SHSA and the FFN run on the tokens that
  survive, as a (B, C, N', 1) map, so their 1×1 convolutions, attention matmuls and BatchNorm
  statistics see N' tokens only. SHSA's GroupNorm (one group) normalises over the tokens present.
- **Untouched channels**: a pruned position leaves with all its channels; fusion merges the whole
  token (attention channels and pass-through channels alike, by the similarity of the whole token).
- **What runs on the grid**: each block's depthwise 3×3 convolution needs neighbours, so it runs on
  the grid restored from the tokens (a gather: every pruned position takes the value of the kept
  token it was fused into, or that token's own when nothing was fused), at full cost; then the kept
  tokens read the convolution's output at their own positions. A pruned position's own value is
  never used again. The stage hands the next stage's downsampling (and the head, or a feature
  pyramid) the restored grid.
- **Chunks follow the grid**: the layout is decided from each call's grid. Where it cannot tile
  the grid (a later stage, or the grid of an image of another size), the stage attends as one chunk, which is
  SHViT's own global attention.
- Shared Q/K (``symmetric``) is not implemented for SHSA; the method refuses it on SHViT.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from timm.models.shvit import SHSA, SHViT

from vitexp.methods.bspf.layout import check_layout, window_order
from vitexp.methods.bspf.pruning import TokenPruner


def stage_layout(grid: tuple[int, int], chunk_size: int | None, layout: str) -> tuple[int, torch.Tensor | None]:
    """(chunk count, window order or None) on ``grid``; one chunk where the layout cannot tile it."""
    try:
        chunks = check_layout(grid, chunk_size, layout)
    except ValueError:
        return 1, None
    order = window_order(grid, chunk_size) if layout == "window" and chunks > 1 else None
    return chunks, order


class ChunkSHSA(SHSA):
    """timm's ``SHSA`` on a token map (B, C, N, 1) whose N tokens form ``chunks`` chunks of
    consecutive tokens: a query attends to the keys of its own chunk. ``num_chunks`` records the
    last call's chunk count (for the FLOPs protocol); ``chunk_layout`` is set by the surgery."""

    num_chunks: int | None
    chunk_layout: str

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("BSPF's SHSA runs through its TokenStage (timm's block-by-block path, e.g. gradient "
                           "checkpointing, would skip the pruning)")

    def attend(self, x: torch.Tensor, chunks: int, need_blocks: bool = False):
        """(SHSA's output before its residual, the chunks' attention blocks B×C×Ω×Ω or None).
        The blocks carry the graph (the scorer's straight-through gradient reaches q and k)."""
        B, _, N, _ = x.shape
        if N % chunks:
            raise RuntimeError(f"{N} tokens do not split into {chunks} equal chunks")
        self.num_chunks = chunks
        L = N // chunks
        x1, x2 = torch.split(x, [self.pdim, self.dim - self.pdim], dim=1)
        q, k, v = torch.split(self.qkv(self.pre_norm(x1)), [self.qk_dim, self.qk_dim, self.pdim], dim=1)
        q, k, v = (t.flatten(2).transpose(1, 2).reshape(B, chunks, L, -1) for t in (q, k, v))
        attn = ((q @ k.transpose(-2, -1)) * self.scale).softmax(dim=-1)  # B, C, Ω, Ω (single head)
        x1 = (attn @ v).reshape(B, N, self.pdim).transpose(1, 2).unsqueeze(-1)
        out = self.proj(torch.cat([x1.to(x2.dtype), x2], dim=1))
        return out, (attn if need_blocks else None)


class TokenStage(nn.Sequential):
    """The blocks of one SHSA stage (class swapped onto ``StageBlock.blocks``): NCHW in, the
    restored NCHW grid out (module docstring). A block with a ``pruner`` prunes and fuses between
    its attention and its FFN. ``chunk_size`` and ``chunk_layout`` are set by the surgery."""

    chunk_size: int | None
    chunk_layout: str

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, D, H, W = x.shape
        N = H * W
        chunks, order = stage_layout((H, W), self.chunk_size, self.chunk_layout)
        raster = torch.arange(N, device=x.device)
        order = raster if order is None else order.to(x.device)
        pos = order.expand(B, N)  # token slot -> the raster position of the token itself
        where = torch.argsort(order).expand(B, N)  # raster position -> the slot that stands for it
        grid = x
        for block in self:
            grid = block.conv(grid)  # depthwise 3x3 on the full grid
            t = grid.flatten(2).gather(2, pos.unsqueeze(1).expand(B, D, pos.shape[1])).unsqueeze(-1)
            pruner: TokenPruner | None = getattr(block, "pruner", None)
            out, blocks = block.mixer.m.attend(t, chunks, need_blocks=pruner is not None)
            t = t + out
            if pruner is not None:
                pruner.num_chunks = chunks
                t = pruner(t.squeeze(-1).transpose(1, 2), blocks).transpose(1, 2).unsqueeze(-1)
                keep = pruner.last["keep"]  # B, C, Ω' indices within each chunk
                L = pos.shape[1] // chunks
                kept = (keep + L * torch.arange(chunks, device=x.device).view(1, chunks, 1)).reshape(B, -1)
                pos = pos.gather(1, kept)
                where = pruner.last["assign"].gather(1, where)
            t = block.ffn(t)
            grid = t.squeeze(-1).gather(2, where.unsqueeze(1).expand(B, D, N)).reshape(B, D, H, W)
        return grid


def shsa_stages(model: SHViT) -> list[int]:
    """Indices of the stages whose blocks have SHSA mixers."""
    return [i for i, st in enumerate(model.stages) if isinstance(getattr(st.blocks[0].mixer, "m", None), SHSA)]


def patch_shvit(model: SHViT, keep_ratio: float, chunk_size: int | None, chunk_layout: str,
                prune_layers, score: str, mirror: str, fusion: str) -> SHViT:
    """Make every SHSA stage a :class:`TokenStage` with :class:`ChunkSHSA` attention; a
    :class:`TokenPruner` after the attention of ``prune_layers`` (counted in the first SHSA stage)."""
    stages = shsa_stages(model)
    if not stages:
        raise TypeError("BSPF on SHViT needs SHSA stages")
    for i in stages:
        stage = model.stages[i]
        stage.grad_checkpointing = False  # timm's checkpoint_seq would call the blocks one by one
        stage.blocks.__class__ = TokenStage
        stage.blocks.chunk_size, stage.blocks.chunk_layout = chunk_size, chunk_layout
        for j, block in enumerate(stage.blocks):
            block.mixer.m.__class__ = ChunkSHSA
            block.mixer.m.chunk_layout, block.mixer.m.num_chunks = chunk_layout, None
            if i == stages[0] and j in prune_layers:
                block.pruner = TokenPruner(keep_ratio, 0, 1, score, mirror, fusion)
                block.pruner.track = True
    return model
