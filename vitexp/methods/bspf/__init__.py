"""BSPF-ViT: block-based symmetric pruning and fusion (arXiv 2507.12125), as vitexp reads it.

The paper's full text was not available; each decision is a named config key
(``conf/method/bspf.yaml``), written down in the module that implements it and in docs/reading-bspf.md:

- ``layout``: which tokens form a chunk (``chunk_layout``: √Ω×√Ω windows by default, or raster
  ranges) and the chunk count (``chunk_size`` = Ω; null is one chunk, Table 8's "without chunking").
- ``pruning``: the 3×3 block scorer (``score``: learned softmax taps, fixed average, or the single
  token), block-based 2D pruning with its straight-through gradient, and fusion (``fusion``).
- ``surgery``: chunk attention as fused 4-D SDPA calls, the pruned blocks, window ordering and
  CaFormer's grid restoration, shared Q/K (``symmetric``, ``mirror``), patched onto a live timm
  model ToMe-style.
- ``shvit``: SHViT's SHSA stages as token stages (attention and FFN on the kept tokens, the
  depthwise convolutions on the restored grid).
- ``method``: the Method glue (``prune_layers``, budget validation, EViT's keep-rate warm-up
  ``keep_warmup_epochs``) and the chunk layout and realised keep fractions a FLOPs count records.

Tokens are removed by gather, so later layers, MLPs included, run on fewer tokens; CLS and the
other prefix tokens are always kept.
"""

from vitexp.methods.bspf.layout import CHUNK_LAYOUTS, chunk_count, window_order
from vitexp.methods.bspf.method import BSPF, ChunkOnly, KeepRateWarmup, bspf_record, warmup_keep_ratio
from vitexp.methods.bspf.pruning import FUSIONS, MIRRORS, SCORES, BlockScorer, TokenPruner
from vitexp.methods.bspf.shvit import ChunkSHSA, TokenStage
from vitexp.methods.bspf.surgery import (
    ChunkAttention,
    PruneBlock,
    PruneMetaBlock,
    RestoringSequential,
    WindowOrder,
    patch_attention,
)

__all__ = [
    "BSPF",
    "CHUNK_LAYOUTS",
    "FUSIONS",
    "MIRRORS",
    "SCORES",
    "BlockScorer",
    "ChunkAttention",
    "ChunkOnly",
    "ChunkSHSA",
    "KeepRateWarmup",
    "PruneBlock",
    "PruneMetaBlock",
    "RestoringSequential",
    "TokenPruner",
    "TokenStage",
    "WindowOrder",
    "bspf_record",
    "chunk_count",
    "patch_attention",
    "warmup_keep_ratio",
    "window_order",
]
