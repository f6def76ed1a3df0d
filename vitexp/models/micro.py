"""Micro ViTs for CPU runs: the DeiT layout (CLS token, learned position embedding,
pre-norm blocks, linear head on CLS) at 32 px with 4 px patches.

``vit_micro_patch4_32``: dim 64, depth 6, 4 heads, MLP ratio 4: about 0.30 M parameters,
64 patch tokens + CLS. It is timm's own ``VisionTransformer``, so every method that patches
timm ViTs (attention, blocks, LayerScale) applies to it unchanged.
"""

from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from timm.models.vision_transformer import VisionTransformer, checkpoint_filter_fn

from vitexp.models._common import vit_feature_cfg


def _cfg(**kwargs):
    return {
        "url": "",
        "num_classes": 10,
        "input_size": (3, 32, 32),
        "pool_size": None,
        "crop_pct": 1.0,
        "interpolation": "bilinear",
        "fixed_input_size": True,  # absolute position embedding built for img_size, as timm's ViT cfgs
        "mean": IMAGENET_DEFAULT_MEAN,
        "std": IMAGENET_DEFAULT_STD,
        "first_conv": "patch_embed.proj",
        "classifier": "head",
        **kwargs,
    }


default_cfgs = generate_default_cfgs(
    {
        "vit_micro_patch4_32": _cfg(),
        "vit_micro_patch14_dinov2": _cfg(input_size=(3, 56, 56), interpolation="bicubic"),
    }
)


@register_model
def vit_micro_patch4_32(pretrained: bool = False, **kwargs) -> VisionTransformer:
    """DeiT-layout micro ViT: 32 px, patch 4, dim 64, depth 6, 4 heads."""
    model_args = dict(img_size=32, patch_size=4, embed_dim=64, depth=6, num_heads=4, mlp_ratio=4.0)
    model_args.update(kwargs)
    return build_model_with_cfg(
        VisionTransformer,
        "vit_micro_patch4_32",
        pretrained,
        pretrained_filter_fn=checkpoint_filter_fn,
        feature_cfg=vit_feature_cfg(model_args),
        **model_args,
    )


@register_model
def vit_micro_patch14_dinov2(pretrained: bool = False, **kwargs) -> VisionTransformer:
    """DINOv2 layout at micro size (CPU tests): 56 px, patch 14 (16 patches), LayerScale 1e-5,
    dim 64, depth 4, 4 heads (16 heads in all)."""
    model_args = dict(
        img_size=56, patch_size=14, embed_dim=64, depth=4, num_heads=4, mlp_ratio=4.0, init_values=1e-5
    )
    model_args.update(kwargs)
    return build_model_with_cfg(
        VisionTransformer,
        "vit_micro_patch14_dinov2",
        pretrained,
        pretrained_filter_fn=checkpoint_filter_fn,
        feature_cfg=vit_feature_cfg(model_args),
        **model_args,
    )
