"""timm's model contract, checked for every model vitexp registers with timm.

The contract is the one timm's own model tests hold its models to: inference and training
forwards, a gradient on every parameter, default configs that point at real modules,
``forward_features`` / ``forward_head`` against ``num_features`` / ``head_hidden_size``,
``forward_intermediates`` / ``prune_intermediate_layers`` / ``features_only``, FX tracing
(forward and backward), TorchScript, and fine-tuning from a 1000-class checkpoint into another
class count. Full-size architectures are built at 64 px (their position embedding sized for it at
creation) so the whole file runs in seconds on a CPU.
"""

from __future__ import annotations

import pytest
import timm
import torch
import torch.nn as nn
from timm.layers import get_notrace_functions, get_notrace_modules
from timm.models import FeatureInfo, model_entrypoint
from torchvision.models.feature_extraction import create_feature_extractor, get_graph_node_names

import vitexp  # noqa: F401  (registers the models)

#: The resolution the CPU tests build every model at (the micro models' own; full-size ones are resized).
TEST_SIZE = 64
NUM_CLASSES = 13


def _cfg_size(name: str) -> int:
    return int(timm.get_pretrained_cfg(name).input_size[-1])


def _params(names):
    """Full-size architectures (tens of millions of weights: seconds each to build on 2 cores) run
    with ``-m slow``; the micro models, which share their code, run in the default suite."""
    return [pytest.param(n, marks=pytest.mark.slow) if _cfg_size(n) > TEST_SIZE else n for n in names]


#: Every model vitexp registers with timm (a model registered later is covered without editing this file).
NAMES = sorted(n for n in timm.list_models() if model_entrypoint(n).__module__.startswith("vitexp."))
REGISTERED = _params(NAMES)


def test_the_registered_names_are_found():
    assert {
        "t2t_vit_14",
        "t2t_vit_t_14",
        "t2t_vit_micro",
        "lvvit_s",
        "lvvit_micro",
        "vit_micro_patch4_32",
        "vit_micro_patch14_dinov2",
        "caformer_micro",
    } <= set(NAMES)


def create(name: str, **kwargs) -> tuple[nn.Module, torch.Tensor]:
    """The model and a batch of 2 images at the size it is built for: its own when it is at most
    TEST_SIZE px, else TEST_SIZE px through ``img_size`` (timm's way to build a ViT for a size)."""
    torch.manual_seed(0)
    size = _cfg_size(name)
    if size > TEST_SIZE:
        kwargs.setdefault("img_size", TEST_SIZE)
        size = TEST_SIZE
    return timm.create_model(name, **kwargs), torch.randn(2, 3, size, size)


def is_vit(model: nn.Module) -> bool:
    return hasattr(model, "blocks") and hasattr(model, "cls_token")


def _fx_kwargs() -> dict:
    return dict(leaf_modules=get_notrace_modules(), autowrap_functions=get_notrace_functions())


def _fx_model(model: nn.Module) -> nn.Module:
    """torchvision's feature extractor on the model's output node, traced with timm's leaves."""
    train_nodes, eval_nodes = get_graph_node_names(model, tracer_kwargs=_fx_kwargs())
    return create_feature_extractor(
        model,
        train_return_nodes=[train_nodes[-1]],
        eval_return_nodes=[eval_nodes[-1]],
        tracer_kwargs=_fx_kwargs(),
    )


def _assert_every_parameter_has_a_gradient(model: nn.Module) -> None:
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, f"parameters without a gradient: {missing}"


@pytest.mark.parametrize("name", REGISTERED)
def test_inference_and_training_forward(name):
    model, x = create(name, num_classes=NUM_CLASSES)
    with torch.no_grad():
        out = model.eval()(x[:1])
    assert out.shape == (1, NUM_CLASSES) and torch.isfinite(out).all()
    out = model.train()(x)
    assert out.shape == (2, NUM_CLASSES) and torch.isfinite(out).all()


@pytest.mark.parametrize("name", REGISTERED)
def test_backward_reaches_every_parameter(name):
    model, x = create(name, num_classes=NUM_CLASSES)
    model.train()(x).mean().backward()
    _assert_every_parameter_has_a_gradient(model)


@pytest.mark.parametrize("name", REGISTERED)
def test_default_cfg_points_at_real_modules(name):
    model, x = create(name, num_classes=NUM_CLASSES)
    cfg = model.pretrained_cfg
    assert len(cfg["mean"]) == 3 and len(cfg["std"]) == 3 and all(s > 0 for s in cfg["std"])
    assert 0 < cfg["crop_pct"] <= 1 and cfg["interpolation"] in ("bilinear", "bicubic")
    assert cfg["input_size"][0] == 3
    modules, state = dict(model.named_modules()), model.state_dict()
    classifiers = cfg["classifier"] if isinstance(cfg["classifier"], (tuple, list)) else (cfg["classifier"],)
    for c in classifiers:
        assert f"{c}.weight" in state, f"classifier {c} is not in the model"
    # every layer that produces class logits is named, so a new class count re-initialises all of them
    logit_layers = {
        n for n, m in modules.items() if isinstance(m, nn.Linear) and m.out_features == NUM_CLASSES
    }
    assert logit_layers == set(classifiers)
    # first_conv: the first layer with weights on the pixels (its input is the 3 channels, or patches of them)
    first = modules[cfg["first_conv"]]
    assert f"{cfg['first_conv']}.weight" in state
    assert first.weight.shape[1] % 3 == 0 and first.weight.dim() >= 2
    # input size: declared fixed (absolute position embeddings), or the model runs at another size
    if not cfg.get("fixed_input_size", False):
        other = x.shape[-1] + 32
        assert model.eval()(torch.randn(1, 3, other, other)).shape == (1, NUM_CLASSES)


@pytest.mark.parametrize("name", REGISTERED)
def test_forward_features_and_head_against_num_features(name):
    model, x = create(name, num_classes=NUM_CLASSES)
    model.eval()
    with torch.no_grad():
        feats = model.forward_features(x)
        pre = model.forward_head(feats, pre_logits=True)
        assert pre.shape == (2, model.head_hidden_size)
        torch.testing.assert_close(model.forward_head(feats), model(x))
        if is_vit(model):
            grid = model.patch_embed.grid_size
            assert model.num_prefix_tokens == 1
            assert feats.shape == (2, model.num_prefix_tokens + grid[0] * grid[1], model.num_features)
            torch.testing.assert_close(pre, feats[:, 0])
        else:
            assert feats.shape[1] == model.num_features
        model.reset_classifier(0)
        assert model(x).shape == (2, model.num_features)


@pytest.mark.parametrize("name", REGISTERED)
def test_feature_info_and_forward_intermediates(name):
    model, x = create(name)
    model.eval()
    info = FeatureInfo(model.feature_info, list(range(len(model.feature_info))))
    with torch.no_grad():
        final, inter = model.forward_intermediates(x)
        assert len(inter) == len(info.channels())
        for y, chs, red in zip(inter, info.channels(), info.reduction()):
            assert y.shape == (2, chs, x.shape[-2] // red, x.shape[-1] // red)
        torch.testing.assert_close(final, model.forward_features(x))
        only = model.forward_intermediates(x, indices=[0, -1], intermediates_only=True)
        torch.testing.assert_close(only, [inter[0], inter[-1]])
        if is_vit(model):
            P = model.num_prefix_tokens
            raw = model.forward_intermediates(x, indices=2, output_fmt="NLC", intermediates_only=True)
            normed = model.forward_intermediates(
                x, indices=2, output_fmt="NLC", norm=True, intermediates_only=True
            )
            assert len(raw) == len(normed) == 2
            torch.testing.assert_close(raw[0], inter[-2].flatten(2).transpose(1, 2))
            torch.testing.assert_close(normed[0], model.norm(raw[0]))
            # the last block's output through the final norm is forward_features' patch tokens
            torch.testing.assert_close(normed[-1], final[:, P:])
            pairs = model.forward_intermediates(
                x, indices=[0], return_prefix_tokens=True, intermediates_only=True
            )
            assert pairs[0][1].shape == (2, P, model.embed_dim)
        kept = model.prune_intermediate_layers(indices=[1])
        assert kept == [1]
        pruned = model.forward_intermediates(x, indices=[1], intermediates_only=True)
        torch.testing.assert_close(pruned[0], inter[1])


@pytest.mark.parametrize("name", REGISTERED)
def test_features_only(name):
    model, x = create(name, features_only=True)
    model.eval()
    channels, reductions = model.feature_info.channels(), model.feature_info.reduction()
    with torch.no_grad():
        outs = model(x)
    assert len(outs) == len(channels) >= 3
    for o, chs, red in zip(outs, channels, reductions):
        assert o.shape == (2, chs, x.shape[-2] // red, x.shape[-1] // red)
        assert torch.isfinite(o).all()


@pytest.mark.parametrize("name", REGISTERED)
def test_fx_trace_matches_eager_and_backward_reaches_every_parameter(name):
    """torchvision's feature extraction traces the eval and the train graph (timm's leaves)."""
    model, x = create(name, num_classes=NUM_CLASSES)
    fx = _fx_model(model.eval()).eval()
    with torch.no_grad():
        (out,) = fx(x).values()
        torch.testing.assert_close(out, model(x))
    (out,) = fx.train()(x).values()
    assert out.shape == (2, NUM_CLASSES)
    out.mean().backward()
    _assert_every_parameter_has_a_gradient(fx)


@pytest.mark.parametrize("name", REGISTERED)
def test_torchscript_matches_eager(name):
    with timm.set_scriptable(True):
        model, x = create(name, num_classes=NUM_CLASSES)
    model.eval()
    scripted = torch.jit.script(model)
    with torch.no_grad():
        torch.testing.assert_close(scripted(x), model(x))


@pytest.mark.parametrize("name", _params(NAMES + ["deit_small_patch16_224"]))
def test_a_1000_class_checkpoint_fine_tunes_into_another_class_count(tmp_path, name):
    """As timm's own DeiT-S (the last case, the reference): every classifier named in the
    pretrained cfg is re-initialised at the new class count; everything else loads."""
    source, x = create(name, num_classes=1000)
    path = tmp_path / f"{name}.pth"
    torch.save(source.state_dict(), path)
    kwargs = {"img_size": x.shape[-1]} if _cfg_size(name) > TEST_SIZE else {}
    model = timm.create_model(
        name,
        pretrained=True,
        num_classes=5,
        pretrained_cfg_overlay=dict(file=str(path), num_classes=1000),
        **kwargs,
    )
    cfg = model.pretrained_cfg
    classifiers = cfg["classifier"] if isinstance(cfg["classifier"], (tuple, list)) else (cfg["classifier"],)
    reinitialised = {f"{c}.{p}" for c in classifiers for p in ("weight", "bias")}
    for key, value in model.state_dict().items():
        if key in reinitialised:
            assert value.shape[0] == 5, key
        else:
            assert torch.equal(value, source.state_dict()[key]), key
    assert model.eval()(x).shape == (2, 5)


def test_nchw_intermediates_of_a_token_pruned_model_are_refused():
    """After BSPF drops tokens the grid is gone: NCHW would silently fold tokens into channels."""
    from vitexp.methods.bspf import BSPF

    model, x = create("lvvit_micro")
    BSPF(chunk_size=8, prune_layers=[1], chunk_layout="raster").apply(
        model.eval(), {"kind": "keep_ratio", "keep_ratio": 0.5}
    )
    with torch.no_grad():
        nlc = model.forward_intermediates(x, output_fmt="NLC", intermediates_only=True)
        assert [y.shape[1] for y in nlc] == [16, 8, 8, 8]
        with pytest.raises(ValueError, match="NLC"):
            model.forward_intermediates(x)
