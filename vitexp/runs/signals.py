"""The signals that stop a run (:func:`vitexp.runs.owner.owned_run`): noted so the ledger entry closes
``interrupted`` with the signal, then handed on to whatever handled them before the run.

Its reasoning: docs/cluster.md, "vitexp/runs/signals.py".
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import Any, Callable

#: Signals a closing run notes instead of raising (module docstring).
DEFERRED_WHILE_CLOSING = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


class Interrupted(BaseException):
    """Raised in the run's thread by SIGTERM (SIGINT raises KeyboardInterrupt, as Python's default)."""


def deferred(run: Any, signum: int) -> bool:
    """Whether ``run`` is closing and ``signum`` is one it notes (in ``run.deferred``) instead of raising."""
    if not getattr(run, "entry_closing", False) or signum not in DEFERRED_WHILE_CLOSING:
        return False
    run.deferred.append(signal.Signals(signum).name)
    return True


def catch_signals(run: Any) -> Callable[[], None]:
    """Install the run's handlers (module docstring); returns the restorer of the previous ones."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    from vitexp.runs import slurm

    caught = (signal.SIGINT, signal.SIGTERM, *((signal.SIGUSR1,) if slurm.job_id() else ()))
    previous = {s: signal.getsignal(s) for s in caught}

    def handler(signum, frame):
        if deferred(run, signum):
            return
        run.signal = (
            run.signal or signal.Signals(signum).name
        )  # SLURM's SIGTERM after a requeue keeps the first
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        if signum == signal.SIGUSR1:
            run.requeued = slurm.command()  # asked once the entry is closed (owned_run)
        raise Interrupted(run.signal)

    for s in list(previous):
        signal.signal(s, handler)
    previous.update(slurm.note_submitit_requeue(run))

    def restore() -> None:
        for s, h in previous.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)

    return restore


def pass_on(signame: str) -> None:
    """Hand a signal that stopped a run, its entry now closed, to whatever handled it before the run.

    SIGINT and SIGTERM are raised again with the handlers from before the run back in place: Python's
    default SIGINT handler raises ``KeyboardInterrupt`` (pytest then ends its session, the CLI exits
    130), and the default SIGTERM action ends the process as the signal would have. A handler that
    returns (submitit's SIGTERM bypass, ``SIG_IGN``) leaves the exit to vitexp: ``SystemExit`` with the
    shell's code for a process ended by a signal, 128 + its number, as after SLURM's SIGUSR1."""
    signum = int(getattr(signal, signame))
    if signame in ("SIGINT", "SIGTERM") and threading.current_thread() is threading.main_thread():
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            signal.raise_signal(signum)
        except BaseException as err:  # the previous handler's own exception, without the run's chain
            err.__suppress_context__ = True  # (Lightning's frames, which pytest would render for a minute)
            raise
    raise SystemExit(128 + signum)
