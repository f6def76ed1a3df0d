"""SHViT (Yun & Ro, "SHViT: Single-Head Vision Transformer with Memory Efficient Macro Design",
CVPR 2024) comes from timm (``shvit_s1`` … ``shvit_s4``: a 16×16 overlapping conv stem, three
stages at strides 16 / 32 / 64, single-head attention on ``partial_dim`` of the channels in stages 2
and 3). vitexp adds ``shvit_micro``: the same layout at micro width for CPU runs and tests
(128 px: 8×8, 4×4 and 2×2 grids).
"""
from __future__ import annotations

from timm.models import register_model
from timm.models._registry import generate_default_cfgs
from timm.models.shvit import SHViT, _cfg, _create_shvit

default_cfgs = generate_default_cfgs({
    "shvit_micro": _cfg(num_classes=10, input_size=(3, 128, 128), pool_size=(2, 2)),
})


@register_model
def shvit_micro(pretrained: bool = False, **kwargs) -> SHViT:
    """SHViT layout at micro size: widths (32, 48, 64), attention on (8, 12, 16) channels,
    depths (1, 2, 1); stage 1 without attention, as in every SHViT."""
    model_args = dict(embed_dim=(32, 48, 64), depth=(1, 2, 1), partial_dim=(8, 12, 16), qk_dim=(8, 8, 8),
                      types=("i", "s", "s"))
    return _create_shvit("shvit_micro", pretrained=pretrained, **dict(model_args, **kwargs))
