"""Lightning callbacks of vitexp's training loop."""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback


class BestValidation(Callback):
    """The largest value of ``key`` (a synced metric in ``trainer.callback_metrics``) over every
    validation run the trainer makes (a ``trainer.validate`` before the fit, when there is one,
    then each epoch's), and ``best_epoch``, the training epochs done when it was reached (0: before
    training; the first value wins a tie). Sanity checks do not count. Both travel with
    checkpoints, so a resumed stage reports the same best."""

    def __init__(self, key: str = "val/top1"):
        self.key = key
        self.best: float | None = None
        self.best_epoch: int | None = None

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from lightning.pytorch.trainer.states import TrainerFn

        if trainer.sanity_checking or self.key not in trainer.callback_metrics:
            return
        value = float(trainer.callback_metrics[self.key])
        if self.best is None or value > self.best:
            self.best = value
            self.best_epoch = 0 if trainer.state.fn == TrainerFn.VALIDATING else trainer.current_epoch + 1

    def state_dict(self) -> dict[str, Any]:
        return {"key": self.key, "best": self.best, "best_epoch": self.best_epoch}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.best, self.best_epoch = state_dict["best"], state_dict.get("best_epoch")


class LastValidation(Callback):
    """The ``val/*`` metrics of the trainer's last validation (sanity checks aside), which travel
    with checkpoints: a stage restored from a checkpoint written after its last epoch runs no
    validation, and reports those of the epoch that wrote it, as the uninterrupted stage does."""

    def __init__(self):
        self.metrics: dict[str, float] = {}

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}

    def state_dict(self) -> dict[str, Any]:
        return {"metrics": dict(self.metrics)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.metrics = dict(state_dict.get("metrics") or {})


class Heartbeat(Callback):
    """Beats the run's ledger entry (:meth:`vitexp.ledger.LedgerEntry.beat`) after every training
    epoch and validation, on rank zero: a running entry from a cluster node stays "running" while
    it beats and reads as interrupted once it stops. Each beat also records how long this attempt
    has fitted ``stage`` (:meth:`vitexp.ledger.LedgerEntry.fitting`), so an attempt that is killed
    leaves its fit time for the resumed run's sum."""

    def __init__(self, entry: Any, stage: str = "main"):
        self.entry, self.stage = entry, stage
        self.started: float | None = None

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        import time

        self.started = time.perf_counter()

    def _clock(self) -> None:
        import time

        if self.entry is not None and self.started is not None:
            self.entry.fitting(self.stage, time.perf_counter() - self.started)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero:
            self._clock()

    def _beat(self, trainer: L.Trainer) -> None:
        if self.entry is not None and trainer.is_global_zero and not trainer.sanity_checking:
            self._clock()
            self.entry.beat()

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._beat(trainer)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._beat(trainer)


class ResumedFrom(Callback):
    """Records where this attempt's fit of ``stage`` started, on rank zero: the ``checkpoint`` it
    restored (``None``: a fresh fit, nothing recorded) and the epochs done and global step the trainer
    stands at once it is restored (:meth:`vitexp.ledger.LedgerEntry.resumed`). What a same-seed run
    trained again from scratch cannot fake: its metrics would be the resumed run's, its record not.
    Read at the start of training (after the restore); a fit restored past its last epoch trains
    nothing and is read at its end."""

    def __init__(self, entry: Any, stage: str, checkpoint: str | None):
        self.entry, self.stage, self.checkpoint = entry, stage, checkpoint
        self.recorded = False

    def _record(self, trainer: L.Trainer) -> None:
        if self.recorded or self.checkpoint is None or self.entry is None or not trainer.is_global_zero:
            return
        self.recorded = True
        self.entry.resumed(self.stage, self.checkpoint, trainer.current_epoch, trainer.global_step)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._record(trainer)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._record(trainer)


class DataOrderMark(Callback):
    """Records the training sampler's order (:data:`vitexp.data.datamodules.DATA_ORDER`) in every checkpoint
    and,
    on resume, notes a checkpoint whose epochs another order drew. A checkpoint without the mark was
    written by the sampler that drew epoch e of seed s from ``s + e`` (:data:`PRE_MARK_ORDER`). A run
    resumed from one is recorded without ``data_order`` (``data_order_resumed_from`` instead), so
    :func:`vitexp.report.aggregate.overlapping_order` treats it as the old runs it resembles."""

    KEY = "vitexp_data_order"
    PRE_MARK_ORDER = "seed+epoch"

    def __init__(self, order: str):
        self.order = order
        self.resumed_from: str | None = None

    def on_save_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        checkpoint[self.KEY] = (
            self.resumed_from or self.order
        )  # a run once resumed from another order keeps saying so

    def on_load_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        drawn = checkpoint.get(self.KEY, self.PRE_MARK_ORDER)
        if drawn != self.order and checkpoint.get("global_step", 0) > 0:
            self.resumed_from = drawn

    def protocol(self) -> dict[str, str]:
        """The run's ledger protocol entry: ``data_order``, or ``data_order_resumed_from``."""
        return (
            {"data_order": self.order}
            if self.resumed_from is None
            else {"data_order_resumed_from": self.resumed_from}
        )
