"""One live process per run folder: ``<run folder>/run.lock``, held with ``flock``, names its owner.

Its reasoning: docs/cluster.md, "vitexp/runs/lock.py".
"""

from __future__ import annotations

import fcntl
import json
import os
import platform
import time
from pathlib import Path

from vitexp.errors import ConfigError
from vitexp.ledger.status import now

LOCK_NAME = "run.lock"
#: How long (× 0.05 s) a refused process waits for the lock's owner to have written itself.
OWNER_WAIT_STEPS = 40
#: {lock path: file descriptor} of the locks this process holds (an inner run of an outer one re-enters).
_HELD: dict[str, int] = {}


#: What a refused process is told (``{folder}``, ``{pid}``, ``{host}``, ``{since}``).
RUN_REFUSAL = (
    "run folder {folder} is in use by process {pid} on {host} (since {since}); two runs never share a"
    " folder: give this one another hydra.run.dir, or wait for that run to end"
)


class RunFolderLock:
    """The lock of one run folder (module docstring); ``name`` and ``refusal``: another folder's lock
    (``vitexp-tables --out``'s, :data:`vitexp.report.tables.TABLES_LOCK`) and what its refusal says."""

    def __init__(self, folder: Path | str, name: str = LOCK_NAME, refusal: str = RUN_REFUSAL):
        self.folder = Path(folder)
        self.path = self.folder / name
        self.refusal = refusal
        self.held = False

    def _holder(self) -> dict:
        try:
            return json.loads(self.path.read_text() or "{}")
        except (OSError, json.JSONDecodeError):
            return {}

    def acquire(self) -> "RunFolderLock":
        key = str(self.path.resolve())
        if key in _HELD:
            return self  # this process's own, held by an outer run (it releases it)
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            holder = self._holder()
            for _ in range(OWNER_WAIT_STEPS):  # its owner writes itself just after taking the lock
                if holder:
                    break
                time.sleep(0.05)
                holder = self._holder()
            raise ConfigError(
                self.refusal.format(
                    folder=self.folder,
                    pid=holder.get("pid", "?"),
                    host=holder.get("host", "?"),
                    since=holder.get("since", "?"),
                )
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"host": platform.node(), "pid": os.getpid(), "since": now()}).encode(), 0)
        _HELD[key] = fd
        self.held = True
        return self

    def touch(self) -> None:
        """Kept for the heartbeat's hook: the kernel keeps the lock alive, nothing to refresh."""

    def release(self) -> None:
        if self.held:
            fd = _HELD.pop(str(self.path.resolve()), None)
            if fd is not None:
                os.ftruncate(fd, 0)
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
            self.held = False
