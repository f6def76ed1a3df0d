"""The Method glue of BSPF-ViT: config keys -> surgery on the backbone, budget validation, the keep-rate
warm-up, and what the FLOPs protocol records about a BSPF model.

Its reasoning: docs/reading-bspf.md, "vitexp/methods/bspf/method.py".
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Mapping, Sequence

import torch.nn as nn
from timm.models.metaformer import Attention as MetaAttention
from timm.models.metaformer import MetaFormer
from timm.models.shvit import SHViT

from vitexp.measure.flops import register_model_record
from vitexp.methods.base import Method
from vitexp.methods.bspf.layout import CHUNK_LAYOUTS, check_layout, square_side, window_order
from vitexp.methods.bspf.pruning import FUSIONS, MIRRORS, SCORES, TokenPruner
from vitexp.methods.bspf.shvit import ChunkSHSA, TokenStage, patch_shvit
from vitexp.methods.bspf.surgery import (
    ChunkAttention,
    PruneBlock,
    PruneMetaBlock,
    RestoringSequential,
    patch_attention,
    put_in_window_order,
)


def warmup_keep_ratio(epoch: float, target: float, warmup_epochs: float, start: float = 0.0) -> float:
    """EViT's keep-rate warm-up at (fractional) ``epoch``: 1, then a half-cosine to ``target``."""
    if warmup_epochs <= 0 or epoch >= start + warmup_epochs:
        return target
    if epoch < start:
        return 1.0
    return target + (1.0 - target) * 0.5 * (1.0 + math.cos(math.pi * (epoch - start) / warmup_epochs))


class KeepRateWarmup:
    """``model.set_progress(fraction)`` (called by the LightningModule every training step): sets
    each pruner's ``train_keep_ratio`` to :func:`warmup_keep_ratio` at epoch fraction × epochs."""

    def __init__(self, pruners: Sequence[TokenPruner], epochs: int, warmup_epochs: float, start: float):
        self.pruners, self.epochs, self.warmup_epochs, self.start = (
            list(pruners),
            int(epochs),
            warmup_epochs,
            start,
        )
        self(0.0)

    def __call__(self, fraction: float) -> None:
        for p in self.pruners:
            p.train_keep_ratio = warmup_keep_ratio(
                fraction * self.epochs, p.keep_ratio, self.warmup_epochs, self.start
            )


class BSPF(Method):
    """``method=bspf``: chunk attention in every layer, pruning + fusion at ``prune_layers``."""

    objective = "classify"
    budget_kinds: ClassVar[tuple[str, ...]] = ("keep_ratio",)

    def __init__(
        self,
        name: str = "bspf",
        chunk_size: int | None = 49,
        prune_layers: Sequence[int] = (4, 6, 9),
        score: str = "local3x3",
        fusion: str = "similarity",
        symmetric: bool = False,
        mirror: str = "none",
        chunk_layout: str = "window",
        keep_warmup_epochs: float = 0,
        keep_warmup_start: float = 0,
        train_epochs: int | None = None,
    ):
        super().__init__(name)
        for key, value, valid in (
            ("score", score, SCORES),
            ("fusion", fusion, FUSIONS),
            ("mirror", mirror, MIRRORS),
            ("chunk_layout", chunk_layout, CHUNK_LAYOUTS),
        ):
            if value not in valid:
                raise ValueError(f"method.{key}={value!r}: valid values are {valid}")
        self.chunk_size = None if chunk_size in (None, "null") else int(chunk_size)
        self.prune_layers = sorted(int(i) for i in prune_layers)
        self.score, self.fusion, self.symmetric, self.mirror = score, fusion, bool(symmetric), mirror
        self.chunk_layout = chunk_layout
        self.keep_warmup_epochs, self.keep_warmup_start = float(keep_warmup_epochs), float(keep_warmup_start)
        self.train_epochs = None if train_epochs is None else int(train_epochs)

    def keep_ratio(self, budget: Mapping[str, Any]) -> float:
        return float(budget["keep_ratio"]) if budget["kind"] == "keep_ratio" else 1.0

    def validate_budget(self, budget: Mapping[str, Any], arch: Mapping[str, Any]) -> None:
        from vitexp.errors import ConfigError

        super().validate_budget(budget, arch)
        if arch.get("family") == "shvit" and self.symmetric:
            raise ConfigError(
                "method.symmetric=true: shared Q/K is refused on SHViT: its attention computes q and k "
                "with one convolution and BatchNorm, and no shared layer keeps their two "
                "normalisations (docs/reading-bspf.md, 'Shared Q/K on SHViT'); use method.symmetric=false"
            )
        if budget["kind"] == "keep_ratio" and not 0 < float(budget["keep_ratio"]) <= 1:
            raise ConfigError(f"budget.keep_ratio: {budget['keep_ratio']} must be in (0, 1]")
        depth = int(arch["depth"])
        bad = [i for i in self.prune_layers if not 0 <= i < depth]
        if bad:
            raise ConfigError(f"method.prune_layers: {bad} outside the backbone's layers 0..{depth - 1}")
        if "img_size" in arch and "patch_size" in arch:
            side = int(arch["img_size"]) // int(arch["patch_size"])
            try:
                if arch.get("family") == "shvit":  # its token stages pad any grid to whole windows
                    if self.chunk_layout == "window" and self.chunk_size is not None:
                        square_side(self.chunk_size)
                else:
                    check_layout((side, side), self.chunk_size, self.chunk_layout)
            except ValueError as err:
                raise ConfigError(str(err)) from None
        if self.keep_warmup_epochs < 0 or self.keep_warmup_start < 0:
            raise ConfigError(
                f"method.keep_warmup_epochs={self.keep_warmup_epochs} and method.keep_warmup_start="
                f"{self.keep_warmup_start} must be >= 0"
            )
        if (
            self.keep_warmup_epochs
            and self.train_epochs is not None
            and self.keep_warmup_start + self.keep_warmup_epochs > self.train_epochs
        ):
            raise ConfigError(
                "method.keep_warmup_start + method.keep_warmup_epochs = "
                f"{self.keep_warmup_start + self.keep_warmup_epochs} exceeds the {self.train_epochs} "
                "training epochs: the keep ratio would never reach budget.keep_ratio"
            )

    def apply(self, backbone: nn.Module, budget: Mapping[str, Any]) -> nn.Module:
        if isinstance(backbone, SHViT):
            model = patch_shvit(
                backbone,
                self.keep_ratio(budget),
                self.chunk_size,
                self.chunk_layout,
                self.prune_layers,
                self.score,
                self.mirror,
                self.fusion,
            )
        elif isinstance(backbone, MetaFormer):
            model = self._apply_metaformer(backbone, budget)
        else:
            model = self._apply_vit(backbone, budget)
        if self.keep_warmup_epochs > 0:
            if self.train_epochs is None:
                raise ValueError(
                    "method.keep_warmup_epochs needs method.train_epochs (conf: ${recipe.epochs})"
                )
            pruners = [m for m in model.modules() if isinstance(m, TokenPruner)]
            model.set_progress = KeepRateWarmup(
                pruners, self.train_epochs, self.keep_warmup_epochs, self.keep_warmup_start
            )
        return model

    def _apply_vit(self, backbone: nn.Module, budget: Mapping[str, Any]) -> nn.Module:
        blocks = getattr(backbone, "blocks", None)
        if blocks is None or not len(blocks):
            raise TypeError(f"BSPF needs a ViT with .blocks; {type(backbone).__name__} has none")
        P = int(getattr(backbone, "num_prefix_tokens", 1))
        grid = tuple(backbone.patch_embed.grid_size)
        chunks = check_layout(grid, self.chunk_size, self.chunk_layout)
        rho = self.keep_ratio(budget)
        for i, block in enumerate(blocks):
            patch_attention(block.attn, P, chunks, self.symmetric, self.chunk_layout)
            if i in self.prune_layers:
                block.__class__ = PruneBlock
                block.pruner = TokenPruner(rho, P, chunks, self.score, self.mirror, self.fusion)
        order = window_order(grid, self.chunk_size) if self.chunk_layout == "window" else None
        if order is not None:
            put_in_window_order(blocks[0], order.to(next(backbone.parameters()).device), P)
            if hasattr(backbone, "forward_intermediates"):
                backbone.forward_intermediates = _tokens_only(backbone.forward_intermediates)
        return backbone

    def _apply_metaformer(self, model: MetaFormer, budget: Mapping[str, Any]) -> MetaFormer:
        """CaFormer (decision, docs/reading-backbones.md): chunk attention in every attention
        stage (a later stage whose grid the layout cannot tile attends as one chunk); pruning and
        fusion at ``prune_layers``, counted within the first attention stage (stage 3, 14×14
        tokens at 224 px), whose grid must tile; before that stage hands its tokens to the strided
        downsampling of stage 4, :class:`RestoringSequential` puts the full raster grid back from
        the window-ordered, fused tokens. Stage 4 (7×7) runs unpruned."""
        size = int(model.pretrained_cfg["input_size"][-1])
        attn_stages = [
            i for i, st in enumerate(model.stages) if isinstance(st.blocks[0].token_mixer, MetaAttention)
        ]
        if not attn_stages:
            raise TypeError("BSPF on a MetaFormer needs attention stages (CaFormer)")
        rho = self.keep_ratio(budget)
        for i in attn_stages:
            side = size // (4 * 2**i)
            first = i == attn_stages[0]
            try:
                chunks = check_layout((side, side), self.chunk_size, self.chunk_layout)
            except ValueError:
                if first:
                    raise
                chunks = 1
            stage = model.stages[i]
            for j, block in enumerate(stage.blocks):
                patch_attention(block.token_mixer, 0, chunks, self.symmetric, self.chunk_layout)
                if first and j in self.prune_layers:
                    block.__class__ = PruneMetaBlock
                    block.pruner = TokenPruner(rho, 0, chunks, self.score, self.mirror, self.fusion)
                    block.pruner.track = True
            order = (
                window_order((side, side), self.chunk_size)
                if self.chunk_layout == "window" and chunks > 1
                else None
            )
            if first or order is not None:
                stage.blocks.__class__ = RestoringSequential
                device = next(model.parameters()).device
                stage.blocks.register_buffer(
                    "window_order", None if order is None else order.to(device), persistent=False
                )
        return model


def _tokens_only(forward_intermediates):
    """A ViT's ``forward_intermediates`` that refuses ``output_fmt="NCHW"``: with
    ``chunk_layout=window`` the tokens are in window order, so a raster reshape would scramble the
    map. ``NLC`` gives the tokens as they are (window order; pruned layers: the survivors)."""

    def refusing(*args, output_fmt: str = "NCHW", **kwargs):
        if output_fmt == "NCHW":
            raise ValueError(
                "output_fmt='NCHW': BSPF with method.chunk_layout=window runs the tokens in window order, "
                "so a raster grid would be scrambled; use output_fmt='NLC' (or chunk_layout=raster)"
            )
        return forward_intermediates(*args, output_fmt=output_fmt, **kwargs)

    return refusing


class ChunkOnly(BSPF):
    """``method=chunk``: chunk attention in every layer; no pruning, no fusion (Table 8)."""

    budget_kinds: ClassVar[tuple[str, ...]] = ("none",)

    def __init__(
        self,
        name: str = "chunk",
        chunk_size: int | None = 49,
        symmetric: bool = False,
        chunk_layout: str = "window",
    ):
        super().__init__(
            name=name, chunk_size=chunk_size, prune_layers=(), symmetric=symmetric, chunk_layout=chunk_layout
        )


def bspf_record(model: nn.Module) -> dict[str, dict[str, Any]]:
    """What a FLOPs count records about a BSPF model, read after the counted forward: the chunk
    layout and chunk count (protocol; SHViT: the first attention stage's, and ``chunks_by_stage``,
    each attention stage's grid, the grid padded to whole windows and its chunk count), and each
    pruning layer's realised keep fraction, kept / input patch tokens = ⌈ρΩ⌉/Ω, with
    ``keep_fraction`` their geometric mean: the constant per-layer fraction that leaves as many
    tokens (metrics)."""
    attns = [m for m in model.modules() if isinstance(m, (ChunkAttention, ChunkSHSA))]
    if not attns:
        return {}
    record: dict[str, dict[str, Any]] = {
        "protocol": {"chunk_layout": attns[0].chunk_layout, "chunks": attns[0].num_chunks or 1}
    }
    stages = {
        name.removesuffix(".blocks"): m.last_chunks
        for name, m in model.named_modules()
        if isinstance(m, TokenStage) and getattr(m, "last_chunks", None)
    }
    if stages:
        record["protocol"]["chunks_by_stage"] = stages
    realised = [m.realised for m in model.modules() if isinstance(m, TokenPruner) and m.realised]
    if realised:
        layers = [kept / total for kept, total in realised]
        record["metrics"] = {
            "keep_fraction_layers": [round(k, 4) for k in layers],
            "keep_fraction": math.prod(layers) ** (1.0 / len(layers)),
        }
    return record


register_model_record(bspf_record)
