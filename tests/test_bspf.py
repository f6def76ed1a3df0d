"""BSPF-ViT: chunk attention, block-based 2D pruning, fusion, symmetric Q/K (vitexp/methods/bspf/)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import timm
import torch
import torch.nn.functional as F
import yaml

import vitexp  # noqa: F401
import vitexp.config.composition as vconfig
from vitexp.measure.flops import count_macs
from vitexp.methods.bspf import BSPF, BlockScorer, ChunkOnly, TokenPruner
from vitexp.training import resolve

KEEP = {"kind": "keep_ratio", "keep_ratio": 0.5}
STEPS = 10  # training steps of the scorer-learning test


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
    model = BSPF(chunk_size=None, prune_layers=[1, 3]).apply(
        copy.deepcopy(base), {"kind": "keep_ratio", "keep_ratio": 1.0}
    )
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
        grad = model.blocks[i].pruner.scorer.logits.grad
        assert grad is not None and grad.abs().sum() > 0


def test_single_token_score_is_the_fixed_identity_kernel():
    scorer = BlockScorer("single")
    blocks = torch.rand(2, 3, 7, 7)
    torch.testing.assert_close(scorer(blocks), blocks)
    assert not list(scorer.parameters())


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
    fused = TokenPruner._merge(kept, *TokenPruner._match(patches, kept, keep, mask))
    w2 = F.cosine_similarity(patches[0, 0, 2], patches[0, 0, 0], dim=0)
    w3 = 1.0
    torch.testing.assert_close(fused[0, 0, 0], (patches[0, 0, 0] + w2 * patches[0, 0, 2]) / (1 + w2))
    torch.testing.assert_close(fused[0, 0, 1], (patches[0, 0, 1] + w3 * patches[0, 0, 3]) / (1 + w3))


def test_fusion_ablations_match_by_one_factor_alone():
    """Table 8's ablations: ``cosine`` ignores the masks, ``hamming`` ignores the features. Pruned token 2
    points like kept token 0 but shares its mask row with kept token 1, so the two pick different targets."""
    patches = torch.tensor([[[[1.0, 0.0], [0.0, 1.0], [1.0, 0.2], [0.0, 2.0]]]])  # B=1, C=1, L=4, D=2
    keep = torch.tensor([[[0, 1]]])
    kept = patches[:, :, :2].clone()
    mask = torch.tensor([[[[1.0, 0, 0, 0], [0, 1, 1, 0], [0, 1, 1, 0], [0, 1, 1, 0]]]])
    _, _, by_cos, w_cos = TokenPruner._match(patches, kept, keep, mask, "cosine")
    _, _, by_ham, w_ham = TokenPruner._match(patches, kept, keep, mask, "hamming")
    _, _, by_both, w_both = TokenPruner._match(patches, kept, keep, mask, "similarity")
    assert by_cos[0, 0].tolist() == [0, 1]  # token 2 -> 0 (cos 0.98), token 3 -> 1 (cos 1)
    assert by_ham[0, 0].tolist() == [1, 1]  # both share token 1's mask row (Hamming 0)
    torch.testing.assert_close(w_ham[0, 0], torch.ones(2))
    torch.testing.assert_close(w_cos[0, 0, 0], F.cosine_similarity(patches[0, 0, 2], patches[0, 0, 0], dim=0))
    # the product: token 2 -> 0 by cos 0.98 · (1 − 3/4) = 0.245 > cos(t2, t1) · 1 = 0.196
    assert by_both[0, 0].tolist() == [0, 1]
    torch.testing.assert_close(w_both[0, 0, 0], 0.25 * w_cos[0, 0, 0])


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
    from vitexp.training.build import build_model

    cfg = vconfig.compose([f"backbone={backbone}", "method=bspf", "budget=keep_ratio", "data=imagenet"])
    assert cfg.budget.kind == "keep_ratio" and cfg.budget.keep_ratio == 0.5
    model, method, _ = build_model(cfg)
    assert count_macs(method.deploy(model), 224).gmacs == pytest.approx(target, abs=tol)


def test_bad_chunk_size_names_valid_ones():
    with pytest.raises(vconfig.ConfigError, match=r"accepts budget kinds \['keep_ratio'\]"):
        resolve.validate(vconfig.compose(["method=bspf"]))
    cfg = vconfig.compose(["method=bspf", "budget=keep_ratio", "method.chunk_size=10"])
    with pytest.raises(vconfig.ConfigError, match="valid chunk sizes"):
        resolve.validate(cfg)
    with pytest.raises(vconfig.ConfigError, match="keep_ratio"):
        resolve.validate(vconfig.compose(["method=bspf", "budget=keep_ratio", "budget.keep_ratio=1.5"]))


def test_bspf_on_lvvit_keeps_its_residual_scaling_and_aux_head():
    torch.manual_seed(0)
    base = timm.create_model("lvvit_micro", num_classes=10).eval()
    x = torch.randn(2, 3, 64, 64)
    expected = base(x)
    same = BSPF(chunk_size=None, prune_layers=[1]).apply(
        copy.deepcopy(base), {"kind": "keep_ratio", "keep_ratio": 1.0}
    )
    torch.testing.assert_close(same(x), expected, rtol=1e-5, atol=1e-5)
    pruned = BSPF(chunk_size=4, prune_layers=[1]).apply(copy.deepcopy(base), KEEP).eval()
    with torch.no_grad():
        feats = pruned.forward_features(x)
        assert feats.shape[1] == 1 + 4 * 2  # 4x4 patches in four 2x2 windows -> 4 x 2 survive
        aux = pruned.aux_head(feats[:, 1:]).max(dim=1).values  # max over the surviving tokens
        torch.testing.assert_close(pruned(x), pruned.head(feats[:, 0]) + 0.5 * aux)


def test_bspf_on_t2t_vit_uses_its_attention_scale():
    torch.manual_seed(0)
    base = timm.create_model("t2t_vit_micro", num_classes=10, qk_scale=0.05).eval()
    x = torch.randn(2, 3, 64, 64)
    expected = base(x)
    same = BSPF(chunk_size=None, prune_layers=[1]).apply(
        copy.deepcopy(base), {"kind": "keep_ratio", "keep_ratio": 1.0}
    )
    torch.testing.assert_close(same(x), expected, rtol=1e-5, atol=1e-5)
    chunked = ChunkOnly(chunk_size=4).apply(copy.deepcopy(base), {"kind": "none"})
    assert chunked(x).shape == (2, 10)


def test_bspf_on_caformer_prunes_stage_3_and_restores_the_grid():
    """CaFormer: pruning inside stage 3, the full 2-D grid restored before stage 4's downsampling."""
    from vitexp.methods.bspf import RestoringSequential

    torch.manual_seed(0)
    base = timm.create_model("caformer_micro", num_classes=10).eval()
    x = torch.randn(2, 3, 64, 64)
    expected = base(x)
    same = BSPF(chunk_size=None, prune_layers=[0]).apply(
        copy.deepcopy(base), {"kind": "keep_ratio", "keep_ratio": 1.0}
    )
    torch.testing.assert_close(same(x), expected, rtol=1e-5, atol=1e-5)
    model = BSPF(chunk_size=4, prune_layers=[0]).apply(copy.deepcopy(base), KEEP).eval()
    stage = model.stages[2]
    assert isinstance(stage.blocks, RestoringSequential)
    seen = {}
    stage.blocks[1].mlp.register_forward_hook(lambda m, i, o: seen.__setitem__("tokens", i[0].shape[1]))
    stage_out = {}
    stage.register_forward_hook(lambda m, i, o: stage_out.__setitem__("shape", o.shape))
    assert model(x).shape == (2, 10)
    assert seen["tokens"] == 8  # 4x4 tokens in four 2x2 windows -> 4 x 2 survive
    assert stage_out["shape"] == (2, 64, 4, 4)  # the grid stage 4 downsamples is whole again
    assign = model.stages[2].blocks[0].pruner.last["assign"]
    assert assign.shape == (2, 16) and int(assign.max()) < 8
    assert count_macs(model, 64).gmacs < count_macs(base, 64).gmacs


# -- fused attention (issue 14, point 2) ---------------------------------------------------------
def test_chunk_attention_runs_on_the_flash_kernel():
    """4-D SDPA inputs: chunked patch queries and the CLS (prefix) queries both run on the flash
    kernel alone (a 5-D call has no fused kernel and fails here)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = ChunkOnly(chunk_size=16).apply(micro(), {"kind": "none"})
    x = torch.randn(2, 3, 32, 32)
    expected = model(x)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION), torch.no_grad():
        got = model(x)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


# -- chunk layout (point 4) ----------------------------------------------------------------------
def window_chunk_mask(n_prefix: int, side: int, window: int) -> torch.Tensor:
    """Boolean raster-order mask: a patch query sees the prefix and the patches of its window."""
    rows = torch.arange(side * side) // side
    cols = torch.arange(side * side) % side
    win = (rows // window) * (side // window) + cols // window
    n = n_prefix + side * side
    mask = torch.ones(n, n, dtype=torch.bool)
    mask[n_prefix:, n_prefix:] = win.unsqueeze(1) == win.unsqueeze(0)
    return mask


@pytest.mark.parametrize("layout", ["window", "raster"])
def test_chunks_are_windows_or_raster_ranges_of_the_grid(layout):
    """The chunked model equals the backbone with full attention under the layout's mask (raster
    token order): window chunks are the 4x4 windows of the 8x8 grid, raster chunks two rows."""
    base = micro()
    img = torch.randn(2, 3, 32, 32)
    mask = window_chunk_mask(1, 8, 4) if layout == "window" else chunk_mask(1, 64, 16)
    with torch.no_grad():
        expected = base.forward_head(base.forward_features(img, attn_mask=mask))
        got = ChunkOnly(chunk_size=16, chunk_layout=layout).apply(copy.deepcopy(base), {"kind": "none"})(img)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_window_order_and_pruning_keep_tokens_in_their_windows():
    from vitexp.methods.bspf import window_order

    order = window_order((14, 14), 49)  # DeiT-S: four 7x7 windows
    windows = order.reshape(4, 49)
    assert sorted(set((windows[1] // 14).tolist())) == list(range(7))  # window 1: rows 0-6 ...
    assert sorted(set((windows[1] % 14).tolist())) == list(range(7, 14))  # ... columns 7-13
    pruner = TokenPruner(0.5, num_prefix=1, num_chunks=4, score="local3x3", mirror="none", fusion="none")
    ids = torch.arange(1 + 4 * 49, dtype=torch.float).view(1, -1, 1)  # token value = its window-order slot
    out = pruner(ids, torch.rand(1, 4, 49, 49))
    survivors = out[0, 1:, 0].round().long().reshape(4, 25) - 1
    assert (
        (survivors // 49) == torch.arange(4).view(4, 1)
    ).all()  # each chunk's survivors come from its window
    assert (survivors.diff(dim=1) > 0).all()  # in order: a later layer's chunk is again that window


def test_window_and_raster_layouts_cost_the_same_gmacs():
    window = count_macs(
        BSPF(chunk_size=16, prune_layers=[1, 3], chunk_layout="window").apply(micro(), KEEP), 32
    )
    raster = count_macs(
        BSPF(chunk_size=16, prune_layers=[1, 3], chunk_layout="raster").apply(micro(), KEEP), 32
    )
    assert window.gmacs == raster.gmacs
    assert window.protocol["chunk_layout"] == "window" and raster.protocol["chunk_layout"] == "raster"
    assert window.protocol["chunks"] == 4


def test_a_grid_that_windows_cannot_tile_is_a_config_error():
    cfg = vconfig.compose(["method=bspf", "budget=keep_ratio", "method.chunk_size=8"])  # 8x8 grid, Ω = 8
    with pytest.raises(
        vconfig.ConfigError, match=r"chunk_layout=window needs Ω = s².*valid chunk sizes: \[1, 4, 16, 64\]"
    ):
        resolve.validate(cfg)
    resolve.validate(
        vconfig.compose(
            ["method=bspf", "budget=keep_ratio", "method.chunk_size=8", "method.chunk_layout=raster"]
        )
    )
    with pytest.raises(Exception, match=r"chunk_layout='diagonal': valid values are \('window', 'raster'\)"):
        resolve.validate(
            vconfig.compose(["method=bspf", "budget=keep_ratio", "method.chunk_layout=diagonal"])
        )


def test_caformer_windows_are_undone_when_the_grid_is_restored():
    """Window layout on CaFormer's stage 3: the stage equals the raster-layout stage run on the
    window-ordered tokens, put back in raster order (window order composed with the fusion map)."""
    from vitexp.methods.bspf import window_order

    torch.manual_seed(0)
    base = timm.create_model("caformer_micro", num_classes=10).eval()
    windowed = BSPF(chunk_size=4, prune_layers=[0]).apply(copy.deepcopy(base), KEEP).eval()
    raster = (
        BSPF(chunk_size=4, prune_layers=[0], chunk_layout="raster").apply(copy.deepcopy(base), KEEP).eval()
    )
    seen = {}
    windowed.stages[2].blocks.register_forward_hook(lambda m, i, o: seen.update(tokens_in=i[0], tokens_out=o))
    with torch.no_grad():
        windowed(torch.randn(2, 3, 64, 64))
        order = window_order((4, 4), 4)
        assert order.tolist()[:4] == [0, 1, 4, 5]  # the first 2x2 window
        reference = raster.stages[2].blocks(seen["tokens_in"][:, order])[:, torch.argsort(order)]
    assert seen["tokens_out"].shape == (2, 16, 64)
    torch.testing.assert_close(seen["tokens_out"], reference)


# -- the learned scorer (point 3) ----------------------------------------------------------------
def test_learned_scorer_is_a_softmax_kernel_outside_weight_decay():
    from timm.optim import create_optimizer_v2

    scorer = BlockScorer("local3x3")
    torch.testing.assert_close(scorer.kernel(), torch.full((1, 1, 3, 3), 1 / 9))  # init: the 3x3 average
    with torch.no_grad():
        scorer.logits.copy_(torch.randn(9) * 3)
    assert float(scorer.kernel().min()) > 0 and float(scorer.kernel().sum()) == pytest.approx(1.0)
    model = BSPF(chunk_size=16, prune_layers=[1]).apply(micro(), KEEP)
    optimizer = create_optimizer_v2(model, opt="adamw", lr=1e-3, weight_decay=0.05)
    logits = model.blocks[1].pruner.scorer.logits
    group = next(g for g in optimizer.param_groups if any(p is logits for p in g["params"]))
    assert group["weight_decay"] == 0.0
    avg = BlockScorer("avg3x3")
    assert not list(avg.parameters())
    torch.testing.assert_close(avg(torch.ones(1, 5, 5))[0, 2, 2], torch.tensor(1.0))


def test_training_changes_the_kernels_shape_and_decisions():
    """Ten AdamW steps of BSPF on the micro ViT (digits, lr 1e-2 to keep it short): the normalised
    3x3 kernel moves away from the uniform average in both pruning layers (2.6 % and 6.3 % of a
    tap here), and on fixed attention blocks some keep decisions change (6.4 % here). Adam's
    per-tap steps also reshape a free kernel somewhat; what fails for it is the gradient's
    direction (the next test)."""
    from timm.optim import create_optimizer_v2

    from vitexp.data.datamodules import DigitsDataModule

    torch.manual_seed(0)
    model = BSPF(chunk_size=16, prune_layers=[1, 3]).apply(micro(), KEEP)
    dm = DigitsDataModule(data_config={"input_size": (3, 32, 32)}, batch_size=32)
    dm.setup("fit")
    batches = iter(dm.train_dataloader())
    images, _ = next(batches)
    pruner = model.blocks[1].pruner
    with torch.no_grad():
        model(images)
        blocks = model.blocks[1].attn.last_blocks.clone()
        keep_before = pruner.select(blocks)[0]
    model.train()
    optimizer = create_optimizer_v2(model, opt="adamw", lr=1e-2, weight_decay=0.05)
    for _ in range(STEPS):
        x, y = next(batches)
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    for i in (1, 3):
        kernel = model.blocks[i].pruner.scorer.kernel().detach().flatten()
        shape_change = float((kernel / kernel.sum() - 1 / 9).abs().max() * 9)  # relative to a uniform tap
        assert shape_change > 0.01, f"layer {i}: kernel shape moved by {shape_change:.4f}"
    with torch.no_grad():
        keep_after = pruner.select(blocks)[0]
    changed = float((keep_before != keep_after).float().mean())
    assert changed > 0.02, f"{changed:.4f} of the keep decisions changed"


def test_a_gradient_step_changes_the_kernels_shape_not_its_scale():
    """The issue's diagnostic: at the uniform init, the kernel change of one SGD step on the
    scorer has (almost) no component along the kernel itself (its scale, to which the top-k is
    blind). Softmax taps: exactly none; a free 4-D kernel: squared cosine ≈ 1."""
    torch.manual_seed(0)
    model = BSPF(chunk_size=16, prune_layers=[1, 3]).apply(micro(), KEEP).train()
    F.cross_entropy(model(torch.randn(8, 3, 32, 32)), torch.arange(8)).backward()
    for i in (1, 3):
        scorer = model.blocks[i].pruner.scorer
        before = scorer.kernel().detach().flatten().clone()
        with torch.no_grad():
            for p in scorer.parameters():
                p -= 1e-3 * p.grad / p.grad.norm()
        step = scorer.kernel().detach().flatten() - before
        cos2 = float(torch.dot(step, before) ** 2 / (step.pow(2).sum() * before.pow(2).sum()))
        assert cos2 < 0.01, f"layer {i}: squared cosine of the step with the kernel {cos2:.3f}"


# -- realised keep fraction (point 6) ------------------------------------------------------------
def test_realised_keep_fraction_per_layer_is_recorded():
    report = count_macs(
        BSPF(chunk_size=16, prune_layers=[1, 3]).apply(micro(), {"kind": "keep_ratio", "keep_ratio": 0.3}), 32
    )
    metrics = report.metrics()
    # Ω = 16: ⌈0.3·16⌉ = 5 kept; then Ω' = 5: ⌈0.3·5⌉ = 2 kept
    assert metrics["keep_fraction_layers"] == pytest.approx([5 / 16, 2 / 5])
    assert metrics["keep_fraction"] == pytest.approx((5 / 16 * 2 / 5) ** 0.5)
    assert (
        "keep_fraction"
        not in count_macs(ChunkOnly(chunk_size=16).apply(micro(), {"kind": "none"}), 32).metrics()
    )


def test_flops_run_records_the_layout_and_keep_fractions(make_cfg):
    from vitexp.commands.inspect import run_flops

    out = run_flops(make_cfg(["experiment=bspf_demo", "logger=none"]))
    assert out["protocol"]["chunk_layout"] == "window"
    assert out["metrics"]["keep_fraction_layers"] == pytest.approx([8 / 16, 4 / 8])
    assert all(
        type(v) is float for v in out["metrics"]["keep_fraction_layers"]
    )  # plain numbers in the ledger
    spec = yaml.safe_load((Path(__file__).parents[1] / "sweeps" / "bspf_table7.yaml").read_text())
    assert "keep_fraction" in [c["key"] for c in spec["columns"]]


# -- audit state out of the graph (point 12) -----------------------------------------------------
@pytest.mark.parametrize("backbone", ["vit_micro_patch4_32", "caformer_micro"])
def test_model_deep_copies_after_a_forward_with_gradients(backbone):
    torch.manual_seed(0)
    size = 32 if backbone.startswith("vit") else 64
    model = (
        BSPF(chunk_size=16 if size == 32 else 4, prune_layers=[1] if size == 32 else [0])
        .apply(timm.create_model(backbone, num_classes=10), KEEP)
        .train()
    )
    loss = F.cross_entropy(model(torch.randn(2, 3, size, size)), torch.tensor([0, 1]))
    loss.backward()
    ema = copy.deepcopy(model)  # what an EMA / SWA callback does
    assert ema(torch.randn(1, 3, size, size)).shape == (1, 10)


# -- keep-rate warm-up (point 9, EViT's schedule) ------------------------------------------------
def test_keep_warmup_goes_from_one_to_the_target_along_a_half_cosine(make_cfg):
    from vitexp.methods.bspf import warmup_keep_ratio
    from vitexp.training.build import build_model

    assert warmup_keep_ratio(0.0, 0.5, 10) == 1.0
    assert warmup_keep_ratio(5.0, 0.5, 10) == pytest.approx(0.75)
    assert warmup_keep_ratio(10.0, 0.5, 10) == 0.5
    assert warmup_keep_ratio(3.0, 0.5, 10, start=4) == 1.0  # EViT's shrink_start_epoch
    cfg = make_cfg(["experiment=bspf_demo", "method.keep_warmup_epochs=10", "recipe.epochs=20"])
    resolve.validate(cfg)
    model, _, _ = build_model(cfg)
    model.train()
    x = torch.randn(2, 3, 32, 32)
    seen = {}
    model.blocks[1].mlp.register_forward_hook(lambda m, i, o: seen.__setitem__("tokens", i[0].shape[1]))
    model.set_progress(0.0)
    model(x)
    assert seen["tokens"] == 65  # keep ratio 1 at the start
    model.set_progress(1.0)
    model(x)
    assert seen["tokens"] == 33  # the target 0.5 once warmed up
    model.set_progress(0.0)
    model.eval()
    model(x)
    assert seen["tokens"] == 33  # evaluation always uses the target
    with pytest.raises(vconfig.ConfigError, match="never reach"):
        resolve.validate(
            make_cfg(["experiment=bspf_demo", "method.keep_warmup_epochs=30", "recipe.epochs=20"])
        )


def test_window_ordered_tokens_refuse_raster_feature_maps():
    """With chunk_layout=window the tokens run in window order: forward_intermediates refuses NCHW
    (a raster reshape would scramble the map) and gives the tokens with NLC."""
    import timm

    import vitexp.models  # noqa: F401
    from vitexp.methods.bspf import BSPF

    model = timm.create_model("vit_micro_patch4_32", num_classes=10).eval()
    BSPF(chunk_size=16, prune_layers=[3]).apply(model, {"kind": "keep_ratio", "keep_ratio": 0.5})
    x = torch.randn(1, 3, 32, 32)
    with pytest.raises(ValueError, match="window order"):
        model.forward_intermediates(x, indices=[0], intermediates_only=True)
    (tokens,) = model.forward_intermediates(x, indices=[0], output_fmt="NLC", intermediates_only=True)
    assert tokens.shape == (1, 64, 64)


def test_bspf_caformer_at_another_resolution_names_backbone_img_size():
    """CaFormer's windows are fixed at surgery for backbone.img_size's grid; another input size is a
    clear error (SHViT's token stages pad any grid instead)."""
    import timm

    model = timm.create_model("caformer_micro", pretrained_cfg_overlay=dict(input_size=(3, 128, 128)))
    model = BSPF(chunk_size=16, prune_layers=[0]).apply(model, {"kind": "keep_ratio", "keep_ratio": 0.5})
    assert model(torch.randn(1, 3, 128, 128)).shape == (1, 10)
    with pytest.raises(RuntimeError, match="backbone.img_size"):
        model(torch.randn(1, 3, 160, 160))
