"""The published detector that detection rows' GPU-hours are anchored on (``conf/cost.yaml`` anchor
``maskrcnn_r50_fpn``: torchvision's Mask R-CNN ResNet-50 FPN and its measured training time), counted
the way a detection row's rehearsal counts its own detector: the training step by
:mod:`vitexp.cost.rehearsal.meter`'s counter, the forward by
:func:`vitexp.detection.model.detector_macs`.

Its reasoning: docs/full-size.md, "vitexp/detection/reference.py".
"""

from __future__ import annotations

from typing import Sequence


def reference_model():
    """torchvision's Mask R-CNN R50-FPN, random weights, as its reference training builds it."""
    from torchvision.models.detection import maskrcnn_resnet50_fpn

    return maskrcnn_resnet50_fpn(
        weights=None, weights_backbone=None, num_classes=91, trainable_backbone_layers=3
    )


def count_reference(size: Sequence[int] = (1280, 800), items: int = 4) -> dict[str, float]:
    """{train_gflops, forward_gflops} per image of :func:`reference_model` on a ``size`` = (width, height)
    synthetic image with ``items`` instances (module docstring)."""
    from vitexp.detection.synthetic import SyntheticInstances
    from vitexp.measure.flops import flop_counting

    width, height = int(size[0]), int(size[1])
    data = SyntheticInstances(8, height, width, num_classes=90, max_items=items, seed=0)
    image, target = next((data[i] for i in range(len(data)) if len(data[i][1]["boxes"]) == items), data[0])
    model = reference_model().train()
    stack, counter = flop_counting()
    with stack:
        losses = model([image], [target])
        sum(losses.values()).backward()
    from vitexp.detection.model import detector_macs

    return {
        "train_gflops": counter.get_total_flops() / 1e9,
        "forward_gflops": detector_macs(model, height, width)["gflops"],
    }
