"""LapSum soft top-k: closed-form forward, O(n) backward (vitexp/methods/lapsum.py)."""

from __future__ import annotations

import pytest
import torch

from vitexp.methods.lapsum import laplace_cdf, soft_topk


def test_outputs_in_open_unit_interval_and_sum_to_fractional_k():
    torch.manual_seed(0)
    scores = torch.randn(4, 7, 50, dtype=torch.float64)
    k = torch.tensor([1.5, 10.0, 24.25, 49.0], dtype=torch.float64).view(4, 1)
    p = soft_topk(scores, k, 0.7)
    assert p.shape == scores.shape
    assert (p > 0).all() and (p < 1).all()
    torch.testing.assert_close(p.sum(-1), k.expand(4, 7), rtol=0, atol=1e-9)


def test_gradcheck_scores_k_alpha():
    torch.manual_seed(0)
    scores = torch.randn(3, 9, dtype=torch.float64, requires_grad=True)
    k = torch.tensor([2.3, 4.0, 6.5], dtype=torch.float64, requires_grad=True)
    alpha = torch.tensor(0.8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda s, kk, a: soft_topk(s, kk, a), (scores, k, alpha))


def test_backward_matches_the_closed_form_jacobian():
    """∂p/∂r = (S/α)(diag q − q qᵀ), with f_i = ½e^{−|x_i|}, S = Σ f, q = f/S."""
    torch.manual_seed(1)
    alpha = 0.5
    r = torch.randn(6, dtype=torch.float64, requires_grad=True)
    p = soft_topk(r, 2.5, alpha)
    jac = torch.stack([torch.autograd.grad(p[i], r, retain_graph=True)[0] for i in range(6)])
    pd = p.detach()
    x = torch.where(pd <= 0.5, torch.log(2 * pd), -torch.log(2 * (1 - pd)))  # F⁻¹(p)
    f = 0.5 * torch.exp(-x.abs())
    q = f / f.sum()
    torch.testing.assert_close(jac, (f.sum() / alpha) * (torch.diag(q) - torch.outer(q, q)))
    # the jacobian is never formed by the backward: one vector-Jacobian product is O(n)
    g = torch.randn(6, dtype=torch.float64)
    (vjp,) = torch.autograd.grad(p, r, g)
    torch.testing.assert_close(vjp, g @ jac)


def test_small_alpha_is_the_hard_top_k():
    torch.manual_seed(2)
    scores = torch.randn(5, 40)
    p = soft_topk(scores, 7, 1e-4)
    hard = torch.zeros_like(scores).scatter_(-1, scores.topk(7, dim=-1).indices, 1.0)
    torch.testing.assert_close(p, hard, atol=1e-3, rtol=0)


def test_large_alpha_tends_to_k_over_n():
    scores = torch.randn(2, 30, dtype=torch.float64)
    p = soft_topk(scores, 6, 1e6)
    torch.testing.assert_close(p, torch.full_like(p, 6 / 30), atol=1e-5, rtol=0)


def test_stable_for_a_million_scores_and_magnitude_ten_thousand():
    torch.manual_seed(3)
    big = torch.randn(1_000_000)
    p = soft_topk(big, 1234.5, 0.1)
    assert torch.isfinite(p).all() and abs(float(p.double().sum()) - 1234.5) < 1e-1
    huge = torch.randn(8, 100) * 1e4
    huge.requires_grad_(True)
    p2 = soft_topk(huge, 12.0, 1.0)
    assert torch.isfinite(p2).all()
    torch.testing.assert_close(p2.sum(-1), torch.full((8,), 12.0), atol=1e-3, rtol=0)
    p2.sum().backward()
    assert torch.isfinite(huge.grad).all()


def test_bad_k_and_alpha_are_refused():
    with pytest.raises(ValueError, match="k must lie in"):
        soft_topk(torch.randn(5), 5, 1.0)
    with pytest.raises(ValueError, match="alpha must be > 0"):
        soft_topk(torch.randn(5), 2, 0.0)


def test_laplace_cdf_values():
    x = torch.tensor([-1000.0, -1.0, 0.0, 1.0, 1000.0])
    torch.testing.assert_close(
        laplace_cdf(x), torch.tensor([0.0, 0.5 * 0.36787944, 0.5, 1 - 0.5 * 0.36787944, 1.0])
    )
