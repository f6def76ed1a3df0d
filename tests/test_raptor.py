"""RAPTOR's phases and surrogate architecture (vitexp/methods/raptor.py); training comes later."""
from __future__ import annotations

import pytest
import timm
import torch

import vitexp  # noqa: F401
from vitexp.flops import count_macs
from vitexp.methods.raptor import RaptorSurrogate, layer_distance_matrix, max_cut_phases, phases_for_blocks
from vitexp.methods.saper import ProbeModel


def block_matrix(sizes, inside=0.1, outside=1.0):
    n = sum(sizes)
    w = torch.full((n, n), outside)
    start = 0
    for s in sizes:
        w[start:start + s, start:start + s] = inside
        start += s
    w.fill_diagonal_(0)
    return w


@pytest.mark.parametrize("sizes", [[7, 5], [7, 3, 2]])
def test_max_cut_recovers_constructed_phases(sizes):
    phases = max_cut_phases(block_matrix(sizes), f=0.7, min_size=2)
    assert [len(p) for p in phases] == sizes
    assert [l for p in phases for l in p] == list(range(sum(sizes)))


@pytest.mark.parametrize("sizes", [[7, 5], [7, 3, 2], [4, 3, 3, 2]])
def test_phases_for_a_block_budget_recover_raptors_vit_b_partitions(sizes):
    """RAPTOR's ViT-B phases: [1-7][8-12]; [1-7][8-10][11-12]; [1-4][5-7][8-10][11-12]."""
    assert [len(p) for p in phases_for_blocks(block_matrix(sizes), len(sizes))] == sizes


def test_homogeneous_layers_are_not_split():
    assert max_cut_phases(block_matrix([12], inside=1.0), f=0.7) == [list(range(12))]


def test_layer_distance_matrix():
    feats = torch.randn(5, 8, 2, 16)
    feats[3] = feats[2]  # two identical layers: distance 0
    d = layer_distance_matrix(feats)
    assert d.shape == (5, 5)
    torch.testing.assert_close(d, d.T)
    assert float(d[2, 3]) == pytest.approx(0.0, abs=1e-9) and float(d.diagonal().abs().max()) < 1e-9
    assert float(d[0, 1]) > 0.5  # random directions: 1 - cos ~ 1 for each of the 2 token kinds


@pytest.mark.parametrize("phases", [[range(0, 7), range(7, 12)], [range(0, 4), range(4, 7), range(7, 10), range(10, 12)]])
@pytest.mark.parametrize("name, gflops", [("vit_base_patch14_reg4_dinov2", 61.86), ("vit_small_patch14_reg4_dinov2", 16.15)])
def test_raptor_flops_under_its_own_setting(name, gflops, phases):
    """224 px, 4 registers (261 tokens), SwiGLU, 12 block applications, linear head on
    [CLS ‖ mean patch]: the same GFLOPs for 2 and 4 blocks."""
    teacher = timm.create_model(name, img_size=224, num_classes=1000)
    surrogate = RaptorSurrogate(teacher, [list(p) for p in phases])
    model = ProbeModel(surrogate, 1000)
    assert count_macs(model, 224, registers=4).gflops == pytest.approx(gflops, abs=0.02)


def test_surrogate_runs_all_layers_with_k_blocks_and_only_blocks_train():
    torch.manual_seed(0)
    teacher = timm.create_model("vit_micro_patch14_dinov2", num_classes=0)
    surrogate = RaptorSurrogate(teacher, [[0, 1], [2, 3]])
    calls = []
    for b in surrogate.blocks:
        b.attn.register_forward_hook(lambda m, i, o: calls.append(1))
    out = surrogate.forward_features(torch.randn(2, 3, 56, 56))
    assert out.shape == (2, 17, 64) and len(calls) == 4 and len(surrogate.blocks) == 2
    trainable = {n.split(".")[0] for n, p in surrogate.named_parameters() if p.requires_grad}
    assert trainable == {"blocks"}
    out.sum().backward()
    assert all(p.grad is not None for p in surrogate.blocks.parameters())
