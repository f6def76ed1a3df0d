"""The closing line of a Hydra multirun (``vitexp-train -m ...``): one JSON object after the jobs' own
lines, with how many runs completed, failed or were interrupted and their run ids.

Its reasoning: docs/cluster.md, "vitexp/runs/multirun.py".
"""

from __future__ import annotations

import datetime as _dt
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

#: The multirun this process launched: {"sweep_dir", "results_dir", "since"}; empty otherwise.
STARTED: dict[str, Any] = {}
COUNTED = ("completed", "failed", "interrupted")


class MultirunRecorder(Callback):
    """Notes where and when a multirun started (module docstring)."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        STARTED.update(
            sweep_dir=Path(str(config.hydra.sweep.dir)).resolve(),
            results_dir=str(config.results_dir),
            since=_dt.datetime.now(_dt.timezone.utc).replace(microsecond=0) - _dt.timedelta(seconds=1),
        )


def _touched(record: dict[str, Any]) -> _dt.datetime | None:
    stamps = [record.get(k) for k in ("started", "heartbeat", "finished") if record.get(k)]
    try:
        return (
            max(_dt.datetime.fromisoformat(s).astimezone(_dt.timezone.utc) for s in stamps)
            if stamps
            else None
        )
    except ValueError:
        return None


def summary(stopped_invalid: bool = False) -> dict[str, Any] | None:
    """The multirun's closing line (``None`` when this process launched no multirun)."""
    from vitexp.ledger import Ledger, effective_status, portable_path

    if not STARTED:
        return None
    results_dir, since = STARTED["results_dir"], STARTED["since"]
    where = portable_path(STARTED["sweep_dir"], results_dir).rstrip("/") + "/"
    run_ids: dict[str, list[str]] = {status: [] for status in COUNTED}
    for record in Ledger.load(results_dir):
        touched = _touched(record)
        output_dir = record.get("output_dir") or (record.get("config") or {}).get("output_dir") or ""
        if str(output_dir).startswith(where) and touched is not None and touched >= since:
            run_ids.setdefault(effective_status(record), []).append(record["run_id"])
    bad = any(run_ids[s] for s in run_ids if s != "completed")
    status = "invalid" if stopped_invalid else "failed" if bad else "completed"
    return {
        "status": status,
        "multirun": portable_path(STARTED["sweep_dir"], results_dir),
        "runs": sum(map(len, run_ids.values())),
        **{s: len(ids) for s, ids in run_ids.items()},
        "run_ids": run_ids,
        "ledger": None,
    }
