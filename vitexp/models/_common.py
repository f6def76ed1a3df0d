"""Pieces shared by vitexp's own architectures (T2T-ViT, LV-ViT)."""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import trunc_normal_
from timm.models.vision_transformer import Attention


def official_cfg(first_conv: str, **kwargs) -> dict[str, Any]:
    """timm ``pretrained_cfg`` of the official ImageNet evaluation: crop 0.9, bicubic, ImageNet mean/std."""
    return {"url": "", "num_classes": 1000, "input_size": (3, 224, 224), "pool_size": None, "crop_pct": 0.9,
            "interpolation": "bicubic", "mean": IMAGENET_DEFAULT_MEAN, "std": IMAGENET_DEFAULT_STD,
            "first_conv": first_conv, "classifier": "head", **kwargs}


def init_weights(m: nn.Module) -> None:
    """Truncated-normal linear weights (std 0.02), zero biases, unit LayerNorms (as the official code)."""
    if isinstance(m, nn.Linear):
        trunc_normal_(m.weight, std=0.02)
        if m.bias is not None:
            nn.init.zeros_(m.bias)
    elif isinstance(m, nn.LayerNorm):
        nn.init.ones_(m.weight)
        nn.init.zeros_(m.bias)


def official_checkpoint_filter(state_dict: dict[str, Any], pos_embed_like: torch.Tensor,
                               resize_pos_embed: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
    """Unwrap ``state_dict_ema`` / ``state_dict`` / ``model`` (the first present), strip a
    ``module.`` prefix, and pass a ``pos_embed`` of another shape through ``resize_pos_embed``."""
    for key in ("state_dict_ema", "state_dict", "model"):
        if isinstance(state_dict.get(key), dict):
            state_dict = state_dict[key]
            break
    out = {}
    for k, v in state_dict.items():
        k = k[len("module."):] if k.startswith("module.") else k
        if k == "pos_embed" and v.shape != pos_embed_like.shape:
            v = resize_pos_embed(v)
        out[k] = v
    return out


class ClsTokenViT(nn.Module):
    """The shared skeleton: patch embedding -> [CLS ‖ tokens] + position embedding -> blocks ->
    final norm -> head on CLS. Subclasses build ``patch_embed``, ``cls_token``, ``pos_embed``,
    ``pos_drop``, ``blocks``, ``norm``, ``head`` and set ``embed_dim``."""

    num_prefix_tokens = 1

    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: Any = None) -> None:
        self.num_classes = num_classes
        self.head = nn.Linear(self.embed_dim, num_classes) if num_classes else nn.Identity()

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = self.pos_drop(x + self.pos_embed)
        for block in self.blocks:
            x = block(x)
        return self.norm(x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        return x[:, 0] if pre_logits else self.head(x[:, 0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


class ScaledAttention(Attention):
    """timm ``Attention`` whose fused path honours ``self.scale`` (T2T-ViT's ``qk_scale``) and,
    when ``gate_values`` (heads,) is set, scales each head's output before the projection (SAPER)."""

    gate_values: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, attn_mask=None, is_causal: bool = False) -> torch.Tensor:
        B, N, _ = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_drop.p if self.training else 0.0,
                                             scale=self.scale)
        if self.gate_values is not None:
            out = out * self.gate_values.view(1, -1, 1, 1).to(out.dtype)
        out = self.norm(out.transpose(1, 2).reshape(B, N, self.num_heads * self.head_dim))
        return self.proj_drop(self.proj(out))
