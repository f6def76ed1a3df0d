"""``objective: auto``: the method's own objective. Its stages are the method's
(:meth:`~vitexp.methods.Method.stages`), each trained by the LightningModule of the stage's
objective (:data:`vitexp.training.modules.OBJECTIVE_MODULES`: classify, the linear probes; distill, SAPER's
k-NN rows; raptor, RAPTOR's surrogate stages), and tested for top-1 and top-5 (%) and the loss.

Counted (:mod:`vitexp.measure.flops`): the deployed model's MACs on one image at ``backbone.img_size``,
register tokens as the protocol says, and its attention heads; at the end of a training run only
when ``eval.flops``, and timed alone (``eval.throughput``, :mod:`vitexp.measure.throughput`) on
``bench.device``.
"""

from __future__ import annotations

from typing import Any, ClassVar, Mapping

from vitexp.training.objectives.base import Count, Objective


class Classification(Objective):
    name: ClassVar[str] = "auto"
    headline: ClassVar[tuple[str, ...]] = ("top1",)
    synthetic_data: ClassVar[str] = "synthetic"

    def stages(self, cfg, method, model, data_config):
        return method.stages(model)

    def module_class(self, stage):
        from vitexp.training.modules import module_for

        return module_for(stage.objective)

    def test_metrics(self, logged: Mapping[str, float], prefix: str) -> dict[str, Any]:
        return {
            f"{prefix}top1": 100.0 * logged["test/top1"],
            f"{prefix}top5": 100.0 * logged["test/top5"],
            f"{prefix}test_loss": logged.get("test/loss"),
        }

    def validation_metrics(self, logged: Mapping[str, float], prefix: str) -> dict[str, Any]:
        """``<prefix>val_top1`` (None for a stage that validates no accuracy: RAPTOR's distillation) and
        ``<prefix>val_loss`` (None where the model has no loss to validate: a deployed k-NN model)."""
        return {
            f"{prefix}val_top1": 100.0 * logged["val/top1"] if "val/top1" in logged else None,
            f"{prefix}val_loss": logged.get("val/loss"),
        }

    def measured(self, cfg, deployed, data_config):
        return deployed

    def count(self, cfg, model) -> Count:
        from vitexp.measure.flops import count_heads, count_macs
        from vitexp.training.build import registers_of

        img_size = int(cfg.backbone.img_size)
        report = count_macs(model, img_size, registers=registers_of(cfg))
        return Count(
            {**report.metrics(), "heads": count_heads(model)},
            {**report.protocol, "num_classes": int(cfg.data.num_classes)},
            f"{img_size} px",
            report.by_module,
            report.by_module,
        )

    def deployed_cost(self, cfg, model) -> tuple[dict[str, Any], dict[str, Any]]:
        """The count when ``eval.flops`` (else the heads alone) and, when ``eval.throughput``, the
        images/s of the model alone on ``bench.device`` (the GPU when there is one: Lightning hands
        the model back on the CPU)."""
        from vitexp.measure.flops import count_heads
        from vitexp.measure.throughput import bench_device, measure_throughput

        metrics: dict[str, Any] = {}
        protocol: dict[str, Any] = {"accuracy_unit": "%", "num_classes": int(cfg.data.num_classes)}
        if cfg.eval.flops:
            count = self.count(cfg, model)
            metrics.update(count.metrics)
            protocol.update(count.protocol)
        else:
            metrics["heads"] = count_heads(model)
        if cfg.eval.throughput:
            model = model.to(bench_device(str(cfg.bench.device)))
            tp = measure_throughput(
                model,
                cfg.eval.throughput_batch,
                int(cfg.backbone.img_size),
                iters=int(cfg.eval.throughput_iters),
                amp=cfg.bench.amp,
            )
            metrics["throughput"] = tp["throughput"]
            protocol["throughput"] = {k: v for k, v in tp.items() if k != "throughput"}
        return metrics, protocol

    def rehearsal_data(self, config: Mapping[str, Any], n_train: int, n_eval: int) -> list[str]:
        """``data=synthetic`` at the backbone's resolution (the module takes it from the model's data
        config)."""
        return [
            f"data={self.synthetic_data}",
            f"data.num_classes={int(config['data']['num_classes'])}",
            f"data.num_train={n_train}",
            f"data.num_val={n_eval}",
            f"data.num_test={n_eval}",
        ]
