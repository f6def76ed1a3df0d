"""Object detection (``objective=detect``): torchvision's Mask R-CNN around a backbone's stages.

Object detection and instance segmentation (``objective=detect``): torchvision's Mask R-CNN around a
vitexp backbone (:mod:`.model`), COCO data (:mod:`.coco_data`), the micro COCO (:mod:`.micro_coco`) and
the LightningModule (:mod:`.module`). Runs reach them through the objective's plug-in,
:mod:`vitexp.training.objectives.detection`.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn


def detector_for(cfg, model: nn.Module, data_config: dict[str, Any]) -> nn.Module:
    """The run's Mask R-CNN around ``model`` (the backbone with the method applied). ``freeze_bn:
    auto`` freezes the backbone's BatchNorm only when it starts from weights (``backbone.pretrained``)."""
    from vitexp.detection.model import build_detector

    detector_cfg = dict(cfg.detector)
    if str(detector_cfg.get("freeze_bn", "auto")) == "auto":
        detector_cfg["freeze_bn"] = bool(cfg.backbone.get("pretrained"))
    return build_detector(model, int(cfg.data.num_classes), detector_cfg, data_config)


def detection_flops(cfg, detector: nn.Module) -> tuple[dict[str, Any], dict[str, Any]]:
    """(metrics, protocol) of the whole detector at ``detector.flops_size`` (height, width), with
    what the method records about the backbone's forward at that size (BSPF-ViT: the chunks of
    each attention stage, the realised keep fractions; :func:`vitexp.measure.flops.register_model_record`)."""
    from vitexp.detection.model import detector_macs
    from vitexp.measure.flops import count_params, model_records

    height, width = (int(v) for v in cfg.detector.flops_size)
    report = detector_macs(detector, height, width)
    method_protocol, method_metrics = model_records(detector.backbone.body.model)
    metrics = {
        "gmacs": report["gmacs"],
        "gflops": report["gflops"],
        "params_m": count_params(detector) / 1e6,
        **{f"gmacs_{k}": v for k, v in report["by_part_gmacs"].items()},
        **method_metrics,
    }
    return metrics, {
        **report["protocol"],
        **method_protocol,
        "objective": "detect",
        "throughput": "not measured for detectors",
    }
