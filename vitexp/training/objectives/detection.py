"""``objective: detect``: object detection and instance segmentation, a thin plug-in over
:mod:`vitexp.detection` (torchvision's Mask R-CNN around the backbone with the method applied, COCO
data, :class:`~vitexp.training.detection_module.DetectModule`).

Its reasoning: docs/commands.md, "vitexp/training/objectives/detection.py".
"""

from __future__ import annotations

from typing import Any, ClassVar, Mapping

from vitexp.config.objective_schemas import Detector
from vitexp.errors import ConfigError
from vitexp.training.objectives.base import Count, Objective

#: Backbone families with stages a feature pyramid can read.
STAGED_FAMILIES = ("metaformer", "shvit")


class Detection(Objective):
    name: ClassVar[str] = "detect"
    headline: ClassVar[tuple[str, ...]] = ("ap_box", "ap_mask")
    synthetic_data: ClassVar[str] = "synthetic_coco"
    config_groups: ClassVar[Mapping[str, type]] = {"detector": Detector}

    def validate(self, cfg) -> None:
        data, bb = cfg.data, cfg.backbone
        if not str(data.get("_target_", "")).endswith("CocoDataModule"):
            raise ConfigError(
                "data: objective=detect needs a detection dataset (data=coco or data=micro_coco), "
                f"not data={data.name}"
            )
        if bb.arch.get("family") not in STAGED_FAMILIES:
            raise ConfigError(
                "backbone: objective=detect needs a backbone with stages (caformer_*, shvit_*), "
                f"not {bb.name}"
            )

    def stages(self, cfg, method, model, data_config):
        from vitexp.detection import detector_for
        from vitexp.methods import Stage

        detector = detector_for(cfg, model, data_config)
        return [Stage("main", self.name, lambda: detector)]

    def module_class(self, stage):
        from vitexp.training.detection_module import DetectModule

        return DetectModule

    def test_metrics(self, logged: Mapping[str, float], prefix: str) -> dict[str, Any]:
        return {f"{prefix}{k[5:]}": 100.0 * v for k, v in logged.items() if k.startswith("test/ap")}

    def validation_metrics(self, logged: Mapping[str, float], prefix: str) -> dict[str, Any]:
        return {f"{prefix}val_{k[4:]}": 100.0 * v for k, v in logged.items() if k.startswith("val/ap")}

    def measured(self, cfg, deployed, data_config):
        from vitexp.detection import detector_for

        return detector_for(cfg, deployed, data_config)

    def count(self, cfg, model) -> Count:
        from vitexp.detection import detection_flops
        from vitexp.measure.flops import count_heads, count_macs

        metrics, protocol = detection_flops(cfg, model)
        report = count_macs(model.backbone.body.model, int(cfg.backbone.img_size))
        metrics.update({"heads": count_heads(model), "backbone_gmacs": report.gmacs})
        protocol["num_classes"] = int(cfg.data.num_classes)
        parts = {k[len("gmacs_") :]: v for k, v in metrics.items() if k.startswith("gmacs_")}
        return Count(
            metrics, protocol, f"{protocol['resolution']} (the whole detector)", parts, report.by_module
        )

    def deployed_cost(self, cfg, model) -> tuple[dict[str, Any], dict[str, Any]]:
        count = self.count(cfg, model)
        return count.metrics, {
            "accuracy_unit": "%",
            "num_classes": int(cfg.data.num_classes),
            **count.protocol,
        }

    def rebuild(self, cfg, method, backbone, record, data_config):
        (stage,) = self.stages(cfg, method, method.rebuild_deployed(backbone, record), data_config)
        return stage, stage.model()

    def dataset_sizes(self, data: Mapping[str, Any]) -> dict[str, int] | None:
        """The micro COCO (``data.generate``): ``n_train`` training images and ``n_val`` for both
        validation and test (its test split is its validation split)."""
        generate = data.get("generate") or {}
        if generate.get("n_train") is None:
            return None
        return {
            "train": int(generate["n_train"]),
            "val": int(generate["n_val"]),
            "test": int(generate["n_val"]),
        }

    def cost_anchor(self, config: Mapping[str, Any]) -> str | None:
        """A published detector's training time (torchvision's Mask R-CNN R50-FPN;
        :mod:`vitexp.detection.reference` counts it as a row is counted)."""
        return "maskrcnn_r50_fpn"

    def check_timed(self, cfg) -> None:
        raise ConfigError(
            "objective=detect: vitexp-bench times a model on a batch of images at backbone.img_size; "
            "a detector's throughput is not measured (its RoI heads' time depends on its detections): "
            "vitexp-flops counts the whole detector"
        )

    def rehearsal_data(self, config: Mapping[str, Any], n_train: int, n_eval: int) -> list[str]:
        """``data=synthetic_coco`` at ``detector.flops_size`` (1280 × 800 for COCO)."""
        height, width = (int(v) for v in config["detector"]["flops_size"])
        return [
            f"data={self.synthetic_data}",
            f"data.num_classes={int(config['data']['num_classes'])}",
            f"data.num_train={n_train}",
            f"data.num_val={n_eval}",
            f"data.generate={{height:{height},width:{width},max_items:4}}",
        ]
