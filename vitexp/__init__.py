"""vitexp: an experiment framework for efficient vision transformers (the layout: docs/layout.md).

The package root holds the checkout's paths, and importing it registers vitexp's architectures with
timm (``timm.create_model("vit_micro_patch4_32")`` after ``import vitexp``).
"""

from pathlib import Path

__version__ = "0.1.0"

#: Root of the source checkout (holds ``conf/``, ``sweeps/`` and ``results/``).
PROJECT_ROOT = Path(__file__).resolve().parent.parent
CONF_DIR = PROJECT_ROOT / "conf"
SWEEPS_DIR = PROJECT_ROOT / "sweeps"

from vitexp import models as _models  # noqa: E402,F401  (registers vitexp's architectures with timm)
