"""ToMe (Token Merging, Bolya et al., ICLR 2023) as vitexp runs it.

ToMe (Token Merging, Bolya et al., ICLR 2023) as vitexp runs it: the algorithm (:mod:`.merge`), the
surgery on a timm ViT (:mod:`.patch`), the Method (:mod:`.method`).
"""

from vitexp.methods.tome.method import ToMe

__all__ = ["ToMe"]
