"""Methods turn a backbone into the model to train (:class:`vitexp.methods.base.Method`).

A method is built from its config group with ``hydra.utils.instantiate`` and implements
:class:`~vitexp.methods.base.Method`: which objective trains it, which budgets it accepts,
``apply`` (graph surgery on a live timm model) and ``deploy`` (the model as it runs after
training, e.g. with pruned heads physically removed), which FLOPs and throughput measure.
"""

from __future__ import annotations

from typing import Any, Mapping

from vitexp.methods.base import Method, Stage


def method_from_config(cfg: Mapping[str, Any]) -> Method:
    from hydra.utils import instantiate

    method = instantiate(cfg, _convert_="all")
    if not isinstance(method, Method):
        raise TypeError(f"method._target_ {cfg.get('_target_')} does not build a vitexp Method")
    return method


__all__ = ["Method", "Stage", "method_from_config"]
