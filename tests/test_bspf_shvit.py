"""BSPF-ViT on SHViT (vitexp/methods/bspf/shvit.py): keep 1 is the unmodified model, pruned tokens
leave the attention and the FFN while the depthwise convolutions run on the restored grid, the
FLOPs drop by exactly the pruned tokens' work, and the micro model trains under bf16 autocast."""

from __future__ import annotations

import copy

import pytest
import timm
import torch

import vitexp  # noqa: F401  (registers shvit_micro)
import vitexp.config.composition as vconfig
from vitexp.measure.flops import count_macs
from vitexp.methods.bspf import BSPF, ChunkOnly
from vitexp.methods.bspf.shvit import ChunkSHSA, TokenStage
from vitexp.training import resolve

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
    model = (
        BSPF(chunk_size=None, prune_layers=[0, 1])
        .apply(copy.deepcopy(base), {"kind": "keep_ratio", "keep_ratio": 1.0})
        .train(train)
    )
    assert isinstance(model.stages[1].blocks, TokenStage) and isinstance(model.stages[2].blocks, TokenStage)
    x = torch.randn(2, 3, 128, 128, dtype=torch.float64)
    torch.testing.assert_close(model(x), base(x), rtol=0, atol=1e-9)


def _token_counts(model) -> dict[str, tuple]:
    """Input shapes of stage 2's depthwise convs, SHSA qkv and FFN, per block, in one forward."""
    seen: dict[str, tuple] = {}
    for j, block in enumerate(model.stages[1].blocks):
        for name, module in (("conv", block.conv), ("qkv", block.mixer.m.qkv), ("ffn", block.ffn.m.pw1)):
            module.register_forward_hook(
                lambda m, args, out, key=f"{name}{j}": seen.__setitem__(key, tuple(args[0].shape))
            )
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
                window = grid[b, :, i : i + 2, j : j + 2].flatten(1).T  # 4 positions x 48 channels
                assert window.unique(dim=0).shape[0] == 2


def test_flops_drop_by_exactly_the_pruned_tokens_work():
    """keep 0.5 at stage 2's block 0 (4 chunks of L = 4 -> K = 2): 8 tokens skip block 0's FFN and
    all of block 1 but its depthwise conv; block 1's chunks attend K x K; the 3x3 scorer and the
    fusion's similarity matmuls are added."""
    chunked = count_macs(ChunkOnly(chunk_size=4).apply(shvit(), {"kind": "none"}), 128).gmacs * 1e9
    pruned = count_macs(BSPF(chunk_size=4, prune_layers=[0]).apply(shvit(), KEEP), 128).gmacs * 1e9
    D, pdim, qk, hidden, C, L, K = 48, 12, 8, 96, 4, 4, 2
    gone = C * (L - K)
    saved = (
        gone * 2 * D * hidden
        + gone * (pdim * (2 * qk + pdim) + D * D + 2 * D * hidden)
        + C * (L * L - K * K) * (qk + pdim)
    )
    added = C * L * L * 9 + C * (L - K) * K * D + C * (L - K) * K * L
    assert chunked - pruned == pytest.approx(saved - added, abs=0.5)
    assert pruned < chunked < count_macs(shvit(), 128).gmacs * 1e9


def test_a_grid_the_windows_do_not_tile_is_padded_to_whole_windows():
    """At 160 px stage 2 is 5x5 and stage 3 3x3: padded to 6x6 and 4x4, they hold 9 and 4 chunks of
    2x2 windows, as a detection image's grid does. Block 0 keeps ⌈r/2⌉ of each window's r real
    tokens: 4 full windows keep 2, 4 edge windows of 2 keep 1, the corner window of 1 keeps it."""
    model = BSPF(chunk_size=4, prune_layers=[0]).apply(shvit(), KEEP)
    model(torch.randn(1, 3, 128, 128))
    assert model.stages[1].blocks[0].mixer.m.num_chunks == 4
    assert model(torch.randn(1, 3, 160, 160)).shape == (1, 10)
    assert model.stages[1].blocks.last_chunks == {"grid": "5x5", "padded": "6x6", "chunks": 9}
    assert model.stages[2].blocks.last_chunks == {"grid": "3x3", "padded": "4x4", "chunks": 4}
    assert model.stages[1].blocks[0].pruner.realised == (13, 25)
    assert model.stages[1].blocks[1].mixer.m.num_chunks == 9


def _partial_chunks():
    from vitexp.methods.bspf.layout import padded_chunks

    chunks, order, padded = padded_chunks((5, 3), 4, "window")  # 2x2 windows on 5 rows x 3 columns
    assert padded == (6, 4) and chunks.counts == (4, 2, 4, 2, 2, 1) and chunks.length == 4
    return chunks, order


def test_a_padded_slot_never_receives_attention_weight_and_a_chunk_attends_over_its_real_tokens():
    """SHSA on a 5x3 grid in 2x2 windows: an empty slot's attention weight is exactly 0 for every
    query, and each real token's output is the attention over the real tokens of its window alone."""
    chunks, order = _partial_chunks()
    shsa = shvit(dtype=torch.float64).stages[1].blocks[0].mixer.m
    shsa.__class__ = ChunkSHSA
    x = torch.randn(2, 48, chunks.tokens, 1, dtype=torch.float64)
    out, attn = shsa.attend(x, chunks, need_blocks=True)
    empty = ~chunks.valid()
    assert empty.any() and attn.shape == (2, 6, 4, 4)
    assert (attn[:, empty.unsqueeze(1).expand(6, 4, 4)] == 0).all()  # every query, every empty key: exactly 0
    torch.testing.assert_close(
        attn[:, ~empty].sum(-1), torch.ones(2, int((~empty).sum()), dtype=torch.float64)
    )
    x1, x2 = x.split([shsa.pdim, 48 - shsa.pdim], dim=1)
    q, k, v = shsa.qkv(shsa.pre_norm(x1)).flatten(2).split([shsa.qk_dim, shsa.qk_dim, shsa.pdim], dim=1)
    start, ref = 0, []
    for r in chunks.counts:  # a window alone: its r real tokens, plain softmax attention
        sl = slice(start, start + r)
        a = (q[:, :, sl].transpose(1, 2) @ k[:, :, sl] * shsa.scale).softmax(-1)
        ref.append(v[:, :, sl] @ a.transpose(1, 2))
        start += r
    expected = shsa.proj(torch.cat([torch.cat(ref, dim=2).unsqueeze(-1), x2], dim=1))
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)


def _pruner(fusion: str):
    from vitexp.methods.bspf.pruning import TokenPruner

    pruner = TokenPruner(0.5, 0, 1, "local3x3", "none", fusion).double()
    with torch.no_grad():
        pruner.scorer.logits.copy_(torch.randn(9))
    pruner.track = True
    return pruner


@pytest.mark.parametrize("fusion", ["similarity", "none"])
def test_a_partial_chunk_is_pruned_and_fused_as_a_chunk_of_its_real_tokens(fusion):
    """The pruner on chunks of 4 slots holding (4, 2, 4, 2, 2, 1) tokens equals the pruner run on
    each chunk alone as a full chunk of its r tokens: the same kept tokens, fused values, realised
    fraction; the empty slots are zeros that nothing reads."""
    chunks, _ = _partial_chunks()
    C, L, D = chunks.num, chunks.length, 8
    torch.manual_seed(3)
    tokens = torch.randn(2, chunks.tokens, D, dtype=torch.float64)
    x = torch.cat([tokens, tokens.new_zeros(2, 1, D)], dim=1)[:, chunks.token_of_slot()]
    logits = torch.randn(2, C, L, L, dtype=torch.float64).masked_fill(
        ~chunks.valid()[None, :, None, :], float("-inf")
    )
    blocks = logits.softmax(-1)
    pruner = _pruner(fusion)
    out = pruner(x, blocks, counts=chunks.counts).reshape(2, C, 2, D)
    kept_counts = pruner.last["counts"]
    assert kept_counts == (2, 1, 2, 1, 1, 1) and pruner.realised == (8, 15)
    start = 0
    for c, r in enumerate(chunks.counts):
        alone = _pruner(fusion)
        alone.scorer.logits.data.copy_(pruner.scorer.logits.data)
        ref = alone(tokens[:, start : start + r], blocks[:, c : c + 1, :r, :r])
        assert torch.equal(pruner.last["keep"][:, c, : kept_counts[c]], alone.last["keep"][:, 0])
        torch.testing.assert_close(out[:, c, : kept_counts[c]], ref, rtol=0, atol=1e-12)
        start += r


def test_full_chunks_through_the_partial_path_are_the_tiled_path():
    """Counts that fill every chunk take the partial path to the same tokens as the tiled path."""
    torch.manual_seed(4)
    x = torch.randn(2, 16, 8, dtype=torch.float64)
    blocks = torch.randn(2, 4, 4, 4, dtype=torch.float64).softmax(-1)
    tiled, partial = _pruner("similarity"), _pruner("similarity")
    partial.scorer.logits.data.copy_(tiled.scorer.logits.data)
    tiled.num_chunks = 4
    expected = tiled(x, blocks)
    torch.testing.assert_close(partial(x, blocks, counts=(4, 4, 4, 4)), expected, rtol=0, atol=1e-12)
    assert torch.equal(partial.last["assign"], tiled.last["assign"])


def test_flops_count_the_padded_chunks_attention():
    """Chunk attention at 160 px, counted as it runs: each SHSA block attends in its padded chunks,
    C·Ω·Ω·(qk + pdim) MACs (stage 2: 9 chunks of 4 slots, qk 8, pdim 12; stage 3: 4 chunks of 4, qk 8,
    pdim 16), where SHViT attends globally over the 25 and 9 tokens; nothing else changes."""
    base = count_macs(shvit(), 160).gmacs * 1e9
    chunked = count_macs(ChunkOnly(chunk_size=4).apply(shvit(), {"kind": "none"}), 160).gmacs * 1e9
    stage2 = 2 * (9 * 4 * 4 - 25 * 25) * (8 + 12)  # two blocks
    stage3 = 1 * (4 * 4 * 4 - 9 * 9) * (8 + 16)  # one block
    assert chunked - base == pytest.approx(stage2 + stage3, abs=0.5)


def test_bspf_shvit_micro_trains_a_step_under_bf16_autocast():
    """Through the configs (method=bspf backbone=shvit_micro): the loss is finite and the scorer's
    kernel and the SHSA projections receive gradients."""
    import torch.nn.functional as F

    from vitexp.training.build import build_model

    cfg = vconfig.compose(
        ["backbone=shvit_micro", "method=bspf", "budget=keep_ratio", "data=synthetic", "logger=none"]
    )
    resolve.validate(cfg, need_data=False)
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
    cfg = vconfig.compose(
        [
            "backbone=shvit_micro",
            "method=bspf",
            "budget=keep_ratio",
            "method.symmetric=true",
            "data=synthetic",
            "logger=none",
        ]
    )
    with pytest.raises(vconfig.ConfigError, match="method.symmetric"):
        resolve.validate(cfg, need_data=False)


def test_timm_block_by_block_path_is_refused():
    """timm's gradient checkpointing calls the blocks one by one, which would skip the pruning."""
    model = BSPF(chunk_size=4, prune_layers=[0]).apply(shvit(), KEEP)
    with pytest.raises(RuntimeError, match="TokenStage"):
        model.stages[1].blocks[0].mixer(torch.randn(1, 48, 4, 4))


def test_the_detector_count_records_the_chunks_of_each_attention_stage(make_cfg):
    """The whole-detector count at a size the windows do not tile (160 × 224: SHViT's attention
    stages see 5 × 7 and 3 × 4 grids) records each stage's grid, padded grid and chunk count, read
    from that forward: what a rehearsal's or a FLOPs run's ledger entry shows."""
    from vitexp.detection import detection_flops, detector_for
    from vitexp.training.build import build_model

    overrides = [
        "experiment=micro_coco_bspf_shvit",
        "data.root=/nonexistent",
        "detector.flops_size=[160,224]",
    ]
    model, _, data_config = build_model(make_cfg(overrides))
    cfg = make_cfg(overrides)
    metrics, protocol = detection_flops(cfg, detector_for(cfg, model, data_config))
    assert protocol["resolution"] == "224x160"
    assert protocol["chunks_by_stage"] == {
        "stages.1": {"grid": "5x7", "padded": "6x8", "chunks": 12},
        "stages.2": {"grid": "3x4", "padded": "4x4", "chunks": 4},
    }
    assert 0.5 < metrics["keep_fraction"] < 1  # realised on the padded stage: ⌈r/2⌉ of each window's r tokens


def test_shvit_takes_any_grid_but_needs_square_windows():
    """The token stages pad any grid to whole windows, so a backbone size whose grid the windows do
    not tile is accepted; a window needs a square chunk size."""
    ok = vconfig.compose(
        [
            "backbone=shvit_micro",
            "method=bspf",
            "budget=keep_ratio",
            "backbone.img_size=160",
            "data=synthetic",
            "logger=none",
        ]
    )
    resolve.validate(ok, need_data=False)
    bad = vconfig.compose(
        [
            "backbone=shvit_micro",
            "method=bspf",
            "budget=keep_ratio",
            "method.chunk_size=6",
            "data=synthetic",
            "logger=none",
        ]
    )
    with pytest.raises(vconfig.ConfigError, match="square"):
        resolve.validate(bad, need_data=False)
