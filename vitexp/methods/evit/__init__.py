"""EViT (Liang et al., ICLR 2022) as vitexp runs it.

EViT (Liang et al., ICLR 2022) as vitexp runs it: the algorithm (:mod:`.fuse`), the surgery on a timm
ViT (:mod:`.patch`), the Method (:mod:`.method`).
"""

from vitexp.methods.evit.method import EViT

__all__ = ["EViT"]
