"""MAC/FLOP counting under an explicit protocol.

Its reasoning: docs/flops.md, "vitexp/measure/flops.py".
"""

from __future__ import annotations

import math
import warnings
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn

#: fvcore handles that would count non-MAC work; the convention leaves these out.
_UNCOUNTED_OPS = (
    "aten::layer_norm",
    "aten::batch_norm",
    "aten::group_norm",
    "aten::instance_norm",
    "aten::upsample_nearest2d",
    "aten::upsample_bilinear2d",
    "aten::adaptive_avg_pool2d",
    "aten::grid_sampler",
)

_EXTRA_HANDLES: dict[str, Callable] = {}
_MODEL_RECORDS: list[Callable[[nn.Module], dict[str, dict[str, Any]]]] = []


def _shape(value) -> list[int]:
    from fvcore.nn.jit_handles import get_shape

    return list(get_shape(value))


def sdpa_mac_handle(inputs: list, outputs: list) -> int:
    """MACs of ``scaled_dot_product_attention(q, k, v)``: Q·Kᵀ is B·H·N·M·d and A·V is
    B·H·N·M·d_v, for q of shape (..., N, d), k (..., M, d), v (..., M, d_v)."""
    q, k, v = (_shape(x) for x in inputs[:3])
    batch_heads = math.prod(q[:-2])
    n, d = q[-2], q[-1]
    m, dv = k[-2], v[-1]
    return batch_heads * n * m * (d + dv)


def _zero_handle(inputs: list, outputs: list) -> int:
    return 0


def register_op_handle(op_name: str, handle: Callable[[list, list], int]) -> None:
    """Count an extra traced op (``"aten::..."``) with ``handle(inputs, outputs) -> MACs``."""
    _EXTRA_HANDLES[op_name] = handle


register_op_handle("aten::scaled_dot_product_attention", sdpa_mac_handle)


def register_model_record(record: Callable[[nn.Module], dict[str, dict[str, Any]]]) -> None:
    """After each count, ``record(model)`` may return ``{"protocol": {...}, "metrics": {...}}``
    about the forward just counted (an empty dict when the model is not its method's)."""
    if record not in _MODEL_RECORDS:
        _MODEL_RECORDS.append(record)


def model_records(model: nn.Module) -> tuple[dict[str, Any], dict[str, Any]]:
    """(protocol, metrics) that the :func:`register_model_record` callbacks read from ``model``
    about its last forward (the one just counted)."""
    protocol: dict[str, Any] = {}
    metrics: dict[str, Any] = {}
    for record in _MODEL_RECORDS:
        found = record(model)
        protocol.update(found.get("protocol", {}))
        metrics.update(found.get("metrics", {}))
    return protocol, metrics


@dataclass
class FlopsReport:
    gmacs: float
    gflops: float
    params_m: float
    protocol: dict[str, Any] = field(default_factory=dict)
    by_module: dict[str, float] = field(default_factory=dict)
    recorded: dict[str, Any] = field(default_factory=dict)  # metrics from :func:`register_model_record`

    def metrics(self) -> dict[str, Any]:
        return {"gmacs": self.gmacs, "gflops": self.gflops, "params_m": self.params_m, **self.recorded}


def count_heads(model: nn.Module) -> int:
    """Attention heads present in a model (modules with a ``num_heads`` and a ``qkv`` or ``qk``
    projection: timm's ViT and MetaFormer attentions and their patched forms)."""
    return sum(
        int(m.num_heads)
        for m in model.modules()
        if hasattr(m, "num_heads") and (hasattr(m, "qkv") or getattr(m, "qk", None) is not None)
    )


def count_params(model: nn.Module) -> int:
    """Parameters, plus the buffers a module lists in ``frozen_weights``: the fixed tables a
    published model counts as parameters (T2T-ViT's position table and Performer matrices,
    ``nn.Parameter(requires_grad=False)`` in the official code, buffers in vitexp)."""
    frozen = sum(
        getattr(m, name).numel() for m in model.modules() for name in getattr(m, "frozen_weights", ())
    )
    return sum(p.numel() for p in model.parameters()) + frozen


def _analysis(model: nn.Module, inputs: tuple):
    """fvcore's analysis of ``model(*inputs)`` with vitexp's op handles (the protocol above)."""
    from fvcore.nn import FlopCountAnalysis

    analysis = FlopCountAnalysis(model, inputs)
    for op in _UNCOUNTED_OPS:  # a zero handle: fvcore's None keeps its default handle
        analysis.set_op_handle(op, _zero_handle)
    for op, handle in _EXTRA_HANDLES.items():
        analysis.set_op_handle(op, handle)
    analysis.unsupported_ops_warnings(False)
    analysis.uncalled_modules_warnings(False)
    analysis.tracer_warnings("none")
    return analysis


def count_module_macs(module: nn.Module, inputs: tuple) -> int:
    """MACs of ``module(*inputs)`` (eval mode, no gradients) under vitexp's protocol: for parts of
    a model that do not take an image (RoI heads on pooled features)."""
    was_training = module.training
    module.eval()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        total = int(_analysis(module, inputs).total())
    module.train(was_training)
    return total


def count_macs(
    model: nn.Module,
    img_size: int,
    in_chans: int = 3,
    registers: int = 0,
) -> FlopsReport:
    """Count MACs of one image through ``model`` (eval mode, batch 1) under vitexp's protocol;
    ``by_module`` holds the GMACs of each top-level child. ``registers`` is recorded in the
    protocol (it is a property of the model being counted)."""
    import fvcore

    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    x = torch.randn(1, in_chans, img_size, img_size, device=device)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        analysis = _analysis(model, (x,))
        total = analysis.total()
        by_module = {
            name: macs / 1e9 for name, macs in analysis.by_module().items() if name and "." not in name
        }
    method_protocol, recorded = model_records(model)
    model.train(was_training)
    protocol = {
        "counter": f"fvcore {fvcore.__version__} + vitexp op handles ({', '.join(sorted(_EXTRA_HANDLES))})",
        "unit": "GMACs (gflops = 2 x MACs)",
        "resolution": img_size,
        "batch": 1,
        "registers": registers,
        "attention_counted": True,
        "normalisation_counted": False,
        "elementwise_counted": False,
        **method_protocol,
    }
    return FlopsReport(
        gmacs=total / 1e9,
        gflops=2 * total / 1e9,
        params_m=count_params(model) / 1e6,
        protocol=protocol,
        by_module=by_module,
        recorded=recorded,
    )


def flop_counting() -> tuple[ExitStack, Any]:
    """(an entered ``ExitStack``, its ``FlopCounterMode``): torch's FLOP counter with the math kernel of
    ``scaled_dot_product_attention`` (module docstring); close the stack to stop counting."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    stack = ExitStack()
    stack.enter_context(sdpa_kernel(SDPBackend.MATH))
    return stack, stack.enter_context(FlopCounterMode(display=False))
