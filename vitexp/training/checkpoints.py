"""What a run needs from this machine, checked before it starts: its weights files and its accelerator.

Its reasoning: docs/commands.md, "vitexp/training/checkpoints.py".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from vitexp.errors import CheckpointError, ConfigError, join_lines, one_line


def check_backbone_weights(cfg: DictConfig, weights: str | Path) -> None:
    """Build the configured backbone with ``weights`` (already through :func:`check_file`) as the
    run will; a checkpoint that does not load into it is a :class:`CheckpointError`."""
    from vitexp.models import CheckpointMismatchError
    from vitexp.training.build import build_configured_backbone

    try:
        build_configured_backbone(cfg, str(weights))
    except CheckpointError:  # the loader's own one line (backbone.use_ema and the weights the file holds)
        raise
    except CheckpointMismatchError as err:
        raise CheckpointError(f"backbone.pretrained: {join_lines(str(err))}") from None
    except Exception as err:  # noqa: BLE001 - a timm key filter that meets another model's keys
        from vitexp.models import build_backbone

        build_backbone(
            {**cfg.backbone, "pretrained": None}, num_classes=int(cfg.data.num_classes)
        )  # not the weights: raises
        raise CheckpointError(
            f"backbone.pretrained: {weights} does not load into {cfg.backbone.timm_name} "
            f"({type(err).__name__}: {one_line(err)[:300]})"
        ) from None


#: ``trainer.precision`` values Lightning does not run on the CPU: fp16 AMP, which it replaces by bf16 AMP.
CPU_REPLACED_PRECISIONS = {"16-mixed": "bf16-mixed", "16": "bf16-mixed"}


def _check_cpu_precision(trainer: Any, accelerator: str) -> None:
    """A precision the CPU does not run is refused (Lightning would run another one in its place,
    with a warning, and the ledger would record the one asked for): ``trainer.precision=16-mixed``
    on ``trainer.accelerator=cpu``, or ``auto`` on a machine without a GPU."""
    import torch

    mps = getattr(torch.backends, "mps", None)
    on_cpu = accelerator == "cpu" or (
        accelerator == "auto"
        and not torch.cuda.is_available()
        and not (mps is not None and mps.is_available())
    )
    precision = str(trainer.get("precision", "32-true"))
    if on_cpu and precision in CPU_REPLACED_PRECISIONS:
        raise ConfigError(
            f"trainer.precision={precision}: fp16 mixed precision does not run on the CPU (Lightning "
            f"would run {CPU_REPLACED_PRECISIONS[precision]} instead); use trainer.precision="
            f"{CPU_REPLACED_PRECISIONS[precision]} or 32-true, or a GPU (trainer=gpu)"
        )


def check_accelerator(trainer: Any) -> None:
    """``trainer.accelerator=gpu`` (or ``cuda``) on a machine without a CUDA GPU, more GPUs in
    ``trainer.devices`` than it has, or a precision the CPU does not run: a :class:`ConfigError` now,
    not Lightning's inside the run (or its silent replacement)."""
    import torch

    accelerator = str(trainer.get("accelerator", "auto"))
    if accelerator not in ("gpu", "cuda", "auto", "cpu"):  # tpu, mps, hpu, ...: Lightning's registry says
        from lightning.pytorch.accelerators import AcceleratorRegistry

        if accelerator not in AcceleratorRegistry:
            raise ConfigError(f"trainer.accelerator={accelerator}: not one of {sorted(AcceleratorRegistry)}")
        try:
            available = AcceleratorRegistry[accelerator]["accelerator"].is_available()
        except Exception:  # noqa: BLE001 - its package missing (torch_xla)
            available = False
        if not available:
            raise ConfigError(
                f"trainer.accelerator={accelerator}: not available on this machine; "
                "run with trainer=cpu, or trainer=gpu on a GPU machine"
            )
        return
    if accelerator not in ("gpu", "cuda"):
        _check_cpu_precision(trainer, accelerator)
        return
    if not torch.cuda.is_available():
        raise ConfigError(
            f"trainer.accelerator={accelerator}: this machine has no CUDA GPU "
            "(torch.cuda.is_available() is false); run with trainer=cpu, or on a GPU machine"
        )
    devices = trainer.get("devices", 1)
    if isinstance(devices, int) and devices > torch.cuda.device_count():
        raise ConfigError(
            f"trainer.devices={devices}: this machine has {torch.cuda.device_count()} CUDA GPU(s)"
        )
