"""Seeded, perturbed weights and inputs for the reference-equivalence fixtures
(``tests/fixtures/reference/*.json``, written by ``tests/fixtures/reference/generate.py``).

A fixture stores no weights: it lists the reference model's state-dict keys, shapes and dtypes
and a seed, and :func:`seeded_state_dict` rebuilds the same tensors on both sides (the generator,
which runs the reference code, and the test, which loads them through vitexp). The values are
perturbed away from every default, so that a changed epsilon, scale or key shows in the outputs:

- norm weights (1-D ``weight``, not a bias) 1 + 0.2·n; LayerScale ``gamma`` 0.5 + 0.1·n;
  biases and BatchNorm ``running_mean`` 0.1·n; ``running_var`` 0.5 + u; ``num_batches_tracked`` 0;
- token tables (``cls_token``, ``pos_embed``, ``reg_token``, ``register_tokens``, ``mask_token``,
  any (1, N, D) tensor) 0.5·n;
- other matrices and kernels n · 0.7 / √fan_in (fan_in = the product of all but the first dim),

with n ~ N(0, 1), u ~ U(0, 1) drawn in float64 from one ``torch.Generator`` in the listed key order.
Every value is then rounded to a multiple of 2⁻¹⁴, so a float32 file holds it exactly and the sum
of two of them (DINOv2-reg's ``cls_token + pos_embed[:, 0]``, folded by timm at load) is exact too.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

FIXTURES = Path(__file__).parent / "fixtures" / "reference"
GRID = 2.0**-14
TOKEN_TABLES = ("cls_token", "pos_embed", "reg_token", "register_tokens", "mask_token", "dist_token")


def _quantize(t: torch.Tensor) -> torch.Tensor:
    return torch.round(t / GRID) * GRID


def seeded_tensor(key: str, shape: Sequence[int], gen: torch.Generator) -> torch.Tensor:
    """One float64 tensor by the rules of the module docstring."""
    shape = tuple(int(s) for s in shape)
    name = key.rsplit(".", 1)[-1]
    n = torch.randn(shape, generator=gen, dtype=torch.float64)
    if name == "running_var":
        v = 0.5 + torch.rand(shape, generator=gen, dtype=torch.float64)
    elif name == "running_mean" or name.endswith("bias"):
        v = 0.1 * n
    elif name == "gamma":
        v = 0.5 + 0.1 * n
    elif name in TOKEN_TABLES or (len(shape) == 3 and shape[0] == 1):
        v = 0.5 * n
    elif len(shape) == 1:
        v = 1.0 + 0.2 * n
    else:
        v = n * 0.7 / math.sqrt(math.prod(shape[1:]))
    return _quantize(v)


def seeded_state_dict(spec: Iterable[Sequence[Any]], seed: int) -> dict[str, torch.Tensor]:
    """``spec``: ``[key, shape, dtype]`` rows in order -> a state dict of float32 (or int64) tensors."""
    gen = torch.Generator().manual_seed(int(seed))
    out = {}
    for key, shape, dtype in spec:
        if dtype == "int64":
            out[key] = torch.zeros(tuple(shape), dtype=torch.int64)
        else:
            out[key] = seeded_tensor(key, shape, gen).to(getattr(torch, dtype))
    return out


def state_spec(state: dict[str, torch.Tensor]) -> list[list[Any]]:
    """A state dict's ``[key, shape, dtype]`` rows, in its order (what a fixture stores)."""
    return [[k, list(v.shape), str(v.dtype).removeprefix("torch.")] for k, v in state.items()]


def seeded_input(shape: Sequence[int], seed: int) -> torch.Tensor:
    """A float64 input, N(0, 1) rounded to the grid (the same in float32)."""
    gen = torch.Generator().manual_seed(int(seed))
    return _quantize(torch.randn(tuple(int(s) for s in shape), generator=gen, dtype=torch.float64))


def load_fixture(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def max_rel(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max |ours − ref| / max |ref| (a relative error that a near-zero entry cannot inflate)."""
    return float((ours.double() - ref).abs().max() / ref.abs().max())
