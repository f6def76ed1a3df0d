"""BSPF-ViT: block-based symmetric pruning and fusion (arXiv 2507.12125), as vitexp reads it.

Its reasoning: docs/reading-bspf.md, "vitexp/methods/bspf/__init__.py".
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
