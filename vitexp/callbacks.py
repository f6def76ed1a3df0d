"""Lightning callbacks of vitexp's training loop."""
from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback


class BestValidation(Callback):
    """The largest value of ``key`` (a synced metric in ``trainer.callback_metrics``) over every
    validation run the trainer makes: a ``trainer.validate`` before the fit, then each epoch's.
    Sanity checks do not count. The value travels with checkpoints, so a resumed stage reports
    the same best."""

    def __init__(self, key: str = "val/top1"):
        self.key = key
        self.best: float | None = None

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or self.key not in trainer.callback_metrics:
            return
        value = float(trainer.callback_metrics[self.key])
        self.best = value if self.best is None else max(self.best, value)

    def state_dict(self) -> dict[str, Any]:
        return {"key": self.key, "best": self.best}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.best = state_dict["best"]


class Heartbeat(Callback):
    """Beats the run's ledger entry (:meth:`vitexp.results.LedgerEntry.beat`) after every training
    epoch and validation, on rank zero: a running entry from a cluster node stays "running" while
    it beats and reads as interrupted once it stops."""

    def __init__(self, entry: Any):
        self.entry = entry

    def _beat(self, trainer: L.Trainer) -> None:
        if self.entry is not None and trainer.is_global_zero and not trainer.sanity_checking:
            self.entry.beat()

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._beat(trainer)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._beat(trainer)
