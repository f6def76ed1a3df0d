"""vitexp's error types, and the one line every error is reported in. This module imports nothing
from vitexp, so any module (config, methods, modules, the run owner) can raise them without
importing another and without an import cycle."""

from __future__ import annotations

import functools
import os
import re
import signal
from typing import Any, Callable


class ConfigError(ValueError):
    """A composed config that vitexp cannot run; the message names the key and its valid values.
    Raised before any model is built or any ledger entry written (exit code 2, status ``invalid``)."""


class CheckpointError(ConfigError):
    """A weights file that cannot be loaded into the model: missing, empty, not a torch file, refused
    by ``torch.load(weights_only=True)``, or keys that do not fit. The message names the file; found
    before the run starts, so it is reported as an invalid config (exit code 2, nothing written)."""


class NonFiniteLossError(FloatingPointError):
    """The training loss became NaN or infinite."""


#: Set beside ``HYDRA_FULL_ERROR=1`` when vitexp set it (for Hydra to raise), not the user.
HYDRA_FULL_ERROR_BY_VITEXP = "VITEXP_SET_HYDRA_FULL_ERROR"


def debug_mode() -> bool:
    """``VITEXP_DEBUG=1`` (or Hydra's own ``HYDRA_FULL_ERROR=1``, set by the user): errors keep
    their traceback. Otherwise every error is reported in one line (:func:`one_line`)."""
    hydra_full = os.environ.get("HYDRA_FULL_ERROR") == "1" and not os.environ.get(HYDRA_FULL_ERROR_BY_VITEXP)
    return os.environ.get("VITEXP_DEBUG", "") not in ("", "0") or hydra_full


def one_line(err: BaseException) -> str:
    """``err``'s message on one line: OmegaConf's ``full_key: message`` where it names a key,
    Hydra's config search path left out, the items listed under a heading ("Available options in
    'backbone':") joined by commas, other lines by "; ", and the cause added when the message does
    not already hold it."""
    text = re.sub(r"\n\s*(full_key|object_type|reference_type)\s*[:=].*", "", str(err))  # OmegaConf's trailer
    key = getattr(err, "full_key", None)
    if key and not text.startswith(f"{key}:"):
        text = f"{key}: {text}"
    cause = err.__cause__ or (None if err.__suppress_context__ else err.__context__)
    if cause is not None and str(cause).strip() and str(cause).split("\n")[0] not in text:
        text += f" ({one_line(cause)})"
    return join_lines(text.split("\nConfig search path:")[0])


def join_lines(text: str) -> str:
    """Lines of ``text`` as one line (:func:`one_line`)."""
    out, listing = "", False
    for line in (re.sub(r"\s+", " ", raw).strip() for raw in text.splitlines()):
        if not line:
            continue
        if not out:
            out = line
        elif listing:
            out += (" " if out.endswith(":") else ", ") + line
        else:
            out += ("" if out.endswith((".", ";", ":")) else ";") + " " + line
        listing = listing or out.endswith(":")
    return out


def console_script(main: Callable[..., None]) -> Callable[..., None]:
    """A console script ends on Ctrl-C as the shell expects of a process stopped by SIGINT: exit 130,
    no traceback (the run's own entry and closing line were written by :func:`vitexp.runs.owner.owned_run`).
    """

    @functools.wraps(main)
    def script(*args: Any, **kwargs: Any) -> None:
        try:
            main(*args, **kwargs)
        except KeyboardInterrupt:
            raise SystemExit(128 + int(signal.SIGINT)) from None

    return script
