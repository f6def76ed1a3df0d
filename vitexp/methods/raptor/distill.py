"""RAPTOR's two training stages: the losses, the teacher-state cache and :class:`RaptorDistill`
(package docstring, "Training")."""

from __future__ import annotations

import hashlib
from functools import partial
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from vitexp.ledger import atomic_write
from vitexp.methods.raptor.surrogate import RaptorSurrogate, teacher_states

#: Stage 2's token weights (RAPTOR): CLS, registers, patches.
TOKEN_WEIGHTS = {"cls": 0.45, "registers": 0.10, "patches": 0.45}
#: Stage 1's token weights for a block whose phase ends at the teacher's last layer. RAPTOR's
#: stage-1 runs of those blocks pass ``--weighted`` without weights, so its defaults apply; the
#: other blocks train with plain MSE.
STAGE1_FINAL_TOKEN_WEIGHTS = {"cls": 0.34, "registers": 0.33, "patches": 0.33}


def anneal_tau(progress: float, fraction: float = 0.25) -> float:
    """Stage 1's teacher-forcing weight τ = max(0, 1 − step / (fraction · steps))."""
    return max(0.0, 1.0 - progress / fraction) if fraction > 0 else 0.0


def weighted_token_mse(
    pred: torch.Tensor,
    target: torch.Tensor,
    num_prefix_tokens: int,
    weights: Mapping[str, float] = TOKEN_WEIGHTS,
) -> torch.Tensor:
    """Σ_kind w_kind · MSE over that kind's tokens (CLS = token 0, registers = 1..p−1, patches);
    the weights of the kinds present are renormalised to sum to 1."""
    parts = {
        "cls": slice(0, 1),
        "registers": slice(1, num_prefix_tokens),
        "patches": slice(num_prefix_tokens, None),
    }
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
        return hashlib.blake2b(
            image.detach().cpu().contiguous().numpy().tobytes(), digest_size=16
        ).hexdigest()

    def states(self, teacher: nn.Module, x: torch.Tensor) -> torch.Tensor:
        keys = [self.key(img) for img in x]
        files = [self.dir / f"{k}.pt" for k in keys]
        found = [
            torch.load(f, map_location=x.device, weights_only=True) if f.is_file() else None for f in files
        ]
        missing = [i for i, t in enumerate(found) if t is None]
        self.hits += len(x) - len(missing)
        self.misses += len(missing)
        if missing:
            fresh = teacher_states(teacher, x[missing])
            for j, i in enumerate(missing):
                found[i] = fresh[:, j]
                state = fresh[:, j].to(self.dtype).cpu().clone()
                atomic_write(files[i], lambda tmp, state=state: torch.save(state, tmp))
        return torch.stack([t.to(x.dtype) for t in found], dim=1)


class RaptorDistill(nn.Module):
    """The frozen teacher and the surrogate being trained. ``stage_loss(x, stage, progress)`` is
    stage 1's or stage 2's loss (module docstring); there is no ``forward``: what runs after
    training is the surrogate under a probe (``Raptor.deploy``)."""

    def __init__(
        self,
        teacher: nn.Module,
        surrogate: RaptorSurrogate,
        cache_dir: str | None = None,
        tau_fraction: float = 0.25,
        stage2_targets: str = "all_layers",
    ):
        super().__init__()
        if stage2_targets not in ("all_layers", "final"):
            raise ValueError(
                f"method.stage2_targets={stage2_targets!r}: valid values are ('all_layers', 'final')"
            )
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
        return (
            self.cache.states(self.teacher, x) if self.cache is not None else teacher_states(self.teacher, x)
        )

    def stage1_criterion(self, phase: Sequence[int]) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """Plain MSE, or the weighted token MSE (:data:`STAGE1_FINAL_TOKEN_WEIGHTS`) for the block
        whose phase ends at the teacher's last layer."""
        if phase[-1] == len(self.teacher.blocks) - 1:
            return partial(
                weighted_token_mse,
                num_prefix_tokens=self.num_prefix_tokens,
                weights=STAGE1_FINAL_TOKEN_WEIGHTS,
            )
        return F.mse_loss

    def stage1_block_losses(self, x: torch.Tensor, tau: float) -> torch.Tensor:
        """(k,): each block's τ·forced + (1 − τ)·autoregressive loss over its phase, every
        block fed only the teacher's states (package docstring, "Training")."""
        h = self.teacher_states(x)
        losses = []
        for block, phase in zip(self.surrogate.blocks, self.surrogate.phases):
            criterion = self.stage1_criterion(phase)
            forced = autoregressive = 0.0
            if tau > 0:
                forced = sum(criterion(block(h[l], l), h[l + 1]) for l in phase) / len(phase)
            if tau < 1:
                z, autoregressive = h[phase[0]], 0.0
                for l in phase:
                    z = block(z, l)
                    autoregressive = autoregressive + criterion(z, h[l + 1])
                autoregressive = autoregressive / len(phase)
            losses.append(tau * forced + (1 - tau) * autoregressive)
        return torch.stack(losses)

    def stage1_loss(self, x: torch.Tensor, tau: float) -> torch.Tensor:
        """The sum of the blocks' losses. Blocks share no parameter, so its gradient with respect
        to a block is that block's own loss's gradient, as when the block trains alone."""
        return self.stage1_block_losses(x, tau).sum()

    def clip_groups(self, stage: int) -> list[list[nn.Parameter]]:
        """Parameter groups whose gradient norms are clipped separately: in stage 1 one group per
        block (RAPTOR clips each block in its own run), in stage 2 every trainable parameter."""
        if stage == 1:
            return [list(block.parameters()) for block in self.surrogate.blocks]
        return [[p for p in self.parameters() if p.requires_grad]]

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
