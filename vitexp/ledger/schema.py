"""The schema of a ledger entry, checked on every entry the ledger loads.

Its reasoning: docs/ledger.md, "vitexp/ledger/schema.py".
"""

from __future__ import annotations

import datetime as _dt
import math
from dataclasses import dataclass
from typing import Any, Iterable

#: ``interrupted``: closed by a signal (SIGINT, SIGTERM), or a running attempt found dead on resume.
STATUSES = ("running", "completed", "failed", "interrupted")
FINAL_STATUSES = ("completed", "failed", "interrupted")
KINDS = ("train", "flops", "bench", "eval", "audit", "analyze", "rehearsal", "rebuild")

_STR, _OPT_STR, _DICT, _LIST = (str,), (str, type(None)), (dict,), (list,)
#: Optional fields and their types.
FIELDS: dict[str, tuple[type, ...]] = {
    "config": _DICT,
    "metrics": _DICT,
    "protocol": _DICT,
    "env": _DICT,
    "artifacts": _DICT,
    "attempts": _LIST,
    "started": _STR,
    "finished": _OPT_STR,
    "heartbeat": _STR,
    "error": _OPT_STR,
    "wandb_url": _OPT_STR,
    "wandb_id": _OPT_STR,
    "output_dir": _OPT_STR,
    "evaluates": _STR,
    "fingerprint": _STR,
    "signal": _OPT_STR,
    "resumed_from": (dict, type(None)),
}
REQUIRED = ("run_id", "experiment", "status", "kind", "started")
#: Seconds a ``started`` may lie ahead of this machine's clock (another node's clock) before the entry is
#: broken.
CLOCK_SKEW_S = 300
_METRIC = (int, float, str, bool, list, dict, type(None))


@dataclass(frozen=True)
class BrokenEntry:
    """A ledger file that could not be used: its name and what is wrong; ``record`` is what parsed
    (``None`` when the file did not parse), so a table can tell whether it names one of its rows."""

    path: str
    problem: str
    record: dict[str, Any] | None = None

    def __str__(self) -> str:
        return f"{self.path}: {self.problem}"


class LedgerError(ValueError):
    """Broken ledger entries where a command needs a whole ledger; the message names every file
    and what is wrong with it."""

    def __init__(self, broken: Iterable[BrokenEntry], what: str = "the ledger"):
        self.broken = list(broken)
        names = "; ".join(str(b) for b in self.broken[:10])
        more = f" (and {len(self.broken) - 10} more)" if len(self.broken) > 10 else ""
        super().__init__(
            f"{len(self.broken)} broken ledger entr{'y' if len(self.broken) == 1 else 'ies'} in "
            f"{what}: {names}{more}"
        )


def finite(value: Any) -> bool:
    """Whether every number in ``value`` (at any depth of lists and objects) is finite: NaN and
    Infinity are no metric (and not JSON)."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, (list, tuple)):
        return all(finite(v) for v in value)
    if isinstance(value, dict):
        return all(finite(v) for v in value.values())
    return True


def non_finite(metrics: dict[str, Any]) -> list[str]:
    """The names of the metrics that hold NaN or Infinity."""
    return [key for key, value in metrics.items() if not finite(value)]


def problems(record: Any, stem: str | None = None) -> list[str]:
    """What breaks the schema in ``record`` (empty: nothing); ``stem``: the file's name without
    ``.json``, which must be the ``run_id``."""
    if not isinstance(record, dict):
        return [f"not a JSON object but {type(record).__name__}"]
    out = [f"no {key!r}" for key in REQUIRED if key not in record]
    for key in ("run_id", "experiment", "status", "kind"):
        if key in record and not isinstance(record[key], str):
            out.append(f"{key!r} is {type(record[key]).__name__}, not a string")
    if isinstance(record.get("status"), str) and record["status"] not in STATUSES:
        out.append(f"status {record['status']!r} is not one of {list(STATUSES)}")
    if isinstance(record.get("kind"), str) and record["kind"] not in KINDS:
        out.append(f"kind {record['kind']!r} is not one of {list(KINDS)}")
    if stem is not None and isinstance(record.get("run_id"), str) and record["run_id"] != stem:
        out.append(f"run_id {record['run_id']!r} is not the file's name {stem!r}")
    for key, types in FIELDS.items():
        if key in record and not isinstance(record[key], types):
            out.append(
                f"{key!r} is {type(record[key]).__name__}, not {' or '.join(t.__name__ for t in types)}"
            )
    if isinstance(record.get("started"), str):
        out += _start_problems(record["started"])
    for key, value in (
        (record.get("metrics") or {}).items() if isinstance(record.get("metrics"), dict) else ()
    ):
        if not isinstance(value, _METRIC):
            out.append(f"metric {key!r} is {type(value).__name__}")
        elif not finite(value):
            out.append(f"metric {key!r} holds {value!r}: not a finite number")
    if isinstance(record.get("attempts"), list) and not all(isinstance(a, dict) for a in record["attempts"]):
        out.append("'attempts' holds something other than objects")
    return out


def started_at(stamp: str) -> _dt.datetime:
    """``started`` as a time (UTC when it names no zone, as W&B's ``created_at``); ``ValueError`` when it is
    none."""
    then = _dt.datetime.fromisoformat(stamp)
    return then if then.tzinfo is not None else then.replace(tzinfo=_dt.timezone.utc)


def _start_problems(stamp: str, when: _dt.datetime | None = None) -> list[str]:
    try:
        then = started_at(stamp)
    except ValueError:
        return [f"started {stamp!r} is not an ISO 8601 time"]
    now = when or _dt.datetime.now(_dt.timezone.utc)
    if (then - now).total_seconds() > CLOCK_SKEW_S:
        return [
            f"started {stamp} is in the future (this machine's clock says"
            f" {now.isoformat(timespec='seconds')})"
        ]
    return []
