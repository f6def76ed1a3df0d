"""What a table says about the run behind a cell, beyond its number.

Its reasoning: docs/ledger.md, "vitexp/ledger/marks.py".
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

STALE, BUSY, NO_DIFF = "§", "≈", "‡"
#: Metrics of the model's cost, which the order of the training data does not change (a stale
#: protocol marks the other metrics of a cell's run: its accuracies and losses).
COST_PREFIXES = ("gmacs", "gflops", "macs", "flops", "params", "throughput", "heads", "latency", "speedup")


def cost_metric(key: str) -> bool:
    return key.startswith(COST_PREFIXES) or "throughput" in key


#: The protocol key a training run records for the order its sampler drew
#: (:data:`vitexp.data.datamodules.DATA_ORDER`).
ORDER_KEY = "data_order"


def run_seed(run: Mapping[str, Any]) -> int | None:
    seed = (run.get("config") or {}).get("seed")
    return int(seed) if isinstance(seed, (int, float)) and not isinstance(seed, bool) else None


def old_order(run: Mapping[str, Any]) -> bool:
    """A completed training run that took steps and whose protocol names no ``data_order``. Not
    judged: a running run (no protocol yet), a record without a protocol (a W&B run)."""
    return (
        run.get("kind") == "train"
        and run.get("status") == "completed"
        and isinstance(run.get("protocol"), dict)
        and ORDER_KEY not in run["protocol"]
        and (run.get("metrics") or {}).get("steps", 1) != 0
    )


def stale(run: Mapping[str, Any]) -> bool:
    """Trained under a protocol today's code does not reproduce (module docstring)."""
    return old_order(run) and run_seed(run) not in (0, None)


def load_of(run: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The machine load recorded with the run's throughput (a bench's protocol or a train run's
    ``protocol.throughput``), or ``None``."""
    protocol = run.get("protocol") or {}
    for where in (protocol.get("throughput"), protocol):
        if isinstance(where, Mapping) and isinstance(where.get("load"), Mapping):
            return where["load"]
    before_after = protocol.get("load_average_1m_before_after")  # bench.compare before loads were recorded
    if isinstance(before_after, list) and before_after and protocol.get("cpu_count"):
        return {
            "loadavg": [max(before_after)],
            "cpus": protocol["cpu_count"],
            "threads": protocol.get("threads"),
        }
    return None


def busy(run: Mapping[str, Any]) -> bool:
    """The run's throughput was timed on a busy machine (module docstring)."""
    load = load_of(run)
    if not load or not load.get("loadavg") or not load.get("cpus"):
        return False
    return float(load["loadavg"][0]) > float(load["cpus"])


def diff_missing(run: Mapping[str, Any]) -> bool:
    env = run.get("env") or {}
    return env.get("git_dirty") is True and not env.get("code_patch")


def rebuilt(records: Iterable[Mapping[str, Any]]) -> set[str]:
    """The run ids whose newest completed ``rebuild`` entry (:mod:`vitexp.commands.rebuild`) says ``rebuilt``;
    ``records`` oldest first, as a ledger holds them."""
    verdict: dict[str, bool] = {}
    for r in records:
        if r.get("kind") == "rebuild" and r.get("status") == "completed" and r.get("rebuilds"):
            verdict[str(r["rebuilds"])] = r.get("rebuilt") is True
    return {run_id for run_id, ok in verdict.items() if ok}
