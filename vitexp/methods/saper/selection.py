"""Head-selection baselines at SAPER's budget k (``method.selection``): rules that choose the k heads once,
before training, instead of learning them with LapSum.

Its reasoning: docs/reading-saper.md, "vitexp/methods/saper/selection.py".
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from vitexp.methods.probe import pool_tokens

#: ``method.selection``: the learned rule (SAPER's) and the rules fixed before training.
SELECTIONS = ("lapsum", "random", "magnitude", "importance")
#: The calibration probe's L2 penalty on the mean cross-entropy, and its L-BFGS iterations.
PROBE_WEIGHT_DECAY = 1e-3
PROBE_ITERATIONS = 100


def top_k_heads(scores: torch.Tensor, k: int) -> list[list[int]]:
    """The k highest-scoring heads of an (L, H) score tensor, as the kept head indices per layer."""
    mask = torch.zeros(scores.numel(), dtype=torch.bool)
    mask[scores.detach().flatten().cpu().topk(int(k)).indices] = True
    return [row.nonzero().flatten().tolist() for row in mask.view(scores.shape)]


def random_scores(depth: int, heads: int, seed: int) -> torch.Tensor:
    """Uniform scores from a generator seeded with ``seed``: their top k is a uniform k-subset."""
    return torch.rand(depth, heads, generator=torch.Generator().manual_seed(int(seed)))


def magnitude_scores(backbone: nn.Module) -> torch.Tensor:
    """(L, H): the norm of each head's input columns of its layer's output projection."""
    rows = []
    for block in backbone.blocks:
        attn = block.attn
        w = attn.proj.weight.detach().float()
        rows.append(w.view(w.shape[0], attn.num_heads, attn.head_dim).norm(dim=(0, 2)))
    return torch.stack(rows).cpu()


@contextmanager
def head_gates(backbone: nn.Module, batch: int) -> Iterator[list[torch.Tensor]]:
    """Per-layer gates ξ (batch, H), all 1 and requiring grad, that multiply each example's head
    outputs where they enter the output projection (a forward pre-hook on ``attn.proj``, whose
    input is the heads' outputs side by side). ∂(Σ_x L(x))/∂ξ[x, h] is then ∂L(x)/∂ξ_h."""
    param = next(backbone.parameters())
    gates, handles = [], []
    for block in backbone.blocks:
        attn = block.attn
        if not isinstance(getattr(attn, "norm", nn.Identity()), nn.Identity):
            raise TypeError(
                "head importance needs the heads' outputs unmixed before the projection (attn.norm)"
            )
        gate = torch.ones(batch, attn.num_heads, device=param.device, dtype=param.dtype, requires_grad=True)

        def scale(module: nn.Module, args: tuple, gate: torch.Tensor = gate, d: int = attn.head_dim) -> tuple:
            x = args[0]
            B, N, D = x.shape
            return ((x.view(B, N, D // d, d) * gate.view(B, 1, -1, 1)).view(B, N, D), *args[1:])

        handles.append(attn.proj.register_forward_pre_hook(scale))
        gates.append(gate)
    try:
        yield gates
    finally:
        for handle in handles:
            handle.remove()


def head_importance(
    backbone: nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """(L, H): the mean over the examples of ``batches`` of |∂L(x)/∂ξ_h|, every gate at 1.
    ``loss(tokens, labels)`` maps the backbone's final tokens to per-example losses (B,)."""
    param = next(backbone.parameters())
    total, seen = None, 0
    for x, y in batches:
        x, y = x.to(param.device, param.dtype), y.to(param.device)
        with head_gates(backbone, len(x)) as gates:
            grads = torch.autograd.grad(loss(backbone.forward_features(x), y).sum(), gates)
        batch = torch.stack([g.abs().sum(0) for g in grads]).detach()
        total = batch if total is None else total + batch
        seen += len(x)
    if total is None:
        raise ValueError("head importance: the calibration set is empty")
    return total / seen


def normalise_per_layer(scores: torch.Tensor) -> torch.Tensor:
    """Each layer's scores divided by their ℓ2 norm (a layer of zeros stays zero)."""
    return scores / scores.norm(dim=1, keepdim=True).clamp_min(torch.finfo(scores.dtype).tiny)


def fit_linear_probe(
    features: torch.Tensor, labels: torch.Tensor, num_classes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Multinomial logistic regression on fixed features, (weight, bias) for ``F.linear``: zero
    initial weights, full-batch L-BFGS (strong Wolfe line search) on the mean cross-entropy plus
    :data:`PROBE_WEIGHT_DECAY`/2 · ‖W‖², :data:`PROBE_ITERATIONS` iterations. Deterministic, and
    it draws nothing from the global RNG (the run's initialisation stays the seed's)."""
    weight = features.new_zeros(num_classes, features.shape[1], requires_grad=True)
    bias = features.new_zeros(num_classes, requires_grad=True)
    opt = torch.optim.LBFGS([weight, bias], lr=1.0, max_iter=PROBE_ITERATIONS, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = (
            F.cross_entropy(F.linear(features, weight, bias), labels)
            + 0.5 * PROBE_WEIGHT_DECAY * weight.square().sum()
        )
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)
    return weight.detach(), bias.detach()


def calibration_loader(datamodule: Any, batches: int, seed: int) -> torch.utils.data.DataLoader:
    """``batches`` batches of the training split under evaluation transforms: a random subset of
    ``batches × batch size`` images (fewer if the split is smaller) drawn with ``seed``, in a
    fixed order."""
    from torch.utils.data import DataLoader, Subset

    datamodule.setup("fit")
    dataset = datamodule.train_eval_dataloader().dataset
    images = min(len(dataset), int(batches) * int(datamodule.batch_size))
    chosen = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(int(seed)))[:images]
    return DataLoader(
        Subset(dataset, chosen.tolist()),
        batch_size=int(datamodule.batch_size),
        shuffle=False,
        num_workers=int(getattr(datamodule, "num_workers", 0)),
        generator=torch.Generator().manual_seed(0),
    )


def importance_scores(
    backbone: nn.Module, datamodule: Any, batches: int, seed: int, pool: str
) -> torch.Tensor:
    """Michel et al.'s importance of every head of the unpruned ``backbone`` (module docstring),
    normalised per layer; computed on this process's GPU when there is one (``LOCAL_RANK``: each DDP
    rank its own device, as Lightning will assign it), the backbone left on the CPU. The probe is fitted
    on the same calibration images it scores (a decision: with few images per class the fit nears
    separation and the gradients shrink, so use enough batches for the number of classes)."""
    loader = calibration_loader(datamodule, batches, seed)
    was_training = backbone.training
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    backbone.to(device).eval()
    prefix = int(getattr(backbone, "num_prefix_tokens", 1))
    param = next(backbone.parameters())
    try:
        with torch.no_grad():
            pairs = [
                (
                    pool_tokens(backbone.forward_features(x.to(param.device, param.dtype)), pool, prefix),
                    y.to(param.device),
                )
                for x, y in loader
            ]
        weight, bias = fit_linear_probe(
            torch.cat([f for f, _ in pairs]), torch.cat([y for _, y in pairs]), int(datamodule.num_classes)
        )

        def probe_loss(tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(
                F.linear(pool_tokens(tokens, pool, prefix), weight, bias), labels, reduction="none"
            )

        scores = head_importance(backbone, loader, probe_loss)
    finally:
        backbone.cpu().train(was_training)
    return normalise_per_layer(scores.cpu())
