"""One live process per run folder: ``<run folder>/run.lock`` names the host and pid that own it.

Two identical ``vitexp-train`` commands started in the same second share Hydra's default folder
(``outputs/<name>/<time to the second>``); under ``resume=auto`` the second would read the first's
``run.json`` and continue the first's unfinished ledger entry as its own. The lock stops that: the
first process to create the lock file (``O_CREAT | O_EXCL``, atomic) owns the folder until its run
ends; another gets a :class:`~vitexp.errors.ConfigError` naming the owner (exit 2, nothing written),
never the other's entry.

Decisions:
- A lock whose process is gone (same host: no such pid; another host: untouched for longer than
  ``$VITEXP_STALE_HOURS``, the ledger's rule for a running entry) is stale and taken over: a run
  killed by SIGKILL is resumed in its own folder by the same command.
- Only rank zero of a distributed run locks (the other ranks share its folder by design).
"""
from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

from vitexp.errors import ConfigError
from vitexp.ledger.status import now, older_than_stale, pid_alive

LOCK_NAME = "run.lock"


class RunFolderLock:
    """The lock of one run folder (module docstring)."""

    def __init__(self, folder: Path | str):
        self.folder = Path(folder)
        self.path = self.folder / LOCK_NAME
        self.held = False

    def _holder(self) -> dict | None:
        for _ in range(20):  # the owner writes its line right after creating the file
            try:
                return json.loads(self.path.read_text())
            except FileNotFoundError:
                return None
            except (OSError, json.JSONDecodeError):
                time.sleep(0.05)
        return {}

    def _stale(self, holder: dict) -> bool:
        alive = pid_alive(holder.get("host"), holder.get("pid"))
        if alive is None:  # another host (or no pid): by the lock's age
            try:
                stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(self.path.stat().st_mtime))
            except FileNotFoundError:
                return True
            return older_than_stale(stamp)
        return not alive

    def acquire(self) -> "RunFolderLock":
        self.folder.mkdir(parents=True, exist_ok=True)
        mine = json.dumps({"host": platform.node(), "pid": os.getpid(), "since": now()})
        for _ in range(5):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                if holder is None:
                    continue  # released meanwhile
                if holder.get("pid") == os.getpid() and holder.get("host") == platform.node():
                    return self  # this process's own, held by an outer run (it releases it)
                if not self._stale(holder):
                    raise ConfigError(
                        f"run folder {self.folder} is in use by process {holder.get('pid')} on {holder.get('host')} "
                        f"(since {holder.get('since')}); two runs never share a folder: give this one another "
                        "hydra.run.dir, or wait for that run to end") from None
                try:
                    self.path.unlink()  # stale: its process is gone
                except FileNotFoundError:
                    pass
                continue
            with os.fdopen(fd, "w") as fh:
                fh.write(mine)
            self.held = True
            return self
        raise ConfigError(f"run folder {self.folder}: could not take its lock {self.path}")

    def touch(self) -> None:
        """Mark the lock alive (another host judges it by its age)."""
        if self.held:
            try:
                os.utime(self.path)
            except OSError:
                pass

    def release(self) -> None:
        if self.held:
            holder = self._holder() or {}
            if holder.get("pid") == os.getpid():
                try:
                    self.path.unlink()
                except FileNotFoundError:
                    pass
            self.held = False
