"""``torch.compile`` as vitexp runs it (the config's ``compile`` block): a model's entry point compiled
once, its batch dimension dynamic, its module and its weights untouched (no ``_orig_mod.`` prefix in a
state dict or a checkpoint).

Its reasoning: docs/measurements.md, "vitexp/models/compiled.py" (which methods compile whole, the
tolerances against eager, why ``compile`` stays out of the fingerprint, and the measured speed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

#: ``compile.mode``: ``torch.compile``'s modes.
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass(frozen=True)
class CompileOptions:
    """The ``compile`` block of a config: ``enabled``, ``mode`` (:data:`MODES`), ``fullgraph`` (a
    graph break is an error instead of a fallback to eager) and ``backend`` (``inductor``; ``eager``
    and ``aot_eager`` capture graphs without generating code, for debugging)."""

    enabled: bool = False
    mode: str = "default"
    fullgraph: bool = False
    backend: str = "inductor"

    @classmethod
    def of(cls, block: Mapping[str, Any] | None) -> "CompileOptions":
        """The options of a config's ``compile`` block (``None``: an old run's config, compiled off)."""
        if not block:
            return cls()
        return cls(
            enabled=bool(block.get("enabled", False)),
            mode=str(block.get("mode", "default")),
            fullgraph=bool(block.get("fullgraph", False)),
            backend=str(block.get("backend", "inductor")),
        )

    def record(self) -> dict[str, Any]:
        """What a ledger entry's protocol says of it (``torch`` version beside it)."""
        return {
            "mode": self.mode,
            "fullgraph": self.fullgraph,
            "backend": self.backend,
            "dynamic": "batch dimension (maybe_mark_dynamic)",
            "torch": torch.__version__,
        }


def mark_batch_dynamic(value: Any) -> None:
    """Mark dimension 0 of every tensor in ``value`` (a tensor, or a list, tuple or dict of them)
    dynamic, so a last batch of another size reuses the graph instead of compiling another. A
    batch of 1 stays specialised (torch's 0/1 rule): ``maybe_mark_dynamic`` does not raise then."""
    if isinstance(value, torch.Tensor):
        if value.dim() > 0:
            torch._dynamo.maybe_mark_dynamic(value, 0)
    elif isinstance(value, (list, tuple)):
        for v in value:
            mark_batch_dynamic(v)
    elif isinstance(value, dict):
        for v in value.values():
            mark_batch_dynamic(v)


def size_oblivious() -> None:
    """Let inductor decide size-dependent code without a guard on the batch size. Its CPU code for a
    float sum guards on the reduction's length (over 4096 elements: an accumulation helper,
    ``need_use_acc_helper`` in ``torch/_inductor/codegen/cpp.py``); a backward's bias gradient sums
    batch x tokens, so a last batch on the other side of 4096 / tokens compiled the training graph
    again. Size-oblivious, the guard is not taken (the plain vectorised sum is used) and one graph
    serves every batch size but 1. Process-wide: set once by the first compiled call."""
    import torch.fx.experimental._config as fx_config

    fx_config.backed_size_oblivious = True


def compile_call(fn: Callable[..., Any], options: CompileOptions, backend: Any = None) -> Callable[..., Any]:
    """``fn`` (a module or a bound method) compiled with ``options``, its tensor arguments' batch
    dimension marked dynamic at each call (:func:`mark_batch_dynamic`, :func:`size_oblivious`). The
    module's parameters are shared, not copied: training the compiled call trains the module.
    ``backend``: a backend object in place of ``options.backend`` (the tests' graph counter)."""
    size_oblivious()
    kwargs: dict[str, Any] = {"fullgraph": options.fullgraph, "backend": backend or options.backend}
    if backend is None and options.backend == "inductor":
        kwargs["mode"] = options.mode
    compiled = torch.compile(fn, **kwargs)

    def call(*args: Any, **kw: Any) -> Any:
        mark_batch_dynamic(args)
        return compiled(*args, **kw)

    call.compiled = compiled  # type: ignore[attr-defined]  (torch's object, for tests and explain)
    return call
