"""LV-ViT (Jiang et al., "All Tokens Matter: Token Labeling for Training Better Vision Transformers",
NeurIPS 2021), registered with timm as ``lvvit_s`` (and ``lvvit_micro`` for CPU tests).

Its reasoning: docs/reading-backbones.md, "vitexp/models/lvvit.py".
"""

from typing import Any, Dict, Optional, Tuple, Union

import torch
import torch.nn as nn
from timm.layers import resample_abs_pos_embed, to_2tuple, trunc_normal_
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from timm.models.vision_transformer import Block

from vitexp.models._common import (
    ClsTokenViT,
    init_weights,
    official_cfg,
    official_checkpoint_filter,
    vit_feature_cfg,
)


class LVBlock(Block):
    """timm ``Block`` whose two residual branches are divided by ``skip_lam``."""

    skip_lam: float = 2.0

    def forward(
        self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False
    ) -> torch.Tensor:
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x)))) / self.skip_lam
        x = x + self.drop_path2(self.ls2(self.mlp(self.norm2(x)))) / self.skip_lam
        return x


class Stem42(nn.Module):
    """LV-ViT's "4_2" patch embedding: a 4-layer convolutional stem, 16-pixel patches."""

    def __init__(
        self,
        img_size: Union[int, Tuple[int, int]] = 224,
        in_chans: int = 3,
        hidden: int = 64,
        embed_dim: int = 384,
    ):
        super().__init__()
        self.img_size = to_2tuple(img_size)
        self.patch_size = (16, 16)
        self.grid_size = (self.img_size[0] // 16, self.img_size[1] // 16)
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.conv1 = nn.Conv2d(in_chans, hidden, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(hidden)
        self.conv2 = nn.Conv2d(hidden, hidden, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(hidden)
        self.conv3 = nn.Conv2d(hidden, hidden, 3, stride=1, padding=1, bias=False)
        self.bn3 = nn.BatchNorm2d(hidden)
        self.proj = nn.Conv2d(hidden, embed_dim, kernel_size=8, stride=8)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.relu(self.bn2(self.conv2(x)))
        x = self.relu(self.bn3(self.conv3(x)))
        return self.proj(x).flatten(2).transpose(1, 2)


class LVViT(ClsTokenViT):
    def __init__(
        self,
        img_size: Union[int, Tuple[int, int]] = 224,
        in_chans: int = 3,
        num_classes: int = 1000,
        embed_dim: int = 384,
        depth: int = 16,
        num_heads: int = 6,
        mlp_ratio: float = 3.0,
        qkv_bias: bool = False,
        skip_lam: float = 2.0,
        stem_dim: int = 64,
        drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        aux_weight: float = 0.5,
    ):
        super().__init__()
        self.init_vit_attributes(embed_dim, depth, num_classes)
        self.aux_weight = aux_weight
        self.patch_embed = Stem42(img_size, in_chans, stem_dim, embed_dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, self.patch_embed.num_patches + 1, embed_dim))
        self.pos_drop = nn.Dropout(drop_rate)
        dpr = [x.item() for x in torch.linspace(0, drop_path_rate, depth)]
        norm = nn.LayerNorm  # eps 1e-5, as the official model
        self.blocks = nn.ModuleList()
        for i in range(depth):
            block = LVBlock(
                embed_dim,
                num_heads,
                mlp_ratio=mlp_ratio,
                qkv_bias=qkv_bias,
                drop_path=dpr[i],
                proj_drop=drop_rate,
                norm_layer=norm,
            )
            block.skip_lam = skip_lam
            self.blocks.append(block)
        self.norm = norm(embed_dim)
        self.head = nn.Linear(embed_dim, num_classes) if num_classes else nn.Identity()
        self.aux_head = nn.Linear(embed_dim, num_classes) if num_classes else nn.Identity()
        trunc_normal_(self.pos_embed, std=0.02)
        trunc_normal_(self.cls_token, std=0.02)
        self.apply(init_weights)

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        return {"pos_embed", "cls_token"}

    def reset_classifier(self, num_classes: int, global_pool: Any = None) -> None:
        super().reset_classifier(num_classes)
        self.aux_head = nn.Linear(self.embed_dim, num_classes) if num_classes else nn.Identity()

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Class head on CLS + aux_weight × max over the (surviving) patch tokens of the aux head."""
        if pre_logits:
            return x[:, 0]
        return self.head(x[:, 0]) + self.aux_weight * self.aux_head(x[:, 1:]).max(dim=1).values


def checkpoint_filter_fn(state_dict: Dict[str, Any], model: LVViT) -> Dict[str, torch.Tensor]:
    """Official checkpoint layouts; the position embedding is resampled to the model's grid."""
    return official_checkpoint_filter(
        state_dict,
        model.pos_embed,
        lambda v: resample_abs_pos_embed(v, new_size=model.patch_embed.grid_size, num_prefix_tokens=1),
    )


def _cfg(**kwargs):
    """Both heads are classifiers: loading a checkpoint into another class count re-initialises both."""
    return official_cfg("patch_embed.conv1", classifier=("head", "aux_head"), **kwargs)


default_cfgs = generate_default_cfgs(
    {
        "lvvit_s": _cfg(),
        "lvvit_micro": _cfg(num_classes=10, input_size=(3, 64, 64), crop_pct=1.0),
    }
)


def _create(variant: str, pretrained: bool, **kwargs) -> LVViT:
    return build_model_with_cfg(
        LVViT,
        variant,
        pretrained,
        pretrained_filter_fn=checkpoint_filter_fn,
        feature_cfg=vit_feature_cfg(kwargs),
        **kwargs,
    )


@register_model
def lvvit_s(pretrained: bool = False, **kwargs) -> LVViT:
    """LV-ViT-S: depth 16, dim 384, 6 heads, MLP ratio 3, 26.15 M params, 6.6 GMACs at 224 px."""
    args = dict(embed_dim=384, depth=16, num_heads=6, mlp_ratio=3.0, skip_lam=2.0)
    return _create("lvvit_s", pretrained, **{**args, **kwargs})


@register_model
def lvvit_micro(pretrained: bool = False, **kwargs) -> LVViT:
    """The LV-ViT layout at micro size for CPU tests: 64 px (a 4×4 grid of 16-pixel patches), dim 64."""
    args = dict(img_size=64, embed_dim=64, depth=4, num_heads=4, mlp_ratio=3.0, skip_lam=2.0, stem_dim=16)
    return _create("lvvit_micro", pretrained, **{**args, **kwargs})
