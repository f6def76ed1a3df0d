"""The ledger as one indexed object: :class:`Ledger` loads a results folder, a snapshot or a W&B project
once, keeps every entry that keeps the schema (and the broken ones aside), and answers the queries the
commands need, each from an index (by run id, by name, by fingerprint), so that a table is linear in
runs + cells.

Its reasoning: docs/ledger.md, "vitexp/ledger/index.py".
"""

from __future__ import annotations

import bisect
import datetime as _dt
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

from vitexp.ledger import fingerprint as fp
from vitexp.ledger.packs import read_root
from vitexp.ledger.schema import BrokenEntry, LedgerError, started_at
from vitexp.ledger.sources import is_snapshot, read_snapshot, read_wandb

RUN_PREFIX = fp.RUN_PREFIX
SEED_NAME = "{name}+seed={seed}"


def seeded_name(name: str, seed: int | str) -> str:
    """The ledger name of one seed of a row as vitexp-sweep launches it (``<name>+seed=<s>``)."""
    return SEED_NAME.format(name=name, seed=seed)


def base_of(name: str) -> str:
    return name.split("+", 1)[0]


def run_seed(run: Mapping[str, Any]) -> int | None:
    seed = (run.get("config") or {}).get("seed")
    return int(seed) if isinstance(seed, (int, float)) and not isinstance(seed, bool) else None


def time_key(stamp: Any) -> str:
    """An ISO time as a string that sorts as time: UTC, microseconds, ``+00:00`` (a time that names no
    zone is UTC, :func:`vitexp.ledger.schema.started_at`); an unreadable one as given, empty when none."""
    if not stamp:
        return ""
    try:
        return started_at(str(stamp)).astimezone(_dt.timezone.utc).isoformat(timespec="microseconds")
    except ValueError:
        return str(stamp)


def _order(r: Mapping[str, Any]) -> tuple[str, str]:
    """A run's place in time: its start as time, ties by run id (wherever its entry lives)."""
    return (time_key(r.get("started")), r.get("run_id", ""))


@dataclass
class RowQuery:
    """What a table row asks of the ledger: its ledger ``name``, base ``experiment``, ``seeds``
    (``None``: unseeded), ``config(seed)``, its composed resolved config (``None``: it does not
    compose today), ``default_of(key, config)``, the default of a dotted key in its group file,
    resolved in ``config`` (:data:`vitexp.ledger.fingerprint.NO_DEFAULT` when it has none), and
    ``own_name``: only runs recorded under ``name`` (a start that other rows load by ``run:<name>``,
    whose configuration another row's run may share)."""

    name: str
    experiment: str
    seeds: Sequence[int] | None = None
    config: Callable[[int | None], Mapping[str, Any] | None] | None = None
    own_name: bool = False
    default_of: Callable[[str, Mapping[str, Any]], Any] | None = None
    _memo: dict = field(default_factory=dict, repr=False)

    def composed(self, seed: int | None) -> Mapping[str, Any] | None:
        if seed not in self._memo:
            self._memo[seed] = self.config(seed) if self.config else None
        return self._memo[seed]

    def defaults(self, seed: int | None) -> Callable[[str], Any] | None:
        """``default_of`` for the row's config of ``seed``."""
        config = self.composed(seed)
        if self.default_of is None or config is None:
            return None
        known = self._memo.setdefault(("defaults", seed), {})

        def default(key: str) -> Any:
            if key not in known:
                known[key] = self.default_of(key, config)
            return known[key]

        return default

    def all_seeds(self) -> list[int | None]:
        return list(self.seeds) if self.seeds is not None else [None]


class Ledger:
    """Every entry of one ledger, checked and indexed (module docstring)."""

    def __init__(
        self, records: Iterable[dict[str, Any]], broken: Iterable[BrokenEntry] = (), source: str = ""
    ):
        self.records = sorted(records, key=_order)  # by time, ties by run id (not by where an entry lives)
        self._rank = {id(r): i for i, r in enumerate(self.records)}
        self.broken = list(broken)
        self.source = source
        self._by_id = {r["run_id"]: r for r in self.records}
        self._by_name: dict[str, list[dict[str, Any]]] = {}
        self._by_fp: dict[str, list[dict[str, Any]]] = {}
        self._by_weightless: dict[str, list[dict[str, Any]]] = {}
        for r in self.records:
            self._by_name.setdefault(r["experiment"], []).append(r)
        for r in self.records:
            key = fp.of_record(r, self.experiment_of)
            if key:
                self._by_fp.setdefault(key, []).append(r)
                if r["kind"] in fp.WEIGHTLESS_KINDS:
                    self._by_weightless.setdefault(fp.weightless(r.get("config") or {}), []).append(r)
        self._finished: dict[str, tuple[list[str], list[tuple[str, str]]]] = {}
        #: {row name: {run id: the config keys that keep that run under the row's name out of the row}}
        self.unmatched: dict[str, dict[str, list[str]]] = {}

    # -- loading -----------------------------------------------------------------------------------
    @classmethod
    def load(cls, source: Path | str | None = None) -> "Ledger":
        """The ledger of a results root (its ``runs/`` and its packs ``ledger/*.jsonl.gz``), a ``runs``
        folder (with the packs beside it), or a snapshot file;
        default: :func:`vitexp.ledger.paths.default_results_dir`."""
        from vitexp.ledger.paths import default_results_dir

        path = Path(source) if source else default_results_dir()
        if is_snapshot(path):
            records, broken = read_snapshot(path)
        else:
            runs = (
                path
                if path.name == "runs" or (not (path / "runs").is_dir() and any(path.glob("*.json")))
                else path / "runs"
            )
            records, broken = read_root(runs.parent, runs)  # the packs beside runs/ too (vitexp.ledger.packs)
        return cls(records, broken, str(path))

    @classmethod
    def wandb(cls, project: str) -> "Ledger":
        records, broken = read_wandb(project)
        return cls(records, broken, f"W&B {project}")

    @classmethod
    def of(cls, runs: "Ledger | Iterable[dict[str, Any]]") -> "Ledger":
        """``runs`` as a ledger: itself, or records of this process (their paths made portable as a
        run writes them, :func:`vitexp.ledger.paths.portable_paths`; then checked like files)."""
        if isinstance(runs, Ledger):
            return runs
        from vitexp.ledger.paths import portable_paths
        from vitexp.ledger.sources import check

        pairs = [
            check(portable_paths(r) if isinstance(r, dict) else r, f"record {i}") for i, r in enumerate(runs)
        ]
        return cls([g for g, _ in pairs if g], [b for _, b in pairs if b], "records")

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.records)

    def __len__(self) -> int:
        return len(self.records)

    # -- broken entries ----------------------------------------------------------------------------
    def broken_for(
        self, names: Iterable[str] | None = None, rows: Iterable[RowQuery] = ()
    ) -> list[BrokenEntry]:
        """The broken entries a result about ``names`` (ledger names; ``None``: anything) and ``rows``
        could depend on (module docstring): those recorded under one of the names' experiments (by
        the entry, else by its file's name), or that do not say; and those whose config could be one
        of the ``rows``' (no readable config: any row that composes)."""
        if names is None:
            return list(self.broken)
        if not self.broken:
            return []
        bases = {base_of(n) for n in names}
        safe = {"".join(c if c.isalnum() or c in "-_" else "-" for c in b) for b in bases}
        rows = list(rows)
        out = []
        for b in self.broken:
            named = (b.record or {}).get("experiment")
            if isinstance(named, str):
                hit = base_of(named) in bases
            else:  # by the file's name: <date>-<time>-<kind>-<experiment>-<suffix>.json
                parts = Path(b.path.split(":")[0]).stem.split("-", 3)
                hit = len(parts) < 4 or any(parts[3].rsplit("-", 1)[0].startswith(s) for s in safe)
            if hit or any(self._could_be(b, row) for row in rows):
                out.append(b)
        return out

    def _could_be(self, broken: BrokenEntry, row: RowQuery) -> bool:
        """Whether ``broken`` could be a run of ``row`` by its config (module docstring)."""
        config = (broken.record or {}).get("config")
        if isinstance(config, Mapping) and not fp.is_run_config(config):
            return False  # a config that is no run's (an audit's arguments) matches no row
        weightless = (broken.record or {}).get("kind") in fp.WEIGHTLESS_KINDS
        for seed in row.all_seeds():
            today = row.composed(seed)
            if today is None:
                return False  # a row that does not compose is matched by name only
            if not isinstance(config, Mapping):  # lost with the rest of the file: it could be this row's
                return True
            if not fp.differences(config, today, self.experiment_of, weightless, row.defaults(seed)):
                return True
        return False

    def check(self, names: Iterable[str] | None = None, what: str | None = None) -> None:
        """Raise :class:`LedgerError` naming the broken entries :meth:`broken_for` ``names`` finds."""
        broken = self.broken_for(names)
        if broken:
            raise LedgerError(broken, what or self.source or "the ledger")

    # -- single runs -------------------------------------------------------------------------------
    def get(self, run_id: str) -> dict[str, Any] | None:
        return self._by_id.get(run_id)

    @property
    def rebuilt(self) -> set[str]:
        """The runs a rerun at their recorded commit rebuilt (:func:`vitexp.ledger.marks.rebuilt`)."""
        if not hasattr(self, "_rebuilt"):
            from vitexp.ledger.marks import rebuilt

            self._rebuilt = rebuilt(self.records)
        return self._rebuilt

    def experiment_of(self, run_id: str) -> str:
        """The experiment of entry ``run_id`` (``run_id`` itself when there is none: an experiment)."""
        run = self._by_id.get(run_id)
        return run["experiment"] if run else run_id

    def named(self, name: str) -> list[dict[str, Any]]:
        """Every entry recorded under ``name``, any status, oldest first."""
        return self._by_name.get(name, [])

    def completed(self, name: str | None = None, kind: str | None = None) -> list[dict[str, Any]]:
        runs = self.records if name is None else self.named(name)
        return [r for r in runs if r["status"] == "completed" and (kind is None or r["kind"] == kind)]

    def newest(
        self, ref: str, kind: str | None = "train", where: Callable[[dict[str, Any]], bool] | None = None
    ) -> dict[str, Any] | None:
        """The completed run ``ref`` (a run id), else the newest completed run recorded under the
        name ``ref``, of ``kind`` and passing ``where``; ``None`` when there is none."""
        pinned = self._by_id.get(ref)
        runs = [pinned] if pinned is not None else self.named(ref)
        for r in reversed(runs):
            if (
                r["status"] == "completed"
                and (kind is None or r["kind"] == kind)
                and (where is None or where(r))
            ):
                return r
        return None

    def find(
        self, ref: str, key: str, kind: str = "train", where: Callable[[dict[str, Any]], bool] | None = None
    ) -> dict[str, Any]:
        """:meth:`newest`, or ``FileNotFoundError`` naming the config ``key`` that asked and what to run."""
        run = self.newest(ref, kind, where)
        if run is None:
            raise FileNotFoundError(
                f"{key}={ref}: no completed {kind} run with that id or experiment in "
                f"{self.source}; run `vitexp-train experiment={base_of(ref)}` first"
            )
        return run

    def start_of(self, run: Mapping[str, Any]) -> str | None:
        """The id of the run whose weights ``run`` loaded (``backbone.pretrained``): ``run:<run_id>``
        as recorded, or for ``run:<experiment>`` the newest (by start) completed train run of that
        experiment that had finished when ``run`` started; ``None`` when it loaded no run."""
        ref = str(((run.get("config") or {}).get("backbone") or {}).get("pretrained") or "")
        if not ref.startswith(RUN_PREFIX):
            return None
        target = ref[len(RUN_PREFIX) :]
        if target in self._by_id:
            return target
        if target not in self._finished:
            done = sorted(
                ((time_key(r.get("finished")), r) for r in self.completed(target, "train")),
                key=lambda p: (p[0], p[1]["run_id"]),
            )
            best: list[tuple[str, str]] = []
            for _, r in done:  # the newest start among the runs finished so far
                best.append(max(best[-1], _order(r)) if best else _order(r))
            self._finished[target] = ([f for f, _ in done], best)
        finished, best = self._finished[target]
        i = bisect.bisect_right(finished, time_key(run.get("started")))
        return best[i - 1][1] if i else None

    def evaluations(self, before: Iterable[str] = ()) -> dict[str, dict[str, Any]]:
        """{train run id: its newest completed eval entry}; an entry whose id is not in ``before``
        counts as newer than every entry that is (start times have a resolution of one second)."""
        before = set(before)
        entries = [
            r
            for r in self.records
            if r["kind"] == "eval" and r["status"] == "completed" and r.get("evaluates")
        ]
        return {r["evaluates"]: r for r in sorted(entries, key=lambda r: r["run_id"] not in before)}  # stable

    # -- rows --------------------------------------------------------------------------------------
    def row_runs(self, row: RowQuery) -> dict[int | None, list[dict[str, Any]]]:
        """{seed (``None`` for an unseeded row): the row's runs of that seed, any status, oldest
        first} (module docstring)."""
        out = {}
        for seed in row.all_seeds():
            names = [row.name] if seed is None else [seeded_name(row.name, seed), row.name]
            by_name = [
                r for n in dict.fromkeys(names) for r in self.named(n) if seed is None or run_seed(r) == seed
            ]
            config = row.composed(seed) if row.config else None
            found = (
                by_name if config is None else self._matching(row.name, by_name, config, row.defaults(seed))
            )
            if seed is not None:
                found = [r for r in found if run_seed(r) == seed]
            if row.own_name:
                found = [r for r in found if r["experiment"] in names]
            out[seed] = sorted(found, key=lambda r: self._rank[id(r)])
        return out

    def _matching(
        self,
        name: str,
        named: list[dict[str, Any]],
        config: Mapping[str, Any],
        default_of: Callable[[str], Any] | None,
    ) -> list[dict[str, Any]]:
        """The runs of ``config``: every run with its fingerprint (a FLOPs count or a timing: whatever its
        ``backbone.pretrained``, :data:`vitexp.ledger.fingerprint.WEIGHTLESS_KINDS`), and those of ``named``
        (the row's
        runs under its names) whose recorded config differs from today's by no key
        (:func:`vitexp.ledger.fingerprint.differences`). The other runs under the row's names are
        kept in :attr:`unmatched` with the keys that separate them (``vitexp-tables`` says so)."""
        found = {id(r): r for r in self._by_fp.get(fp.fingerprint(config, self.experiment_of), [])}
        for r in self._by_weightless.get(fp.weightless(config), []):
            found.setdefault(id(r), r)
        flat: dict[bool, dict[str, str]] = {}  # today's config flattened once, compared with each run
        for r in named:
            if id(r) in found:
                continue
            weightless = r["kind"] in fp.WEIGHTLESS_KINDS
            if weightless not in flat:
                flat[weightless] = fp.flattened(config, weightless, self.experiment_of)
            keys = fp.differences(
                r.get("config") or {}, config, self.experiment_of, weightless, default_of, flat[weightless]
            )
            if keys:
                self.unmatched.setdefault(name, {})[r["run_id"]] = keys
            else:
                found[id(r)] = r
        return list(found.values())
