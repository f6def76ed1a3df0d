"""BSPF-ViT's algorithm on one layer: the block scorer, block-based 2D pruning and fusion.

Its reasoning: docs/reading-bspf.md, "vitexp/methods/bspf/pruning.py".
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from vitexp.methods.token_record import TokenDecision

SCORES = ("local3x3", "avg3x3", "single")
FUSIONS = ("similarity", "cosine", "hamming", "none", "paper_literal")
MERGING_FUSIONS = ("similarity", "cosine", "hamming")  # the fusions that merge pruned tokens into kept ones
MIRRORS = ("none", "upper")


class BlockScorer(nn.Module):
    """Scores a batch of Ω×Ω attention blocks with one 3×3 kernel (padding 1)."""

    def __init__(self, score: str = "local3x3", mirror: str = "none"):
        super().__init__()
        if score not in SCORES:
            raise ValueError(f"method.score={score!r}: valid scores are {SCORES}")
        if mirror not in MIRRORS:
            raise ValueError(f"method.mirror={mirror!r}: valid mirrors are {MIRRORS}")
        self.score, self.mirror = score, mirror
        if score == "local3x3":
            self.logits = nn.Parameter(torch.zeros(9))  # softmax(0) = the uniform 3x3 average
        else:
            fixed = (
                torch.full((1, 1, 3, 3), 1.0 / 9.0)
                if score == "avg3x3"
                else F.pad(torch.ones(1, 1, 1, 1), (1, 1, 1, 1))
            )
            self.register_buffer("fixed", fixed, persistent=False)

    def kernel(self) -> torch.Tensor:
        """The (1, 1, 3, 3) kernel: softmax of the logits (``local3x3``) or the fixed one."""
        w = self.logits.softmax(0).reshape(1, 1, 3, 3) if self.score == "local3x3" else self.fixed
        if self.mirror == "upper":
            w = 0.5 * (w + w.transpose(-1, -2))
        return w

    def forward(self, blocks: torch.Tensor) -> torch.Tensor:
        """blocks: (..., Ω, Ω) -> scores of the same shape."""
        lead, (n, m) = blocks.shape[:-2], blocks.shape[-2:]
        s = F.conv2d(blocks.reshape(-1, 1, n, m), self.kernel().to(blocks.dtype), padding=1).reshape(
            *lead, n, m
        )
        if self.mirror == "upper":
            s = torch.triu(s) + torch.triu(s, 1).transpose(-1, -2)
        return s


class TokenPruner(nn.Module):
    """Block-based 2D pruning and fusion of one layer (module docstring).

    ``keep_ratio`` is ρ. While training, ``train_keep_ratio`` (set by a keep-rate warm-up) replaces
    it when not None. ``realised`` holds (kept, input) patch tokens of the last call, the layer's
    realised keep fraction kept / input = ⌈ρΩ⌉ / Ω. With ``record_decisions`` set, ``decision``
    (:class:`~vitexp.methods.token_record.TokenDecision`) says where each input patch token went."""

    record_decisions = False

    def __init__(
        self, keep_ratio: float, num_prefix: int, num_chunks: int, score: str, mirror: str, fusion: str
    ):
        super().__init__()
        if fusion not in FUSIONS:
            raise ValueError(f"method.fusion={fusion!r}: valid fusions are {FUSIONS}")
        self.keep_ratio, self.num_prefix, self.num_chunks, self.fusion = (
            keep_ratio,
            num_prefix,
            num_chunks,
            fusion,
        )
        self.train_keep_ratio: float | None = None
        self.scorer = BlockScorer(score, mirror)
        self.track = False  # record where every token went (for restoring a full grid)
        self.last: dict[str, torch.Tensor] = {}
        self.realised: tuple[int, int] | None = None

    def ratio(self) -> float:
        """ρ of this call: the warm-up's value while training, else ``keep_ratio``."""
        return (
            self.train_keep_ratio if self.training and self.train_keep_ratio is not None else self.keep_ratio
        )

    def select(self, blocks: torch.Tensor):
        """blocks (B, C, Ω, Ω) -> (kept token indices per chunk (B, C, Ω'), entry mask M, scores S, soft
        importance)."""
        B, C, L, _ = blocks.shape
        rho = self.ratio()
        scores = self.scorer(blocks)
        flat = scores.reshape(B, C, L * L)
        n_entries = max(1, math.ceil(rho * L * L))
        top = flat.topk(n_entries, dim=-1).indices
        mask = torch.zeros_like(flat).scatter_(-1, top, 1.0).reshape(B, C, L, L)
        count = mask.sum(-1) + mask.sum(-2)  # as query (row) + as key (column)
        kept_scores = mask * scores
        soft = (kept_scores.sum(-1) + kept_scores.sum(-2)) / L
        tie = soft.detach() / (soft.detach().abs().amax(-1, keepdim=True) + 1e-12)  # in [-1, 1]
        n_keep = max(1, math.ceil(rho * L))
        keep = (count + 0.25 * tie).topk(n_keep, dim=-1).indices.sort(dim=-1).values
        return keep, mask, scores, soft

    def select_partial(self, blocks: torch.Tensor, counts: tuple[int, ...]):
        """:meth:`select` for chunks whose first ``counts[c]`` slots hold tokens (module docstring):
        (kept slots (B, C, K) with the ⌈ρr⌉ kept ones first, in order, then filler slots; their
        count per chunk; M; S; soft importance)."""
        B, C, L, _ = blocks.shape
        rho = self.ratio()
        dev = blocks.device
        r = torch.tensor(counts, device=dev)
        valid = torch.arange(L, device=dev) < r[:, None]  # C, L
        blocks = blocks * (
            valid[:, :, None] & valid[:, None, :]
        )  # an empty slot's row (its column is 0 already)
        scores = self.scorer(blocks)
        n_entries = torch.tensor([max(1, math.ceil(rho * c * c)) for c in counts], device=dev)
        flat = scores.masked_fill(~(valid[:, :, None] & valid[:, None, :]), float("-inf")).reshape(
            B, C, L * L
        )
        top = flat.topk(int(n_entries.max()), dim=-1).indices
        take = (
            (torch.arange(top.shape[-1], device=dev) < n_entries[:, None]).to(scores.dtype).expand(B, C, -1)
        )
        mask = torch.zeros_like(flat).scatter_(-1, top, take).reshape(B, C, L, L)
        count = mask.sum(-1) + mask.sum(-2)
        kept_scores = mask * scores
        soft = (kept_scores.sum(-1) + kept_scores.sum(-2)) / r[:, None].to(scores.dtype)
        tie = soft.detach() / (soft.detach().abs().amax(-1, keepdim=True) + 1e-12)
        n_keep = tuple(max(1, math.ceil(rho * c)) for c in counts)
        K = max(1, math.ceil(rho * L))
        key = (count + 0.25 * tie).masked_fill(~valid, float("-inf"))
        ranked = key.sort(dim=-1, descending=True, stable=True).indices[
            ..., :K
        ]  # an exact tie: the earlier token
        chosen = torch.arange(K, device=dev) < torch.tensor(n_keep, device=dev)[:, None]  # C, K
        keep = (
            torch.where(chosen, ranked, L - 1).sort(dim=-1).values
        )  # filler: the last slot, empty wherever used
        return keep, n_keep, mask, scores, soft

    def forward(
        self, x: torch.Tensor, blocks: torch.Tensor, counts: tuple[int, ...] | None = None
    ) -> torch.Tensor:
        """x (B, P + C·L, D), blocks (B, C, L, L) -> (B, P + C·K, D). ``counts``: the real tokens of each
        chunk when chunks have empty slots (module docstring); ``last["counts"]`` then holds the kept ones."""
        if counts is not None:
            return self._forward_partial(x, blocks, tuple(int(c) for c in counts))
        B, N, D = x.shape
        P, C = self.num_prefix, self.num_chunks
        L = (N - P) // C
        with torch.autocast(x.device.type, enabled=False):
            keep, mask, scores, soft = self.select(blocks.float())
        n_keep = keep.shape[-1]
        patches = x[:, P:].reshape(B, C, L, D)
        source = self._fuse_paper_literal(patches, keep) if self.fusion == "paper_literal" else patches
        kept = source.gather(2, keep.unsqueeze(-1).expand(B, C, n_keep, D))
        # straight-through: forward value 1, gradient to the scorer through every kept token
        g = 1.0 + soft - soft.detach()
        kept = kept * g.gather(2, keep).unsqueeze(-1).to(kept.dtype)
        match = None
        merging = self.fusion in MERGING_FUSIONS
        if n_keep < L and (merging or self.track or self.record_decisions):
            with torch.autocast(x.device.type, enabled=False):
                match = self._match(patches, kept, keep, mask, self.fusion if merging else "similarity")
        if merging and match is not None:
            kept = self._merge(kept, *match)
        self.last = {"keep": keep.detach(), "mask": mask.detach()}
        self.realised = (int(C * n_keep), int(C * L))  # ints, also when traced by the FLOPs counter
        if self.track:  # where each input token went: its own slot, or its fusion target's
            self.last["assign"] = self._assignment(keep, match, L)
        if self.record_decisions:
            self.decision = self._decision(keep, match, L)
        return torch.cat([x[:, :P], kept.reshape(B, C * n_keep, D)], dim=1)

    def _forward_partial(
        self, x: torch.Tensor, blocks: torch.Tensor, counts: tuple[int, ...]
    ) -> torch.Tensor:
        """:meth:`forward` over chunks with empty slots (module docstring); no prefix tokens."""
        B, N, D = x.shape
        C = len(counts)
        L = N // C
        if self.num_prefix or C * L != N or self.record_decisions or self.fusion == "paper_literal":
            raise ValueError(
                "partial chunks are pruned without prefix tokens, decision records or the "
                "paper_literal fusion (SHViT's token stages)"
            )
        with torch.autocast(x.device.type, enabled=False):
            keep, n_keep, mask, scores, soft = self.select_partial(blocks.float(), counts)
        K = keep.shape[-1]
        patches = x.reshape(B, C, L, D)
        kept = patches.gather(2, keep.unsqueeze(-1).expand(B, C, K, D))
        g = 1.0 + soft - soft.detach()
        kept = kept * g.gather(2, keep).unsqueeze(-1).to(kept.dtype)
        match = None
        merging = self.fusion in MERGING_FUSIONS
        if K < L and (merging or self.track):
            with torch.autocast(x.device.type, enabled=False):
                match = self._match_partial(
                    patches, kept, keep, mask, counts, n_keep, self.fusion if merging else "similarity"
                )
        if merging and match is not None:
            kept = self._merge(kept, *match)
        self.last = {"keep": keep.detach(), "mask": mask.detach(), "counts": n_keep}
        self.realised = (int(sum(n_keep)), int(sum(counts)))
        if self.track:
            self.last["assign"] = self._assignment(keep, match, L)
        return kept.reshape(B, C * K, D)

    @staticmethod
    def _match_partial(patches, kept, keep, mask, counts, n_keep, kind: str = "similarity"):
        """:meth:`_match` within the real tokens of each chunk: a real pruned token's best real kept
        token, by the Hamming distance over the chunk's r tokens; the weight of an empty slot is 0."""
        B, C, L, D = patches.shape
        K = keep.shape[-1]
        dev = patches.device
        r = torch.tensor(counts, device=dev)
        valid = torch.arange(L, device=dev) < r[:, None]
        kept_real = (torch.arange(K, device=dev) < torch.tensor(n_keep, device=dev)[:, None]).expand(B, C, K)
        is_kept = torch.zeros(B, C, L, device=dev).scatter_(2, keep, kept_real.float())
        status = 2 * is_kept + (~valid).float()  # 0: real and pruned, 1: empty, 2: kept
        pruned_idx = status.argsort(dim=-1, stable=True)[
            ..., : L - K
        ]  # every real pruned token, then empty slots
        real = status.gather(2, pruned_idx) == 0
        pruned = patches.gather(2, pruned_idx.unsqueeze(-1).expand(B, C, L - K, D))
        cos = F.normalize(pruned.float(), dim=-1) @ F.normalize(kept.float(), dim=-1).transpose(-1, -2)
        mask = mask.float()
        m_pruned = mask.gather(2, pruned_idx.unsqueeze(-1).expand(B, C, L - K, L))
        m_kept = mask.gather(2, keep.unsqueeze(-1).expand(B, C, K, L))
        inter = m_pruned @ m_kept.transpose(-1, -2)
        hamming = m_pruned.sum(-1, keepdim=True) + m_kept.sum(-1).unsqueeze(-2) - 2 * inter
        overlap = 1.0 - hamming / r.view(1, C, 1, 1).float()
        sim = {"similarity": cos * overlap, "cosine": cos, "hamming": overlap}[kind]
        sim = sim.masked_fill(~kept_real.unsqueeze(-2), float("-inf"))  # targets: real kept tokens only
        best, target = sim.max(dim=-1)
        best = torch.where(real, best, torch.zeros_like(best))  # an empty slot merges nothing
        return pruned_idx, pruned, target, best

    @staticmethod
    def _fuse_paper_literal(patches: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """x⊙k + (x⊙(1−k))⊙k over a chunk's tokens (k: kept-token mask): the second term is 0."""
        B, C, L, _ = patches.shape
        k = (
            torch.zeros(B, C, L, device=patches.device, dtype=patches.dtype)
            .scatter_(2, keep, 1.0)
            .unsqueeze(-1)
        )
        return patches * k + (patches * (1 - k)) * k

    @staticmethod
    def _match(patches, kept, keep, mask, kind: str = "similarity"):
        """Each pruned token's best kept token of its chunk by cos(x_i, x_j)·(1 − Hamming(m_i, m_j)/Ω)
        (``kind="similarity"``), or by one factor alone (``"cosine"``, ``"hamming"``):
        (pruned indices, pruned tokens, target slot, similarity). The similarity is float32."""
        B, C, L, D = patches.shape
        n_keep = keep.shape[-1]
        is_kept = torch.zeros(B, C, L, device=patches.device).scatter_(2, keep, 1.0)
        pruned_idx = is_kept.argsort(dim=-1, stable=True)[
            ..., : L - n_keep
        ]  # ascending: pruned first, in order
        pruned = patches.gather(2, pruned_idx.unsqueeze(-1).expand(B, C, L - n_keep, D))
        cos = F.normalize(pruned.float(), dim=-1) @ F.normalize(kept.float(), dim=-1).transpose(
            -1, -2
        )  # B,C,R,K
        mask = mask.float()
        m_pruned = mask.gather(2, pruned_idx.unsqueeze(-1).expand(B, C, L - n_keep, L))
        m_kept = mask.gather(2, keep.unsqueeze(-1).expand(B, C, n_keep, L))
        inter = m_pruned @ m_kept.transpose(-1, -2)
        hamming = m_pruned.sum(-1, keepdim=True) + m_kept.sum(-1).unsqueeze(-2) - 2 * inter
        overlap = 1.0 - hamming / L
        sim = {"similarity": cos * overlap, "cosine": cos, "hamming": overlap}[kind]
        best, target = sim.max(dim=-1)  # B,C,R
        return pruned_idx, pruned, target, best

    @staticmethod
    def _merge(kept, pruned_idx, pruned, target, best) -> torch.Tensor:
        """x_j ← (x_j + Σ w_i x_i) / (1 + Σ w_i) over the pruned tokens i matched to j, w = max(sim, 0),
        in the tokens' dtype."""
        B, C, n_keep, _ = kept.shape
        w = best.clamp(min=0).unsqueeze(-1).to(kept.dtype)
        num = kept.scatter_add(2, target.unsqueeze(-1).expand_as(pruned), (w * pruned).to(kept.dtype))
        den = torch.ones(B, C, n_keep, 1, dtype=kept.dtype, device=kept.device).scatter_add(
            2, target.unsqueeze(-1), w
        )
        return num / den

    @staticmethod
    def _assignment(keep: torch.Tensor, match, L: int) -> torch.Tensor:
        """(B, C·L) index of the output patch token that stands for each input patch token."""
        B, C, n_keep = keep.shape
        base = (torch.arange(C, device=keep.device) * n_keep).view(1, C, 1)
        assign = torch.zeros(B, C, L, dtype=torch.long, device=keep.device)
        assign.scatter_(
            2, keep, (base + torch.arange(n_keep, device=keep.device).view(1, 1, n_keep)).expand(B, C, n_keep)
        )
        if match is not None:
            pruned_idx, _, target, _ = match
            assign.scatter_(2, pruned_idx, base.expand_as(target) + target)
        return assign.reshape(B, C * L)

    def _decision(self, keep: torch.Tensor, match, L: int) -> TokenDecision:
        """:meth:`_assignment` with the pruned tokens that add nothing marked dropped (−1): all of
        them unless the fusion merges (:data:`MERGING_FUSIONS`), and there those of weight max(sim, 0) = 0."""
        B, C, n_keep = keep.shape
        target = self._assignment(keep, match, L).reshape(B, C, L)
        kept = torch.zeros(B, C, L, dtype=torch.bool, device=keep.device).scatter_(2, keep, True)
        fused = torch.zeros_like(kept)
        if match is not None and self.fusion in MERGING_FUSIONS:
            pruned_idx, _, _, best = match
            fused.scatter_(2, pruned_idx, best > 0)
        target = torch.where(kept | fused, target, torch.full_like(target, -1))
        return TokenDecision(kept.reshape(B, C * L), target.reshape(B, C * L), C * n_keep, C)
