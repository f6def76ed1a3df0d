"""Backbones: timm models by name, vitexp's own architectures registered with timm.

Pretrained weights load only from a local file (``backbone.pretrained=/path/to/file``),
through :func:`vitexp.models.factory.load_checkpoint` (timm's key filter for the model, every key
checked): nothing is ever downloaded.
"""

from vitexp.models import caformer as _caformer  # noqa: F401  (registers caformer_micro)
from vitexp.models import lvvit as _lvvit  # noqa: F401  (registers lvvit_s, lvvit_micro)
from vitexp.models import micro as _micro  # noqa: F401  (registers vit_micro_patch4_32)
from vitexp.models import shvit as _shvit  # noqa: F401  (registers shvit_micro)
from vitexp.models import t2t as _t2t  # noqa: F401  (registers t2t_vit_14, t2t_vit_t_14, t2t_vit_micro)
from vitexp.models.factory import CheckpointMismatchError, build_backbone

__all__ = ["CheckpointMismatchError", "build_backbone"]
