"""Lightning's per-step overhead: the same model on the same batches, a plain loop against a Trainer
(``vitexp-bench bench.mode=overhead``)."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Mapping

import torch
import torch.nn as nn


def _step_times(stamps: list[float], skip: int) -> float:
    deltas = [b - a for a, b in zip(stamps[:-1], stamps[1:])][skip:]
    return statistics.median(deltas)


def lightning_overhead(
    make_model: Callable[[], nn.Module],
    make_loader: Callable[[], Any],
    num_classes: int,
    recipe: Mapping[str, Any],
    steps: int,
    warmup: int = 5,
    repeats: int = 2,
) -> dict[str, float]:
    """Median seconds per training step (time between consecutive batch starts, data loading
    included) of the same model on the same batches: a plain PyTorch loop (forward,
    cross-entropy, backward, optimizer and scheduler step) against ``lightning.Trainer`` running
    vitexp's :class:`~vitexp.training.modules.ClassifyModule` (which also logs and checks the loss). The
    two alternate ``repeats`` times and the best median of each is kept."""
    import lightning as L
    from lightning.pytorch.callbacks import Callback

    from vitexp.training.modules import ClassifyModule, build_optimizer

    class _Stamp(Callback):
        def __init__(self):
            self.stamps: list[float] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.stamps.append(time.perf_counter())

    lr = float(recipe["lr"])

    def plain() -> float:
        torch.manual_seed(0)
        model = make_model().train()
        opt, sched = build_optimizer(model, recipe, lr, steps)
        stamps: list[float] = []
        loader = make_loader()
        it = iter(loader)
        for step in range(steps):
            stamps.append(time.perf_counter())
            try:
                x, y = next(it)
            except StopIteration:
                it = iter(loader)
                x, y = next(it)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if sched is not None:
                sched.step_update(num_updates=step + 1)
        stamps.append(time.perf_counter())
        return _step_times(stamps, warmup)

    def lightning() -> float:
        torch.manual_seed(0)
        module = ClassifyModule(make_model(), num_classes, {**recipe, "lr_base_batch": None})
        stamp = _Stamp()
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=steps,
            max_epochs=-1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[stamp],
            limit_val_batches=0,
            num_sanity_val_steps=0,
        )
        trainer.fit(module, train_dataloaders=make_loader())
        stamp.stamps.append(time.perf_counter())
        return _step_times(stamp.stamps, warmup)

    plain_s, light_s = [], []
    for _ in range(repeats):
        plain_s.append(plain())
        light_s.append(lightning())
    p, lt = min(plain_s), min(light_s)
    return {"plain_step_s": p, "lightning_step_s": lt, "lightning_overhead": lt / p - 1.0, "steps": steps}
