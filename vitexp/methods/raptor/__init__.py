"""RAPTOR (arXiv 2512.19941): block-recurrent surrogates of DINOv2, as vitexp reads it.

RAPTOR (arXiv 2512.19941): block-recurrent surrogates of DINOv2, as vitexp reads it (``method=raptor``,
``budget=blocks budget.k=2|3|4``).

Its reasoning: docs/reading-raptor.md, "vitexp/methods/raptor/__init__.py".
"""

from vitexp.methods.raptor.distill import (
    STAGE1_FINAL_TOKEN_WEIGHTS,
    TOKEN_WEIGHTS,
    RaptorDistill,
    TeacherCache,
    anneal_tau,
    weighted_token_mse,
)
from vitexp.methods.raptor.method import PROBE_RECIPE_KEYS, Raptor, load_linear_head
from vitexp.methods.raptor.phases import (
    distance_matrix_from_data,
    even_phases,
    layer_distance_matrix,
    layer_features,
    max_cut_phases,
    phases_for_blocks,
)
from vitexp.methods.raptor.surrogate import (
    MLP_KINDS,
    RaptorBlock,
    RaptorSurrogate,
    embed_tokens,
    swiglu,
    teacher_states,
)

__all__ = [
    "MLP_KINDS",
    "PROBE_RECIPE_KEYS",
    "STAGE1_FINAL_TOKEN_WEIGHTS",
    "TOKEN_WEIGHTS",
    "Raptor",
    "RaptorBlock",
    "RaptorDistill",
    "RaptorSurrogate",
    "TeacherCache",
    "anneal_tau",
    "distance_matrix_from_data",
    "embed_tokens",
    "even_phases",
    "layer_distance_matrix",
    "layer_features",
    "load_linear_head",
    "max_cut_phases",
    "phases_for_blocks",
    "swiglu",
    "teacher_states",
    "weighted_token_mse",
]
