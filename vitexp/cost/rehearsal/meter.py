"""What a rehearsal measures while it trains: seconds per optimiser step, images per second, the FLOPs of
one training step, and the process's peak memory (:class:`StepMeter`).

Its reasoning: docs/cluster.md, "vitexp/cost/rehearsal/meter.py".
"""

from __future__ import annotations

import statistics
import time
from contextlib import ExitStack
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from vitexp.measure.flops import flop_counting


def _batch_size(batch: Any) -> int | None:
    """Images in a batch: ``(images, labels)`` tensors, or ``(images, targets)`` lists of images."""
    first = batch[0] if isinstance(batch, (list, tuple)) and batch else batch
    if isinstance(first, torch.Tensor):
        return int(first.shape[0])
    if isinstance(first, (list, tuple)):
        return len(first)
    return None


def _sync(module: L.LightningModule) -> None:
    if module.device.type == "cuda":
        torch.cuda.synchronize(module.device)


def peak_memory() -> dict[str, float]:
    """{``peak_rss_mb``: this process's peak resident set; ``cuda_max_allocated_mb`` on a GPU} in MiB."""
    import resource
    import sys

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = {"peak_rss_mb": rss / (1024 * 1024) if sys.platform == "darwin" else rss / 1024}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda_max_allocated_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return out


class StepMeter(Callback):
    """Times and counts the training steps of every stage of a run (module docstring)."""

    def __init__(self, count_flops: bool = True):
        self.count_flops = count_flops
        self.stages: dict[str, dict[str, Any]] = {}
        self._stage: dict[str, Any] | None = None
        self._counting: ExitStack | None = None
        self._counter = None
        self._t0 = 0.0

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from vitexp.runs.callbacks import Heartbeat

        name = next(
            (cb.stage for cb in trainer.callbacks if isinstance(cb, Heartbeat)), f"stage{len(self.stages)}"
        )
        self._stage = self.stages.setdefault(name, {"steps": [], "batch": None, "train_gflops": None})
        self._stage.update(
            epochs=trainer.max_epochs, module=type(pl_module).__name__
        )  # the stage's recipe epochs

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        stage = self._stage
        if stage is None:
            return
        stage["batch"] = _batch_size(batch)
        if self.count_flops and stage["train_gflops"] is None and not stage.get("counted"):
            self._counting, self._counter = flop_counting()
        _sync(pl_module)
        self._t0 = time.perf_counter()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        stage = self._stage
        if stage is None:
            return
        _sync(pl_module)
        seconds = time.perf_counter() - self._t0
        if self._counting is not None:
            self._counting.close()
            stage["counted"] = True
            stage["first_step_s"] = seconds
            stage["train_gflops"] = self._counter.get_total_flops() / 1e9
            self._counting = self._counter = None
        else:
            stage["steps"].append(seconds)

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        if self._counting is not None:  # leave no counting mode behind a failed step
            self._counting.close()
            self._counting = self._counter = None

    def summary(self) -> dict[str, dict[str, Any]]:
        """{stage: {epochs (the stage's recipe epochs), module, batch, timed_steps, step_s, images_per_s,
        first_step_s, train_gflops,
        train_gflops_per_image}} for every stage that trained."""
        out = {}
        for name, s in self.stages.items():
            step = statistics.median(s["steps"]) if s["steps"] else None
            batch = s["batch"]
            gflops = s["train_gflops"]
            out[name] = {
                "epochs": s.get("epochs"),
                "module": s.get("module"),
                "batch": batch,
                "timed_steps": len(s["steps"]),
                "step_s": step,
                "images_per_s": batch / step if step and batch else None,
                "first_step_s": s.get("first_step_s"),
                "train_gflops": gflops,
                "train_gflops_per_image": gflops / batch if gflops is not None and batch else None,
            }
        return out

    def measured(self, device: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """(metrics, protocol) the rehearsal's ledger entry adds: per stage (``stages``), the run's
        ``step_s`` (median over every timed step of every stage), ``images_per_s``, peak memory,
        ``device`` and ``batch_size`` (the per-device batch of the first stage that trained)."""
        stages = self.summary()
        steps = [t for s in self.stages.values() for t in s["steps"]]
        batch = next((s["batch"] for s in stages.values() if s["batch"]), None)
        step = statistics.median(steps) if steps else None
        metrics = {
            "stages": stages,
            "step_s": step,
            "images_per_s": batch / step if step and batch else None,
            "batch_size": batch,
            "device": device,
            **peak_memory(),
        }
        protocol = {
            "timing": (
                "median seconds per optimiser step after each stage's first (forward, backward, "
                "optimiser; no data loading); the first step is counted for FLOPs instead"
            ),
            "train_flops": "torch.utils.flop_counter on the first step, math SDPA kernel, 2 FLOPs per MAC",
            "peak_memory": (
                "resource.getrusage ru_maxrss of rank zero's process; CUDA max_memory_allocated on a GPU"
            ),
        }
        return metrics, protocol
