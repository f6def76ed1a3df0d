"""BSPF-ViT on SHViT (timm ``shvit_*``), patched onto a live model ToMe-style.

Its reasoning: docs/reading-bspf.md, "vitexp/methods/bspf/shvit.py".
"""

from __future__ import annotations

import torch
import torch.nn as nn
from timm.models.shvit import SHSA, SHViT

from vitexp.methods.bspf.layout import Chunks, padded_chunks
from vitexp.methods.bspf.pruning import TokenPruner


class ChunkSHSA(SHSA):
    """timm's ``SHSA`` on a token map (B, C, N, 1) of the real tokens of ``chunks``
    (:class:`~vitexp.methods.bspf.layout.Chunks`): a query attends to the keys of its own chunk.
    ``num_chunks`` records the last call's chunk count (for the FLOPs protocol); ``chunk_layout``
    is set by the surgery."""

    num_chunks: int | None
    chunk_layout: str

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(
            "BSPF's SHSA runs through its TokenStage (timm's block-by-block path, e.g. gradient "
            "checkpointing, would skip the pruning)"
        )

    def attend(self, x: torch.Tensor, chunks: Chunks, need_blocks: bool = False):
        """(SHSA's output before its residual, the chunks' attention blocks B×C×Ω×Ω or None).
        The blocks carry the graph (the scorer's straight-through gradient reaches q and k); an
        empty slot's column in them is 0, its row is not used."""
        B, _, N, _ = x.shape
        if N != chunks.tokens:
            raise RuntimeError(f"{N} tokens, but the chunks hold {chunks.tokens}")
        C, L = chunks.num, chunks.length
        self.num_chunks = C
        x1, x2 = torch.split(x, [self.pdim, self.dim - self.pdim], dim=1)
        q, k, v = torch.split(self.qkv(self.pre_norm(x1)), [self.qk_dim, self.qk_dim, self.pdim], dim=1)
        if chunks.full:
            q, k, v = (t.flatten(2).transpose(1, 2).reshape(B, C, L, -1) for t in (q, k, v))
            attn = ((q @ k.transpose(-2, -1)) * self.scale).softmax(dim=-1)  # B, C, Ω, Ω (single head)
            x1 = (attn @ v).reshape(B, N, self.pdim).transpose(1, 2).unsqueeze(-1)
        else:
            spread = chunks.token_of_slot(x.device)  # an empty slot reads the zero row appended below
            q, k, v = (
                torch.cat([t.flatten(2), t.new_zeros(B, t.shape[1], 1)], dim=2)[:, :, spread]
                .transpose(1, 2)
                .reshape(B, C, L, -1)
                for t in (q, k, v)
            )
            empty = ~chunks.valid(x.device)
            logits = ((q @ k.transpose(-2, -1)) * self.scale).masked_fill(
                empty[None, :, None, :], float("-inf")
            )
            attn = logits.softmax(dim=-1)  # every chunk holds a real key: no row is all -inf
            out = (attn @ v).reshape(B, C * L, self.pdim)[:, chunks.slot_of_token(x.device)]
            x1 = out.transpose(1, 2).unsqueeze(-1)
        out = self.proj(torch.cat([x1.to(x2.dtype), x2], dim=1))
        return out, (attn if need_blocks else None)


class TokenStage(nn.Sequential):
    """The blocks of one SHSA stage (class swapped onto ``StageBlock.blocks``): NCHW in, the
    restored NCHW grid out (module docstring). A block with a ``pruner`` prunes and fuses between
    its attention and its FFN. ``chunk_size`` and ``chunk_layout`` are set by the surgery;
    ``last_chunks`` records the last call's grid, padded grid and chunk count (FLOPs protocol)."""

    chunk_size: int | None
    chunk_layout: str

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, D, H, W = x.shape
        N = H * W
        chunks, order, padded = padded_chunks((H, W), self.chunk_size, self.chunk_layout)
        self.last_chunks = {"grid": f"{H}x{W}", "padded": f"{padded[0]}x{padded[1]}", "chunks": chunks.num}
        order = torch.arange(N, device=x.device) if order is None else order.to(x.device)
        pos = order.expand(B, N)  # token -> the raster position of the token itself
        where = torch.argsort(order).expand(B, N)  # raster position -> the token that stands for it
        grid = x
        for block in self:
            grid = block.conv(grid)  # depthwise 3x3 on the full grid
            t = grid.flatten(2).gather(2, pos.unsqueeze(1).expand(B, D, pos.shape[1])).unsqueeze(-1)
            pruner: TokenPruner | None = getattr(block, "pruner", None)
            out, blocks = block.mixer.m.attend(t, chunks, need_blocks=pruner is not None)
            t = t + out
            if pruner is not None:
                t, pos, where, chunks = _prune(pruner, t, blocks, pos, where, chunks)
            t = block.ffn(t)
            grid = t.squeeze(-1).gather(2, where.unsqueeze(1).expand(B, D, N)).reshape(B, D, H, W)
        return grid


def _prune(
    pruner: TokenPruner,
    t: torch.Tensor,
    blocks: torch.Tensor,
    pos: torch.Tensor,
    where: torch.Tensor,
    chunks: Chunks,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Chunks]:
    """Prune and fuse the tokens ``t`` (B, D, N, 1) of ``chunks``: (the kept tokens, their raster
    positions, the kept token standing for each raster position, the kept tokens' chunks)."""
    B, D = t.shape[:2]
    C, L = chunks.num, chunks.length
    pruner.num_chunks = C
    dev = t.device
    tokens = t.squeeze(-1).transpose(1, 2)
    base = L * torch.arange(C, device=dev).view(1, C, 1)
    if chunks.full:
        out = pruner(tokens, blocks)
        keep = pruner.last["keep"]  # B, C, Ω' indices within each chunk
        kept = Chunks((keep.shape[-1],) * C, keep.shape[-1])
        pos = pos.gather(1, (keep + base).reshape(B, -1))
        where = pruner.last["assign"].gather(1, where)
        return out.transpose(1, 2).unsqueeze(-1), pos, where, kept
    spread = chunks.token_of_slot(dev)
    padded = torch.cat([tokens, tokens.new_zeros(B, 1, D)], dim=1)[:, spread]  # B, C·L, D; empty slots 0
    out = pruner(padded, blocks, counts=chunks.counts)  # B, C·K, D
    keep = pruner.last["keep"]
    kept = Chunks(tuple(pruner.last["counts"]), keep.shape[-1])
    real_out = kept.slot_of_token(dev)
    source = spread[(keep + base).reshape(B, -1)[:, real_out]]  # the input token each kept token is
    pos = pos.gather(1, source)
    slot_in = chunks.slot_of_token(dev)[where]  # raster position -> input slot -> output slot -> kept token
    where = kept.token_of_slot(dev)[pruner.last["assign"].gather(1, slot_in)]
    return out[:, real_out].transpose(1, 2).unsqueeze(-1), pos, where, kept


def shsa_stages(model: SHViT) -> list[int]:
    """Indices of the stages whose blocks have SHSA mixers."""
    return [
        i for i, st in enumerate(model.stages) if isinstance(getattr(st.blocks[0].mixer, "m", None), SHSA)
    ]


def patch_shvit(
    model: SHViT,
    keep_ratio: float,
    chunk_size: int | None,
    chunk_layout: str,
    prune_layers,
    score: str,
    mirror: str,
    fusion: str,
) -> SHViT:
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
