"""BSPF-ViT on SHViT (vitexp/methods/bspf/shvit.py): keep 1 is the unmodified model, pruned tokens
leave the attention and the FFN while the depthwise convolutions run on the restored grid, the
FLOPs drop by exactly the pruned tokens' work, and the micro model trains under bf16 autocast."""
from __future__ import annotations

import copy

import pytest
import timm
import torch

import vitexp  # noqa: F401  (registers shvit_micro)
import vitexp.config as vconfig
from vitexp.flops import count_macs
from vitexp.methods.bspf import BSPF, ChunkOnly
from vitexp.methods.bspf.shvit import ChunkSHSA, TokenStage

KEEP = {"kind": "keep_ratio", "keep_ratio": 0.5}


def shvit(seed: int = 0, dtype=torch.float32):
    torch.manual_seed(seed)
    model = timm.create_model("shvit_micro").to(dtype)
    for m in model.modules():  # non-trivial BatchNorm statistics and affine (timm zero-inits some)
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 1.5)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.5, 0.5)
    return model.eval()


@pytest.mark.parametrize("train", [False, True])
def test_keep_one_without_chunks_is_the_unmodified_model(train):
    base = shvit(dtype=torch.float64).train(train)
    model = BSPF(chunk_size=None, prune_layers=[0, 1]).apply(copy.deepcopy(base),
                                                            {"kind": "keep_ratio", "keep_ratio": 1.0}).train(train)
    assert isinstance(model.stages[1].blocks, TokenStage) and isinstance(model.stages[2].blocks, TokenStage)
    x = torch.randn(2, 3, 128, 128, dtype=torch.float64)
    torch.testing.assert_close(model(x), base(x), rtol=0, atol=1e-9)


def _token_counts(model) -> dict[str, tuple]:
    """Input shapes of stage 2's depthwise convs, SHSA qkv and FFN, per block, in one forward."""
    seen: dict[str, tuple] = {}
    for j, block in enumerate(model.stages[1].blocks):
        for name, module in (("conv", block.conv), ("qkv", block.mixer.m.qkv), ("ffn", block.ffn.m.pw1)):
            module.register_forward_hook(lambda m, args, out, key=f"{name}{j}": seen.__setitem__(key, tuple(args[0].shape)))
    model(torch.randn(2, 3, 128, 128))
    return seen


def test_pruned_tokens_leave_attention_and_ffn_while_the_convs_see_the_grid():
    """Stage 2 of shvit_micro is 4x4 = 16 tokens in 4 windows of 4; block 0 keeps 2 per window."""
    base = shvit()
    model = BSPF(chunk_size=4, prune_layers=[0]).apply(copy.deepcopy(base), KEEP)
    seen = _token_counts(model)
    assert seen["conv0"] == (2, 48, 4, 4) and seen["conv1"] == (2, 48, 4, 4)  # full grid, full cost
    assert seen["qkv0"] == (2, 12, 16, 1)  # SHSA on the pdim = 12 attention channels of all 16 tokens
    assert seen["ffn0"] == (2, 48, 8, 1) and seen["qkv1"] == (2, 12, 8, 1) and seen["ffn1"] == (2, 48, 8, 1)
    x = torch.randn(2, 3, 128, 128)
    assert model(x).shape == (2, 10)
    shapes = [f.shape for f in model.forward_intermediates(x, intermediates_only=True)]
    assert shapes == [f.shape for f in base.forward_intermediates(x, intermediates_only=True)]


def test_the_restored_grid_gives_each_window_its_kept_tokens_values():
    """After pruning, every position of a 2x2 window holds one of that window's 2 kept tokens (its
    own or the one it was fused into), so the stage hands the downsampling 2 values per window."""
    model = BSPF(chunk_size=4, prune_layers=[1]).apply(shvit(), KEEP)
    grid = model.forward_intermediates(torch.randn(2, 3, 128, 128), indices=[1], intermediates_only=True)[0]
    for b in range(2):
        for i in (0, 2):
            for j in (0, 2):
                window = grid[b, :, i:i + 2, j:j + 2].flatten(1).T  # 4 positions x 48 channels
                assert window.unique(dim=0).shape[0] == 2


def test_flops_drop_by_exactly_the_pruned_tokens_work():
    """keep 0.5 at stage 2's block 0 (4 chunks of L = 4 -> K = 2): 8 tokens skip block 0's FFN and
    all of block 1 but its depthwise conv; block 1's chunks attend K x K; the 3x3 scorer and the
    fusion's similarity matmuls are added."""
    chunked = count_macs(ChunkOnly(chunk_size=4).apply(shvit(), {"kind": "none"}), 128).gmacs * 1e9
    pruned = count_macs(BSPF(chunk_size=4, prune_layers=[0]).apply(shvit(), KEEP), 128).gmacs * 1e9
    D, pdim, qk, hidden, C, L, K = 48, 12, 8, 96, 4, 4, 2
    gone = C * (L - K)
    saved = gone * 2 * D * hidden + gone * (pdim * (2 * qk + pdim) + D * D + 2 * D * hidden) \
        + C * (L * L - K * K) * (qk + pdim)
    added = C * L * L * 9 + C * (L - K) * K * D + C * (L - K) * K * L
    assert chunked - pruned == pytest.approx(saved - added, abs=0.5)
    assert pruned < chunked < count_macs(shvit(), 128).gmacs * 1e9


def test_a_grid_the_windows_cannot_tile_attends_as_one_chunk():
    """At 160 px stage 2 is 5x5: 2x2 windows do not tile it, so it attends as one chunk (SHViT's own
    attention), as a detection image's grid does."""
    model = BSPF(chunk_size=4, prune_layers=[0]).apply(shvit(), KEEP)
    model(torch.randn(1, 3, 128, 128))
    assert model.stages[1].blocks[0].mixer.m.num_chunks == 4
    assert model(torch.randn(1, 3, 160, 160)).shape == (1, 10)
    assert model.stages[1].blocks[0].mixer.m.num_chunks == 1
    assert model.stages[1].blocks[0].pruner.realised == (13, 25)


def test_bspf_shvit_micro_trains_a_step_under_bf16_autocast():
    """Through the configs (method=bspf backbone=shvit_micro): the loss is finite and the scorer's
    kernel and the SHSA projections receive gradients."""
    import torch.nn.functional as F

    from vitexp.build import build_model

    cfg = vconfig.compose(["backbone=shvit_micro", "method=bspf", "budget=keep_ratio", "data=synthetic", "logger=none"])
    vconfig.validate(cfg, need_data=False)
    torch.manual_seed(0)
    model, _, _ = build_model(cfg)
    model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(torch.randn(4, 3, 128, 128)), torch.tensor([0, 1, 2, 3]))
    loss.backward()
    assert torch.isfinite(loss)
    block = model.stages[1].blocks[0]
    assert isinstance(block.mixer.m, ChunkSHSA)
    assert block.pruner.scorer.logits.grad is not None and block.pruner.scorer.logits.grad.abs().sum() > 0
    assert block.mixer.m.qkv.c.weight.grad.abs().sum() > 0


def test_shared_qk_is_refused_on_shvit():
    cfg = vconfig.compose(["backbone=shvit_micro", "method=bspf", "budget=keep_ratio", "method.symmetric=true",
                           "data=synthetic", "logger=none"])
    with pytest.raises(vconfig.ConfigError, match="method.symmetric"):
        vconfig.validate(cfg, need_data=False)


def test_timm_block_by_block_path_is_refused():
    """timm's gradient checkpointing calls the blocks one by one, which would skip the pruning."""
    model = BSPF(chunk_size=4, prune_layers=[0]).apply(shvit(), KEEP)
    with pytest.raises(RuntimeError, match="TokenStage"):
        model.stages[1].blocks[0].mixer(torch.randn(1, 48, 4, 4))
