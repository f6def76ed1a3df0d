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
    weight (at most 0.67 for m ≥ 4), so only real block structure passes.
  - A budget of k blocks (:func:`phases_for_blocks`) bisects, one cut at a time, the segment
    whose best cut takes the largest share of its weight: f lowered until k phases remain.
  - The matrix comes from ``method.phase_images`` training images (evaluation transforms) before
    training starts, unless ``method.phases`` lists the phases; without data (``vitexp-flops``,
    ``vitexp-bench``) the layers are split evenly, which changes no FLOPs count.
- **Block.** Pre-LN attention with biases, a SwiGLU MLP (Linear d → 2·4d, SiLU(first half) ⊙
  second half, Linear 4d → d), and LayerScale initialised to 1e-5.
  - Gates come from the layer index t: Linear(1 → 16), SiLU, Linear(16 → 3d) initialised
    N(0, 1e-4), plus 1, giving (γ1, γ2, γ3).
  - The update is x ← x + γ1·LS1(Attn(LN1 x)), then x ← x + γ2·LS2(MLP(LN2 x)), and the output is
    γ3·x.
- **Surrogate.** k blocks, each applied recurrently over its phase's layers, so there are always
  as many block applications as the teacher has layers. The teacher's patch embedding, tokens,
  position embedding and final norm are reused, frozen.
- **Training** (:class:`RaptorDistill`; h_0 = the embedded tokens, h_l = teacher layer l's output).
  - Stage 1 trains each block alone on its phase p = [a, b): the teacher-forced loss is the mean
    over l ∈ p of MSE(B(h_l, l), h_{l+1}); the autoregressive loss starts from h_a, feeds the
    block its own output and takes the mean over l ∈ p of MSE(z_{l+1}, h_{l+1}). Loss =
    τ·forced + (1 − τ)·autoregressive, τ = max(0, 1 − step / (0.25 · steps)) over the stage's
    steps. vitexp's reading: "alone" means each block sees only the teacher's states, never another
    block's output, so the k blocks train side by side in one pass; the stage's loss is their mean.
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
  teacher's final norm (:class:`~vitexp.methods.saper.ProbeModel`), trained on the frozen
  surrogate, and on the frozen teacher for the recovered fraction (surrogate top-1 / teacher top-1).
"""
from __future__ import annotations

import copy
import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any, ClassVar, Mapping, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import GluMlp, Mlp
from timm.models.vision_transformer import Attention, LayerScale

from vitexp.methods.base import Method, Stage
from vitexp.methods.saper import ProbeModel, require_vit

#: Stage 2's token weights (RAPTOR): CLS, registers, patches.
TOKEN_WEIGHTS = {"cls": 0.45, "registers": 0.10, "patches": 0.45}


def layer_distance_matrix(features: torch.Tensor) -> torch.Tensor:
    """features (layers, images, 2, d) — CLS and mean patch token per layer -> (layers, layers)."""
    f = F.normalize(features.double(), dim=-1)
    cos = torch.einsum("lnsd,mnsd->lmns", f, f)  # layers x layers x images x {cls, mean}
    return (1 - cos).sum(-1).mean(-1)


def _cut_weight(w: torch.Tensor, a: int, s: int, b: int) -> float:
    return float(w[a:s, s:b].sum())


def max_cut_phases(w: torch.Tensor, f: float = 0.7, min_size: int = 2) -> list[list[int]]:
    """Recursive exact max-cut bisection of layers 0..L−1 into contiguous phases (see module docstring)."""
    w = w.double()

    def split(a: int, b: int) -> list[list[int]]:
        cut = _best_cut(w, a, b, min_size)
        if cut is None or cut[1] <= f:  # the best cut's weight is at most f · ΣW/2
            return [list(range(a, b))]
        return split(a, cut[0]) + split(cut[0], b)

    return split(0, w.shape[0])


def _best_cut(w: torch.Tensor, a: int, b: int, min_size: int, spare: int | None = None) -> tuple[int, float] | None:
    """The best contiguous cut of segment [a, b) and its share of the segment's edge weight.
    ``spare``: how many phases of ``min_size`` the split may lose against the segment's capacity
    (cuts that would leave too few phases for the budget are not offered)."""
    def capacity(n: int) -> int:
        return n // min_size

    cuts = [(s, _cut_weight(w, a, s, b)) for s in range(a + min_size, b - min_size + 1)
            if spare is None or capacity(b - a) - capacity(s - a) - capacity(b - s) <= spare]
    if not cuts:
        return None
    s, best = max(cuts, key=lambda c: c[1])
    total = float(torch.triu(w[a:b, a:b], diagonal=1).sum())  # ΣW/2: each pair of the segment once
    return s, best / total if total > 0 else 0.0


def phases_for_blocks(w: torch.Tensor, blocks: int, min_size: int = 2) -> list[list[int]]:
    """k phases (the budget = number of recurrent blocks): split, one bisection at a time, the
    segment whose best cut takes the largest share of its weight — the threshold f of
    :func:`max_cut_phases` lowered until exactly ``blocks`` phases remain. A cut that would leave
    too few layers for the remaining phases (e.g. 6 layers cut 3 | 3 when 3 phases of 2 are due)
    is skipped."""
    w = w.double()
    if blocks * min_size > w.shape[0]:
        raise ValueError(f"{w.shape[0]} layers cannot form {blocks} phases of at least {min_size} layers")
    segments = [(0, w.shape[0])]
    while len(segments) < blocks:
        spare = sum((b - a) // min_size for a, b in segments) - blocks
        options = [(i, _best_cut(w, a, b, min_size, spare)) for i, (a, b) in enumerate(segments)]
        options = [(i, c) for i, c in options if c is not None]
        i, (s, _) = max(options, key=lambda o: o[1][1])
        a, b = segments.pop(i)
        segments[i:i] = [(a, s), (s, b)]
    return [list(range(a, b)) for a, b in segments]


def swiglu(dim: int, hidden: int) -> nn.Module:
    """RAPTOR's MLP: Linear d → 2·hidden, SiLU(first half) ⊙ second half, Linear hidden → d
    (timm's ``GluMlp`` with the gate first)."""
    return GluMlp(dim, 2 * hidden, act_layer=nn.SiLU, gate_last=False)


#: ``swiglu`` is RAPTOR's block; ``gelu`` (the teacher's Linear d -> 4d, GELU, Linear 4d -> d) is
#: the audit's counterfactual that isolates the SwiGLU MLP's share of RAPTOR's FLOPs.
MLP_KINDS = ("swiglu", "gelu")


class RaptorBlock(nn.Module):
    """One recurrent block; ``forward(x, t)`` applies it as layer ``t``."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0, mlp: str = "swiglu"):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, num_heads, qkv_bias=True)
        self.ls1 = LayerScale(dim, init_values=1e-5)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        if mlp not in MLP_KINDS:
            raise ValueError(f"method.mlp={mlp!r}: valid MLPs are {MLP_KINDS}")
        self.mlp = swiglu(dim, int(mlp_ratio * dim)) if mlp == "swiglu" else Mlp(dim, int(mlp_ratio * dim))
        self.ls2 = LayerScale(dim, init_values=1e-5)
        self.gate = nn.Sequential(nn.Linear(1, 16), nn.SiLU(), nn.Linear(16, 3 * dim))
        nn.init.normal_(self.gate[2].weight, std=1e-4)
        nn.init.zeros_(self.gate[2].bias)

    def forward(self, x: torch.Tensor, t: int) -> torch.Tensor:
        g = 1 + self.gate(torch.full((1, 1), float(t), device=x.device, dtype=x.dtype))
        g1, g2, g3 = g.view(3, 1, 1, -1).unbind(0)
        x = x + g1 * self.ls1(self.attn(self.norm1(x)))
        x = x + g2 * self.ls2(self.mlp(self.norm2(x)))
        return g3 * x


class RaptorSurrogate(nn.Module):
    """The teacher's embedding and final norm (frozen) around k recurrent blocks over ``phases``."""

    def __init__(self, teacher: nn.Module, phases: Sequence[Sequence[int]], mlp: str = "swiglu"):
        super().__init__()
        layers = [l for p in phases for l in p]
        if sorted(layers) != list(range(len(teacher.blocks))):
            raise ValueError(f"phases {phases} must cover the teacher's layers 0..{len(teacher.blocks) - 1} once")
        self.phases = [list(p) for p in phases]
        self.embed_dim = teacher.embed_dim
        self.num_prefix_tokens = teacher.num_prefix_tokens
        self.num_classes = 0
        heads = teacher.blocks[0].attn.num_heads
        # the teacher without its blocks: patch embedding, CLS/register tokens, positions, final norm
        self.teacher_embed = copy.deepcopy(teacher)
        self.teacher_embed.blocks = nn.ModuleList()
        self.teacher_embed.reset_classifier(0)
        for p in self.teacher_embed.parameters():
            p.requires_grad_(False)
        self.blocks = nn.ModuleList(RaptorBlock(teacher.embed_dim, heads, mlp=mlp) for _ in self.phases)

    @property
    def patch_embed(self) -> nn.Module:
        return self.teacher_embed.patch_embed

    def reset_classifier(self, num_classes: int) -> None:
        self.num_classes = num_classes

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x = embed_tokens(self.teacher_embed, x)
        for block, phase in zip(self.blocks, self.phases):
            for layer in phase:
                x = block(x, layer)
        return self.teacher_embed.norm(x)


# -- the teacher's states and the losses ---------------------------------------------------------
def embed_tokens(vit: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """h_0: a timm ViT's tokens before its first block (patch embedding, prefix tokens, positions)."""
    x = vit.patch_embed(x)
    x = vit._pos_embed(x)
    x = vit.patch_drop(x) if hasattr(vit, "patch_drop") else x
    return vit.norm_pre(x)


@torch.no_grad()
def teacher_states(teacher: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """(L + 1, B, T, d): h_0 and every block's output (the residual stream, before the final norm)."""
    h = [embed_tokens(teacher, x)]
    for block in teacher.blocks:
        h.append(block(h[-1]))
    return torch.stack(h)


def layer_features(states: torch.Tensor, num_prefix_tokens: int) -> torch.Tensor:
    """(L, B, 2, d): CLS and mean patch token of each layer's output (``states[1:]``)."""
    out = states[1:]
    return torch.stack([out[:, :, 0], out[:, :, num_prefix_tokens:].mean(dim=2)], dim=2)


def anneal_tau(progress: float, fraction: float = 0.25) -> float:
    """Stage 1's teacher-forcing weight τ = max(0, 1 − step / (fraction · steps))."""
    return max(0.0, 1.0 - progress / fraction) if fraction > 0 else 0.0


def weighted_token_mse(pred: torch.Tensor, target: torch.Tensor, num_prefix_tokens: int,
                       weights: Mapping[str, float] = TOKEN_WEIGHTS) -> torch.Tensor:
    """Σ_kind w_kind · MSE over that kind's tokens (CLS = token 0, registers = 1..p−1, patches);
    the weights of the kinds present are renormalised to sum to 1."""
    parts = {"cls": slice(0, 1), "registers": slice(1, num_prefix_tokens), "patches": slice(num_prefix_tokens, None)}
    terms, total = [], 0.0
    for kind, sl in parts.items():
        if pred[:, sl].shape[1] == 0 or weights[kind] == 0:
            continue
        terms.append(weights[kind] * F.mse_loss(pred[:, sl], target[:, sl]))
        total += weights[kind]
    return sum(terms) / total


class TeacherCache:
    """Teacher states on disk, one file per image: ``<dir>/<teacher hash>/<image hash>.pt``.

    The image hash is over the transformed input tensor's bytes, so a hit needs the same image
    through the same deterministic transforms (``data.augment=false`` on digits; evaluation
    transforms on ImageNet). Files are written to a temporary name, then renamed."""

    def __init__(self, root: str | Path, teacher: nn.Module, dtype: torch.dtype = torch.float16):
        digest = hashlib.blake2b(digest_size=8)
        for name, tensor in sorted(teacher.state_dict().items()):
            digest.update(name.encode())
            digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
        self.dir = Path(root).expanduser() / digest.hexdigest()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.dtype = dtype
        self.hits = self.misses = 0

    @staticmethod
    def key(image: torch.Tensor) -> str:
        return hashlib.blake2b(image.detach().cpu().contiguous().numpy().tobytes(), digest_size=16).hexdigest()

    def states(self, teacher: nn.Module, x: torch.Tensor) -> torch.Tensor:
        keys = [self.key(img) for img in x]
        files = [self.dir / f"{k}.pt" for k in keys]
        found = [torch.load(f, map_location=x.device, weights_only=True) if f.is_file() else None for f in files]
        missing = [i for i, t in enumerate(found) if t is None]
        self.hits += len(x) - len(missing)
        self.misses += len(missing)
        if missing:
            fresh = teacher_states(teacher, x[missing])
            for j, i in enumerate(missing):
                found[i] = fresh[:, j]
                fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=f".{keys[i]}.")
                os.close(fd)
                torch.save(fresh[:, j].to(self.dtype).cpu().clone(), tmp)
                os.replace(tmp, files[i])
        return torch.stack([t.to(x.dtype) for t in found], dim=1)


class RaptorDistill(nn.Module):
    """The frozen teacher and the surrogate being trained. ``stage_loss(x, stage, progress)`` is
    stage 1's or stage 2's loss (module docstring); there is no ``forward``: what runs after
    training is the surrogate under a probe (``Raptor.deploy``)."""

    def __init__(self, teacher: nn.Module, surrogate: RaptorSurrogate, cache_dir: str | None = None,
                 tau_fraction: float = 0.25, stage2_targets: str = "all_layers"):
        super().__init__()
        if stage2_targets not in ("all_layers", "final"):
            raise ValueError(f"method.stage2_targets={stage2_targets!r}: valid values are ('all_layers', 'final')")
        self.teacher = teacher.eval()
        for p in self.teacher.parameters():
            p.requires_grad_(False)
        self.surrogate = surrogate
        self.tau_fraction, self.stage2_targets = float(tau_fraction), stage2_targets
        self.cache = TeacherCache(cache_dir, teacher) if cache_dir else None
        self.num_prefix_tokens = surrogate.num_prefix_tokens

    def tau(self, progress: float) -> float:
        """Stage 1's teacher-forcing weight at ``progress`` (what the LightningModule logs)."""
        return anneal_tau(progress, self.tau_fraction)

    def train(self, mode: bool = True) -> "RaptorDistill":
        super().train(mode)
        self.teacher.eval()
        return self

    def teacher_states(self, x: torch.Tensor) -> torch.Tensor:
        return self.cache.states(self.teacher, x) if self.cache is not None else teacher_states(self.teacher, x)

    def stage1_loss(self, x: torch.Tensor, tau: float) -> torch.Tensor:
        h = self.teacher_states(x)
        losses = []
        for block, phase in zip(self.surrogate.blocks, self.surrogate.phases):
            forced = autoregressive = 0.0
            if tau > 0:
                forced = sum(F.mse_loss(block(h[l], l), h[l + 1]) for l in phase) / len(phase)
            if tau < 1:
                z, autoregressive = h[phase[0]], 0.0
                for l in phase:
                    z = block(z, l)
                    autoregressive = autoregressive + F.mse_loss(z, h[l + 1])
                autoregressive = autoregressive / len(phase)
            losses.append(tau * forced + (1 - tau) * autoregressive)
        return sum(losses) / len(losses)

    def stage2_loss(self, x: torch.Tensor) -> torch.Tensor:
        h = self.teacher_states(x)
        z, terms = h[0], []
        for block, phase in zip(self.surrogate.blocks, self.surrogate.phases):
            for l in phase:
                z = block(z, l)
                if self.stage2_targets == "all_layers":
                    terms.append(weighted_token_mse(z, h[l + 1], self.num_prefix_tokens))
        if self.stage2_targets == "final":
            terms.append(weighted_token_mse(z, h[-1], self.num_prefix_tokens))
        return sum(terms) / len(terms)

    def stage_loss(self, x: torch.Tensor, stage: int, progress: float) -> torch.Tensor:
        if stage == 1:
            return self.stage1_loss(x, anneal_tau(progress, self.tau_fraction))
        return self.stage2_loss(x)


def even_phases(depth: int, blocks: int) -> list[list[int]]:
    """Contiguous phases of near-equal length (used only where no data decides them)."""
    bounds = [round(i * depth / blocks) for i in range(blocks + 1)]
    return [list(range(a, b)) for a, b in zip(bounds, bounds[1:])]


@torch.no_grad()
def distance_matrix_from_data(teacher: nn.Module, loader, images: int) -> torch.Tensor:
    """RAPTOR's layer distance matrix over the first ``images`` images of ``loader``."""
    teacher = teacher.eval()
    device = next(teacher.parameters()).device
    prefix = int(getattr(teacher, "num_prefix_tokens", 1))
    from tqdm.auto import tqdm

    feats, seen = [], 0
    bar = tqdm(total=images, desc="RAPTOR phases: teacher states", unit="img", leave=False, disable=None)
    for x, _ in loader:
        x = x[: images - seen].to(device)
        bar.update(len(x))
        feats.append(layer_features(teacher_states(teacher, x), prefix).cpu())
        seen += len(x)
        if seen >= images:
            break
    bar.close()
    return layer_distance_matrix(torch.cat(feats, dim=1))


#: Recipe keys ``method.probe`` may set for the probe stages.
PROBE_RECIPE_KEYS = frozenset({"epochs", "batch_size", "opt", "lr", "weight_decay", "sched", "warmup_epochs",
                               "warmup_steps", "warmup_lr", "min_lr", "grad_clip"})


class Raptor(Method):
    """``method=raptor``: a k-block recurrent surrogate of the (frozen) backbone; ``budget=blocks``.

    A run has four stages: stage 1 and stage 2 (``objective=raptor``; a stage of 0 epochs is
    skipped, and with both at 0 the probe sees the surrogate at initialisation), then the linear probe on
    the frozen surrogate (the run's top-1) and on the frozen teacher (``teacher_top1``), each with
    the ``method.probe`` recipe keys. ``method.teacher_probe_run`` names a completed probe run of
    the same teacher and data to take ``teacher_top1`` from instead."""

    objective: ClassVar[str] = "raptor"
    budget_kinds: ClassVar[tuple[str, ...]] = ("blocks",)

    def __init__(self, name: str = "raptor", phases: Sequence[Sequence[int]] | None = None,
                 phase_images: int = 256, min_phase_size: int = 2, stage1_epochs: int = 1,
                 stage2_epochs: int = 1, tau_fraction: float = 0.25, stage2_targets: str = "all_layers",
                 cache_dir: str | None = None, probe: Mapping[str, Any] | None = None,
                 teacher_probe: bool = True, teacher_probe_run: str | None = None, mlp: str = "swiglu"):
        super().__init__(name)
        self.mlp = mlp
        self._num_classes = 1000
        self.phases = [list(p) for p in phases] if phases else None
        self.phases_source = "method.phases" if phases else None
        self.distance: torch.Tensor | None = None
        self.phase_images, self.min_phase_size = int(phase_images), int(min_phase_size)
        self.stage1_epochs, self.stage2_epochs = int(stage1_epochs), int(stage2_epochs)
        self.tau_fraction, self.stage2_targets = float(tau_fraction), stage2_targets
        self.cache_dir = cache_dir
        self.probe = dict(probe or {})
        self.teacher_probe, self.teacher_probe_run = bool(teacher_probe), teacher_probe_run

    def validate_budget(self, budget: Mapping[str, Any], arch: Mapping[str, Any]) -> None:
        from vitexp.errors import ConfigError

        super().validate_budget(budget, arch)
        require_vit(self.name, arch)
        if arch.get("family", "vit") != "vit":
            raise ConfigError(f"method {self.name} does not apply to a {arch['family']} backbone: it needs a timm "
                              "VisionTransformer (the DINOv2 or DeiT layout: patch embedding, prefix tokens, blocks, "
                              "final norm)")
        depth, k = int(arch["depth"]), int(budget["k"])
        if not 1 <= k <= depth // self.min_phase_size:
            raise ConfigError(f"budget.k: {k} blocks must be in [1, {depth // self.min_phase_size}] (depth {depth}, "
                              f"phases of at least method.min_phase_size={self.min_phase_size} layers)")
        if self.phases is not None:
            flat = [l for p in self.phases for l in p]
            if len(self.phases) != k or flat != list(range(depth)):
                raise ConfigError(f"method.phases: {self.phases} must be {k} runs of consecutive layers covering "
                                  f"0..{depth - 1} in order (budget.k={k})")
        if self.stage1_epochs < 0 or self.stage2_epochs < 0:
            raise ConfigError(f"method.stage1_epochs={self.stage1_epochs} and method.stage2_epochs="
                              f"{self.stage2_epochs} must be >= 0 (both 0: the untrained surrogate, a control)")
        if self.stage2_targets not in ("all_layers", "final"):
            raise ConfigError(f"method.stage2_targets: {self.stage2_targets!r} is not one of ('all_layers', 'final')")
        if self.mlp not in MLP_KINDS:
            raise ConfigError(f"method.mlp: {self.mlp!r} is not one of {MLP_KINDS}")
        unknown = sorted(set(self.probe) - PROBE_RECIPE_KEYS)
        if unknown:
            raise ConfigError(f"method.probe: unknown recipe keys {unknown}; valid keys are {sorted(PROBE_RECIPE_KEYS)}")
        if not 0 <= self.tau_fraction <= 1:
            raise ConfigError(f"method.tau_fraction: {self.tau_fraction} must be in [0, 1]")

    def prepare(self, backbone: nn.Module, datamodule: Any) -> None:
        """Phases from the teacher's layer distance matrix over ``phase_images`` training images."""
        if self.phases is not None or datamodule is None:
            return
        datamodule.setup("fit")
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # before Lightning places the model
        self.distance = distance_matrix_from_data(backbone.to(device), datamodule.train_eval_dataloader(),
                                                  self.phase_images)
        backbone.cpu()

    def apply(self, backbone: nn.Module, budget: Mapping[str, Any]) -> nn.Module:
        k, depth = int(budget["k"]), len(backbone.blocks)
        if self.phases is None and self.distance is not None:
            self.phases = phases_for_blocks(self.distance, k, self.min_phase_size)
            self.phases_source = f"max-cut of the layer distance matrix over {self.phase_images} training images"
        phases = self.phases
        if phases is None:
            phases, self.phases_source = even_phases(depth, k), "even split (no data: FLOPs and throughput only)"
        teacher = backbone
        self._num_classes = int(teacher.num_classes)
        teacher.reset_classifier(0)
        return RaptorDistill(teacher, RaptorSurrogate(teacher, phases, self.mlp), self.cache_dir, self.tau_fraction,
                             self.stage2_targets)

    def record(self) -> dict[str, Any]:
        """What the ledger keeps of the method's data-dependent choices."""
        out: dict[str, Any] = {"phases": self.phases, "phases_source": self.phases_source}
        if self.distance is not None:
            out["distance_matrix"] = [[round(float(v), 6) for v in row] for row in self.distance]
        return out

    def lookup(self, cfg: Mapping[str, Any]) -> None:
        """``teacher_top1`` from the completed run named by ``method.teacher_probe_run`` (its id or
        experiment), which must have this run's backbone and data."""
        from vitexp.results import completed_runs

        self.teacher_metrics: dict[str, Any] = {}
        run_id = self.teacher_probe_run
        if not run_id:
            return
        runs = [r for r in completed_runs(kind="train", results_dir=cfg["results_dir"])
                if run_id in (r["run_id"], r["experiment"])]
        if not runs:
            raise FileNotFoundError(f"method.teacher_probe_run={run_id}: no completed train run with that id or "
                                    f"experiment in {cfg['results_dir']}/runs")
        run = runs[-1]
        for key in ("backbone", "data"):
            theirs, ours = run["config"].get(key, {}).get("name"), cfg[key]["name"]
            if theirs != ours:
                raise ValueError(f"method.teacher_probe_run={run_id}: that run's {key} is {theirs}, this run's is {ours}")
        self.teacher_metrics = {"teacher_top1": run["metrics"]["top1"], "teacher_top5": run["metrics"].get("top5"),
                                "teacher_probe_run": run["run_id"]}

    def extra_metrics(self, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """The teacher's probe (looked up, or this run's ``teacher_top1``) and ``recovered`` =
        surrogate top-1 / teacher top-1."""
        out = dict(getattr(self, "teacher_metrics", {}))
        teacher = out.get("teacher_top1", metrics.get("teacher_top1"))
        if teacher and metrics.get("top1") is not None:
            out["recovered"] = metrics["top1"] / teacher
        return out

    def stages(self, model: nn.Module) -> list[Stage]:
        def surrogate_probe() -> nn.Module:
            surrogate = model.surrogate
            for p in surrogate.parameters():
                p.requires_grad_(False)
            return ProbeModel(surrogate, self._num_classes)

        def teacher_probe() -> nn.Module:
            return ProbeModel(copy.deepcopy(model.teacher), self._num_classes)

        stages = []
        if self.stage1_epochs > 0:
            stages.append(Stage("stage1", "raptor", lambda: model, {"epochs": self.stage1_epochs},
                                {"stage": 1}, metrics_prefix=None, deployed=False))
        if self.stage2_epochs > 0:
            stages.append(Stage("stage2", "raptor", lambda: model, {"epochs": self.stage2_epochs},
                                {"stage": 2}, metrics_prefix=None, deployed=False))
        stages.append(Stage("probe", "classify", surrogate_probe, self.probe, metrics_prefix="", deployed=True))
        if self.teacher_probe and not self.teacher_probe_run:
            stages.append(Stage("teacher_probe", "classify", teacher_probe, self.probe, metrics_prefix="teacher_",
                                deployed=False))
        return stages

    def deploy(self, model: nn.Module) -> nn.Module:
        if isinstance(model, RaptorDistill):
            return ProbeModel(model.surrogate, self._num_classes)
        return model
