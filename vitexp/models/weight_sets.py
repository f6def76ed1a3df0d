"""Which weights of a training checkpoint ``backbone.pretrained`` loads: the set the architecture's
reference evaluation loads, unless ``backbone.use_ema`` says which.

Its reasoning: docs/reading-backbones.md, "vitexp/models/weight_sets.py".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch.nn as nn
from timm.models.shvit import SHViT

from vitexp.models.lvvit import LVViT
from vitexp.models.t2t import T2TViT

#: The keys of each set, in the order they are looked up: ``False`` the last step's, ``True`` the EMA.
WEIGHTS_KEYS = {False: ("state_dict", "model"), True: ("state_dict_ema", "model_ema")}
#: What a plain state dict (none of the keys above) is recorded as.
PLAIN = "plain"


@dataclass(frozen=True)
class Evaluation:
    """A reference evaluation's choice: the keys it loads, in order, and where it says so."""

    name: str
    keys: tuple[str, ...]
    source: str


ONE_SET = Evaluation(
    "every other architecture's evaluation",
    WEIGHTS_KEYS[False],
    "facebookresearch/deit@7e160fe main.py:402 (--eval --resume: load_state_dict(checkpoint['model'])); "
    "CaFormer and DINOv2 releases and timm hub files hold one set",
)

#: Each architecture's reference evaluation (module docstring), by model class.
REFERENCE_EVALUATIONS: dict[type, Evaluation] = {
    T2TViT: Evaluation(
        "T2T-ViT's main.py --eval_checkpoint",
        ("state_dict_ema", "state_dict"),
        "yitu-opensource/T2T-ViT@0f63dc9 main.py:197 (--model-ema default=True), "
        "main.py:531 (load_checkpoint(model, args.eval_checkpoint, args.model_ema))",
    ),
    LVViT: Evaluation(
        "TokenLabeling's validate.py",
        ("state_dict", "model"),
        "zihangJiang/TokenLabeling@9dbfd59 validate.py:98 (--use-ema store_true, default False), "
        "validate.py:150 (load_checkpoint(model, args.checkpoint, args.use_ema))",
    ),
    SHViT: Evaluation(
        "SHViT's main.py --eval",
        ("model", "state_dict"),
        "ysj9909/SHViT@6a729cc README.md:100 (main.py --eval --resume), main.py:369 "
        "(load_state_dict(checkpoint['model']))",
    ),
}


def evaluation_of(model: nn.Module) -> Evaluation:
    """The reference evaluation whose choice ``model``'s checkpoints follow by default."""
    for cls, evaluation in REFERENCE_EVALUATIONS.items():
        if isinstance(model, cls):
            return evaluation
    return ONE_SET


def held_sets(checkpoint: Mapping[str, Any]) -> list[str]:
    """The weight-set keys ``checkpoint`` holds (each a mapping), in :data:`WEIGHTS_KEYS` order."""
    return [k for k in (*WEIGHTS_KEYS[False], *WEIGHTS_KEYS[True]) if isinstance(checkpoint.get(k), Mapping)]


def choose_set(checkpoint: Mapping[str, Any], evaluation: Evaluation, use_ema: bool | None, path: str) -> str:
    """The key of the set to load (:data:`PLAIN` for a plain state dict), by the module docstring's
    rule; a file without the set asked for is a :class:`~vitexp.errors.CheckpointError` naming the
    file, the sets it holds and the override that loads them."""
    from vitexp.errors import CheckpointError

    held = held_sets(checkpoint)
    if use_ema is None:
        wanted, asked = (
            evaluation.keys,
            f"{evaluation.name} loads {' or '.join(evaluation.keys)} ({evaluation.source})",
        )
    else:
        wanted, asked = (
            WEIGHTS_KEYS[use_ema],
            f"backbone.use_ema={str(use_ema).lower()} loads {' or '.join(WEIGHTS_KEYS[use_ema])}",
        )
    for key in wanted:
        if key in held:
            return key
    if not held and not use_ema:
        return PLAIN
    if use_ema:
        raise CheckpointError(
            f"backbone.use_ema=true: {path} holds no EMA weights (no {' or '.join(WEIGHTS_KEYS[True])}"
            + (f"; it holds {held}" if held else ": it is a plain state dict")
            + ")"
        )
    other = "true" if all(k in WEIGHTS_KEYS[True] for k in held) else "false"
    what = "only EMA weights" if other == "true" else "other weights"
    raise CheckpointError(
        f"backbone.pretrained: {path} holds {what} ({held}); {asked}; ++backbone.use_ema={other} loads these"
    )
