"""SAPER (arXiv 2608.00264): attention-head pruning with the LapSum soft top-k, as vitexp reads it.

SAPER: attention-head pruning with the LapSum soft top-k (arXiv 2608.00264), as vitexp reads it
(``method=saper_ft`` / ``saper_kd``, ``budget=heads budget.k=K``).

Its reasoning: docs/reading-saper.md, "vitexp/methods/saper/__init__.py".
"""

from vitexp.methods.probe import POOLS, LinearProbe, ProbeModel, feature_model
from vitexp.methods.saper.knn import KnnEval
from vitexp.methods.saper.method import TRAINABLE, DistillPair, SaperDistill, SaperHeads, set_trainable
from vitexp.methods.saper.selection import (
    SELECTIONS,
    head_gates,
    head_importance,
    importance_scores,
    magnitude_scores,
    random_scores,
    top_k_heads,
)
from vitexp.methods.saper.selector import HeadPrunedModel, HeadSelector
from vitexp.methods.saper.surgery import ConstantBranch, prune_attention_heads, prune_probe_model

__all__ = [
    "POOLS",
    "SELECTIONS",
    "TRAINABLE",
    "ConstantBranch",
    "DistillPair",
    "HeadPrunedModel",
    "HeadSelector",
    "KnnEval",
    "LinearProbe",
    "ProbeModel",
    "SaperDistill",
    "SaperHeads",
    "feature_model",
    "head_gates",
    "head_importance",
    "importance_scores",
    "magnitude_scores",
    "prune_attention_heads",
    "prune_probe_model",
    "random_scores",
    "set_trainable",
    "top_k_heads",
]
