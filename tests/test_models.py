"""vitexp's registered architectures, tested in timm's style, and their published size and cost."""

from __future__ import annotations

import pytest
import timm
import torch

import vitexp  # noqa: F401
from vitexp.measure.flops import count_macs

#: vitexp's own registered models, at a size the CPU tests afford.
MICRO = {"vit_micro_patch4_32": 32, "lvvit_micro": 64, "t2t_vit_micro": 64}
#: Registered models whose token layout is a ViT's (CLS + patch tokens from forward_features).
VIT_LIKE = set(MICRO)


@pytest.mark.parametrize("name", sorted(MICRO))
def test_model_behaves_like_a_timm_model(name):
    torch.manual_seed(0)
    size = MICRO[name]
    model = timm.create_model(name, num_classes=7)
    x = torch.randn(2, 3, size, size)
    out = model(x)
    assert out.shape == (2, 7) and torch.isfinite(out).all()
    out.sum().backward()
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing, missing
    model.eval()
    with torch.no_grad():
        feats = model.forward_features(x)
        assert feats.shape[:2] == (2, model.patch_embed.num_patches + model.num_prefix_tokens)
        torch.testing.assert_close(model.forward_head(feats), model(x))
        assert model.forward_head(feats, pre_logits=True).shape == (2, model.num_features)
        one = model(x[:1])
        torch.testing.assert_close(one, model(x)[:1], rtol=1e-5, atol=1e-5)  # batch 1 and 2 agree
    model.reset_classifier(3)
    assert model(x).shape == (2, 3)
    assert model.pretrained_cfg["input_size"][-1] == size


def test_vit_micro_size():
    assert 0.1e6 <= sum(p.numel() for p in timm.create_model("vit_micro_patch4_32").parameters()) <= 0.5e6


@pytest.mark.parametrize(
    "name, params_m, gmacs",
    [
        ("lvvit_s", 26.15, 6.6),
        ("t2t_vit_14", 21.5, 4.8),
        ("t2t_vit_t_14", 21.5, 6.1),
        ("caformer_s18", 26.3, 4.13),
    ],
)
def test_published_size_and_cost(name, params_m, gmacs):
    report = count_macs(timm.create_model(name), 224)
    assert report.params_m == pytest.approx(params_m, abs=0.1)
    assert report.gmacs == pytest.approx(gmacs, abs=0.1)


def test_lvvit_eval_logits_add_half_the_max_of_the_aux_head():
    model = timm.create_model("lvvit_micro", num_classes=5).eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        feats = model.forward_features(x)
        expected = model.head(feats[:, 0]) + 0.5 * model.aux_head(feats[:, 1:]).max(dim=1).values
        torch.testing.assert_close(model(x), expected)
    assert all(block.skip_lam == 2.0 for block in model.blocks)


def test_lvvit_block_divides_residual_branches_by_two():
    model = timm.create_model("lvvit_micro").eval()
    block = model.blocks[0]
    x = torch.randn(1, 17, 64)
    with torch.no_grad():
        h = x + block.attn(block.norm1(x)) / 2
        torch.testing.assert_close(block(x), h + block.mlp(block.norm2(h)) / 2)


@pytest.mark.parametrize("wrapper", ["state_dict", "state_dict_ema"])
def test_lvvit_official_checkpoint_layout_loads_exactly(tmp_path, wrapper):
    from vitexp.models import build_backbone

    torch.manual_seed(0)
    source = timm.create_model("lvvit_micro", num_classes=10)
    path = tmp_path / "lvvit_micro.pth.tar"
    torch.save({wrapper: {f"module.{k}": v for k, v in source.state_dict().items()}, "epoch": 300}, path)
    use_ema = wrapper == "state_dict_ema"  # a file holding only EMA weights loads them when asked to
    loaded = build_backbone(
        {"timm_name": "lvvit_micro", "img_size": 64, "pretrained": str(path), "use_ema": use_ema},
        num_classes=10,
    )
    for k, v in source.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k]), k
    # another resolution: the position embedding is resized (4x4 -> 6x6 grid)
    bigger = build_backbone(
        {"timm_name": "lvvit_micro", "img_size": 96, "pretrained": str(path), "use_ema": use_ema},
        num_classes=10,
    )
    assert bigger.pos_embed.shape == (1, 37, 64)
    assert bigger(torch.randn(1, 3, 96, 96)).shape == (1, 10)


@pytest.mark.parametrize(
    "saved, use_ema, match",
    [
        (
            {"state_dict_ema": "w"},
            False,
            r"holds only EMA weights \(\['state_dict_ema'\]\).*\+\+backbone\.use_ema=true",
        ),
        ({"model_ema": "w", "epoch": 1}, False, r"holds only EMA weights \(\['model_ema'\]\)"),
        ({"state_dict": "w"}, True, r"backbone\.use_ema=true: .* holds no EMA weights .*\['state_dict'\]"),
        ("w", True, r"backbone\.use_ema=true: .* holds no EMA weights .*plain state dict"),
        (
            {"state_dict_ema": "w"},
            None,
            r"holds only EMA weights \(\['state_dict_ema'\]\); TokenLabeling's validate\.py "
            r"loads state_dict or model \(.*validate\.py:150.*\); \+\+backbone\.use_ema=true loads these",
        ),
    ],
    ids=[
        "state_dict_ema alone",
        "model_ema alone",
        "use_ema without EMA weights",
        "use_ema on a plain state dict",
        "state_dict_ema alone, no override",
    ],
)
def test_use_ema_never_falls_back_to_other_weights(saved, use_ema, match, tmp_path):
    """``backbone.use_ema`` picks the weights and says when the file does not hold them: EMA weights
    alone are not loaded without it, and no EMA weights with it (one line naming the file)."""
    from vitexp.errors import CheckpointError
    from vitexp.models import build_backbone

    state = timm.create_model("lvvit_micro", num_classes=10).state_dict()
    path = tmp_path / "lvvit_micro.pth.tar"
    torch.save(
        {k: state if v == "w" else v for k, v in saved.items()} if isinstance(saved, dict) else state, path
    )
    with pytest.raises(CheckpointError, match=match) as err:
        build_backbone(
            {"timm_name": "lvvit_micro", "img_size": 64, "pretrained": str(path), "use_ema": use_ema},
            num_classes=10,
        )
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_deit3_original_layer_scale_keys_load_through_timms_registered_filter(tmp_path):
    """timm's DeiT-III creates its models with ``partial(checkpoint_filter_fn, adapt_layer_scale=True)``,
    which renames the original release's ``gamma_1`` / ``gamma_2`` to ``ls1.gamma`` / ``ls2.gamma``:
    ``backbone.pretrained`` goes through that filter, arguments included."""
    import re

    from vitexp.models import build_backbone

    kwargs = {"embed_dim": 48, "depth": 2, "num_heads": 2}
    torch.manual_seed(0)
    source = timm.create_model("deit3_small_patch16_224", img_size=64, num_classes=10, **kwargs).eval()
    with torch.no_grad():
        for name, p in source.named_parameters():
            if name.endswith("gamma"):
                p.uniform_(0.5, 1.5)  # away from the 1e-6 init, so a layer scale that is not loaded shows
    original = {re.sub(r"\.ls([12])\.gamma$", r".gamma_\1", k): v for k, v in source.state_dict().items()}
    assert "blocks.0.gamma_1" in original and "blocks.0.ls1.gamma" not in original
    path = tmp_path / "deit_3_small_224_1k.pth"
    torch.save({"model": original}, path)
    loaded = build_backbone(
        {"timm_name": "deit3_small_patch16_224", "img_size": 64, "pretrained": str(path), "kwargs": kwargs},
        num_classes=10,
    ).eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), source(x))


def test_loading_weights_keeps_the_initialisation_of_what_the_file_lacks(tmp_path):
    """The model a file loads into is created as without one (timm's filter is read as it is
    built): under one seed, the classifier re-initialised for another class count is the one
    ``timm.create_model`` draws."""
    from vitexp.models import build_backbone

    path = tmp_path / "t2t_micro.pth"
    torch.save(timm.create_model("t2t_vit_micro", num_classes=10).state_dict(), path)
    torch.manual_seed(3)
    loaded = build_backbone(
        {"timm_name": "t2t_vit_micro", "img_size": 64, "pretrained": str(path)}, num_classes=7
    )
    torch.manual_seed(3)
    fresh = timm.create_model("t2t_vit_micro", num_classes=7)
    assert torch.equal(loaded.head.weight, fresh.head.weight) and torch.equal(
        loaded.head.bias, fresh.head.bias
    )


def test_t2t_fixed_tables_are_saved_buffers_counted_as_parameters():
    """The position table and the Performer matrices are persistent buffers under the official
    state-dict keys, and the parameter count includes them as the official count does."""
    from vitexp.measure.flops import count_params

    model = timm.create_model("t2t_vit_micro")
    state, buffers = model.state_dict(), dict(model.named_buffers())
    tables = ["pos_embed", "tokens_to_token.attention1.w", "tokens_to_token.attention2.w"]
    for key in tables:
        assert key in state and key in buffers, key
    assert not set(tables) & {n for n, _ in model.named_parameters()}
    assert count_params(model) == sum(p.numel() for p in model.parameters()) + sum(
        buffers[k].numel() for k in tables
    )
    w = model.tokens_to_token.attention1.w  # orthogonal rows scaled by sqrt(m)
    torch.testing.assert_close(w @ w.T / w.shape[0], torch.eye(w.shape[0]), atol=1e-5, rtol=1e-5)


def test_lvvit_layer_norms_use_the_official_eps():
    model = timm.create_model("lvvit_micro")
    norms = [m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]
    assert len(norms) == 2 * 4 + 1 and all(m.eps == 1e-5 for m in norms)


def test_t2t_qk_scale_is_a_key():
    default = timm.create_model("t2t_vit_micro")
    assert default.blocks[0].attn.scale == pytest.approx(16**-0.5)  # head_dim^-0.5, the official eval build
    scaled = timm.create_model("t2t_vit_micro", qk_scale=64**-0.5)
    scaled.load_state_dict(default.state_dict())
    x = torch.randn(1, 3, 64, 64)
    assert not torch.allclose(default.eval()(x), scaled.eval()(x))


def test_t2t_official_checkpoint_layout_loads_exactly(tmp_path):
    from vitexp.models import build_backbone

    torch.manual_seed(0)
    source = timm.create_model("t2t_vit_micro", num_classes=10)
    path = tmp_path / "t2t_micro.pth.tar"
    torch.save({"state_dict_ema": {f"module.{k}": v for k, v in source.state_dict().items()}}, path)
    loaded = build_backbone(
        {"timm_name": "t2t_vit_micro", "img_size": 64, "pretrained": str(path), "use_ema": True},
        num_classes=10,
    )
    for k, v in source.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k]), k
    # another resolution at creation: the fixed table is rebuilt for the 6x6 grid, the rest loads
    from vitexp.models.t2t import sinusoid_encoding

    bigger = build_backbone(
        {"timm_name": "t2t_vit_micro", "img_size": 96, "pretrained": str(path), "use_ema": True},
        num_classes=10,
    )
    torch.testing.assert_close(bigger.pos_embed, sinusoid_encoding(37, 64))
    assert torch.equal(bigger.tokens_to_token.attention1.w, source.tokens_to_token.attention1.w)
    assert bigger(torch.randn(1, 3, 96, 96)).shape == (1, 10)


def test_t2t_checkpoint_for_other_input_channels_is_refused_by_name(tmp_path):
    path = tmp_path / "t2t_micro.pth"
    torch.save(timm.create_model("t2t_vit_micro").state_dict(), path)
    with pytest.raises(ValueError, match="3 input channels cannot load into a model with in_chans=1"):
        timm.create_model(
            "t2t_vit_micro", pretrained=True, in_chans=1, pretrained_cfg_overlay=dict(file=str(path))
        )


def test_caformer_micro_behaves_like_a_timm_model():
    model = timm.create_model("caformer_micro", num_classes=7)
    x = torch.randn(2, 3, 64, 64)
    out = model(x)
    assert out.shape == (2, 7) and torch.isfinite(out).all()
    out.sum().backward()
    assert not [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    model.reset_classifier(3)
    assert model(x).shape == (2, 3)
