"""BSPF-ViT: chunk attention, block-based 2D pruning, fusion, symmetric Q/K (vitexp/methods/bspf.py)."""
from __future__ import annotations

import copy

import pytest
import timm
import torch
import torch.nn.functional as F

import vitexp  # noqa: F401
import vitexp.config as vconfig
from vitexp.flops import count_macs
from vitexp.methods.bspf import BSPF, BlockScorer, ChunkOnly, TokenPruner

KEEP = {"kind": "keep_ratio", "keep_ratio": 0.5}


def micro(seed: int = 0):
    torch.manual_seed(seed)
    return timm.create_model("vit_micro_patch4_32", num_classes=10).eval()


def chunk_mask(n_prefix: int, n_patches: int, chunk: int) -> torch.Tensor:
    """Boolean mask (True = attend): patch queries see their chunk and the prefix; prefix queries see all."""
    n = n_prefix + n_patches
    mask = torch.zeros(n, n, dtype=torch.bool)
    mask[:n_prefix] = True
    mask[:, :n_prefix] = True
    for start in range(0, n_patches, chunk):
        s = slice(n_prefix + start, n_prefix + start + chunk)
        mask[s, s] = True
    return mask


def test_chunk_attention_equals_masked_full_attention():
    model = micro()
    x = torch.randn(2, 65, 64)
    reference_attn = copy.deepcopy(model.blocks[0].attn)
    mask = chunk_mask(1, 64, 16)
    expected = reference_attn(x, attn_mask=mask)
    ChunkOnly(chunk_size=16).apply(model, {"kind": "none"})
    assert type(model.blocks[0].attn).__name__ == "ChunkAttention"
    got = model.blocks[0].attn(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    model.blocks[0].attn.keep_probs = True  # the explicit-softmax path agrees too
    torch.testing.assert_close(model.blocks[0].attn(x), expected, rtol=1e-5, atol=1e-6)


def test_chunk_attention_costs_n_times_omega():
    full = count_macs(micro(), 32).gmacs
    chunked = count_macs(ChunkOnly(chunk_size=16).apply(micro(), {"kind": "none"}), 32).gmacs
    # per layer: patch queries 64 x (16 + 1) keys instead of 65 x 65, CLS query unchanged (65 keys)
    saved = 6 * 2 * 64 * (65 - 17) * 64
    assert (full - chunked) * 1e9 == pytest.approx(saved)


def test_keep_ratio_one_with_one_chunk_reproduces_the_backbone():
    base = micro()
    x = torch.randn(3, 3, 32, 32)
    expected = base(x)
    one_chunk = ChunkOnly(chunk_size=None).apply(copy.deepcopy(base), {"kind": "none"})
    assert torch.equal(one_chunk(x), expected)  # the same fused attention call: bit-exact
    model = BSPF(chunk_size=None, prune_layers=[1, 3]).apply(copy.deepcopy(base), {"kind": "keep_ratio", "keep_ratio": 1.0})
    # the pruning layers compute the softmax explicitly (its blocks are scored): float tolerance
    torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)


def test_tokens_are_really_removed_and_flops_fall():
    model = BSPF(chunk_size=16, prune_layers=[1, 3]).apply(micro(), KEEP)
    seen = {}
    for i, block in enumerate(model.blocks):
        block.mlp.register_forward_hook(lambda m, inp, out, i=i: seen.__setitem__(i, inp[0].shape[1]))
    model(torch.randn(2, 3, 32, 32))
    # 1 CLS + 4 chunks x 16 -> 4 x 8 after layer 1's attention -> 4 x 4 after layer 3's
    assert [seen[i] for i in range(6)] == [65, 33, 33, 17, 17, 17]
    assert count_macs(model, 32).gmacs < 0.5 * count_macs(micro(), 32).gmacs


def test_scorer_receives_gradients_straight_through():
    model = BSPF(chunk_size=16, prune_layers=[1, 3]).apply(micro(), KEEP).train()
    loss = F.cross_entropy(model(torch.randn(4, 3, 32, 32)), torch.tensor([0, 1, 2, 3]))
    loss.backward()
    for i in (1, 3):
        grad = model.blocks[i].pruner.scorer.weight.grad
        assert grad is not None and grad.abs().sum() > 0


def test_single_token_score_is_the_fixed_identity_kernel():
    scorer = BlockScorer("single")
    blocks = torch.rand(2, 3, 7, 7)
    torch.testing.assert_close(scorer(blocks), blocks)
    assert not scorer.weight.requires_grad


def test_pruning_keeps_balanced_chunks_and_joint_qk_counts():
    pruner = TokenPruner(0.5, num_prefix=1, num_chunks=2, score="single", mirror="none", fusion="none")
    blocks = torch.zeros(1, 2, 4, 4)
    blocks[0, 0, 2, :] = 1.0  # token 2 of chunk 0: every entry of its row is large
    blocks[0, 0, :, 1] = 0.9  # token 1 of chunk 0: large as a key (column)
    blocks[0, 1] = torch.eye(4) * torch.tensor([0.1, 0.2, 0.8, 0.9])
    keep, mask, _, _ = pruner.select(blocks)
    assert keep.shape == (1, 2, 2)
    assert keep[0, 0].tolist() == [1, 2]
    assert keep[0, 1].tolist() == [2, 3]
    assert mask[0, 0].sum() == 8  # ⌈0.5 · 16⌉ entries kept per block


def test_paper_literal_fusion_changes_nothing():
    torch.manual_seed(0)
    none = BSPF(chunk_size=16, prune_layers=[1, 3], fusion="none").apply(micro(), KEEP)
    literal = BSPF(chunk_size=16, prune_layers=[1, 3], fusion="paper_literal").apply(micro(), KEEP)
    similar = BSPF(chunk_size=16, prune_layers=[1, 3], fusion="similarity").apply(micro(), KEEP)
    x = torch.randn(2, 3, 32, 32)
    assert torch.equal(none(x), literal(x))
    assert not torch.allclose(none(x), similar(x))


def test_similarity_fusion_is_a_weighted_average_into_the_best_kept_token():
    patches = torch.tensor([[[[1.0, 0.0], [0.0, 1.0], [1.0, 0.1], [0.0, 2.0]]]])  # B=1, C=1, L=4, D=2
    keep = torch.tensor([[[0, 1]]])
    kept = patches[:, :, :2].clone()
    mask = torch.ones(1, 1, 4, 4)  # identical rows: Hamming 0, similarity = cosine
    fused = TokenPruner._fuse_similarity(patches, kept, keep, mask)
    w2 = F.cosine_similarity(patches[0, 0, 2], patches[0, 0, 0], dim=0)
    w3 = 1.0
    torch.testing.assert_close(fused[0, 0, 0], (patches[0, 0, 0] + w2 * patches[0, 0, 2]) / (1 + w2))
    torch.testing.assert_close(fused[0, 0, 1], (patches[0, 0, 1] + w3 * patches[0, 0, 3]) / (1 + w3))


def test_symmetric_qk_is_shared_and_initialised_from_the_mean():
    base = micro()
    wq, wk = base.blocks[0].attn.qkv.weight[:64].clone(), base.blocks[0].attn.qkv.weight[64:128].clone()
    model = BSPF(chunk_size=16, prune_layers=[1], symmetric=True, mirror="upper").apply(base, KEEP)
    attn = model.blocks[0].attn
    torch.testing.assert_close(attn.qk.weight, 0.5 * (wq + wk))
    assert not hasattr(attn, "qkv")
    logits = model(torch.randn(2, 3, 32, 32))
    assert logits.shape == (2, 10)
    s = model.blocks[1].pruner.scorer(torch.rand(2, 4, 16, 16))
    torch.testing.assert_close(s, s.transpose(-1, -2))
    # one projection for q and k: 2/3 of the qkv MACs
    full = count_macs(BSPF(chunk_size=16, prune_layers=[1]).apply(micro(), KEEP), 32).gmacs
    sym = count_macs(BSPF(chunk_size=16, prune_layers=[1], symmetric=True).apply(micro(), KEEP), 32).gmacs
    assert sym < full


@pytest.mark.parametrize("backbone, target, tol", [("deit_small", 2.4, 0.1), ("deit_tiny", 0.6, 0.05)])
def test_default_prune_layers_hit_the_papers_gmacs(backbone, target, tol):
    from vitexp.build import build_model

    cfg = vconfig.compose([f"backbone={backbone}", "method=bspf", "budget=keep_ratio", "data=imagenet"])
    assert cfg.budget.kind == "keep_ratio" and cfg.budget.keep_ratio == 0.5
    model, method, _ = build_model(cfg)
    assert count_macs(method.deploy(model), 224).gmacs == pytest.approx(target, abs=tol)


def test_bad_chunk_size_names_valid_ones():
    with pytest.raises(vconfig.ConfigError, match=r"accepts budget kinds \['keep_ratio'\]"):
        vconfig.validate(vconfig.compose(["method=bspf"]))
    cfg = vconfig.compose(["method=bspf", "budget=keep_ratio", "method.chunk_size=10"])
    with pytest.raises(vconfig.ConfigError, match="valid chunk sizes"):
        vconfig.validate(cfg)
    with pytest.raises(vconfig.ConfigError, match="keep_ratio"):
        vconfig.validate(vconfig.compose(["method=bspf", "budget=keep_ratio", "budget.keep_ratio=1.5"]))


def test_bspf_on_lvvit_keeps_its_residual_scaling_and_aux_head():
    torch.manual_seed(0)
    base = timm.create_model("lvvit_micro", num_classes=10).eval()
    x = torch.randn(2, 3, 64, 64)
    expected = base(x)
    same = BSPF(chunk_size=None, prune_layers=[1]).apply(copy.deepcopy(base), {"kind": "keep_ratio", "keep_ratio": 1.0})
    torch.testing.assert_close(same(x), expected, rtol=1e-5, atol=1e-5)
    pruned = BSPF(chunk_size=8, prune_layers=[1]).apply(copy.deepcopy(base), KEEP).eval()
    with torch.no_grad():
        feats = pruned.forward_features(x)
        assert feats.shape[1] == 1 + 2 * 4  # 16 patches in 2 chunks of 8 -> 2 x 4 survive
        aux = pruned.aux_head(feats[:, 1:]).max(dim=1).values  # max over the surviving tokens
        torch.testing.assert_close(pruned(x), pruned.head(feats[:, 0]) + 0.5 * aux)


def test_bspf_on_t2t_vit_uses_its_attention_scale():
    torch.manual_seed(0)
    base = timm.create_model("t2t_vit_micro", num_classes=10, qk_scale=0.05).eval()
    x = torch.randn(2, 3, 64, 64)
    expected = base(x)
    same = BSPF(chunk_size=None, prune_layers=[1]).apply(copy.deepcopy(base), {"kind": "keep_ratio", "keep_ratio": 1.0})
    torch.testing.assert_close(same(x), expected, rtol=1e-5, atol=1e-5)
    chunked = ChunkOnly(chunk_size=8).apply(copy.deepcopy(base), {"kind": "none"})
    assert chunked(x).shape == (2, 10)


def test_bspf_on_caformer_prunes_stage_3_and_restores_the_grid():
    """CaFormer: pruning inside stage 3, the full 2-D grid restored before stage 4's downsampling."""
    from vitexp.methods.bspf import RestoringSequential

    torch.manual_seed(0)
    base = timm.create_model("caformer_micro", num_classes=10).eval()
    x = torch.randn(2, 3, 64, 64)
    expected = base(x)
    same = BSPF(chunk_size=None, prune_layers=[0]).apply(copy.deepcopy(base), {"kind": "keep_ratio", "keep_ratio": 1.0})
    torch.testing.assert_close(same(x), expected, rtol=1e-5, atol=1e-5)
    model = BSPF(chunk_size=8, prune_layers=[0]).apply(copy.deepcopy(base), KEEP).eval()
    stage = model.stages[2]
    assert isinstance(stage.blocks, RestoringSequential)
    seen = {}
    stage.blocks[1].mlp.register_forward_hook(lambda m, i, o: seen.__setitem__("tokens", i[0].shape[1]))
    stage_out = {}
    stage.register_forward_hook(lambda m, i, o: stage_out.__setitem__("shape", o.shape))
    assert model(x).shape == (2, 10)
    assert seen["tokens"] == 8  # 16 tokens in 2 chunks of 8 -> 2 x 4 survive
    assert stage_out["shape"] == (2, 64, 4, 4)  # the grid stage 4 downsamples is whole again
    assign = model.stages[2].blocks[0].pruner.last["assign"]
    assert assign.shape == (2, 16) and int(assign.max()) < 8
    assert count_macs(model, 64).gmacs < count_macs(base, 64).gmacs
