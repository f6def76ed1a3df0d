"""T2T-ViT (Yuan et al., "Tokens-to-Token ViT", ICCV 2021), registered with timm as ``t2t_vit_14``
(Performer tokens-to-token module), ``t2t_vit_t_14`` (Transformer variant) and ``t2t_vit_micro`` (CPU
tests). Parameter names follow the official code, so its checkpoints load.

Its reasoning: docs/reading-backbones.md, "vitexp/models/t2t.py".
"""

import math
from typing import Any, Dict, Optional, Tuple, Union

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import Mlp, to_2tuple, trunc_normal_
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from timm.models.vision_transformer import Block

from vitexp.models._common import (
    ClsTokenViT,
    ScaledAttention,
    init_weights,
    official_cfg,
    official_checkpoint_filter,
    register_frozen_weight,
    vit_feature_cfg,
)


def _at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """The official ``x.float()`` for half and float32 inputs; float64 stays float64."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


class TokenPerformer(nn.Module):
    """Single-head Performer token block (official ``Token_performer``): FAVOR+ positive random
    features, m = 0.5 × 64 = 32, from a frozen orthogonal matrix."""

    def __init__(self, dim: int, in_dim: int, kernel_ratio: float = 0.5, drop: float = 0.1):
        super().__init__()
        self.emb = in_dim
        self.kqv = nn.Linear(dim, 3 * self.emb)
        self.dp = nn.Dropout(drop)
        self.proj = nn.Linear(self.emb, self.emb)
        self.norm1 = nn.LayerNorm(dim)
        self.norm2 = nn.LayerNorm(self.emb)
        self.epsilon = 1e-8
        self.mlp = nn.Sequential(
            nn.Linear(self.emb, self.emb), nn.GELU(), nn.Linear(self.emb, self.emb), nn.Dropout(drop)
        )
        self.m = int(self.emb * kernel_ratio)
        w = nn.init.orthogonal_(torch.randn(self.m, self.emb)) * math.sqrt(self.m)
        register_frozen_weight(self, "w", w)

    def prm_exp(self, x: torch.Tensor) -> torch.Tensor:
        xd = (x * x).sum(dim=-1, keepdim=True) / 2
        wtx = torch.einsum("bti,mi->btm", _at_least_float32(x), self.w)
        return torch.exp(wtx - xd) / math.sqrt(self.m)

    def single_attn(self, x: torch.Tensor) -> torch.Tensor:
        k, q, v = torch.split(self.kqv(x), self.emb, dim=-1)
        kp, qp = self.prm_exp(k), self.prm_exp(q)
        d = torch.einsum("bti,bi->bt", qp, kp.sum(dim=1)).unsqueeze(dim=2)
        kptv = torch.einsum("bin,bim->bnm", _at_least_float32(v), kp)
        y = torch.einsum("bti,bni->btn", qp, kptv) / (d + self.epsilon)
        return v + self.dp(self.proj(y))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.single_attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class _TokenAttention(nn.Module):
    """Single-head attention from ``dim`` to ``in_dim`` with a skip from v (official code's scale:
    ``dim``^-0.5, since its head_dim is dim // num_heads)."""

    def __init__(self, dim: int, in_dim: int):
        super().__init__()
        self.in_dim = in_dim
        self.scale = dim**-0.5
        self.qkv = nn.Linear(dim, in_dim * 3, bias=False)
        self.proj = nn.Linear(in_dim, in_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, _ = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, 1, self.in_dim).permute(2, 0, 3, 1, 4).unbind(0)
        x = F.scaled_dot_product_attention(q, k, v, scale=self.scale)
        x = self.proj(x.transpose(1, 2).reshape(B, N, self.in_dim))
        return v.squeeze(1) + x


class TokenTransformer(nn.Module):
    """Single-head Transformer token block (official ``Token_transformer``, MLP ratio 1)."""

    def __init__(self, dim: int, in_dim: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = _TokenAttention(dim, in_dim)
        self.norm2 = nn.LayerNorm(in_dim)
        self.mlp = Mlp(in_features=in_dim, hidden_features=in_dim, out_features=in_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class T2TModule(nn.Module):
    """Tokens-to-token: three soft splits (Unfold) with two token blocks between them."""

    def __init__(
        self,
        img_size: Union[int, Tuple[int, int]] = 224,
        tokens_type: str = "performer",
        in_chans: int = 3,
        embed_dim: int = 384,
        token_dim: int = 64,
    ):
        super().__init__()
        if tokens_type not in ("performer", "transformer"):
            raise ValueError(f"tokens_type={tokens_type!r}: valid types are ('performer', 'transformer')")
        self.soft_split0 = nn.Unfold(kernel_size=(7, 7), stride=(4, 4), padding=(2, 2))
        self.soft_split1 = nn.Unfold(kernel_size=(3, 3), stride=(2, 2), padding=(1, 1))
        self.soft_split2 = nn.Unfold(kernel_size=(3, 3), stride=(2, 2), padding=(1, 1))
        block = TokenPerformer if tokens_type == "performer" else TokenTransformer
        self.attention1 = block(in_chans * 7 * 7, token_dim)
        self.attention2 = block(token_dim * 3 * 3, token_dim)
        self.project = nn.Linear(token_dim * 3 * 3, embed_dim)
        self.img_size = to_2tuple(img_size)
        self.patch_size = (16, 16)
        self.grid_size = (self.img_size[0] // 16, self.img_size[1] // 16)
        self.num_patches = self.grid_size[0] * self.grid_size[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, w = x.shape[-2] // 4, x.shape[-1] // 4
        x = self.attention1(self.soft_split0(x).transpose(1, 2))
        x = x.transpose(1, 2).reshape(x.shape[0], x.shape[2], h, w)
        x = self.attention2(self.soft_split1(x).transpose(1, 2))
        x = x.transpose(1, 2).reshape(x.shape[0], x.shape[2], h // 2, w // 2)
        return self.project(self.soft_split2(x).transpose(1, 2))


def sinusoid_encoding(n_position: int, d_hid: int) -> torch.Tensor:
    """The fixed sinusoidal table of the official code, shape (1, n_position, d_hid)."""
    pos = np.arange(n_position)[:, None]
    j = np.arange(d_hid)[None, :]
    table = pos / np.power(10000, 2 * (j // 2) / d_hid)
    table[:, 0::2] = np.sin(table[:, 0::2])
    table[:, 1::2] = np.cos(table[:, 1::2])
    return torch.tensor(table, dtype=torch.float32).unsqueeze(0)


class T2TViT(ClsTokenViT):
    """T2T-ViT: the tokens-to-token module, then a ViT with a fixed sinusoidal position table."""

    __jit_unused_properties__ = ["patch_embed"]

    def __init__(
        self,
        img_size: Union[int, Tuple[int, int]] = 224,
        tokens_type: str = "performer",
        in_chans: int = 3,
        num_classes: int = 1000,
        embed_dim: int = 384,
        depth: int = 14,
        num_heads: int = 6,
        mlp_ratio: float = 3.0,
        qkv_bias: bool = False,
        qk_scale: Optional[float] = None,
        drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        token_dim: int = 64,
    ):
        super().__init__()
        self.init_vit_attributes(embed_dim, depth, num_classes)
        self.tokens_to_token = T2TModule(img_size, tokens_type, in_chans, embed_dim, token_dim)
        n = self.tokens_to_token.num_patches
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        register_frozen_weight(self, "pos_embed", sinusoid_encoding(n + 1, embed_dim))
        self.pos_drop = nn.Dropout(drop_rate)
        dpr = [x.item() for x in torch.linspace(0, drop_path_rate, depth)]
        self.blocks = nn.ModuleList()
        for i in range(depth):
            block = Block(
                embed_dim,
                num_heads,
                mlp_ratio=mlp_ratio,
                qkv_bias=qkv_bias,
                proj_drop=drop_rate,
                drop_path=dpr[i],
                norm_layer=nn.LayerNorm,
            )  # eps 1e-5, the official nn.LayerNorm
            block.attn.__class__ = ScaledAttention
            block.attn.gate_values = None
            if qk_scale is not None:
                block.attn.scale = float(qk_scale)
            self.blocks.append(block)
        self.norm = nn.LayerNorm(embed_dim)
        self.head = nn.Linear(embed_dim, num_classes) if num_classes else nn.Identity()
        trunc_normal_(self.cls_token, std=0.02)
        self.apply(init_weights)

    @property
    def patch_embed(self) -> T2TModule:
        """The tokens-to-token module plays the patch embedding's role (token grid, patch size)."""
        return self.tokens_to_token

    def embed_patches(self, x: torch.Tensor) -> torch.Tensor:
        return self.tokens_to_token(x)

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        return {"cls_token"}


def checkpoint_filter_fn(state_dict: Dict[str, Any], model: T2TViT) -> Dict[str, torch.Tensor]:
    """Official checkpoint layouts; a position table of another length is rebuilt (it is fixed).
    A checkpoint for another number of input channels is refused: the first token block normalises
    and projects the whole C×7×7 unfolded patch, which has no per-channel adaptation."""
    shape = model.pos_embed.shape
    out = official_checkpoint_filter(
        state_dict, model.pos_embed, lambda v: sinusoid_encoding(shape[1], shape[2])
    )
    key = "tokens_to_token.attention1.norm1.weight"
    theirs, ours = out.get(key), model.tokens_to_token.attention1.norm1.weight
    if theirs is not None and theirs.shape != ours.shape:
        raise ValueError(
            f"a T2T-ViT checkpoint for {theirs.shape[0] // 49} input channels cannot load into a model "
            f"with in_chans={ours.shape[0] // 49}: its first token block acts on the whole C×7×7 patch"
        )
    return out


#: ``first_conv`` of each tokens-to-token type: Unfold(7, s4) followed by this linear layer is a
#: 7×7/4 convolution over the pixels, so it is the layer that plays the first conv's role.
_FIRST_CONV = {
    "performer": "tokens_to_token.attention1.kqv",
    "transformer": "tokens_to_token.attention1.attn.qkv",
}

default_cfgs = generate_default_cfgs(
    {
        "t2t_vit_14": official_cfg(_FIRST_CONV["performer"]),
        "t2t_vit_t_14": official_cfg(_FIRST_CONV["transformer"]),
        "t2t_vit_micro": official_cfg(
            _FIRST_CONV["performer"], num_classes=10, input_size=(3, 64, 64), crop_pct=1.0
        ),
    }
)


def _create(variant: str, pretrained: bool, **kwargs) -> T2TViT:
    return build_model_with_cfg(
        T2TViT,
        variant,
        pretrained,
        pretrained_filter_fn=checkpoint_filter_fn,
        feature_cfg=vit_feature_cfg(kwargs),
        **kwargs,
    )


@register_model
def t2t_vit_14(pretrained: bool = False, **kwargs) -> T2TViT:
    """T2T-ViT-14, Performer tokens-to-token: 21.5 M params, 4.8 GMACs at 224 px."""
    args = dict(tokens_type="performer", embed_dim=384, depth=14, num_heads=6, mlp_ratio=3.0)
    return _create("t2t_vit_14", pretrained, **{**args, **kwargs})


@register_model
def t2t_vit_t_14(pretrained: bool = False, **kwargs) -> T2TViT:
    """T2T-ViT_t-14, Transformer tokens-to-token: 21.5 M params, 6.1 GMACs at 224 px."""
    args = dict(tokens_type="transformer", embed_dim=384, depth=14, num_heads=6, mlp_ratio=3.0)
    return _create("t2t_vit_t_14", pretrained, **{**args, **kwargs})


@register_model
def t2t_vit_micro(pretrained: bool = False, **kwargs) -> T2TViT:
    """The T2T-ViT layout at micro size for CPU tests: 64 px (16 tokens), dim 64, depth 4."""
    args = dict(
        img_size=64, tokens_type="performer", embed_dim=64, depth=4, num_heads=4, mlp_ratio=3.0, token_dim=16
    )
    return _create("t2t_vit_micro", pretrained, **{**args, **kwargs})
