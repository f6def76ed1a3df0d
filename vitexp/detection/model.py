"""``objective: detect``: torchvision's Mask R-CNN around a vitexp backbone.

Its reasoning: docs/full-size.md, "vitexp/detection/model.py".
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Mapping, Sequence

import torch
import torch.nn as nn


class StageFeatures(nn.Module):
    """A timm backbone's stage outputs ``indices`` as an ordered dict ``{"0": finest, ...}``."""

    def __init__(self, model: nn.Module, indices: Sequence[int] | None = None):
        super().__init__()
        info = getattr(model, "feature_info", None)
        if not hasattr(model, "forward_intermediates") or not info or len(info) < 2:
            raise TypeError(
                "objective=detect needs a backbone with stages (timm feature_info and "
                f"forward_intermediates); {type(model).__name__} has none"
            )
        stages = list(range(len(info)))
        self.indices = [stages[i] for i in (indices if indices is not None else stages)]
        if hasattr(model, "prune_intermediate_layers"):  # the classifier (and stages past the last used) go
            model.prune_intermediate_layers(self.indices, prune_norm=True, prune_head=True)
        self.model = model
        self.channels = [int(info[i]["num_chs"]) for i in self.indices]
        self.strides = [int(info[i]["reduction"]) for i in self.indices]

    def forward(self, x: torch.Tensor) -> "OrderedDict[str, torch.Tensor]":
        feats = self.model.forward_intermediates(x, indices=self.indices, intermediates_only=True)
        return OrderedDict((str(i), f) for i, f in enumerate(feats))


class BackboneFPN(nn.Module):
    """Stage features -> torchvision's FPN (plus its max-pool level); ``out_channels`` as torchvision
    expects."""

    def __init__(self, body: StageFeatures, out_channels: int = 256):
        super().__init__()
        from torchvision.ops.feature_pyramid_network import FeaturePyramidNetwork, LastLevelMaxPool

        self.body = body
        self.fpn = FeaturePyramidNetwork(body.channels, out_channels, extra_blocks=LastLevelMaxPool())
        self.out_channels = out_channels
        self.strides = [*body.strides, 2 * body.strides[-1]]

    def forward(self, x: torch.Tensor) -> "OrderedDict[str, torch.Tensor]":
        return self.fpn(self.body(x))


def build_detector(
    backbone: nn.Module,
    num_classes: int,
    cfg: Mapping[str, Any],
    data_config: Mapping[str, Any] | None = None,
) -> nn.Module:
    """torchvision ``MaskRCNN`` on ``backbone``'s stages; ``num_classes`` excludes the background."""
    from torchvision.models.detection import MaskRCNN
    from torchvision.models.detection.anchor_utils import AnchorGenerator
    from torchvision.models.detection.faster_rcnn import FastRCNNPredictor, TwoMLPHead
    from torchvision.models.detection.mask_rcnn import MaskRCNNHeads, MaskRCNNPredictor
    from torchvision.ops import MultiScaleRoIAlign

    if cfg.get("freeze_bn", True) is True:
        from timm.layers import freeze_batch_norm_2d

        backbone = freeze_batch_norm_2d(backbone)
    features = BackboneFPN(StageFeatures(backbone, cfg.get("stages")), int(cfg.get("fpn_channels", 256)))
    levels = [str(i) for i in range(len(features.body.channels))]
    scale = float(cfg.get("anchor_scale", 8))
    anchors = AnchorGenerator(
        sizes=tuple((int(scale * s),) for s in features.strides),
        aspect_ratios=((0.5, 1.0, 2.0),) * len(features.strides),
    )
    data_config = dict(data_config or {})
    c = features.out_channels
    representation = int(cfg.get("box_representation", 1024))
    mask_layers = [int(w) for w in cfg.get("mask_layers", (256, 256, 256, 256))]
    # num_classes is given to the predictors (torchvision wants it there or in the model, not both)
    return MaskRCNN(
        features,
        num_classes=None,
        box_head=TwoMLPHead(c * 7 * 7, representation),
        box_predictor=FastRCNNPredictor(representation, int(num_classes) + 1),
        mask_head=MaskRCNNHeads(c, mask_layers, 1),
        mask_predictor=MaskRCNNPredictor(mask_layers[-1], mask_layers[-1], int(num_classes) + 1),
        box_batch_size_per_image=int(cfg.get("box_batch_size_per_image", 512)),
        min_size=int(cfg.get("min_size", 800)),
        max_size=int(cfg.get("max_size", 1333)),
        image_mean=list(data_config.get("mean", (0.485, 0.456, 0.406))),
        image_std=list(data_config.get("std", (0.229, 0.224, 0.225))),
        rpn_anchor_generator=anchors,
        box_roi_pool=MultiScaleRoIAlign(featmap_names=levels, output_size=7, sampling_ratio=2),
        mask_roi_pool=MultiScaleRoIAlign(featmap_names=levels, output_size=14, sampling_ratio=2),
        rpn_pre_nms_top_n_test=int(cfg.get("rpn_pre_nms_top_n_test", 1000)),
        rpn_post_nms_top_n_test=int(cfg.get("rpn_post_nms_top_n_test", 1000)),
        box_detections_per_img=int(cfg.get("detections_per_img", 100)),
    )


def detector_macs(detector: nn.Module, height: int = 800, width: int = 1280) -> dict[str, Any]:
    """MACs of a Mask R-CNN at ``width`` × ``height`` under vitexp's protocol, by part.

    Counted (matmuls and convolutions): backbone + FPN on the padded image, the RPN head on every
    level, the box head on ``rpn_post_nms_top_n_test`` RoIs (1,000) and the mask head on
    ``box_detections_per_img`` detections (100), as at test time. Not counted (not matmuls):
    RoIAlign, anchor decoding, NMS, the resize and mask pasting."""
    from vitexp.measure.flops import count_module_macs

    device = next(detector.parameters()).device
    was_training = detector.training
    detector.eval()
    stride = int(detector.transform.size_divisible)
    h, w = -(-height // stride) * stride, -(-width // stride) * stride
    image = torch.zeros(1, 3, h, w, device=device)
    with torch.no_grad():
        feats = list(detector.backbone(image).values())
    rois = detector.rpn._post_nms_top_n["testing"]
    dets = detector.roi_heads.detections_per_img
    c = detector.backbone.out_channels
    box_in = torch.zeros(rois, c, 7, 7, device=device)
    mask_in = torch.zeros(dets, c, 14, 14, device=device)
    heads = detector.roi_heads
    parts = {
        "backbone_fpn": count_module_macs(_Tupled(detector.backbone), (image,)),
        "rpn_head": count_module_macs(_Tupled(detector.rpn.head), (feats,)),
        "box_head": count_module_macs(nn.Sequential(heads.box_head, heads.box_predictor), (box_in,)),
        "mask_head": count_module_macs(nn.Sequential(heads.mask_head, heads.mask_predictor), (mask_in,)),
    }
    detector.train(was_training)
    total = sum(parts.values())
    return {
        "gmacs": total / 1e9,
        "gflops": 2 * total / 1e9,
        "by_part_gmacs": {k: v / 1e9 for k, v in parts.items()},
        "protocol": {
            "resolution": f"{width}x{height}",
            "padded": f"{w}x{h}",
            "rpn_rois": rois,
            "mask_detections": dets,
            "unit": "GMACs (gflops = 2 x MACs)",
            "counted": (
                "backbone, FPN, RPN head, box head on the RPN's test-time RoIs, mask head on "
                "the detections: matmuls and convolutions"
            ),
            "not_counted": "RoIAlign, anchor decoding, NMS, resizing, mask pasting",
        },
    }


class _Tupled(nn.Module):
    """A module whose dict or list output becomes a tuple (fvcore traces tensors and tuples)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, x):
        out = self.module(x)
        if isinstance(out, dict):
            return tuple(out.values())
        if isinstance(out, (list, tuple)) and out and isinstance(out[0], (list, tuple)):
            return tuple(t for group in out for t in group)
        return tuple(out) if isinstance(out, list) else out
