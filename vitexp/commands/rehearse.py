"""The rehearsal of one row, as a Hydra app (``python -m vitexp.commands.rehearse_main <overrides>``, what
``vitexp-sweep TABLE --rehearse`` launches with :func:`vitexp.cost.rehearsal.plan.rehearsal_overrides`):
``vitexp.commands.train.train`` itself, every stage, deploy, test, FLOPs, with a :class:`StepMeter`, recorded
as a ledger entry of kind ``rehearsal``.

Decision: the app refuses a config that is not a rehearsal's (no ``trainer.max_steps``, or data
that is not synthetic), so it can never train a real row for its full recipe under the kind
``rehearsal``, nor a rehearsal be mistaken for a training run (the kind ``train`` is vitexp-train's).
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from vitexp.cost.rehearsal.meter import StepMeter
from vitexp.cost.rehearsal.plan import KIND
from vitexp.errors import ConfigError
from vitexp.training.objectives import objective_for


def device_name(cfg: DictConfig) -> str:
    """``cpu``, or ``cuda:<device name>`` when the trainer runs on a GPU."""
    import torch

    if str(cfg.trainer.get("accelerator")) in ("gpu", "cuda", "auto") and torch.cuda.is_available():
        return f"cuda:{torch.cuda.get_device_name(0)}"
    return "cpu"


def rehearse(cfg: DictConfig) -> dict[str, Any]:
    """Train, deploy, test and count the row ``cfg`` for its few steps; the entry adds the meter's
    step time, images per second and peak memory (:meth:`StepMeter.measured`)."""
    import torch

    from vitexp.commands.train import train

    if not cfg.trainer.get("max_steps") or int(cfg.trainer.max_steps) < 1:
        raise ConfigError(
            "a rehearsal runs a few optimiser steps: trainer.max_steps is not set "
            "(launch it with vitexp-sweep TABLE --rehearse)"
        )
    synthetic = objective_for(cfg).synthetic_data
    if str(cfg.data.name) != synthetic:
        raise ConfigError(
            f"a rehearsal trains on synthetic images: data={cfg.data.name} is not {synthetic} "
            "(launch it with vitexp-sweep TABLE --rehearse)"
        )
    meter = StepMeter()
    device = device_name(cfg)

    def measured() -> tuple[dict[str, Any], dict[str, Any]]:
        metrics, protocol = meter.measured(device)
        protocol.update(
            rehearsal={
                "steps": int(cfg.trainer.max_steps),
                "batch_size": int(cfg.recipe.batch_size),
                "precision": str(cfg.trainer.precision),
                "devices": cfg.trainer.get("devices"),
                "strategy": str(cfg.trainer.get("strategy")),
                "data": str(cfg.data.name),
                "torch_threads": torch.get_num_threads(),
            }
        )
        return metrics, protocol

    return train(cfg, [meter], kind=KIND, measured=measured)
