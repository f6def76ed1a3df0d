"""Rewrite a results root's ledger once through today's entry schema (issue 58); re-runnable, and a second
run changes nothing.

    python scripts/migrate_ledger.py [RESULTS] [--written-at DIR] [--dry-run] [--untracked]

What it rewrites, in every pack (``<results>/ledger/*.jsonl.gz``) and every loose entry
(``<results>/runs/*.json``; in a git checkout only the files git tracks, unless ``--untracked``: an
in-flight run's entry is its own process's to write):

- a path of one machine (absolute, a ``..`` path relative to the results root, which means something at
  one depth of the tree only, a ``file:///`` URL in a text) becomes relative to the checkout or the
  results root where it lies inside one, else ``file://<host>/<path>``, ``<host>`` the entry's
  ``env.hostname`` (:func:`vitexp.ledger.paths.portable_paths`); a ``..`` path is read against
  ``--written-at`` (default: the results root itself), the folder the entries were written in;
- a metric that holds NaN or Infinity (a ``NaN`` token) becomes null: it was never a number;
- ``started``, ``finished``, ``heartbeat`` and each attempt's times are written in UTC.

Each entry must then keep the schema (:func:`vitexp.ledger.schema.validated`), or nothing is written. A
pack is rewritten under its own name only where one of its entries changed (same order, gzip without a
time stamp); a loose entry the same way. Prints one JSON line: what changed, file by file.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

from vitexp.ledger.paths import atomic_write_json, portable_paths
from vitexp.ledger.schema import problems, validated
from vitexp.ledger.sources import write_snapshot


def _finite(value: Any) -> Any:
    """``value`` with every NaN or Infinity, at any depth, as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list):
        return [_finite(v) for v in value]
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    return value


def migrated(record: dict[str, Any], written_at: Path) -> dict[str, Any]:
    """``record`` in today's schema (module docstring); ``ValueError`` naming what still breaks it."""
    host = str((record.get("env") or {}).get("hostname") or "unknown-host")
    out = portable_paths(record, written_at, host=host)
    if isinstance(out.get("metrics"), dict):
        out["metrics"] = _finite(out["metrics"])
    return validated(out)


def _tracked(runs: Path) -> list[Path] | None:
    """The files of ``runs`` git tracks; ``None`` outside a git checkout."""
    try:
        done = subprocess.run(
            ["git", "ls-files", "-z", "--", "."], cwd=runs, capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return sorted(runs / name for name in done.stdout.split("\0") if name.endswith(".json"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="?", default="results", type=Path)
    parser.add_argument("--written-at", type=Path, default=None)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument(
        "--untracked",
        action="store_true",
        help="also the loose entries git does not track (no run may be live)",
    )
    args = parser.parse_args(argv)
    root = args.results.resolve()
    written_at = (args.written_at or root).resolve()
    changed: dict[str, int] = {}
    for pack in sorted((root / "ledger").glob("*.jsonl.gz")):
        lines = [ln for ln in gzip.open(pack, "rt", encoding="utf-8").read().split("\n") if ln.strip()]
        records = [json.loads(ln) for ln in lines]
        new = [migrated(r, written_at) for r in records]
        n = sum(a != b for a, b in zip(records, new))
        if n:
            changed[f"ledger/{pack.name}"] = n
            if not args.dry_run:
                write_snapshot(new, pack)
    runs = root / "runs"
    files = _tracked(runs) if runs.is_dir() and not args.untracked else None
    for path in files if files is not None else sorted(runs.glob("*.json")):
        if path.name.startswith(".") or not path.is_file():
            continue
        record = json.loads(path.read_text(encoding="utf-8"))
        new = migrated(record, written_at)
        if new != record:
            changed[f"runs/{path.name}"] = 1
            if not args.dry_run:
                atomic_write_json(path, new)
    for pack in sorted((root / "ledger").glob("*.jsonl.gz")) if not args.dry_run else ():
        for i, line in enumerate(gzip.open(pack, "rt", encoding="utf-8").read().split("\n"), 1):
            wrong = problems(json.loads(line)) if line.strip() else []
            if wrong:
                raise SystemExit(f"ledger/{pack.name}:{i}: {'; '.join(wrong)}")
    print(json.dumps({"results": str(root), "changed": changed, "entries": sum(changed.values())}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
