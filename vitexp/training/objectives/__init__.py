"""Objectives as plug-ins: what a run trains, how it is tested and counted (the config's ``objective``).

Objectives as plug-ins: what a run trains, how it is tested and how it is counted, chosen by the
config's ``objective`` key. :mod:`vitexp.training.fit`, :mod:`vitexp.commands.evaluate`,
:mod:`vitexp.commands.inspect` (``vitexp-flops``, ``vitexp-bench``),
:func:`vitexp.training.resolve.validate` and the rehearsal plan call the run's
:class:`~vitexp.training.objectives.base.Objective` and never ask which one it is.

Its reasoning: docs/commands.md, "vitexp/training/objectives/__init__.py".
"""

from __future__ import annotations

import importlib
from typing import Any, Mapping

from vitexp.errors import ConfigError
from vitexp.training.objectives.base import Count, Objective

#: ``objective`` choice -> "module:class" of its plug-in.
OBJECTIVES: dict[str, str] = {
    "auto": "vitexp.training.objectives.classification:Classification",
    "detect": "vitexp.training.objectives.detection:Detection",
}
OBJECTIVE_CHOICES = tuple(OBJECTIVES)

_loaded: dict[str, Objective] = {}


def _load(name: str) -> Objective:
    if name not in _loaded:
        module, _, cls = OBJECTIVES[name].partition(":")
        _loaded[name] = getattr(importlib.import_module(module), cls)()
    return _loaded[name]


def objective_for(cfg: Mapping[str, Any]) -> Objective:
    """The plug-in of ``cfg``'s ``objective`` (a composed config or its resolved dict; ``auto``
    when absent); an unknown choice is a :class:`~vitexp.errors.ConfigError` naming the valid ones."""
    name = str(cfg.get("objective", "auto") or "auto")
    if name not in OBJECTIVES:
        raise ConfigError(f"objective={name!r}: valid choices are {list(OBJECTIVE_CHOICES)}")
    return _load(name)


__all__ = ["OBJECTIVES", "OBJECTIVE_CHOICES", "Count", "Objective", "objective_for"]
