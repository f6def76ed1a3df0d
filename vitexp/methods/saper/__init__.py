"""SAPER: attention-head pruning with the LapSum soft top-k (arXiv 2608.00264), as vitexp reads it
(``method=saper_ft`` / ``saper_kd``, ``budget=heads budget.k=K``).

- ``selector``: LapSum's learned selection. One score per head of the whole model; gates
  g = soft_topk(scores, k_t, α_t) scale each head's output before the output projection; k_t
  anneals by a cosine to k and α_t geometrically over ``anneal_fraction`` of training.
- ``selection``: the baselines at the same budget (``method.selection``: ``random``,
  ``magnitude``, Michel et al.'s ``importance``), chosen once before training.
- ``surgery``: physical head removal (q, k, v rows and output-projection columns; a layer with no
  head left keeps only its projection bias), the deployed model of every rule.
- ``method``: the Method glue. What trains (``method.trainable``): ``scores`` (the head scores,
  plus the linear probe in fine-tune mode; every backbone weight frozen), ``mlp`` (also the blocks'
  MLPs; attention weights frozen) or ``all``. Accuracy is reported for the deployed model
  (vitexp/training/fit.py tests ``Method.deploy(model)``), whose kept heads per layer go into the ledger
  (``kept_heads``) for :meth:`SaperHeads.rebuild_deployed`.
- ``knn``: ``method=knn``, the unpruned k-NN rows.

The probe model (SAPER's linear head on [CLS ‖ mean patch], or the k-NN features) is
:mod:`vitexp.methods.probe`, shared with RAPTOR. ``LinearProbe`` and the other Method classes are
importable from here too: the ledger's configs name ``vitexp.methods.saper.<class>`` as ``_target_``.
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
