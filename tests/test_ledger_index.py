"""The indexed ledger (vitexp.ledger): broken entries are errors that name their file, a row takes only
runs of its own configuration, the ledger scales to 20,000 entries, and a snapshot regenerates the tables.

The two accidents of issue 26, reproduced: a truncated copy of the newest run of a shared start
(vitexp-tables wrote the older start's number without a word), and ``vitexp-train
trainer.limit_train_batches=1`` recorded as ``demo`` (the demo row showed its 9.4 %)."""

from __future__ import annotations

import copy
import datetime
import json
import time
from pathlib import Path

import pytest
from conftest import run_config

from vitexp.commands import recheck
from vitexp.config import rows
from vitexp.config.rows import composed_config, row_query
from vitexp.ledger import Ledger, LedgerEntry, RowQuery, portable_paths
from vitexp.ledger.fingerprint import fingerprint
from vitexp.report import tables

SHARED = {
    "title": "t",
    "seeds": [0],
    "columns": [{"key": "top1", "label": "Top-1", "digits": 2}],
    "rows": [{"label": "start", "experiment": "pre", "seeds": None}, {"label": "ft", "experiment": "ft"}],
}


def _entry(results_dir: Path, name: str, config: dict, top1: float, started: str, kind: str = "train") -> str:
    config = run_config(top=config) if kind == "train" else config  # a train entry's config is a run's
    entry = LedgerEntry(name, kind, config, results_dir).start()
    entry.record["started"] = started
    entry.finish({"top1": top1})
    return entry.run_id


def _spec_file(tmp_path: Path, spec: dict) -> Path:
    path = tmp_path / "shared_start.yaml"
    path.write_text(json.dumps(spec))
    return path


def _last_line(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_a_truncated_entry_stops_the_table_and_skip_broken_lists_it(results_dir, tmp_path, capsys):
    """Accident 1: the newest run of the shared start is a truncated file. vitexp-tables refuses to
    write the table (exit 1, the file and what is wrong named); with --skip-broken it writes it and
    lists the file under the table and in the closing line."""
    _entry(results_dir, "pre", {"seed": 0}, 87.49, "2026-01-01T00:00:00+00:00")
    newest = _entry(results_dir, "pre", {"seed": 0}, 88.66, "2026-01-02T00:00:00+00:00")
    path = results_dir / "runs" / f"{newest}.json"
    path.write_text(path.read_text()[:200])  # an interrupted copy
    spec = _spec_file(tmp_path, SHARED)
    out = tmp_path / "tables"
    assert tables.main([str(spec), "--results-dir", str(results_dir), "--out", str(out)]) == 1
    closing = _last_line(capsys)
    assert closing["status"] == "failed" and f"runs/{newest}.json: not JSON" in closing["error"]
    assert "--skip-broken" in closing["error"] and not out.exists()
    assert (
        tables.main([str(spec), "--results-dir", str(results_dir), "--out", str(out), "--skip-broken"]) == 0
    )
    closing = _last_line(capsys)
    assert closing["skipped_broken"] == [
        f"runs/{newest}.json: not JSON (Unterminated string starting at: line 5 "
        "column 11 at line 5, column 11: a truncated copy or a merge conflict?)"
    ] or closing["skipped_broken"][0].startswith(f"runs/{newest}.json: not JSON")
    md = (out / "shared_start.md").read_text()
    assert "87.49" in md and f"Left out by --skip-broken: runs/{newest}.json" in md


def test_a_broken_entry_of_another_experiment_does_not_stop_a_table(results_dir, tmp_path):
    _entry(results_dir, "pre", {"seed": 0}, 88.66, "2026-01-02T00:00:00+00:00")
    other = _entry(results_dir, "unrelated", {"seed": 0}, 1.0, "2026-01-02T00:00:00+00:00")
    (results_dir / "runs" / f"{other}.json").write_text("{")
    assert (
        tables.main(
            [
                str(_spec_file(tmp_path, SHARED)),
                "--results-dir",
                str(results_dir),
                "--out",
                str(tmp_path / "t"),
            ]
        )
        == 0
    )


def test_a_shared_start_shows_the_run_its_fine_tunes_load_not_a_newer_copy_under_another_name(results_dir):
    """A run of the start's exact configuration under another name (a from-scratch row's seed 0) is
    not the start: the seeded rows load ``run:<start name>``, the newest run so named."""
    spec = {
        "title": "t",
        "seeds": [0],
        "columns": [{"key": "top1", "label": "Top-1", "digits": 2}],
        "rows": [{"label": "start", "experiment": "demo", "seeds": None}],
    }
    start = _entry(results_dir, "demo", _demo_config(), 95.3, "2026-01-01T00:00:00+00:00")
    _entry(results_dir, "demo_scratch+seed=0", _demo_config(), 96.0, "2026-01-03T00:00:00+00:00")
    (row,) = tables.fill(spec, Ledger.load(results_dir))
    assert row["cells"]["top1"]["run_id"] == start
    (row,) = tables.fill(
        {**spec, "seeds": None, "rows": [{"label": "demo", "experiment": "demo"}]}, Ledger.load(results_dir)
    )
    assert row["cells"]["top1"]["value"] == 96.0  # an ordinary row takes its configuration's newest run
    (row,) = tables.fill(
        {**spec, "seeds": None, "rows": [{"label": "demo", "experiment": "demo", "start": True}]},
        Ledger.load(results_dir),
    )
    assert row["cells"]["top1"]["run_id"] == start  # marked as a start, it takes only runs under its name
    assert [c["run_id"] for c in recheck.cited_runs(spec, results_dir)] == [
        start
    ]  # the check cites the same run


def _demo_config(**trainer) -> dict:
    config = copy.deepcopy(composed_config(("experiment=demo",), None))
    config["trainer"].update(trainer)
    return config


DEMO = {
    "name": "demo",
    "title": "t",
    "columns": [
        {"key": "top1", "label": "Top-1", "digits": 1},
        {"key": "throughput", "label": "tp", "digits": 0},
    ],
    "rows": [{"label": "demo", "experiment": "demo"}],
}


def test_a_stray_run_recorded_as_demo_by_older_code_is_not_the_demo_row(results_dir):
    """Accident 2 with entries written before fingerprints: a trainer.limit_train_batches=1 run that
    older code recorded as ``demo`` (newer than the real one) does not replace its cell."""
    real = _entry(results_dir, "demo", _demo_config(), 95.3, "2026-01-01T00:00:00+00:00")
    _entry(results_dir, "demo", _demo_config(limit_train_batches=1), 9.4, "2026-01-02T00:00:00+00:00")
    for path in (results_dir / "runs").glob("*.json"):  # as older code wrote them: no fingerprint
        record = json.loads(path.read_text())
        record.pop("fingerprint")
        path.write_text(json.dumps(record))
    (row,) = tables.fill(DEMO, Ledger.load(results_dir))
    assert row["cells"]["top1"]["value"] == 95.3 and row["cells"]["top1"]["run_id"] == real


def test_a_row_takes_only_runs_of_its_configuration_whatever_their_name(results_dir):
    """Accident 2 with today's entries: the stray run's fingerprint is another configuration's, so it
    is never a cell of the demo row even under the name ``demo``; a run of demo's exact
    configuration under another name is one. The row's metrics all come from one run."""
    real = _entry(results_dir, "demo", _demo_config(), 95.3, "2026-01-01T00:00:00+00:00")
    LedgerEntry("demo", "train", _demo_config(), results_dir).start()  # running: not a cell
    stray = LedgerEntry("demo", "train", _demo_config(limit_train_batches=1), results_dir).start()
    stray.record["started"] = "2026-01-02T00:00:00+00:00"
    stray.finish({"top1": 9.4, "throughput": 999.0})
    ledger = Ledger.load(results_dir)
    assert ledger.get(real)["fingerprint"] != ledger.get(stray.run_id)["fingerprint"]
    (row,) = tables.fill(DEMO, ledger)
    assert row["cells"]["top1"]["run_id"] == real and row["cells"]["throughput"]["value"] is None
    renamed = _entry(results_dir, "my_demo", _demo_config(), 96.0, "2026-01-03T00:00:00+00:00")
    rows._COMPOSED.clear()  # composed afresh, inside the table's one Hydra initialisation
    (row,) = tables.fill(DEMO, Ledger.load(results_dir))
    assert row["cells"]["top1"]["run_id"] == renamed
    from hydra.core.global_hydra import GlobalHydra

    assert not GlobalHydra.instance().is_initialized()  # the rows' compositions leave Hydra as they found it


def test_a_run_from_before_a_new_default_stays_in_its_row_and_a_stray_key_keeps_it_out(
    results_dir, capsys, tmp_path
):
    """An option added to the configs after a run (a key today's config has and the run's lacks)
    does not drop the run from its row; a key the run has and today's config lacks does, and
    vitexp-tables names the run and the key."""
    real = _entry(results_dir, "demo", _demo_config(), 95.3, "2026-01-01T00:00:00+00:00")
    older = dict(_demo_config())
    older["trainer"] = {k: v for k, v in older["trainer"].items() if k != "deterministic"}
    for path in (results_dir / "runs").glob("*.json"):  # written before trainer.deterministic existed
        record = json.loads(path.read_text())
        record["config"], record["fingerprint"] = portable_paths(older, results_dir), fingerprint(older)
        path.write_text(json.dumps(record))
    assert "deterministic" in _demo_config()["trainer"]
    (row,) = tables.fill(DEMO, Ledger.load(results_dir))
    assert row["cells"]["top1"]["run_id"] == real
    stray_config = _demo_config()
    stray_config["trainer"]["my_new_knob"] = 3
    stray = _entry(results_dir, "demo", stray_config, 9.4, "2026-01-02T00:00:00+00:00")
    rows._COMPOSED.clear()
    ledger = Ledger.load(results_dir)
    (row,) = tables.fill(DEMO, ledger)
    assert row["cells"]["top1"]["run_id"] == real
    assert ledger.unmatched == {"demo": {stray: ["trainer.my_new_knob"]}}
    spec = tmp_path / "demo.yaml"
    spec.write_text(json.dumps(DEMO))
    assert tables.main([str(spec), "--results-dir", str(results_dir), "--out", str(tmp_path / "t")]) == 0
    assert f"{stray} (trainer.my_new_knob)" in capsys.readouterr().err


def _without_fingerprint(results_dir: Path, run_id: str, **changes) -> None:
    """Rewrite entry ``run_id`` as older code wrote it: no ``fingerprint`` (and ``changes`` applied)."""
    path = results_dir / "runs" / f"{run_id}.json"
    record = json.loads(path.read_text())
    record.pop("fingerprint")
    record.update(changes)
    path.write_text(json.dumps(record))


def test_an_entry_without_a_fingerprint_is_matched_by_its_recorded_config(results_dir, capsys, tmp_path):
    """Reproduction 3 of issue 47: a newer demo entry with recipe.lr=0.5 and no fingerprint filled the
    demo cell (12.3): an entry without one was matched by its name, checked on trainer.* and
    backbone.pretrained only. Its fingerprint is now computed from its config: it is not the demo's."""
    real = _entry(results_dir, "demo", _demo_config(), 94.4, "2026-01-01T00:00:00+00:00")
    stray_config = _demo_config()
    stray_config["recipe"]["lr"] = 0.5
    stray = _entry(results_dir, "demo", stray_config, 12.3, "2026-01-02T00:00:00+00:00")
    for run_id in (real, stray):
        _without_fingerprint(results_dir, run_id)
    ledger = Ledger.load(results_dir)
    (row,) = tables.fill(DEMO, ledger)
    assert row["cells"]["top1"]["run_id"] == real and ledger.unmatched == {"demo": {stray: ["recipe.lr"]}}
    renamed = _entry(results_dir, "renamed", _demo_config(), 95.0, "2026-01-03T00:00:00+00:00")
    _without_fingerprint(results_dir, renamed)  # of the demo's configuration under another name: a cell
    (row,) = tables.fill(DEMO, Ledger.load(results_dir))
    assert row["cells"]["top1"]["run_id"] == renamed


def test_a_key_an_old_run_lacks_matches_only_at_its_group_files_default(results_dir):
    """Reproduction 4 of issue 47: a run recorded without ``data.augment`` (an option added since)
    matched any row, whatever the row's value. It is read at the default of conf/data/digits.yaml
    (false): a row with data.augment=true does not take it, the demo row (false) does."""
    old_config = _demo_config()
    del old_config["data"]["augment"]
    name = "demo+data.augment=true"
    old_aug = _entry(results_dir, name, old_config, 50.0, "2026-01-01T00:00:00+00:00")
    old_demo = _entry(results_dir, "demo", old_config, 94.4, "2026-01-01T00:00:00+00:00")
    for run_id in (old_aug, old_demo):
        _without_fingerprint(results_dir, run_id)
    augmented = {
        **DEMO,
        "rows": [{"label": "augmented", "experiment": "demo", "overrides": ["data.augment=true"]}],
    }
    ledger = Ledger.load(results_dir)
    (row,) = tables.fill(augmented, ledger)
    assert row["cells"]["top1"]["value"] is None and ledger.unmatched[name] == {old_aug: ["data.augment"]}
    (row,) = tables.fill(DEMO, ledger)
    assert row["cells"]["top1"]["run_id"] == old_demo


def test_a_group_default_is_read_from_its_file_with_the_files_it_extends():
    """rows.group_default: a key of a group's file, one it inherits (trainer/gpu.yaml extends cpu.yaml),
    an interpolation resolved in the row's config, a top-level key of train.yaml; NO_DEFAULT else."""
    from vitexp.config.rows import group_default
    from vitexp.ledger.fingerprint import NO_DEFAULT

    config = {"recipe": {"batch_size": 48}, "seed": 3}
    choices = {"trainer": "gpu", "data": "fashion_mnist", "method": "saper_ft"}
    assert group_default("trainer.precision", choices, config) == "bf16-mixed"
    assert group_default("trainer.deterministic", choices, config) is False  # from cpu.yaml
    assert group_default("data.batch_size", choices, config) == 48  # ${recipe.batch_size}
    assert group_default("method.selection_seed", choices, config) == 3  # ${seed}
    assert group_default("method.recover_epochs", choices, config) == 5
    assert group_default("objective", choices, config) == "auto"
    assert group_default("method.nope", choices, config) is NO_DEFAULT
    assert group_default("budget.k", {"budget": "no_such_option"}, config) is NO_DEFAULT


def test_a_run_from_before_an_option_that_changed_what_runs_do_is_not_a_cell_of_a_row_that_sets_it(
    results_dir,
):
    """SAPER's one-stage runs were recorded before method.recover_epochs and method.straight_through
    (fingerprint.CHANGED_DEFAULTS: such a run had 0 and false); a row of today's two stages (2) never
    shows them, a row that asks for no recovery does."""
    job = ("experiment=fmnist_saper_dinov2_micro", "method=saper_ft", "budget.k=3")
    config = copy.deepcopy(composed_config(job, 0))
    assert config["method"]["recover_epochs"] == 2
    for key in ("recover_epochs", "straight_through"):
        config["method"].pop(key, None)
    old = _entry(results_dir, "saper_k3+seed=0", config, 59.3, "2026-01-01T00:00:00+00:00")
    for path in (results_dir / "runs").glob("*.json"):  # as older code wrote it: no fingerprint
        record = json.loads(path.read_text())
        record.pop("fingerprint")
        path.write_text(json.dumps(record))
    spec = {
        "title": "t",
        "seeds": [0],
        "columns": [{"key": "top1", "label": "Top-1", "digits": 1}],
        "rows": [
            {
                "label": "two stages",
                "experiment": "fmnist_saper_dinov2_micro",
                "name": "saper_k3",
                "overrides": ["method=saper_ft", "budget.k=3"],
            }
        ],
    }
    (row,) = tables.fill(spec, Ledger.load(results_dir))
    assert row["cells"]["top1"]["value"] is None
    spec["rows"][0]["overrides"] += ["method.recover_epochs=0", "method.straight_through=false"]
    rows._COMPOSED.clear()
    (row,) = tables.fill(spec, Ledger.load(results_dir))
    assert row["cells"]["top1"]["run_ids"] == [old]


def test_lapsum_runs_from_before_fold_gates_fill_only_a_folded_row_and_the_fixed_rules_keep_theirs(
    results_dir,
):
    """method.fold_gates (default false) changed what LapSum deploys: a LapSum run recorded without it
    folded its gates, so it fills a row with fold_gates=true and not today's row; a fixed rule's run
    without the key folded nothing and still fills its row (fingerprint.CHANGED_DEFAULTS)."""
    base = ("experiment=fmnist_saper_dinov2_micro", "method=saper_ft", "budget.k=6")
    made = {}
    for selection in ("lapsum", "random"):
        config = copy.deepcopy(composed_config((*base, f"method.selection={selection}"), 0))
        assert config["method"].pop("fold_gates") is False
        made[selection] = _entry(
            results_dir, f"{selection}_k6+seed=0", config, 80.0, "2026-01-01T00:00:00+00:00"
        )
    spec = {
        "title": "t",
        "seeds": [0],
        "columns": [{"key": "top1", "label": "Top-1", "digits": 1}],
        "rows": [
            {
                "label": f"{s}",
                "experiment": "fmnist_saper_dinov2_micro",
                "name": f"{s}_k6",
                "overrides": ["method=saper_ft", "budget.k=6", f"method.selection={s}"],
            }
            for s in ("lapsum", "random")
        ],
    }
    lapsum, random = tables.fill(spec, Ledger.load(results_dir))
    assert lapsum["cells"]["top1"]["value"] is None
    assert random["cells"]["top1"]["run_ids"] == [made["random"]]
    spec["rows"][0]["overrides"].append("method.fold_gates=true")
    rows._COMPOSED.clear()
    lapsum, _ = tables.fill(spec, Ledger.load(results_dir))
    assert lapsum["cells"]["top1"]["run_ids"] == [made["lapsum"]]


def test_a_comparison_bench_entry_is_a_cell_of_its_models_row(results_dir):
    """vitexp-bench experiment=peers_throughput_cpu times each model with the comparison's bench
    settings (bench.compare, rounds, device): its entries are cells of the models' rows, whose
    composition has other bench settings (bench.* is not a configuration of the model)."""
    config = copy.deepcopy(composed_config(("experiment=demo",), None))
    config["bench"].update({"compare": ["demo"], "rounds": 3, "device": "cpu"})
    entry = LedgerEntry("demo", "bench", config, results_dir).start()
    entry.finish({"throughput": 123.4}, {"mode": "compare", "device": "cpu"})
    spec = {**DEMO, "protocol": {"mode": "compare"}}
    (row,) = tables.fill(spec, Ledger.load(results_dir))
    assert row["cells"]["throughput"]["value"] == 123.4


def test_a_temporary_file_of_an_atomic_write_is_not_an_entry(results_dir):
    """atomic_write's ``.<name>.XXXX.json`` (mid-write, or left by a kill before its rename) is not
    read as a broken entry."""
    real = _entry(results_dir, "demo", _demo_config(), 95.3, "2026-01-01T00:00:00+00:00")
    (results_dir / "runs" / f".{real}.json.abc123.json").write_text('{"run_id": "')
    ledger = Ledger.load(results_dir)
    assert not ledger.broken and [r["run_id"] for r in ledger.records] == [real]


def test_a_pack_leaves_every_table_as_it_was_and_keeps_what_may_resume(
    results_dir, tmp_path, capsys, monkeypatch
):
    """vitexp-tables --pack folds the completed entries into results/ledger/<time>.jsonl.gz and removes
    their files; the tables written before and after are identical; an interrupted entry stays a file."""
    from vitexp.ledger import packs

    _entry(results_dir, "pre", {"seed": 0}, 88.66, "2026-01-02T00:00:00+00:00")
    _entry(results_dir, "ft+seed=0", {"seed": 0}, 80.0, "2026-01-03T00:00:00+00:00")
    assert packs.pack(results_dir)["packed"] == 0  # written just now: its process may still be closing it
    monkeypatch.setattr(packs, "SETTLED_S", 0)
    open_entry = LedgerEntry("ft+seed=0", "train", run_config(0), results_dir).start()
    open_entry.interrupt("SIGTERM")
    spec = _spec_file(tmp_path, SHARED)
    assert tables.main([str(spec), "--results-dir", str(results_dir), "--out", str(tmp_path / "before")]) == 0
    assert (
        tables.main(
            [str(spec), "--results-dir", str(results_dir), "--out", str(tmp_path / "after"), "--pack"]
        )
        == 0
    )
    assert "packed 2 completed entries" in capsys.readouterr().err
    assert [p.name for p in (results_dir / "runs").glob("*.json")] == [f"{open_entry.run_id}.json"]
    (pack,) = (results_dir / "ledger").glob("*.jsonl.gz")
    for suffix in ("md", "csv", "tex"):
        assert (tmp_path / "before" / f"shared_start.{suffix}").read_bytes() == (
            tmp_path / "after" / f"shared_start.{suffix}"
        ).read_bytes()
    assert len(Ledger.load(results_dir)) == 3


def test_a_pack_keeps_each_entry_as_written_and_readable_by_the_group(results_dir, monkeypatch):
    """A packed entry reads back exactly as its file held it, key order included at every depth
    (the cost table lists a run's stages in the order they ran), and the pack, like every file
    vitexp writes, has the mode the umask gives, not mkstemp's 0600."""
    import os
    import stat

    from vitexp.ledger import packs

    monkeypatch.setattr(packs, "SETTLED_S", 0)
    old_mask = os.umask(0o022)
    try:
        entry = LedgerEntry(
            "two_stage", "train", run_config(top={"seed": 0, "method": {"z": 1, "a": 2}}), results_dir
        ).start()
        entry.finish({"top1": 1.0, "stage_times": {"select": 2.0, "recover": 1.0}})
        written = json.loads(entry.path.read_text())
        assert packs.pack(results_dir)["packed"] == 1
    finally:
        os.umask(old_mask)
    (pack,) = packs.pack_files(results_dir)
    assert json.dumps(Ledger.load(results_dir).get(entry.run_id)) == json.dumps(written)
    assert stat.S_IMODE(pack.stat().st_mode) == 0o644


def test_a_runs_recorded_fingerprint_is_its_rows(make_cfg, results_dir):
    """A real run (vitexp-flops of the demo) records the fingerprint the table composes for its row."""
    from vitexp.commands.inspect import run_flops

    run_flops(make_cfg(["experiment=demo", "logger=none"]))
    ledger = Ledger.load(results_dir)
    (entry,) = ledger.records
    query = row_query(DEMO, DEMO["rows"][0])
    assert [r["run_id"] for r in ledger.row_runs(query)[None]] == [entry["run_id"]]
    assert not ledger.row_runs(row_query(DEMO, DEMO["rows"][0], ["backbone.img_size=64"]))[None]
    # a FLOPs count does not train: another recipe is the same model (fingerprint.WEIGHTLESS_EXCLUDED)
    assert [
        r["run_id"] for r in ledger.row_runs(row_query(DEMO, DEMO["rows"][0], ["recipe.lr=0.5"]))[None]
    ] == [entry["run_id"]]


LRS = [round(0.001 * (1 + j), 4) for j in range(6)]  # a composition per row: ~0.5 s each


def _seed_of(i: int) -> int:
    return i % 3 if i % 2 == 0 else ((i // 2) // len(LRS)) % 3


def _write_many(runs_dir: Path, n: int) -> None:
    """``n`` entries: half as written before fingerprints (matched by name), half fingerprinted runs of
    the demo at 6 learning rates and 3 seeds, each with the config a run records (matched by fingerprint)."""
    runs_dir.mkdir(parents=True)
    configs = {}
    for j, lr in enumerate(LRS):
        base = composed_config(("experiment=demo", f"recipe.lr={lr}", f"name=demo_lr{j}"), None)
        for seed in range(3):
            config = copy.deepcopy(base)
            config["seed"] = seed
            configs[j, seed] = (portable_paths(config, runs_dir.parent), fingerprint(config))
    for i in range(n):
        seed = _seed_of(i)
        record = {
            "run_id": f"r{i:05d}",
            "status": "completed",
            "kind": "train",
            "metrics": {"top1": float(i % 97)},
            "protocol": {"data_order": "seed*1000003+epoch"},
            "env": {},
            "started": f"2026-01-01T{i % 24:02d}:00:00+00:00",
            "finished": None,
            "error": None,
            "wandb_url": None,
        }
        if i % 2:
            config, fp = configs[(i // 2) % len(LRS), seed]
            record.update(
                experiment=f"demo_lr{(i // 2) % len(LRS)}+seed={seed}", config=config, fingerprint=fp
            )
        else:
            record.update(experiment=f"exp{(i // 2) % 2000}+seed={seed}", config=run_config(seed))
        (runs_dir / f"r{i:05d}.json").write_text(json.dumps(record))


def test_twenty_thousand_entries_in_seconds(results_dir, tmp_path):
    """vitexp-tables on a ledger of 20,000 entries (10,000 of them fingerprinted runs with full
    configs): read, checked, indexed and a 46-row seeded table filled, 40 rows by name and 6 by
    fingerprint (linear in runs + cells: it used to scan every run once per row; a row matched by
    fingerprint costs one Hydra composition, ~0.5 s, whatever the ledger's size)."""
    _write_many(results_dir / "runs", 20_000)
    rows = [{"label": f"row {i}", "experiment": f"exp{i}"} for i in range(40)]
    rows += [
        {"label": f"lr {j}", "experiment": "demo", "overrides": [f"recipe.lr={lr}"], "name": f"demo_lr{j}"}
        for j, lr in enumerate(LRS)
    ]
    spec = {
        "title": "t",
        "seeds": [0, 1, 2],
        "columns": [{"key": "top1", "label": "Top-1", "digits": 1}],
        "rows": rows,
    }
    path = tmp_path / "big.yaml"
    path.write_text(json.dumps(spec))
    start = time.perf_counter()
    assert tables.main([str(path), "--results-dir", str(results_dir), "--out", str(tmp_path / "t")]) == 0
    seconds = time.perf_counter() - start
    assert seconds < 60, seconds  # README: the time on a 2-core machine
    md = (tmp_path / "t" / "big.md").read_text()
    for label, picks in (
        ("row 7 ", lambda i: i % 2 == 0 and (i // 2) % 2000 == 7),
        ("lr 5  ", lambda i: i % 2 == 1 and (i // 2) % len(LRS) == 5),
    ):
        values = []
        for seed in range(3):  # the newest run of each seed: the last by start time, then by run id
            newest = max(
                (i for i in range(20_000) if picks(i) and _seed_of(i) == seed), key=lambda i: (i % 24, i)
            )
            values.append(float(newest % 97))
        mean = sum(values) / 3
        std = (sum((v - mean) ** 2 for v in values) / 2) ** 0.5
        assert f"| {label} | {mean:.1f} ± {std:.1f} (3)" in md, (label, values)


@pytest.mark.slow
def test_twenty_thousand_entries_fill_every_committed_table(results_dir):
    """Every committed table (sweeps/*.yaml) filled from a ledger of 20,000 synthetic entries: one
    pack of 19,000 and 1,000 files, each named like a row (or a seed of it) with the row's composed
    config (half of them at another recipe.lr, a third without a stored fingerprint), a fifth
    unrelated stubs. The ledger is read, checked and indexed, and every table filled, in under 45 s
    on 2 busy cores once the rows are composed (Hydra: about 0.3 s a row, whatever the ledger's
    size; composed first, to write the entries). A cell shows the newest run of its config."""
    from vitexp.config.rows import composing, expand_rows
    from vitexp.ledger.sources import write_snapshot
    from vitexp.report import aggregate

    specs = [tables.load_spec(n) for n in tables.all_specs()]
    keys = sorted({c["key"] for spec in specs for c in spec["columns"]})
    targets = []  # (row name, seed, kind, protocol, config)
    with composing():
        for spec in specs:
            for row in expand_rows(spec["rows"]):
                query = row_query(spec, row) if row.get("experiment") and not row.get("cited") else None
                for seed in query.all_seeds() if query else ():
                    config = query.composed(seed)
                    if config is not None:
                        name = query.name if seed is None else aggregate.seeded_name(query.name, seed)
                        config = portable_paths(dict(config), results_dir)  # as an entry stores it
                        targets.append(
                            (name, seed, row.get("run", "train"), spec.get("protocol") or {}, config)
                        )
    prints = {id(t[4]): fingerprint(t[4]) for t in targets}
    records = []
    for i in range(20_000):
        started = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc) + datetime.timedelta(
            seconds=(i * 7919) % 20_000
        )
        record = {
            "run_id": f"s{i:05d}",
            "status": "completed",
            "protocol": {"data_order": "seed*1000003+epoch"},
            "env": {},
            "started": started.isoformat(),
            "finished": None,
            "error": None,
            "metrics": {k: float(i % 97) for k in keys},
        }
        if i % 5 == 4:
            records.append(
                {**record, "experiment": f"unrelated{i % 500}", "kind": "train", "config": run_config(0)}
            )
            continue
        name, seed, kind, protocol, config = targets[i % len(targets)]
        record.update(experiment=name, kind=kind, protocol={**record["protocol"], **protocol})
        if i % 2:
            config = copy.deepcopy(config)
            config["recipe"]["lr"] = float(config["recipe"].get("lr") or 0) * 10 + 1
            record.update(config=config, fingerprint=fingerprint(config))
        else:
            record.update(config=config, **({} if i % 3 == 0 else {"fingerprint": prints[id(config)]}))
        records.append(record)
    write_snapshot(records[:19_000], results_dir / "ledger" / "20260101-000000.jsonl.gz")
    (results_dir / "runs").mkdir(parents=True)
    for record in records[19_000:]:
        (results_dir / "runs" / f"{record['run_id']}.json").write_text(json.dumps(record))
    start = time.perf_counter()
    ledger = Ledger.load(results_dir)
    filled = {spec["name"]: tables.fill(spec, ledger) for spec in specs}
    seconds = time.perf_counter() - start
    assert len(ledger) == 20_000 and not ledger.broken
    assert seconds < 45, seconds  # docs/ledger.md: the time on a 2-core machine
    demo = _demo_config()
    ours = {
        key for key, value in prints.items() if value == fingerprint(demo)
    }  # the configs composed as demo's
    exact = [r for r in records if r["kind"] == "train" and id(r["config"]) in ours]
    newest = max(exact, key=lambda r: r["started"])  # every start differs
    (row,) = [r for r in filled["demo"] if r["experiment"] == "demo"]
    assert len(exact) > 10 and row["cells"]["top1"]["run_id"] == newest["run_id"]


def test_start_of_and_newest_come_from_the_index():
    runs = [
        {
            "run_id": f"s{i}",
            "experiment": "pre",
            "status": "completed",
            "kind": "train",
            "started": f"2026-01-0{i}T00:00:00+00:00",
            "finished": f"2026-01-0{i}T01:00:00+00:00",
            "config": run_config(),
        }
        for i in (1, 2, 3)
    ]
    ft = {
        "run_id": "ft",
        "experiment": "ft",
        "status": "completed",
        "kind": "train",
        "started": "2026-01-02T12:00:00+00:00",
        "config": run_config(top={"backbone": {"pretrained": "run:pre"}}),
    }
    ledger = Ledger.of([*runs, ft])
    assert ledger.start_of(ft) == "s2" and ledger.newest("pre")["run_id"] == "s3"
    assert ledger.newest("s1")["run_id"] == "s1" and ledger.newest("nope") is None
    with pytest.raises(FileNotFoundError, match="method.x=nope: no completed train run"):
        ledger.find("nope", "method.x")
    assert ledger.row_runs(RowQuery("pre", "pre"))[None] == runs


def test_find_run_takes_the_short_id_a_table_prints(results_dir):
    """vitexp-eval / vitexp-analyze: ``40f87a`` finds the one completed train run whose id ends in it;
    a tail two runs share is refused with both named."""
    from vitexp.commands.evaluate import find_run

    a = _entry(results_dir, "pre", {"seed": 0}, 80.0, "2026-01-01T00:00:00+00:00")
    b = _entry(results_dir, "other", {"seed": 1}, 81.0, "2026-01-02T00:00:00+00:00")
    assert find_run(a.rsplit("-", 1)[-1], results_dir)["run_id"] == a
    assert find_run(b.rsplit("-", 1)[-1], results_dir)["run_id"] == b
    assert find_run("pre", results_dir)["run_id"] == a  # an experiment still wins
    with pytest.raises(FileNotFoundError, match="short id or experiment 'ffffff0'"):
        find_run("ffffff0", results_dir)
    twin = LedgerEntry(
        "pre", "train", run_config(2), results_dir, run_id=f"{a.rsplit('-', 1)[0]}x-{a.rsplit('-', 1)[-1]}"
    )
    twin.start().finish({"top1": 82.0})
    with pytest.raises(FileNotFoundError, match="names 2 completed train runs"):
        find_run(a.rsplit("-", 1)[-1], results_dir)


def test_a_snapshot_regenerates_the_tables_of_its_folder(results_dir, tmp_path, capsys):
    _entry(results_dir, "pre", {"seed": 0}, 88.66, "2026-01-02T00:00:00+00:00")
    _entry(results_dir, "ft+seed=0", {"seed": 0}, 89.0, "2026-01-03T00:00:00+00:00")
    spec, snap = str(_spec_file(tmp_path, SHARED)), tmp_path / "release.jsonl.gz"
    assert (
        tables.main(
            [spec, "--results-dir", str(results_dir), "--out", str(tmp_path / "a"), "--snapshot", str(snap)]
        )
        == 0
    )
    assert tables.main([spec, "--ledger", str(snap), "--out", str(tmp_path / "b")]) == 0
    for ext in ("md", "tex", "csv"):
        assert (tmp_path / "a" / f"shared_start.{ext}").read_text() == (
            tmp_path / "b" / f"shared_start.{ext}"
        ).read_text()


@pytest.mark.parametrize("root", ["main", "sweepA", "sweepB"])
def test_every_entry_of_the_committed_and_running_ledgers_keeps_the_schema(root):
    """Every committed entry (older schemas included) loads; so do the entries that sweeps running
    older code (two-stage SAPER, selected_top1) are writing in other worktrees."""
    from vitexp import PROJECT_ROOT

    folder = PROJECT_ROOT / "results" if root == "main" else PROJECT_ROOT.parent / root / "results"
    if not (folder / "runs").is_dir():
        pytest.skip(f"no {folder}")
    ledger = Ledger.load(folder)
    assert [str(b) for b in ledger.broken if not b.path.startswith("runs/.")] == [] and len(ledger) > 100


def test_no_code_outside_the_ledger_opens_run_files():
    """Only vitexp/ledger/ reads the runs folder (a glob of entries, a path into ``runs/``)."""
    import re

    from vitexp import PROJECT_ROOT

    pattern = re.compile(r"""glob\(["']\*\.json|/ ["']runs["']\s*/|["']runs["']\s*\)\s*/""")
    offenders = [
        str(p.relative_to(PROJECT_ROOT))
        for p in (PROJECT_ROOT / "vitexp").rglob("*.py")
        if "ledger" not in p.parts and pattern.search(p.read_text())
    ]
    assert offenders == []


def test_untracked_code_makes_a_run_dirty_and_goes_into_its_patch(tmp_path):
    """Reproduction 10 of issue 47: a new vitexp/*.py or conf/method/*.yaml that git does not track
    left the run clean (``git diff HEAD`` does not see it), its code impossible to rebuild. It makes
    the tree dirty, and the patch rebuilds it on a clone of the commit; an ignored file does not."""
    import subprocess

    from vitexp.ledger.entry import code_state

    repo = tmp_path / "repo"

    def git(*args, cwd=repo):
        subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True)

    (repo / "vitexp").mkdir(parents=True)
    (repo / "vitexp" / "a.py").write_text("a = 1\n")
    (repo / ".gitignore").write_text("__pycache__/\n")
    git("init", "-q")
    git("add", ".")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "code")
    (repo / "vitexp" / "__pycache__").mkdir()
    (repo / "vitexp" / "__pycache__" / "a.pyc").write_bytes(b"\0")
    assert code_state(repo)[1] is False
    (repo / "vitexp" / "new_method.py").write_text("def f():\n    return 2\n")
    (repo / "conf" / "method").mkdir(parents=True)
    (repo / "conf" / "method" / "new.yaml").write_text("name: new\n")
    (repo / "sweeps").mkdir()
    (repo / "sweeps" / "new_table.yaml").write_text("title: t\n")
    commit, dirty, diff = code_state(repo)
    assert dirty is True and "__pycache__" not in diff
    clone = tmp_path / "clone"
    git("clone", "-q", str(repo), str(clone), cwd=tmp_path)
    (clone / "code.patch").write_text(diff)
    git("apply", "code.patch", cwd=clone)
    for path in ("vitexp/new_method.py", "conf/method/new.yaml", "sweeps/new_table.yaml"):
        assert (clone / path).read_text() == (repo / path).read_text()
    # issue 58: code an unanchored ignore rule hides (outputs/ matches vitexp/outputs/) is code still
    git("add", ".")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "more")
    (repo / ".gitignore").write_text("__pycache__/\noutputs/\n")
    git("add", ".gitignore")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "ignore")
    (repo / "outputs").mkdir()
    (repo / "outputs" / "run.log").write_text("a run's output\n")
    assert code_state(repo)[1] is False
    (repo / "vitexp" / "outputs").mkdir()
    (repo / "vitexp" / "outputs" / "hidden.py").write_text("b = 2\n")
    commit, dirty, diff = code_state(repo)
    assert dirty is True and "vitexp/outputs/hidden.py" in diff and "run.log" not in diff


def test_a_dirty_tree_keeps_its_diff_beside_the_run_and_its_hash_in_the_entry(
    results_dir, tmp_path, monkeypatch
):
    import hashlib

    import vitexp.ledger.entry as entry_module

    diff = "diff --git a/vitexp/x.py b/vitexp/x.py\n+changed = True\n"
    monkeypatch.setattr(entry_module, "code_state", lambda: ("abc123", True, diff))
    run_dir = results_dir / "outputs" / "r1"
    entry = LedgerEntry("demo", "train", run_config(0), results_dir, run_dir=run_dir).start()
    patch = entry.record["env"]["code_patch"]
    digest = hashlib.sha256(diff.encode()).hexdigest()
    # beside the ledger (committed with the entries; run folders are not), a copy in the run folder
    assert patch == {"path": f"patches/{digest[:16]}.patch", "sha256": digest}
    assert (results_dir / patch["path"]).read_text() == diff and (run_dir / "code.patch").read_text() == diff
    elsewhere = LedgerEntry("demo", "bench", {}, results_dir).start()  # no run folder: the same file
    assert elsewhere.record["env"]["code_patch"] == patch


def _marked(results_dir, **changes) -> dict:
    entry = LedgerEntry("demo", "train", _demo_config(), results_dir).start()
    entry.finish(
        {"top1": 95.3, "gmacs": 0.023, "throughput": 643.0, "steps": 40},
        changes.pop("protocol", {"data_order": "seed*1000003+epoch"}),
    )
    entry.record["env"].update(changes)
    entry._write()
    (row,) = tables.fill(DEMO_COST, Ledger.load(results_dir))
    return {k: c["marks"] for k, c in row["cells"].items()}, tables.render_markdown(DEMO_COST, [row])


DEMO_COST = {**DEMO, "columns": [*DEMO["columns"], {"key": "gmacs", "label": "GMACs", "digits": 3}]}


def test_cells_of_a_stale_protocol_a_busy_machine_and_a_lost_diff_are_marked(results_dir, tmp_path):
    """§: a training without data_order at seed 42 (today's sampler draws other orders) marks its
    accuracies, not its costs; ≈: a throughput timed with the load average above the CPU count;
    ‡: a dirty tree whose diff was not kept marks every cell of the run."""
    clean = {"git_dirty": False}
    assert _marked(results_dir / "a", **clean)[0] == {"top1": "", "throughput": "", "gmacs": ""}
    marks, md = _marked(results_dir / "b", protocol={}, **clean)
    assert marks == {"top1": "§", "throughput": "", "gmacs": ""} and "| 95.3 § |" in md.replace("  ", "")
    assert "§ trained under a protocol today's code no longer reproduces" in md
    busy = {
        "data_order": "seed*1000003+epoch",
        "throughput": {"load": {"loadavg": [3.8, 3.5, 3.2], "cpus": 2}},
    }
    assert _marked(results_dir / "c", protocol=busy, **clean)[0] == {
        "top1": "",
        "throughput": "≈",
        "gmacs": "",
    }
    marks, md = _marked(results_dir / "d", git_dirty=True, code_patch=None)
    assert marks == {"top1": "‡", "throughput": "‡", "gmacs": "‡"} and "‡ trained from a dirty tree" in md


def test_a_compiled_bench_entry_fills_only_a_row_that_asks_for_compiled_runs(results_dir):
    """bench.* and compile.* are not in the fingerprint, so a newer compiled timing of the same model is
    a run of its row; it measures the compiled model's speed, so it fills a throughput cell only where
    the table's protocol names ``compile``, and an eager table keeps its eager run."""
    config = copy.deepcopy(composed_config(("experiment=demo",), None))
    eager = LedgerEntry("demo", "bench", config, results_dir).start()
    eager.finish({"throughput": 123.4}, {"mode": "compare", "device": "cpu"})
    time.sleep(1.1)  # the compiled one is the newer run (start times have a resolution of one second)
    compiled = LedgerEntry("demo", "bench", config, results_dir).start()
    compiled.finish(
        {"throughput": 55.5}, {"mode": "compare", "device": "cpu", "compile": {"mode": "default"}}
    )
    (row,) = tables.fill({**DEMO, "protocol": {"mode": "compare"}}, Ledger.load(results_dir))
    assert row["cells"]["throughput"]["value"] == 123.4
    (row,) = tables.fill(
        {**DEMO, "protocol": {"mode": "compare", "compile": {"mode": "default"}}}, Ledger.load(results_dir)
    )
    assert row["cells"]["throughput"]["value"] == 55.5
