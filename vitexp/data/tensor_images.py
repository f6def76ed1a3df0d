"""``data.decoder=tensor``: JPEGs decoded by ``torchvision.io.decode_jpeg``, augmented by transforms v2 on
uint8 tensors in the loader's workers, and normalised on the device (``decoder=pil``, timm's PIL
pipeline, is :func:`vitexp.data.datamodules.timm_transforms`).

Its reasoning: docs/measurements.md, "vitexp/data/tensor_images.py".
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from vitexp.errors import ConfigError

#: ``data.decoder`` choices.
DECODERS = ("pil", "tensor")


def decode_rgb(path: str) -> torch.Tensor:
    """The image at ``path`` as a uint8 3×H×W tensor (``torchvision.io.decode_image``: libjpeg-turbo for
    JPEGs, grey and CMYK converted to RGB)."""
    from torchvision.io import ImageReadMode, decode_image, read_file

    return decode_image(read_file(path), mode=ImageReadMode.RGB)


def randaugment_options(auto_augment: str) -> dict[str, int]:
    """{num_ops, magnitude} of a timm RandAugment string (``rand-m9-mstd0.5-inc1``: 2 operations at
    magnitude 9); another policy is a :class:`~vitexp.errors.ConfigError`."""
    parts = str(auto_augment).split("-")
    if parts[0] != "rand":
        raise ConfigError(
            f"data.decoder=tensor: recipe.auto_augment={auto_augment!r} is not a RandAugment policy "
            "('rand-m<M>[-n<N>]...'); the tensor path has no AutoAugment or AugMix: use data.decoder=pil"
        )
    out = {"num_ops": 2, "magnitude": 10}
    for part in parts[1:]:
        if part.startswith("mstd") or part.startswith("inc") or part.startswith("mmax"):
            continue  # timm's magnitude noise and op variants: not in torchvision (module docstring)
        if part[:1] in ("m", "n") and part[1:].isdigit():
            out["magnitude" if part[0] == "m" else "num_ops"] = int(part[1:])
    return out


def _interpolation(name: str):
    from torchvision.transforms import v2

    modes = {
        "bicubic": v2.InterpolationMode.BICUBIC,
        "bilinear": v2.InterpolationMode.BILINEAR,
        "nearest": v2.InterpolationMode.NEAREST,
    }
    if name not in modes:
        raise ConfigError(f"data.decoder=tensor: interpolation {name!r} is not one of {sorted(modes)}")
    return modes[name]


def tensor_transform(data_config: Mapping[str, Any], train: bool, auto_augment: str | None = None):
    """The worker's v2 transform on uint8 tensors (module docstring): training or evaluation."""
    from torchvision.transforms import v2

    size = int(data_config["input_size"][-1])
    mode = _interpolation(str(data_config.get("interpolation", "bicubic")))
    if not train:
        return v2.Compose(
            [
                v2.Resize(
                    int(size / float(data_config.get("crop_pct", 0.875))), interpolation=mode, antialias=True
                ),
                v2.CenterCrop(size),
            ]
        )
    steps = [
        v2.RandomResizedCrop(
            size, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), interpolation=mode, antialias=True
        ),
        v2.RandomHorizontalFlip(0.5),
    ]
    if auto_augment:
        # the geometric operations on tensors interpolate nearest or bilinear only (timm's: the data config's)
        steps.append(
            v2.RandAugment(
                **randaugment_options(auto_augment),
                num_magnitude_bins=11,
                interpolation=v2.InterpolationMode.BILINEAR,
            )
        )
    else:
        steps.append(v2.ColorJitter(0.4, 0.4, 0.4))
    return v2.Compose(steps)


class DeviceNormalize:
    """A uint8 N×3×H×W batch on its device → ``(x / 255 − mean) / std`` in float32, then random erasing
    with probability ``random_erase`` per image when ``train`` (timm's ``RandomErasing``, mode const).
    A batch that is already floating point passes through unchanged (a split whose workers normalised)."""

    def __init__(self, mean: Sequence[float], std: Sequence[float], random_erase: float = 0.0):
        self.mean = torch.tensor([255.0 * m for m in mean]).view(1, -1, 1, 1)
        self.std = torch.tensor([255.0 * s for s in std]).view(1, -1, 1, 1)
        self.random_erase = float(random_erase or 0.0)

    def __call__(self, x: torch.Tensor, train: bool = False) -> torch.Tensor:
        if x.is_floating_point():
            return x
        out = (x.float() - self.mean.to(x.device)) / self.std.to(x.device)
        if train and self.random_erase > 0:
            from timm.data.random_erasing import RandomErasing

            out = RandomErasing(self.random_erase, mode="const", device=str(x.device))(out)
        return out


def normalised_eval_transform(data_config: Mapping[str, Any]):
    """The evaluation transform with normalisation in the worker (float output): for the splits that
    code reads outside Lightning's batch hooks (the k-NN memory bank, analyses indexing a dataset)."""
    from torchvision.transforms import v2

    return v2.Compose(
        [
            tensor_transform(data_config, False),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(mean=list(data_config["mean"]), std=list(data_config["std"])),
        ]
    )
