"""What an entry's status means now: a ``running`` entry whose process is gone reads as ``interrupted``.

Its reasoning: docs/ledger.md, "vitexp/ledger/status.py".
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
from typing import Any

INTERRUPTED = "interrupted"
#: Hours after its last heartbeat (or start) that a running entry from another host reads as interrupted.
STALE_HOURS = 6.0


def now() -> str:
    """The current time as the ledger writes it (UTC, ISO 8601, seconds)."""
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def pid_alive(host: Any, pid: Any) -> bool | None:
    """Whether process ``pid`` of ``host`` is alive: ``None`` when that cannot be told here (another
    host, or no pid)."""
    if host != platform.node() or not pid:
        return None
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError, ValueError):
        return True
    return True


def older_than_stale(stamp: Any, when: _dt.datetime | None = None) -> bool:
    """Whether the ISO time ``stamp`` (UTC when it has no zone) is more than ``$VITEXP_STALE_HOURS`` ago."""
    if not stamp:
        return False
    then = _dt.datetime.fromisoformat(str(stamp))
    if then.tzinfo is None:  # a timestamp without its zone (W&B's created_at) is UTC
        then = then.replace(tzinfo=_dt.timezone.utc)
    age = (when or _dt.datetime.now(_dt.timezone.utc)) - then
    return age.total_seconds() > 3600 * float(os.environ.get("VITEXP_STALE_HOURS", STALE_HOURS))


def effective_status(record: dict[str, Any], when: _dt.datetime | None = None) -> str:
    """The entry's status, a ``running`` entry whose process is gone read as :data:`INTERRUPTED`
    (module docstring)."""
    status = record.get("status", "")
    if status != "running":
        return status
    env = record.get("env") or {}
    alive = pid_alive(env.get("hostname"), env.get("pid"))
    if alive is not None:
        return status if alive else INTERRUPTED
    return INTERRUPTED if older_than_stale(record.get("heartbeat") or record.get("started"), when) else status
