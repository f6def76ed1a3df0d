"""Pieces shared by vitexp's own architectures (T2T-ViT, LV-ViT).

Its reasoning: docs/reading-backbones.md, "vitexp/models/_common.py".
"""

from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import trunc_normal_
from timm.models._features import feature_take_indices
from timm.models.vision_transformer import Attention


def official_cfg(first_conv: str, **kwargs) -> Dict[str, Any]:
    """timm ``pretrained_cfg`` of the official ImageNet evaluation: crop 0.9, bicubic, ImageNet
    mean/std. ``fixed_input_size``: the position embedding is built for ``img_size`` (as timm's
    ViT and DeiT cfgs declare); another resolution is a creation argument (``img_size=...``), and a
    checkpoint's position embedding is resized to it when it loads."""
    return {
        "url": "",
        "num_classes": 1000,
        "input_size": (3, 224, 224),
        "pool_size": None,
        "crop_pct": 0.9,
        "interpolation": "bicubic",
        "fixed_input_size": True,
        "mean": IMAGENET_DEFAULT_MEAN,
        "std": IMAGENET_DEFAULT_STD,
        "first_conv": first_conv,
        "classifier": "head",
        **kwargs,
    }


def vit_feature_cfg(kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """``feature_cfg`` for ``build_model_with_cfg``, as timm's ViTs use it: ``features_only=True``
    wraps the model in timm's ``FeatureGetterNet`` (``forward_intermediates``), by default on the
    last 3 blocks; ``out_indices`` is taken out of the constructor's kwargs."""
    return dict(out_indices=kwargs.pop("out_indices", 3), feature_cls="getter")


def register_frozen_weight(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """A fixed table of a published model (T2T-ViT's sinusoidal position table, the Performer's
    orthogonal features): a persistent buffer under the same state-dict key as the official
    ``nn.Parameter(requires_grad=False)``, so official checkpoints load, every parameter gets a
    gradient, and ``frozen_weights`` names it for ``vitexp.measure.flops.count_params``, which counts it
    as a parameter as the official count does."""
    module.register_buffer(name, tensor, persistent=True)
    module.frozen_weights = tuple(getattr(module, "frozen_weights", ())) + (name,)


def init_weights(m: nn.Module) -> None:
    """Truncated-normal linear weights (std 0.02), zero biases, unit LayerNorms (as the official code)."""
    if isinstance(m, nn.Linear):
        trunc_normal_(m.weight, std=0.02)
        if m.bias is not None:
            nn.init.zeros_(m.bias)
    elif isinstance(m, nn.LayerNorm):
        nn.init.ones_(m.weight)
        nn.init.zeros_(m.bias)


def official_checkpoint_filter(
    state_dict: Dict[str, Any],
    pos_embed_like: torch.Tensor,
    resize_pos_embed: Callable[[torch.Tensor], torch.Tensor],
) -> Dict[str, torch.Tensor]:
    """Unwrap ``state_dict_ema`` / ``state_dict`` / ``model`` (the first present), strip a
    ``module.`` prefix, and pass a ``pos_embed`` of another shape through ``resize_pos_embed``."""
    for key in ("state_dict_ema", "state_dict", "model"):
        if isinstance(state_dict.get(key), dict):
            state_dict = state_dict[key]
            break
    out = {}
    for k, v in state_dict.items():
        k = k[len("module.") :] if k.startswith("module.") else k
        if k == "pos_embed" and v.shape != pos_embed_like.shape:
            v = resize_pos_embed(v)
        out[k] = v
    return out


class ClsTokenViT(nn.Module):
    """The shared skeleton: patch embedding -> [CLS ‖ tokens] + position embedding -> blocks ->
    final norm -> head on CLS. Subclasses call :meth:`init_vit_attributes` and build
    ``cls_token``, ``pos_embed``, ``pos_drop``, ``blocks`` (a ``ModuleList``), ``norm``, ``head``;
    :meth:`embed_patches` maps images to patch tokens (``patch_embed`` unless overridden)."""

    num_prefix_tokens: int = 1

    def init_vit_attributes(self, embed_dim: int, depth: int, num_classes: int, reduction: int = 16) -> None:
        """timm's attributes: widths, class count, and one ``feature_info`` entry per block."""
        self.num_classes = num_classes
        self.num_features = self.head_hidden_size = self.embed_dim = embed_dim
        self.feature_info = [
            dict(module=f"blocks.{i}", num_chs=embed_dim, reduction=reduction) for i in range(depth)
        ]

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: Any = None) -> None:
        self.num_classes = num_classes
        self.head = nn.Linear(self.embed_dim, num_classes) if num_classes else nn.Identity()

    def embed_patches(self, x: torch.Tensor) -> torch.Tensor:
        return self.patch_embed(x)

    def _pos_embed(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        return self.pos_drop(x + self.pos_embed)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x = self._pos_embed(self.embed_patches(x))
        for block in self.blocks:
            x = block(x)
        return self.norm(x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        return x[:, 0] if pre_logits else self.head(x[:, 0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))

    @torch.jit.ignore
    def forward_intermediates(
        self,
        x: torch.Tensor,
        indices: Optional[Union[int, List[int]]] = None,
        return_prefix_tokens: bool = False,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
    ) -> Union[List[torch.Tensor], Tuple[torch.Tensor, List[torch.Tensor]]]:
        """Block outputs at ``indices`` (timm's convention: None = all, an int n = the last n, a
        list = those blocks, negative from the end), optionally through the final norm, as NCHW
        patch grids or NLC tokens (CLS split off, returned beside each with
        ``return_prefix_tokens``); with the final features unless ``intermediates_only``."""
        if output_fmt not in ("NCHW", "NLC"):
            raise ValueError(f"output_fmt={output_fmt!r}: valid formats are ('NCHW', 'NLC')")
        take_indices, max_index = feature_take_indices(len(self.blocks), indices)
        B, _, height, width = x.shape
        x = self._pos_embed(self.embed_patches(x))
        blocks = self.blocks[: max_index + 1] if stop_early else self.blocks
        intermediates = []
        for i, block in enumerate(blocks):
            x = block(x)
            if i in take_indices:
                intermediates.append(self.norm(x) if norm else x)
        prefix = [y[:, : self.num_prefix_tokens] for y in intermediates]
        intermediates = [y[:, self.num_prefix_tokens :] for y in intermediates]
        if output_fmt == "NCHW":
            ph, pw = self.patch_embed.patch_size
            H, W = height // ph, width // pw
            if any(y.shape[1] != H * W for y in intermediates):
                raise ValueError(
                    f"output_fmt='NCHW' needs the full {H}x{W} token grid, but a block returned "
                    f"{[y.shape[1] for y in intermediates]} patch tokens (a token-pruned model): "
                    "use output_fmt='NLC'"
                )
            intermediates = [y.reshape(B, H, W, -1).permute(0, 3, 1, 2).contiguous() for y in intermediates]
        if return_prefix_tokens:
            intermediates = list(zip(intermediates, prefix))
        if intermediates_only:
            return intermediates
        return self.norm(x), intermediates

    @torch.jit.ignore
    def prune_intermediate_layers(
        self, indices: Union[int, List[int]] = 1, prune_norm: bool = False, prune_head: bool = True
    ) -> List[int]:
        """Drop the blocks after the last of ``indices`` (and the final norm / the classifier)."""
        take_indices, max_index = feature_take_indices(len(self.blocks), indices)
        self.blocks = self.blocks[: max_index + 1]
        if prune_norm:
            self.norm = nn.Identity()
        if prune_head:
            self.reset_classifier(0)
        return take_indices


class ScaledAttention(Attention):
    """timm ``Attention`` whose fused path honours ``self.scale`` (T2T-ViT's ``qk_scale``) and,
    when ``gate_values`` (heads,) is set, scales each head's output before the projection (SAPER).
    The class is swapped onto live ``Attention`` modules; whoever swaps it sets the instance's
    ``gate_values`` (None or a tensor), which TorchScript needs as an instance attribute."""

    gate_values: Optional[torch.Tensor] = None

    def forward(
        self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False
    ) -> torch.Tensor:
        B, N, _ = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        out = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.attn_drop.p if self.training else 0.0, scale=self.scale
        )
        gates = self.gate_values
        if gates is not None:
            out = out * gates.view(1, -1, 1, 1).to(out.dtype)
        out = self.norm(out.transpose(1, 2).reshape(B, N, self.num_heads * self.head_dim))
        return self.proj_drop(self.proj(out))
