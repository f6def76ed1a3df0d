"""The recording hook of the token-reduction methods (BSPF-ViT, EViT, ToMe): what a reducing layer
did with each token, for ``vitexp-analyze tokens`` (vitexp/analysis/tokens.py).

A module that reduces tokens (BSPF's ``TokenPruner``, ``EViTBlock``, ``ToMeBlock``) has the class
attribute ``record_decisions = False``. Set on an instance, each forward that reduces tokens
stores ``decision``: a :class:`TokenDecision` about the M non-prefix tokens entering it. Off, the
forward reads one attribute and computes nothing more.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class TokenDecision(NamedTuple):
    """One layer's decision about the M non-prefix tokens entering it (prefix tokens always stay).

    - ``kept`` (B×M bool): the token goes on as its own output token (a ToMe destination, which
      absorbs others, is kept).
    - ``target`` (B×M long): the non-prefix output token that holds the token afterwards (its own
      slot when kept; the token it was fused or merged into; −1 when it was dropped, i.e. pruned
      without fusion or fused with weight 0).
    - ``tokens_out``: M', the non-prefix tokens after the layer.
    - ``chunks``: C, the groups the tokens are reduced within (BSPF-ViT's chunks: input token i is
      in chunk i // (M/C), output token j in chunk j // (M'/C)); 1 for EViT and ToMe.
    """

    kept: torch.Tensor
    target: torch.Tensor
    tokens_out: int
    chunks: int = 1


def recording_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of ``model`` that can record a :class:`TokenDecision`, in forward order."""
    return [m for m in model.modules() if hasattr(type(m), "record_decisions")]
