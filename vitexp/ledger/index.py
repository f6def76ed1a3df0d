"""The ledger as one indexed object: :class:`Ledger` loads a results folder, a snapshot or a W&B
project once, keeps every entry that keeps the schema (and the broken ones aside), and answers the
queries the commands need, each from an index (by run id, by name, by fingerprint), so that a table
is linear in runs + cells.

Decisions:
- Entries are ordered oldest first by ``started`` (files: then by run id; records handed in: then
  in the order given); "the newest" is the last in that order.
- A row's runs (:meth:`Ledger.row_runs`): the runs whose fingerprint is the row's composed config's
  (:mod:`vitexp.ledger.fingerprint`), whatever their name; plus the entries written before
  fingerprints, which are matched by their name (the row's, or ``<name>+seed=<s>``) as they were
  when the committed tables were made. Such older runs of one row that disagree with one another on
  what their names never said (the ``trainer`` keys, ``backbone.pretrained``) are checked against
  the row's config, and only those that agree with it are kept (a ``trainer.limit_train_batches=1``
  run recorded under the experiment's name is never a cell). A start row (``RowQuery.own_name``)
  keeps only the runs under its own names: ``run:<name>`` loads the newest run so named, and a
  from-scratch row with the start's exact configuration must not take its place.
- The row's config is composed (Hydra, a fraction of a second) only for a row that needs it: one
  whose experiment or name has fingerprinted runs, or whose older runs disagree.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

from vitexp.ledger import fingerprint as fp
from vitexp.ledger.schema import BrokenEntry, LedgerError
from vitexp.ledger.packs import read_root
from vitexp.ledger.sources import is_snapshot, read_snapshot, read_wandb

RUN_PREFIX = fp.RUN_PREFIX
SEED_NAME = "{name}+seed={seed}"
#: Keys an older entry's name never reflected and that change what is measured (the legacy check).
LEGACY_CHECKED = ("trainer.", "backbone.pretrained")


def seeded_name(name: str, seed: int | str) -> str:
    """The ledger name of one seed of a row as vitexp-sweep launches it (``<name>+seed=<s>``)."""
    return SEED_NAME.format(name=name, seed=seed)


def base_of(name: str) -> str:
    return name.split("+", 1)[0]


def run_seed(run: Mapping[str, Any]) -> int | None:
    seed = (run.get("config") or {}).get("seed")
    return int(seed) if isinstance(seed, (int, float)) and not isinstance(seed, bool) else None


def _order(r: Mapping[str, Any]) -> tuple[str, str]:
    return (r.get("started") or "", r.get("run_id", ""))


@dataclass
class RowQuery:
    """What a table row asks of the ledger: its ledger ``name``, base ``experiment``, ``seeds``
    (``None``: unseeded), ``config(seed)``, its composed resolved config (called only when needed), and
    ``own_name``: only runs recorded under ``name`` (a start that other rows load by ``run:<name>``,
    whose configuration another row's run may share)."""

    name: str
    experiment: str
    seeds: Sequence[int] | None = None
    config: Callable[[int | None], Mapping[str, Any] | None] | None = None
    own_name: bool = False
    _memo: dict = field(default_factory=dict, repr=False)

    def composed(self, seed: int | None) -> Mapping[str, Any] | None:
        if seed not in self._memo:
            self._memo[seed] = self.config(seed) if self.config else None
        return self._memo[seed]


class Ledger:
    """Every entry of one ledger, checked and indexed (module docstring)."""

    def __init__(self, records: Iterable[dict[str, Any]], broken: Iterable[BrokenEntry] = (), source: str = ""):
        self.records = sorted(records, key=lambda r: r.get("started") or "")  # stable: ties keep the given order
        self._rank = {id(r): i for i, r in enumerate(self.records)}
        self.broken = list(broken)
        self.source = source
        self._by_id = {r["run_id"]: r for r in self.records}
        self._by_name: dict[str, list[dict[str, Any]]] = {}
        self._by_fp: dict[str, list[dict[str, Any]]] = {}
        self._fp_bases: set[str] = set()
        for r in self.records:
            self._by_name.setdefault(r["experiment"], []).append(r)
        self._by_weightless: dict[str, list[dict[str, Any]]] = {}
        for r in self.records:
            key = fp.of_record(r, self.experiment_of)
            if key:
                self._by_fp.setdefault(key, []).append(r)
                self._fp_bases.add(base_of(r["experiment"]))
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
            runs = path if path.name == "runs" or (not (path / "runs").is_dir() and any(path.glob("*.json"))) \
                else path / "runs"
            records, broken = read_root(runs.parent, runs)  # the packs beside runs/ too (vitexp.ledger.packs)
        return cls(records, broken, str(path))

    @classmethod
    def wandb(cls, project: str) -> "Ledger":
        records, broken = read_wandb(project)
        return cls(records, broken, f"W&B {project}")

    @classmethod
    def of(cls, runs: "Ledger | Iterable[dict[str, Any]]") -> "Ledger":
        """``runs`` as a ledger: itself, or records (checked like files)."""
        if isinstance(runs, Ledger):
            return runs
        from vitexp.ledger.sources import check

        pairs = [check(r, f"record {i}") for i, r in enumerate(runs)]
        return cls([g for g, _ in pairs if g], [b for _, b in pairs if b], "records")

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.records)

    def __len__(self) -> int:
        return len(self.records)

    # -- broken entries ----------------------------------------------------------------------------
    def broken_for(self, names: Iterable[str] | None = None) -> list[BrokenEntry]:
        """The broken entries a result about ``names`` (ledger names; ``None``: anything) could
        depend on: those recorded under one of their experiments, or that do not say."""
        if names is None:
            return list(self.broken)
        bases = {base_of(n) for n in names}
        safe = {"".join(c if c.isalnum() or c in "-_" else "-" for c in b) for b in bases}
        out = []
        for b in self.broken:
            named = (b.record or {}).get("experiment")
            if isinstance(named, str):
                hit = base_of(named) in bases
            else:  # by the file's name: <date>-<time>-<kind>-<experiment>-<suffix>.json
                parts = Path(b.path.split(":")[0]).stem.split("-", 3)
                hit = len(parts) < 4 or any(parts[3].rsplit("-", 1)[0].startswith(s) for s in safe)
            if hit:
                out.append(b)
        return out

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

    def newest(self, ref: str, kind: str | None = "train",
               where: Callable[[dict[str, Any]], bool] | None = None) -> dict[str, Any] | None:
        """The completed run ``ref`` (a run id), else the newest completed run recorded under the
        name ``ref``, of ``kind`` and passing ``where``; ``None`` when there is none."""
        pinned = self._by_id.get(ref)
        runs = [pinned] if pinned is not None else self.named(ref)
        for r in reversed(runs):
            if r["status"] == "completed" and (kind is None or r["kind"] == kind) and (where is None or where(r)):
                return r
        return None

    def find(self, ref: str, key: str, kind: str = "train",
             where: Callable[[dict[str, Any]], bool] | None = None) -> dict[str, Any]:
        """:meth:`newest`, or ``FileNotFoundError`` naming the config ``key`` that asked and what to run."""
        run = self.newest(ref, kind, where)
        if run is None:
            raise FileNotFoundError(f"{key}={ref}: no completed {kind} run with that id or experiment in "
                                    f"{self.source}; run `vitexp-train experiment={base_of(ref)}` first")
        return run

    def start_of(self, run: Mapping[str, Any]) -> str | None:
        """The id of the run whose weights ``run`` loaded (``backbone.pretrained``): ``run:<run_id>``
        as recorded, or for ``run:<experiment>`` the newest (by start) completed train run of that
        experiment that had finished when ``run`` started; ``None`` when it loaded no run."""
        ref = str(((run.get("config") or {}).get("backbone") or {}).get("pretrained") or "")
        if not ref.startswith(RUN_PREFIX):
            return None
        target = ref[len(RUN_PREFIX):]
        if target in self._by_id:
            return target
        if target not in self._finished:
            done = sorted(((r.get("finished") or "", r) for r in self.completed(target, "train")), key=lambda p: p[0])
            best: list[tuple[str, str]] = []
            for _, r in done:  # the newest start among the runs finished so far
                best.append(max(best[-1], _order(r)) if best else _order(r))
            self._finished[target] = ([f for f, _ in done], best)
        finished, best = self._finished[target]
        i = bisect.bisect_right(finished, run.get("started") or "")
        return best[i - 1][1] if i else None

    def evaluations(self, before: Iterable[str] = ()) -> dict[str, dict[str, Any]]:
        """{train run id: its newest completed eval entry}; an entry whose id is not in ``before``
        counts as newer than every entry that is (start times have a resolution of one second)."""
        before = set(before)
        entries = [r for r in self.records if r["kind"] == "eval" and r["status"] == "completed" and r.get("evaluates")]
        return {r["evaluates"]: r for r in sorted(entries, key=lambda r: r["run_id"] not in before)}  # stable

    # -- rows --------------------------------------------------------------------------------------
    def row_runs(self, row: RowQuery) -> dict[int | None, list[dict[str, Any]]]:
        """{seed (``None`` for an unseeded row): the row's runs of that seed, any status, oldest
        first} (module docstring). Fingerprinted runs under the row's names whose config cannot be
        composed today (an experiment file since removed) are matched by name."""
        seeds: Sequence[int | None] = list(row.seeds) if row.seeds is not None else [None]
        elsewhere = bool({base_of(row.name), row.experiment} & self._fp_bases)
        out = {}
        for seed in seeds:
            names = [row.name] if seed is None else [seeded_name(row.name, seed), row.name]
            by_name = [r for n in dict.fromkeys(names) for r in self.named(n) if seed is None or run_seed(r) == seed]
            legacy = self._agreeing(self._current_options([r for r in by_name if not r.get("fingerprint")], row, seed),
                                    row, seed)
            newer = [r for r in by_name if r.get("fingerprint")]
            config = row.composed(seed) if newer or elsewhere else None
            found = newer if config is None else self._matching(row.name, newer, config)
            if seed is not None:
                found = [r for r in found if run_seed(r) == seed]
            if row.own_name:
                found = [r for r in found if r["experiment"] in names]
            out[seed] = sorted({id(r): r for r in [*legacy, *found]}.values(), key=lambda r: self._rank[id(r)])
        return out

    def _matching(self, name: str, named: list[dict[str, Any]], config: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The runs of ``config``: every run with its fingerprint (a FLOPs count or a timing: whatever its
        ``backbone.pretrained``, :data:`vitexp.ledger.fingerprint.WEIGHTLESS_KINDS`), and those of ``named`` (the row's
        fingerprinted runs under its name) whose recorded config differs from today's only by keys
        added since (:func:`vitexp.ledger.fingerprint.differences`). The other runs under the row's
        name are kept in :attr:`unmatched` with the keys that separate them (``vitexp-tables`` says so)."""
        found = list(self._by_fp.get(fp.fingerprint(config, self.experiment_of), []))
        found += [r for r in self._by_weightless.get(fp.weightless(config), []) if r not in found]
        exact = {id(r) for r in found}
        for r in named:
            if id(r) in exact:
                continue
            keys = fp.differences(r.get("config") or {}, config, self.experiment_of, r["kind"] in fp.WEIGHTLESS_KINDS)
            if keys:
                self.unmatched.setdefault(name, {})[r["run_id"]] = keys
            else:
                found.append(r)
        return found

    def _checked(self, run: Mapping[str, Any]) -> tuple:
        config = fp.strip(run.get("config") or {})
        leaves = fp.leaves(config)
        ref = str(leaves.get("backbone.pretrained") or "")
        if ref.startswith(RUN_PREFIX):
            leaves["backbone.pretrained"] = RUN_PREFIX + self.experiment_of(ref[len(RUN_PREFIX):])
        return tuple(sorted((k, repr(v)) for k, v in leaves.items() if k.startswith(LEGACY_CHECKED)))

    def _current_options(self, legacy: list[dict[str, Any]], row: RowQuery, seed: int | None) -> list[dict[str, Any]]:
        """The older runs of a row without those that predate an option of
        :data:`vitexp.ledger.fingerprint.CHANGED_DEFAULTS` the row sets to another value (the row is
        composed only when a run lacks such an option)."""
        suspects = [r for r in legacy if r["kind"] not in fp.WEIGHTLESS_KINDS  # how it trains: not what it costs
                    and fp.lacks_changed_default(r.get("config") or {})]
        config = row.composed(seed) if suspects and row.config is not None else None
        if config is None:
            return legacy
        stale = {id(r) for r in suspects if fp.changed_defaults(r.get("config") or {}, config)}
        return [r for r in legacy if id(r) not in stale]

    def _agreeing(self, legacy: list[dict[str, Any]], row: RowQuery, seed: int | None) -> list[dict[str, Any]]:
        """The older runs of a row that agree with its config where they disagree with one another."""
        done = [r for r in legacy if r["status"] == "completed"]
        if len({self._checked(r) for r in done}) < 2 or row.config is None:
            return legacy
        config = row.composed(seed)
        if config is None:
            return legacy
        want = self._checked({"config": config})
        keys = {k for k, _ in want}
        kept = [r for r in legacy if {(k, v) for k, v in self._checked(r) if k in keys} <= set(want)]
        return kept if any(r["status"] == "completed" for r in kept) else legacy
