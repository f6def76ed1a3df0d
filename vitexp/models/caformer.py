"""CaFormer (Yu et al., "MetaFormer Baselines for Vision", 2022) comes from timm
(``caformer_s18``: 26.3 M params, 4.11 GMACs under vitexp's protocol, timm/paper 4.13 — the gap
is the StarReLU and scaling ops the protocol does not count). vitexp adds ``caformer_micro``: the
same layout (SepConv mixers in stages 1–2, attention in stages 3–4) at micro width for CPU tests.

The official ``MlpHead`` (sail-sg/metaformer) normalises its hidden layer with ``nn.LayerNorm``,
eps 1e-5; timm's port builds it with eps 1e-6, which moved a CaFormer's logits by 1e-5 relative
to the official model's on seeded weights. :func:`official_head_eps` restores 1e-5, and
``build_backbone`` applies it to every MetaFormer it builds (``tests/test_reference_equivalence.py``).
"""

from __future__ import annotations

import torch.nn as nn
from timm.models import register_model
from timm.models._registry import generate_default_cfgs
from timm.models.metaformer import (
    Attention,
    LayerNorm2dNoBias,
    LayerNormNoBias,
    MetaFormer,
    MlpHead,
    SepConv,
    _cfg,
    _create_metaformer,
)

default_cfgs = generate_default_cfgs(
    {
        "caformer_micro": _cfg(
            num_classes=10, input_size=(3, 64, 64), pool_size=(2, 2), classifier="head.fc.fc2"
        ),
    }
)


@register_model
def caformer_micro(pretrained: bool = False, **kwargs) -> MetaFormer:
    """CaFormer layout at micro size: 64 px, depths (1, 1, 2, 1), dims (16, 32, 64, 96);
    stage 3 sees a 4×4 grid (16 tokens), stage 4 a 2×2 grid."""
    model_kwargs = dict(
        depths=[1, 1, 2, 1],
        dims=[16, 32, 64, 96],
        token_mixers=[SepConv, SepConv, Attention, Attention],
        norm_layers=[LayerNorm2dNoBias] * 2 + [LayerNormNoBias] * 2,
        **kwargs,
    )
    return _create_metaformer("caformer_micro", pretrained=pretrained, **model_kwargs)


#: the official MlpHead's LayerNorm (PyTorch's default eps)
OFFICIAL_HEAD_EPS = 1e-5


def official_head_eps(model: nn.Module) -> None:
    """Set a timm MetaFormer's ``MlpHead`` LayerNorm to the official eps (module docstring); other
    models are left alone. A later ``reset_classifier`` to a class count builds timm's head again."""
    head = getattr(getattr(model, "head", None), "fc", None)
    if isinstance(model, MetaFormer) and isinstance(head, MlpHead) and isinstance(head.norm, nn.LayerNorm):
        head.norm.eps = OFFICIAL_HEAD_EPS
