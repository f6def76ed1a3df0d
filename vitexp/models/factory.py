"""Build a backbone from its config group (``conf/backbone/*.yaml``).

Decisions:
- Weights come only from a local file: ``pretrained`` is a path or null. A missing file is a
  ``FileNotFoundError`` naming the path; a file whose keys do not fit the model is a
  ``CheckpointMismatchError`` naming the missing and unexpected keys.
- timm does the loading (``pretrained_cfg_overlay=dict(file=path)``), so its checkpoint
  filters apply: position embeddings are resized, the classifier is dropped when the class
  count differs, and ``state_dict`` / ``model`` / ``state_dict_ema`` wrappers are unwrapped.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import timm
import torch.nn as nn


class CheckpointMismatchError(RuntimeError):
    """A checkpoint's keys do not fit the model it is loaded into."""

    def __init__(self, path: str, missing: list[str], unexpected: list[str], detail: str = ""):
        self.path, self.missing, self.unexpected = path, missing, unexpected
        msg = (
            f"checkpoint {path} does not fit the model: "
            f"{len(missing)} missing keys {missing[:20]}, {len(unexpected)} unexpected keys {unexpected[:20]}"
        )
        if detail and not (missing or unexpected):
            msg += f" ({detail.splitlines()[0][:300]})"
        super().__init__(msg)


def _checkpoint_key_diff(model: nn.Module, path: str) -> tuple[list[str], list[str]]:
    from timm.models import load_state_dict

    state = load_state_dict(path)
    own = set(model.state_dict())
    theirs = set(state)
    return sorted(own - theirs), sorted(theirs - own)


def build_backbone(cfg: Mapping[str, Any], num_classes: int) -> nn.Module:
    """``timm.create_model`` from a backbone config: ``timm_name``, ``img_size``, ``pretrained``,
    ``drop_path_rate`` and free ``kwargs`` passed to the model constructor."""
    kwargs = dict(cfg.get("kwargs") or {})
    img = int(cfg["img_size"])
    overlay: dict[str, Any] = {}
    if "img_size_kwarg" in cfg and not cfg["img_size_kwarg"]:
        # models without an img_size argument (timm's MetaFormer) carry the resolution in their pretrained_cfg
        overlay["input_size"] = (3, img, img)
    else:
        kwargs.setdefault("img_size", img)
    if cfg.get("drop_path_rate") is not None:
        kwargs["drop_path_rate"] = float(cfg["drop_path_rate"])
    path = cfg.get("pretrained")
    if not path:
        return timm.create_model(cfg["timm_name"], pretrained=False, num_classes=num_classes,
                                 pretrained_cfg_overlay=overlay or None, **kwargs)

    file = Path(str(path)).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"backbone.pretrained: checkpoint file not found: {file}")
    try:
        return timm.create_model(
            cfg["timm_name"],
            pretrained=True,
            pretrained_cfg_overlay=dict(file=str(file), hf_hub_id=None, url=None, **overlay),
            num_classes=num_classes,
            **kwargs,
        )
    except RuntimeError as err:  # strict load_state_dict failure: name the keys
        if "state_dict" not in str(err) and "size mismatch" not in str(err):
            raise
        bare = timm.create_model(cfg["timm_name"], pretrained=False, num_classes=num_classes,
                                 pretrained_cfg_overlay=overlay or None, **kwargs)
        missing, unexpected = _checkpoint_key_diff(bare, str(file))
        raise CheckpointMismatchError(str(file), missing, unexpected, str(err)) from err
