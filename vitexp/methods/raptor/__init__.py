"""RAPTOR (arXiv 2512.19941): block-recurrent surrogates of DINOv2, as vitexp reads it
(``method=raptor``, ``budget=blocks budget.k=2|3|4``).

- **Phases.** The layer distance matrix is D[l, l'] = the mean over images of the sum over
  {CLS, mean of patch tokens} of 1 − cos(a_l, a_l'), a_l being layer l's output (the residual
  stream before the final norm; registers are in neither kind).
  - A layer sequence is split by recursive exact max-cut bisection: brute force over every cut
    point that leaves at least ``min_size`` layers on each side.
  - It keeps splitting while the best cut's weight exceeds f · (ΣW / 2), the fraction f of the
    segment's total edge weight (:func:`max_cut_phases`, what ``vitexp-analyze phases`` reports).
  - vitexp's reading: cuts are contiguous split points, since the phases RAPTOR reports are runs
    of consecutive layers.
  - f defaults to 0.7. A uniform segment of m layers has a best cut of m / (2(m − 1)) of its
    weight (at most 0.67 for m ≥ 4), so only real block structure passes. This stopping rule is
    vitexp's: RAPTOR's notebook stops at a threshold ε = c · ΣW/2 of the *whole* matrix, with c
    chosen by hand for each k (0.2, 0.10, 0.09 for 2, 3, 4 phases), and on a DINOv2-B-like
    matrix f = 0.7 yields 5 phases, more than any partition RAPTOR trains.
  - A budget of k blocks (:func:`phases_for_blocks`) bisects, one cut at a time, the segment
    whose best cut takes the largest share of its weight: f lowered until k phases remain. This
    is what a run uses (``budget.k``) and what ``vitexp-analyze phases --blocks`` reports; on
    DINOv2-B-like matrices it gives RAPTOR's partitions.
  - The matrix comes from ``method.phase_images`` training images (evaluation transforms) before
    training starts, unless ``method.phases`` lists the phases; without data (``vitexp-flops``,
    ``vitexp-bench``) the layers are split evenly, which changes no FLOPs count.
- **Block.** Pre-LN attention with biases, a SwiGLU MLP (Linear d → 2·4d, SiLU(first half) ⊙
  second half, Linear 4d → d), and LayerScale initialised to 1e-5.
  - Gates come from the layer index t: Linear(1 → 16), SiLU, Linear(16 → 3d) with weight and
    bias drawn from N(0, 1e-4), plus 1, giving (γ1, γ2, γ3). As in the reference code, t is the
    1-based index of the teacher layer the application outputs (1..L), and LayerNorm's eps is
    1e-5 (PyTorch's default; DINOv2's own blocks use 1e-6).
  - The update is x ← x + γ1·LS1(Attn(LN1 x)), then x ← x + γ2·LS2(MLP(LN2 x)), and the output is
    γ3·x.
- **Surrogate.** k blocks, each applied recurrently over its phase's layers, so there are always
  as many block applications as the teacher has layers. The teacher's patch embedding, tokens,
  position embedding and final norm are reused, frozen.
- **Training** (:class:`RaptorDistill`; h_0 = the embedded tokens, h_l = teacher layer l's output).
  - Stage 1 trains each block alone on its phase p = [a, b): the teacher-forced loss is the mean
    over l ∈ p of ℓ(B(h_l, l), h_{l+1}); the autoregressive loss starts from h_a, feeds the
    block its own output and takes the mean over l ∈ p of ℓ(z_{l+1}, h_{l+1}). Block loss =
    τ·forced + (1 − τ)·autoregressive, τ = max(0, 1 − step / (0.25 · steps)) over the stage's
    steps. ℓ is MSE, except for the block whose phase ends at the teacher's last layer: as in
    the reference's stage-1 runs, ℓ is the weighted token MSE with its default weights
    (CLS 0.34, registers 0.33, patches 0.33) at every layer of that phase.
  - Joint training, vitexp's reading of "alone": the reference trains each block in a run of
    its own (own AdamW, own gradient clipping at norm 1.0). vitexp trains the k blocks side by
    side in one pass: each block sees only the teacher's states, never another block's output;
    the stage's loss is the *sum* of the block losses (blocks share no parameter, so each
    block's gradient is its own loss's); AdamW is per parameter; and ``recipe.grad_clip`` clips
    each block's gradient norm on its own (:meth:`RaptorDistill.clip_groups`, used by the
    stage's LightningModule instead of Lightning's one global norm). What remains shared is the
    batches (the reference's runs draw their own order and seed) and the stage's length.
  - Stage 2 runs the whole surrogate from h_0 on its own outputs. vitexp's reading: the weighted
    MSE (CLS 0.45, registers 0.10, patches 0.45) is taken at every layer's output and averaged
    over layers (``method.stage2_targets=all_layers``; ``final`` uses the last layer only). With no
    registers the weights of the kinds present are renormalised to sum to 1.
  - MSE is the mean of squared differences over tokens and channels of the residual stream
    (before the teacher's final norm).
  - Teacher states are computed on the fly without gradients; ``method.cache_dir`` keeps them on
    disk, keyed by a hash of the teacher's weights and of each input image, so a second pass over
    the same (deterministically transformed) images reads instead of recomputing.
- **Probe.** Linear(2d → classes) on [CLS ‖ mean of patch tokens, registers excluded] after the
  teacher's final norm (:class:`~vitexp.methods.probe.ProbeModel`), trained on the frozen
  surrogate, and on the frozen teacher for the recovered fraction (surrogate top-1 / teacher top-1).
  ``method.probe_head`` starts both from a linear-head checkpoint (the reference starts from
  Meta's reg4 head). Each probe records its final test top-1 (``top1``, what vitexp's tables
  show) and the best validation top-1 over the evaluation before training and every epoch
  (``best_val_top1``, what the reference reports; on ImageNet the validation split is the test
  split, so that number selects an epoch on the test set).
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
