"""vitexp's error types. This module imports nothing from vitexp, so any module (config, methods,
modules, the run owner) can raise them without importing another and without an import cycle."""
from __future__ import annotations


class ConfigError(ValueError):
    """A composed config that vitexp cannot run; the message names the key and its valid values.
    Raised before any model is built or any ledger entry written (exit code 2, status ``invalid``)."""


class NonFiniteLossError(FloatingPointError):
    """The training loss became NaN or infinite."""
