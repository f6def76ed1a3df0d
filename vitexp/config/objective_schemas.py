"""The config groups an objective alone reads, with their schemas: what the config's types and the
ledger's fingerprint need of the objectives' plug-ins (vitexp.training.objectives), declared below them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Literal, Optional, Union


@dataclass
class Detector:
    """``conf/detector/*.yaml`` (:func:`vitexp.detection.model.build_detector`'s keys)."""

    name: str
    stages: Optional[List[int]]
    fpn_channels: int
    anchor_scale: float
    freeze_bn: Union[bool, Literal["auto"]]
    min_size: int
    max_size: int
    rpn_pre_nms_top_n_test: int
    rpn_post_nms_top_n_test: int
    detections_per_img: int
    flops_size: List[int]
    box_representation: int
    mask_layers: List[int]
    box_batch_size_per_image: int


#: {config group: its schema} of the groups an objective alone reads (every run's config holds
#: them: ``conf/train.yaml`` selects one option of each; the owner:
#: :data:`vitexp.ledger.fingerprint.GROUP_OWNERS`).
OBJECTIVE_SCHEMAS: dict[str, type] = {"detector": Detector}
