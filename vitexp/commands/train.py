"""``vitexp-train``'s body: the config resolved once (:func:`vitexp.training.resolve.resolve`: checked,
its weights and earlier runs found), then one run fitted from those parts
(:func:`vitexp.training.fit.fit_run`)."""

from __future__ import annotations

from typing import Any, Callable, Iterable

from lightning.pytorch.callbacks import Callback
from omegaconf import DictConfig

from vitexp.training.fit import fit_run
from vitexp.training.resolve import resolve


def train(
    cfg: DictConfig,
    callbacks: Iterable[Callback] = (),
    kind: str = "train",
    measured: Callable[[], tuple[dict[str, Any], dict[str, Any]]] | None = None,
) -> dict[str, Any]:
    """Resolve ``cfg`` (a :class:`~vitexp.errors.ConfigError` naming the key, or a missing earlier run,
    before anything is written), then train, test and record the run (:func:`vitexp.training.fit.fit_run`)."""
    return fit_run(resolve(cfg, runs=True), callbacks, kind, measured)
