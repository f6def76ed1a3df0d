"""LapSum soft top-k (Struski et al., ICML 2025, arXiv 2503.06242): closed form after a sort, with an O(n)
custom backward.

Its reasoning: docs/reading-saper.md, "vitexp/methods/lapsum.py".
"""

from __future__ import annotations

import math

import torch


def laplace_cdf(x: torch.Tensor) -> torch.Tensor:
    """F(x) = ½eˣ (x ≤ 0), 1 − ½e⁻ˣ (x > 0), without overflow."""
    return torch.where(
        x <= 0, 0.5 * torch.exp(torch.clamp(x, max=0)), 1 - 0.5 * torch.exp(-torch.clamp(x, min=0))
    )


def _solve_threshold(s: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """c with Σ F(s_i − c) = k, for s (..., n) and k (..., 1); returns (..., 1)."""
    n = s.shape[-1]
    s_sorted, _ = torch.sort(s, dim=-1)
    neg_inf = torch.full_like(s_sorted[..., :1], -math.inf)
    # L_j = log Σ_{i<j} e^{s_i} and R_j = log Σ_{i>=j} e^{-s_i}, for j = 0..n
    lcse = torch.logcumsumexp(s_sorted, dim=-1)
    L = torch.cat([neg_inf, lcse], dim=-1)
    rcse = torch.logcumsumexp((-s_sorted).flip(-1), dim=-1).flip(-1)
    R = torch.cat([rcse, neg_inf], dim=-1)
    # g at each knot s_m (m = 0..n-1): ½ Σ_{i<=m} e^{s_i - s_m} + (n - m - 1) + ½ - ... written with L, R:
    # g(s_m) = ½ e^{L_{m+1} - s_m} + (n - m - 1) - ½ e^{R_{m+1} + s_m}
    m_idx = torch.arange(n, device=s.device, dtype=s.dtype)
    g_knots = (
        0.5 * torch.exp(L[..., 1:] - s_sorted) + (n - m_idx - 1) - 0.5 * torch.exp(R[..., 1:] + s_sorted)
    )
    # g is decreasing in c: j = number of knots with g >= k (binary search on -g, increasing)
    j = torch.searchsorted((-g_knots).contiguous(), (-k).contiguous(), right=True)  # (..., 1) in 0..n
    Lj, Rj = L.gather(-1, j), R.gather(-1, j)
    m = (n - j).to(s.dtype) - k
    log_e = Lj + Rj  # <= log(j (n - j)): never overflows, may underflow
    root = torch.sqrt(m * m + torch.exp(log_e))
    # y = -m + sqrt(m² + e), in logs: e / (m + root) for m > 0, ½ log e at m = 0, |m| + root for m < 0
    log_y = torch.where(
        m > 0, log_e - torch.log(m + root), torch.where(m == 0, 0.5 * log_e, torch.log(root - m))
    )
    c_mid = Lj - log_y
    c_left = torch.log(2 * (n - k)) - Rj  # j = 0: every score right of c
    c_right = Lj - torch.log(2 * k)  # j = n: every score left of c
    return torch.where(j == 0, c_left, torch.where(j == n, c_right, c_mid))


class _LapSumTopK(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scores: torch.Tensor, k: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
        s = scores / alpha
        c = _solve_threshold(s, k)
        x = s - c
        ctx.save_for_backward(scores, x, alpha, k)
        return laplace_cdf(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        scores, x, alpha, k = ctx.saved_tensors
        neg_abs = -x.abs()
        q = torch.softmax(neg_abs, dim=-1)  # f / S
        S = 0.5 * torch.exp(torch.logsumexp(neg_abs, dim=-1, keepdim=True))  # Σ ½ e^{-|x|}
        q_grad = (q * grad).sum(-1, keepdim=True)
        grad_scores = (S / alpha) * q * (grad - q_grad)
        grad_k = q_grad
        q_r = (q * scores).sum(-1, keepdim=True)
        grad_alpha = -(S / alpha**2) * (q * (scores - q_r) * grad).sum(-1, keepdim=True)
        return grad_scores, grad_k.sum_to_size(k.shape), grad_alpha.sum_to_size(alpha.shape)


def soft_topk(scores: torch.Tensor, k: float | torch.Tensor, alpha: float | torch.Tensor) -> torch.Tensor:
    """LapSum soft top-k over the last dimension: values in [0, 1] summing to ``k``.

    ``k`` (0 < k < n, may be fractional) and ``alpha`` (> 0) are floats or tensors broadcastable
    to ``scores.shape[:-1]``; as tensors they receive gradients."""
    n = scores.shape[-1]
    k_t = torch.as_tensor(k, dtype=scores.dtype, device=scores.device)
    a_t = torch.as_tensor(alpha, dtype=scores.dtype, device=scores.device)
    # checked in eager only: a branch on a tensor's value is a graph break under torch.compile, where
    # the caller's schedule (SAPER's HeadSelector) keeps k and alpha in range
    if not torch.compiler.is_compiling() and (torch.any(k_t <= 0) or torch.any(k_t >= n)):
        raise ValueError(f"soft_topk: k must lie in (0, {n}), got {k}")
    if not torch.compiler.is_compiling() and torch.any(a_t <= 0):
        raise ValueError(f"soft_topk: alpha must be > 0, got {alpha}")
    batch = scores.shape[:-1]
    k_b = k_t.expand(batch).unsqueeze(-1) if k_t.dim() <= len(batch) else k_t
    a_b = a_t.expand(batch).unsqueeze(-1) if a_t.dim() <= len(batch) else a_t
    return _LapSumTopK.apply(scores, k_b, a_b)
