"""RAPTOR surrogates saved by the reference code (KempnerInstitute/raptor) loaded into vitexp's
:class:`~vitexp.methods.raptor.surrogate.RaptorBlock` (``method.surrogate``).

Its reasoning: docs/reading-raptor.md, "vitexp/methods/raptor/reference.py".
"""

from __future__ import annotations

import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
import torch.nn as nn

#: reference key -> RaptorBlock key (the names that differ)
KEY_MAP = {
    "attn.in_proj_weight": "attn.qkv.weight",
    "attn.in_proj_bias": "attn.qkv.bias",
    "attn.out_proj.weight": "attn.proj.weight",
    "attn.out_proj.bias": "attn.proj.bias",
    "mlp.0.weight": "mlp.fc1.weight",
    "mlp.0.bias": "mlp.fc1.bias",
    "mlp.2.weight": "mlp.fc2.weight",
    "mlp.2.bias": "mlp.fc2.bias",
    "t_proj.0.weight": "gate.0.weight",
    "t_proj.0.bias": "gate.0.bias",
    "t_proj.2.weight": "gate.2.weight",
    "t_proj.2.bias": "gate.2.bias",
}
#: reference keys loaded under their own name
SAME_KEYS = ("norm1.weight", "norm1.bias", "ls1.gamma", "norm2.weight", "norm2.bias", "ls2.gamma")
BLOCK_KEYS = tuple(KEY_MAP) + SAME_KEYS


class _Pickled(nn.Module):
    """Stand-in for a reference class: unpickling restores its attributes (submodules,
    parameters, ``thresholds``), which is all the loader reads."""


#: The reference's classes as ``trainer.py`` pickles them (its modules are ``block`` and ``raptor``
#: when run from ``raptor/``; ``raptor.block`` / ``raptor.raptor`` when imported as a package).
_REFERENCE_CLASSES = [
    f"{m}.{c}" for m in ("block", "raptor.block") for c in ("Block", "LayerScale", "SwiGLU")
] + ["raptor.Raptor", "raptor.raptor.Raptor"]
_TORCH_CLASSES = [
    nn.LayerNorm,
    nn.MultiheadAttention,
    nn.modules.linear.NonDynamicallyQuantizableLinear,
    nn.Linear,
    nn.Sequential,
    nn.ModuleList,
    nn.SiLU,
    nn.GELU,
    nn.Identity,
    nn.Dropout,
    set,
]


@dataclass
class ReferenceSurrogate:
    """Blocks read from reference files: each a ``RaptorBlock`` state dict, their MLP kind, their
    attention heads (read from a pickled module; None from a state dict, which does not hold
    them), the stage-2 thresholds (None for stage-1 block files and state dicts), the files given
    and the file each block came from."""

    blocks: list[dict[str, torch.Tensor]]
    mlp: str
    heads: int | None
    thresholds: list[int] | None
    paths: list[str]
    sources: list[str]

    @property
    def dim(self) -> int:
        return int(self.blocks[0]["norm1.weight"].shape[0])


def _torch_load(path: Path) -> Any:
    allowed = [(_Pickled, name) for name in _REFERENCE_CLASSES] + _TORCH_CLASSES
    with torch.serialization.safe_globals(allowed):
        return torch.load(path, map_location="cpu", weights_only=True)


#: What a reference file must hold, in the words of the errors.
EXPECTED = (
    "a stage-2 raptor.Raptor or a stage-1 block.Block saved by KempnerInstitute/raptor's trainer.py "
    "(torch.save of the module), or the state dict of one"
)


def _unreadable(path: Path, err: BaseException) -> ValueError:
    """One line for a file the weights-only unpickler refuses: the class it met, or why it is no
    torch file; never torch's advice to load with ``weights_only=False``."""
    text = str(err)
    found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text)
    if found:
        return ValueError(
            f"method.surrogate={path}: holds a pickled {found.group(1)}, not a RAPTOR reference "
            f"file; expected {EXPECTED}"
        )
    if isinstance(err, EOFError):
        why = "it ends before the checkpoint does"
    elif isinstance(err, pickle.UnpicklingError):
        reason = re.search(r"WeightsUnpickler error:\s*(.+)", text)
        why = reason.group(1).strip() if reason else type(err).__name__
    else:
        why = f"{type(err).__name__}: {text.strip().splitlines()[0][:200] if text.strip() else ''}"
    if "weights_only" in why:
        why = type(err).__name__
    return ValueError(
        f"method.surrogate={path}: not a PyTorch file vitexp can read ({why}); expected {EXPECTED}"
    )


def _expected(path: Path, found: Sequence[str]) -> ValueError:
    return ValueError(
        f"method.surrogate={path}: not a RAPTOR reference file. Expected a torch.save'd block.Block or "
        "raptor.Raptor (KempnerInstitute/raptor trainer.py), or the state dict of one: a block's keys are "
        f"{list(BLOCK_KEYS)} (a Raptor's the same under 'blocks.<i>.'); found {list(found)[:12]}"
    )


def block_state(reference: Mapping[str, torch.Tensor], path: Path) -> tuple[dict[str, torch.Tensor], str]:
    """One reference block's state dict -> (``RaptorBlock`` state dict, MLP kind)."""
    missing = [k for k in BLOCK_KEYS if k not in reference]
    extra = [k for k in reference if k not in BLOCK_KEYS]
    if missing or extra:
        raise ValueError(
            f"method.surrogate={path}: a reference block needs the keys {list(BLOCK_KEYS)}; "
            f"missing {missing}, unexpected {extra}"
            + (
                " (a block trained without --t_scale has no gates; vitexp's block needs them)"
                if any(k.startswith("t_proj") for k in missing)
                else ""
            )
        )
    state = {KEY_MAP.get(k, k): v for k, v in reference.items()}
    hidden = state["mlp.fc2.weight"].shape[1]
    mlp = "swiglu" if state["mlp.fc1.weight"].shape[0] == 2 * hidden else "gelu"
    return state, mlp


def read_reference(path: str | Path) -> ReferenceSurrogate:
    """One file's blocks."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"method.surrogate: no RAPTOR reference file at {path}")
    try:
        obj = _torch_load(path)
    except Exception as err:  # noqa: BLE001  (an unpickling error names the class it met)
        raise _unreadable(path, err) from None
    thresholds, heads = None, set()
    if isinstance(obj, nn.Module):
        thresholds = list(getattr(obj, "thresholds", None) or []) or None
        heads = {m.num_heads for m in obj.modules() if isinstance(m, nn.MultiheadAttention)}
        obj = obj.state_dict()
    if not isinstance(obj, Mapping):
        raise _expected(path, [type(obj).__name__])
    if any(k.startswith("blocks.") for k in obj):
        count = 1 + max(int(k.split(".")[1]) for k in obj if k.startswith("blocks."))
        parts = [
            {k[len(f"blocks.{i}.") :]: v for k, v in obj.items() if k.startswith(f"blocks.{i}.")}
            for i in range(count)
        ]
    else:
        parts = [dict(obj)]
    if not parts or not any(parts[0]):
        raise _expected(path, list(obj))
    blocks, kinds = zip(*(block_state(p, path) for p in parts))
    if len(set(kinds)) > 1 or len(heads) > 1:
        raise ValueError(
            f"method.surrogate={path}: blocks with different MLPs {kinds} or heads {sorted(heads)}"
        )
    if thresholds is not None and len(thresholds) != len(blocks) - 1:
        raise ValueError(
            f"method.surrogate={path}: {len(blocks)} blocks need {len(blocks) - 1} thresholds, "
            f"the file has {thresholds}"
        )
    return ReferenceSurrogate(
        list(blocks),
        kinds[0],
        heads.pop() if heads else None,
        thresholds,
        [str(path)],
        [str(path)] * len(blocks),
    )


def read_surrogate(paths: str | Path | Sequence[str | Path]) -> ReferenceSurrogate:
    """``method.surrogate``: one stage-2 ``Raptor`` file (its blocks and thresholds), or stage-1
    ``Block`` files, one per phase in order (``trainer.py --bp1 --bp2 ...``)."""
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    files = [read_reference(p) for p in paths]
    if len(files) == 1:
        return files[0]
    whole = [f.paths[0] for f in files if f.thresholds is not None]
    if whole:
        raise ValueError(
            f"method.surrogate: {whole} hold whole RAPTOR surrogates; give one alone, "
            "or one block file per phase"
        )
    kinds, heads = {f.mlp for f in files}, {f.heads for f in files} - {None}
    if len(kinds) > 1 or len(heads) > 1:
        raise ValueError(
            f"method.surrogate: the files {paths} hold blocks with different MLPs {sorted(kinds)} "
            f"or heads {sorted(heads)}"
        )
    return ReferenceSurrogate(
        [b for f in files for b in f.blocks],
        kinds.pop(),
        heads.pop() if heads else None,
        None,
        [str(p) for p in paths],
        [s for f in files for s in f.sources],
    )


def phases_from_thresholds(thresholds: Sequence[int], depth: int) -> list[list[int]]:
    """The reference's thresholds (1-based, block i runs t ≤ thresholds[i]) -> 0-based phases."""
    bounds = [0, *(int(t) for t in thresholds), depth]
    if any(a >= b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(
            f"RAPTOR thresholds {list(thresholds)} do not split a teacher of depth {depth} "
            "into non-empty phases"
        )
    return [list(range(a, b)) for a, b in zip(bounds, bounds[1:])]
