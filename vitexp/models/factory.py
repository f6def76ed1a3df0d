"""Build a backbone from its config group (``conf/backbone/*.yaml``).

Its reasoning: docs/reading-backbones.md, "vitexp/models/factory.py".
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import timm
import torch.nn as nn

from vitexp.errors import CheckpointError, one_line
from vitexp.models import dinov2, shvit
from vitexp.models.caformer import official_head_eps
from vitexp.models.weight_sets import ONE_SET, PLAIN, Evaluation, choose_set, evaluation_of


@dataclass(frozen=True)
class LoadedWeights:
    """What :func:`build_backbone` loaded: the file, the set in it (a key of the checkpoint, or
    ``plain`` for a plain state dict) and why that set (the reference evaluation's source, or the
    ``backbone.use_ema`` override)."""

    path: str
    weights: str
    chosen_by: str


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


#: The Python objects a weights file may hold beside its tensors: the training script's ``args``
#: (timm's CheckpointSaver, SHViT's main.py). Nothing else is unpickled.
SAFE_GLOBALS = [argparse.Namespace]


def read_checkpoint(
    path: str, use_ema: bool | None = None, evaluation: Evaluation = ONE_SET
) -> tuple[str, dict[str, Any]]:
    """The set of ``path`` that ``use_ema`` (absent: ``evaluation``'s choice) selects
    (:func:`.weight_sets.choose_set`) and its state dict, ``module.`` stripped."""
    import torch
    from timm.models import clean_state_dict

    if str(path).endswith(".safetensors"):  # timm's hub files (vitexp.config.weights)
        from safetensors.torch import load_file

        checkpoint = load_file(str(path), device="cpu")
    else:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(checkpoint, Mapping):
        raise CheckpointError(
            f"backbone.pretrained: {path} holds a {type(checkpoint).__name__}, not a state dict"
        )
    key = choose_set(checkpoint, evaluation, use_ema, str(path))
    return key, clean_state_dict(dict(checkpoint) if key == PLAIN else checkpoint[key])


@contextlib.contextmanager
def _capture_filter() -> Iterator[list]:
    """Record the ``filter_fn`` a model's create function passes to timm's ``load_pretrained``
    (called by ``build_model_with_cfg`` when ``pretrained=True``), loading nothing."""
    from timm.models import _builder

    seen: list = []
    original = _builder.load_pretrained

    def capture(model, pretrained_cfg=None, num_classes=1000, in_chans=3, filter_fn=None, *args, **kwargs):
        seen.append(filter_fn)

    _builder.load_pretrained = capture
    try:
        yield seen
    finally:
        _builder.load_pretrained = original


def _create(
    name: str, num_classes: int, overlay: dict[str, Any] | None, kwargs: dict[str, Any], weights: bool
) -> tuple[nn.Module, Callable | None]:
    """``timm.create_model(name)`` and, when ``weights`` are to be loaded, the checkpoint filter
    timm's loading would apply to them (module docstring). The model is then created with
    ``pretrained=True``, so that its create function hands its filter to ``load_pretrained``, which
    :func:`_capture_filter` replaces for the call: nothing is downloaded or read, and the model and
    its random initialisation are those of ``pretrained=False``."""
    if not weights:
        return (
            timm.create_model(
                name, pretrained=False, num_classes=num_classes, pretrained_cfg_overlay=overlay, **kwargs
            ),
            None,
        )
    with _capture_filter() as seen:
        model = timm.create_model(
            name, pretrained=True, num_classes=num_classes, pretrained_cfg_overlay=overlay, **kwargs
        )
    if seen:
        return model, seen[-1]
    return model, getattr(sys.modules.get(type(model).__module__), "checkpoint_filter_fn", None)


def _filtered(model: nn.Module, state: Mapping[str, Any], path: str, fn: Callable | None) -> dict[str, Any]:
    """``state`` through the model's checkpoint filter ``fn`` (:func:`_create`); unchanged without
    one. A filter that cannot read the file (it looks up keys the model does not have, or reshapes
    another model's tensors) is a mismatch naming the file and the keys."""
    if fn is None:
        return dict(state)
    try:
        return fn(dict(state), model)
    except Exception as err:  # noqa: BLE001 - whatever the filter meets in another model's file
        own = set(model.state_dict())
        raise CheckpointMismatchError(
            path,
            sorted(own - set(state)),
            sorted(set(state) - own),
            f"the model's checkpoint filter failed: {err!r}",
        ) from err


def _classifier_keys(model: nn.Module) -> frozenset[str]:
    names = model.pretrained_cfg.get("classifier") or ()
    names = (names,) if isinstance(names, str) else tuple(names)
    return frozenset(f"{n}.{p}" for n in names for p in ("weight", "bias"))


def load_checkpoint(
    model: nn.Module,
    path: str,
    num_classes: int,
    use_ema: bool | None = None,
    filter_fn: Callable | None = None,
) -> LoadedWeights:
    """Load ``path`` into ``model`` by the rules of the module docstring; ``filter_fn`` is the
    model's checkpoint filter (:func:`_create`). Returns what was loaded."""
    evaluation = evaluation_of(model)
    key, raw = read_checkpoint(path, use_ema, evaluation)
    state = shvit.original_to_timm(raw, model) if shvit.is_original_checkpoint(raw, model) else raw
    state = _filtered(model, state, path, filter_fn)
    own = model.state_dict()
    exempt = (
        _classifier_keys(model) if num_classes != model.pretrained_cfg.get("num_classes") else frozenset()
    )
    state = {
        k: v for k, v in state.items() if not (k in exempt and (k not in own or v.shape != own[k].shape))
    }
    missing = sorted(set(own) - set(state) - exempt)
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        raise CheckpointMismatchError(path, missing, unexpected)
    sizes = [
        f"{k}: file {tuple(v.shape)}, model {tuple(own[k].shape)}"
        for k, v in state.items()
        if hasattr(v, "shape") and v.shape != own[k].shape
    ]
    if sizes:
        raise CheckpointMismatchError(path, [], [], f"size mismatch for {'; '.join(sizes[:5])}")
    model.load_state_dict(state, strict=False)
    if dinov2.is_hub_checkpoint(raw) and getattr(model, "pos_embed", None) is not None:
        dinov2.load_hub_pos_embed(model, raw)
    chosen_by = (
        "a plain state dict: one set"
        if key == PLAIN
        else evaluation.source
        if use_ema is None
        else f"backbone.use_ema={str(use_ema).lower()}"
    )
    return LoadedWeights(path, key, chosen_by)


def build_backbone(cfg: Mapping[str, Any], num_classes: int) -> nn.Module:
    """``timm.create_model`` from a backbone config: ``timm_name``, ``img_size``, ``pretrained``,
    ``use_ema`` (absent: the reference evaluation's set), ``drop_path_rate`` and free ``kwargs`` passed to the
    model constructor.
    """
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
    file = Path(str(path)).expanduser() if path else None
    if file is not None and not file.is_file():
        raise FileNotFoundError(f"backbone.pretrained: checkpoint file not found: {file}")
    model, filter_fn = _create(
        cfg["timm_name"], num_classes, overlay or None, kwargs, weights=file is not None
    )
    if file is not None:
        use_ema = cfg.get("use_ema")
        model.pretrained_weights = load_checkpoint(
            model, str(file), num_classes, None if use_ema is None else bool(use_ema), filter_fn
        )
    official_head_eps(model)
    return model


def check_file(path: str | Path, key: str) -> Any:
    """The object ``torch.load(path, weights_only=True)`` reads (an ``argparse.Namespace`` allowed:
    module docstring), or :class:`CheckpointError` naming ``key`` and the file: missing, a folder,
    empty, truncated, not a torch file, or holding Python objects beyond tensors and containers."""
    import pickle

    import torch

    file = Path(str(path)).expanduser()
    if not file.exists():
        raise CheckpointError(f"{key}: checkpoint file not found: {file}")
    if not file.is_file():
        raise CheckpointError(f"{key}: {file} is a folder, not a checkpoint file")
    if file.stat().st_size == 0:
        raise CheckpointError(f"{key}: {file} is empty (0 bytes)")
    if (
        file.suffix == ".safetensors"
    ):  # timm's hub files (vitexp.config.weights): tensors only by construction
        from safetensors.torch import load_file

        try:
            return load_file(str(file), device="cpu")
        except Exception as err:  # noqa: BLE001 - truncated or not a safetensors file
            raise CheckpointError(
                f"{key}: {file} is not a safetensors file ({type(err).__name__}: {one_line(err)[:200]})"
            ) from None
    try:
        with warnings.catch_warnings(), torch.serialization.safe_globals(SAFE_GLOBALS):
            warnings.simplefilter(
                "ignore"
            )  # the unpickler's protocol warning on a file that is no checkpoint
            state = torch.load(str(file), map_location="cpu", weights_only=True, mmap=False)
    except EOFError:
        raise CheckpointError(f"{key}: {file} is truncated (it ends before the checkpoint does)") from None
    except pickle.UnpicklingError as err:
        found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(err))
        if found:
            raise CheckpointError(
                f"{key}: {file} holds a pickled Python object ({found.group(1)}) that vitexp does not load; "
                "save the weights alone: torch.save(model.state_dict(), path)"
            ) from None
        reason = re.search(r"WeightsUnpickler error:\s*(.+)", str(err))
        why = reason.group(1).strip().splitlines()[0] if reason else type(err).__name__
        raise CheckpointError(f"{key}: {file} is not a PyTorch checkpoint ({why})") from None
    except Exception as err:  # noqa: BLE001 - a zip or pickle that is no checkpoint
        raise CheckpointError(
            f"{key}: {file} is not a PyTorch checkpoint ({type(err).__name__}: {one_line(err)[:200]})"
        ) from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{key}: {file} holds a {type(state).__name__}, not a state dict")
    return state
