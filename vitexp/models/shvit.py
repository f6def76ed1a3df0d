"""SHViT (Yun & Ro, "SHViT: Single-Head Vision Transformer with Memory Efficient Macro Design", CVPR 2024)
comes from timm (``shvit_s1`` … ``shvit_s4``: a 16×16 overlapping conv stem, three stages at strides 16
/ 32 / 64, single-head attention on ``partial_dim`` of the channels in stages 2 and 3). vitexp adds
``shvit_micro``: the same layout at micro width for CPU runs and tests (128 px: 8×8, 4×4 and 2×2 grids).

Its reasoning: docs/reading-backbones.md, "vitexp/models/shvit.py".
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import torch
import torch.nn as nn
from timm.models import register_model
from timm.models._registry import generate_default_cfgs
from timm.models.shvit import SHViT, _cfg, _create_shvit

default_cfgs = generate_default_cfgs(
    {
        "shvit_micro": _cfg(num_classes=10, input_size=(3, 128, 128), pool_size=(2, 2)),
    }
)


@register_model
def shvit_micro(pretrained: bool = False, **kwargs) -> SHViT:
    """SHViT layout at micro size: widths (32, 48, 64), attention on (8, 12, 16) channels,
    depths (1, 2, 1); stage 1 without attention, as in every SHViT."""
    model_args = dict(
        embed_dim=(32, 48, 64),
        depth=(1, 2, 1),
        partial_dim=(8, 12, 16),
        qk_dim=(8, 8, 8),
        types=("i", "s", "s"),
    )
    return _create_shvit("shvit_micro", pretrained=pretrained, **dict(model_args, **kwargs))


_STAGE = re.compile(r"^blocks([123])\.(\d+)\.(.*)$")


def is_original_checkpoint(state: Mapping[str, Any], model: nn.Module) -> bool:
    """An original SHViT state dict (``blocks1.*`` keys) for a timm SHViT."""
    return isinstance(model, SHViT) and any(k.startswith("blocks1.") for k in state)


def _timm_key(key: str) -> str:
    m = _STAGE.match(key)
    if m is None:
        return key
    stage, j, rest = int(m[1]) - 1, int(m[2]), m[3]
    if stage == 0:
        return f"stages.0.blocks.{j}.{rest}"
    if j in (0, 2):  # the two (residual conv, residual FFN) pairs around PatchMerging
        sub, rest = rest.split(".", 1)
        return f"stages.{stage}.downsample.{int(sub) + (0 if j == 0 else 3)}.{rest}"
    if j == 1:
        return f"stages.{stage}.downsample.2.{rest}"
    return f"stages.{stage}.blocks.{j - 3}.{rest}"


def original_to_timm(state: Mapping[str, Any], model: nn.Module) -> dict[str, Any]:
    """Rename an original SHViT state dict into timm's SHViT keys (module docstring)."""
    state = state.get("model", state)
    own = model.state_dict()
    out = {}
    for key, value in state.items():
        key = _timm_key(key)
        if (
            key in own
            and isinstance(value, torch.Tensor)
            and value.shape != own[key].shape
            and value.numel() == own[key].numel()
        ):
            value = value.reshape(own[key].shape)
        out[key] = value
    return out
