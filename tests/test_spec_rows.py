"""Table rows from overrides (vitexp.config.rows): grids expand in order, a row's runs are found by its
name, the sweep launches a row's missing (row, seed) jobs with its overrides, and converting
SAPER's experiment files into base experiments + grids changed no table.

The fixtures were captured on the code before rows from overrides (commit 651b222):
``table_cells.json`` holds every spec's rendered header and cells from the committed ledger (and
the run ids it then held), with each row's ledger name and seeds; ``replaced_experiment_configs.json``
holds the composed identity groups of the 89 experiment files grid rows replace (tests/fixtures/capture.py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from conftest import config_of
from ledger_records import iter_runs
from omegaconf import OmegaConf

from vitexp import CONF_DIR, PROJECT_ROOT
from vitexp.config import rows
from vitexp.ledger import LedgerEntry
from vitexp.report import aggregate, render, tables

FIXTURES = Path(__file__).parent / "fixtures"
BEFORE = json.loads((FIXTURES / "table_cells.json").read_text())
OLD_CONFIGS = json.loads((FIXTURES / "replaced_experiment_configs.json").read_text())

GRID = {
    "label": "{arch} k={k}, {mode_label}",
    "experiment": "saper_dinov2",
    "run": "flops",
    "grid": {
        "mode": [{"mode": "ft", "mode_label": "fine-tune"}, {"mode": "kd", "mode_label": "distill"}],
        "k": [6, 12],
        "arch": ["S"],
    },
    "overrides": ["method=saper_{mode}", "budget.k={k}"],
    "name": "saper_{mode}_k{k}",
    "paper": {},
    "by_name": {"saper_kd_k12": {"paper": {"top1": {"value": 1.0, "source": "T1"}}}},
}


def test_a_grid_expands_in_order_with_its_variables_and_by_name_keys():
    out = rows.expand_rows([{"label": "first", "experiment": "demo"}, GRID])
    assert [r["label"] for r in out] == [
        "first",
        "S k=6, fine-tune",
        "S k=12, fine-tune",
        "S k=6, distill",
        "S k=12, distill",
    ]
    assert out[3]["overrides"] == ["method=saper_kd", "budget.k=6"] and out[3]["run"] == "flops"
    assert [rows.row_name(r) for r in out] == [
        "demo",
        "saper_ft_k6",
        "saper_ft_k12",
        "saper_kd_k6",
        "saper_kd_k12",
    ]
    assert out[4]["paper"] == {"top1": {"value": 1.0, "source": "T1"}} and out[3]["paper"] == {}
    assert all("grid" not in r and "by_name" not in r for r in out)
    with pytest.raises(ValueError, match="names 'nope'"):
        rows.expand_rows([{**GRID, "label": "{nope}"}])
    with pytest.raises(ValueError, match="by_name names"):
        rows.expand_rows([{**GRID, "by_name": {"saper_kd_k7": {}}}])


def test_row_names_and_job_arguments():
    plain = {"label": "p", "experiment": "demo"}
    over = {"label": "o", "experiment": "demo", "overrides": ["recipe.epochs=1", "method=chunk"]}
    assert rows.row_name(plain) == "demo" and rows.job_arguments(plain, seeded=True) == ["experiment=demo"]
    assert rows.row_name(over) == "demo+recipe.epochs=1,method=chunk"
    assert rows.job_arguments(over, seeded=False) == [
        "experiment=demo",
        "recipe.epochs=1",
        "method=chunk",
        "name='demo+recipe.epochs=1,method=chunk'",
    ]
    assert rows.job_arguments({**over, "name": "mine"}, seeded=True)[-1] == "name='mine+seed=${seed}'"
    for bad, match in (
        (["seed=1"], "row key of its own"),
        (["name=x"], "row key of its own"),
        ("a=1", "list"),
    ):
        with pytest.raises(ValueError, match=match):
            rows.row_name({**over, "overrides": bad})
    with pytest.raises(ValueError, match="may not contain"):
        rows.row_name({**over, "name": "it's"})
    with pytest.raises(ValueError, match="both recorded as 'x'"):
        rows.check_rows([{**plain, "name": "x"}, {**over, "name": "x"}], "spec")
    rows.check_rows([plain, dict(plain)], "spec")  # the same run twice is one name


def test_a_start_row_with_a_seed_of_its_own_runs_that_seed_under_its_name():
    start = {"label": "s", "experiment": "demo", "name": "demo_start1", "seed": 1, "seeds": None}
    assert rows.row_seed(start) == 1 and not rows.is_plain(start)
    assert rows.job_arguments(start, seeded=False) == ["experiment=demo", "seed=1", "name='demo_start1'"]
    assert rows.job_arguments({**start, "name": "demo", "seed": 2}, seeded=False)[1] == "seed=2"
    with pytest.raises(ValueError, match="both recorded as 'x'"):
        rows.check_rows([{**start, "name": "x"}, {**start, "name": "x", "seed": 2}], "spec")
    for bad, match in (
        ({"seed": "1"}, "must be an integer"),
        ({"seed": True}, "must be an integer"),
        ({"seeds": [0, 1]}, "one run's seed"),
        ({"name": None}, "a name of its own"),
    ):
        with pytest.raises(ValueError, match=match):
            rows.row_seed({**start, **bad})
    unseeded_key = dict(start)
    del unseeded_key["seeds"]  # the table's seeds would run instead
    with pytest.raises(ValueError, match="one run's seed"):
        rows.row_seed(unseeded_key)


def _unmarked(text: str) -> str:
    """A cell's text without the marks added since the capture (stale, no diff, busy: vitexp.ledger.marks),
    and without the derived mark †, which a paper value marked derived since then gained (peers_deit_small's
    BSPF-ViT 81.8 = 79.8 + 2.0; tests/test_provenance.py checks every derived value)."""
    return re.sub(r" [§‡≈]+$", "", text).rstrip("†")


def _before_runs() -> list[dict]:
    """The committed ledger as it was when the fixture was captured (later runs left out)."""
    ids = set(BEFORE["run_ids"])
    return [r for r in iter_runs(PROJECT_ROOT / "results") if r["run_id"] in ids]


@pytest.mark.parametrize("name", sorted(BEFORE["tables"]))
def test_every_table_renders_the_cells_it_rendered_before_rows_from_overrides(name):
    """Each captured row renders the same cells, in the same order (rows and columns added since
    are allowed: the captured columns are compared, in their order)."""
    if name not in tables.all_specs():
        pytest.fail(f"sweeps/{name}.yaml is gone")
    spec = tables.load_spec(name)
    before = BEFORE["tables"][name]
    body = [[_unmarked(c) for c in r] for r in render._body(spec, tables.fill(spec, _before_runs()))]
    labels = {r[0] for r in before["rows"]}
    header = render._header(spec)
    assert [h for h in header if h in before["header"]] == before["header"]
    keep = [header.index(h) for h in before["header"]]
    assert [[r[i] for i in keep] for r in body if r[0] in labels] == [
        [_unmarked(c) for c in r] for r in before["rows"]
    ]


def _fake_run(name: str, seed: int | None, metrics: dict, query) -> dict:
    """A run under ``name`` of the row ``query`` composes (a row's runs are those of its config)."""
    return {
        "run_id": f"fake-{name}-{seed}",
        "experiment": name,
        "status": "completed",
        "kind": "train",
        "config": dict(query.composed(seed)),
        "metrics": metrics,
        "started": "2000-01-01T00:00:00+00:00",
    }


@pytest.mark.parametrize("name", sorted(BEFORE["tables"]))
def test_every_row_finds_the_runs_recorded_under_its_old_name(name):
    """A ledger with one run (per seed) under each row's old experiment name, a distinct value per
    row: every captured row shows its own value, so no row lost or swapped its runs."""
    spec = tables.load_spec(name)
    fake, expect = [], {}
    queries = {row["label"]: rows.row_query(spec, row) for row in spec["rows"] if row.get("experiment")}
    for i, (label, old, seeds, _kind) in enumerate(BEFORE["tables"][name]["identity"]):
        if not old:
            continue
        metrics = {c["key"]: 1000.0 + i for c in spec["columns"]}
        with rows.composing():
            fake += (
                [_fake_run(old, None, metrics, queries[label])]
                if seeds is None
                else [_fake_run(aggregate.seeded_name(old, s), s, metrics, queries[label]) for s in seeds]
            )
        for run in fake:  # of the protocol the spec's cells are read from (peers_throughput_cpu: compare)
            run["protocol"] = dict(spec.get("protocol") or {})
        expect[label] = (1000.0 + i, seeds)
    filled = {r["label"]: r for r in tables.fill(spec, fake)}
    for label, (value, seeds) in expect.items():
        assert filled[label]["seeds"] == seeds, label
        for col in spec["columns"]:
            cell = filled[label]["cells"][col["key"]]
            assert cell["value"] == value, (label, col["key"])
            assert seeds is None or cell["n"] == len(seeds), label


def _rows_by_name() -> dict[str, dict]:
    out = {}
    for spec_name in tables.all_specs():
        for row in tables.load_spec(spec_name)["rows"]:
            if row.get("experiment"):
                out.setdefault(rows.row_name(row), row)
    return out


def _leaves(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, f"{prefix}{k}.")
    else:
        yield prefix[:-1], tree


def _composed(row_list: list[dict]) -> list[dict]:
    """Each row's job composed as vitexp-sweep launches it (unseeded), flattened to dotted keys."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        out = [
            dict(
                _leaves(
                    OmegaConf.to_container(
                        compose("train", overrides=rows.job_arguments(r, seeded=False)), resolve=False
                    )
                )
            )
            for r in row_list
        ]
    GlobalHydra.instance().clear()
    return out


def _check_overrides_took(row: dict, composed: dict) -> None:
    for ov in rows.row_overrides(row):
        key, value = ov.split("=", 1)
        if "." in key:  # a key (a group choice, key=option, is checked by the configs it composes)
            assert str(composed[key]) == value or yaml.safe_load(value) == composed[key], (
                rows.row_name(row),
                ov,
                composed[key],
            )
    assert composed["name"] == rows.row_name(row)


def _needs_selection(row: dict) -> bool:
    return any(ov.startswith("method.selection=") for ov in rows.row_overrides(row))


@pytest.mark.slow  # a migration guard (about 100 s): every row also composes when its table fills
def test_spec_rows_compose_the_configs_of_the_experiment_files_they_replace():
    """Every experiment file the grids replaced is a row of some spec, recorded under the
    same name, whose base + overrides compose the same backbone, method, budget, data, recipe,
    trainer and seed (keys added to a group since are allowed); every other row with overrides
    composes with its overrides in place."""
    by_name = _rows_by_name()
    missing = sorted(set(OLD_CONFIGS) - set(by_name))
    assert not missing, f"no spec row is recorded under {missing}"
    names = sorted(
        set(OLD_CONFIGS) | {n for n, r in by_name.items() if not rows.is_plain(r) and not _needs_selection(r)}
    )
    for name, composed in zip(names, _composed([by_name[n] for n in names])):
        _check_overrides_took(by_name[name], composed)
        starts = (
            {"backbone.pretrained": rows.row_weights(by_name[name])} if by_name[name].get("weights") else {}
        )
        wrong = {
            key: (value, composed.get(key, "<missing>"))
            for key, value in _leaves(OLD_CONFIGS.get(name, {}))
            if composed.get(key, "<missing>") != starts.get(key, value)
        }  # a row's weights: tag, on purpose
        assert not wrong, f"{name}: (experiment file, row) differ: {wrong}"


def test_head_selection_rows_compose_with_their_selection():
    selection = [r for r in _rows_by_name().values() if _needs_selection(r)]
    assert (
        len(selection) == 30
    )  # saper_micro: 2 modes x 3 rules; fmnist_saper_table1: x 3 k; saper_table1: ViT-B k = 24
    for row, composed in zip(selection, _composed(selection)):
        _check_overrides_took(row, composed)


def _spec_file(tmp_path, seeds=(0, 1)) -> Path:
    path = tmp_path / "override_rows.yaml"
    path.write_text(
        json.dumps(
            {
                "title": "t",
                "columns": [{"key": "gmacs", "label": "GMACs"}],
                "seeds": list(seeds),
                "rows": [
                    {
                        "label": "bspf {rho}",
                        "experiment": "bspf_demo",
                        "run": "flops",
                        "grid": {"rho": [0.7]},
                        "overrides": ["budget.keep_ratio={rho}"],
                        "paper": {},
                    }
                ],
            }
        )
    )
    return path


def test_sweep_dry_run_launches_an_override_rows_missing_seeds_with_its_overrides(
    tmp_path, results_dir, capsys
):
    from vitexp.commands.sweep import main

    name = "bspf_demo+budget.keep_ratio=0.7"
    row = {"budget": {"keep_ratio": 0.7}}
    done = LedgerEntry(aggregate.seeded_name(name, 0), "flops", config_of(name, 0, row), results_dir).start()
    done.finish({"gmacs": 0.01})
    LedgerEntry(name, "flops", config_of(name, 5, row), results_dir).start().finish(
        {"gmacs": 0.01}
    )  # a seed not asked for
    LedgerEntry("bspf_demo+seed=1", "flops", config_of("bspf_demo", 1), results_dir).start().finish(
        {}
    )  # the base
    assert main([str(_spec_file(tmp_path, seeds=(0, 1, 2))), "--dry-run", "logger=none"]) == 0
    out, err = capsys.readouterr()
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["skipped"]["flops"] == [f"{name}+seed=0"]
    assert summary["status"] == "dry_run" and summary["would_launch"]["flops"] == [
        f"{name}+seed=1",
        f"{name}+seed=2",
    ]
    assert (
        f"-m experiment=bspf_demo budget.keep_ratio=0.7 name='{name}+seed=${{seed}}' seed=1,2 "
        "++logger.group=override_rows" in err
    )
    from vitexp.config.composition import (
        compose,
        run_name,
    )  # what such a job records: Hydra parses the quoted name

    job = [*rows.job_arguments(tables.load_spec(_spec_file(tmp_path))["rows"][0], seeded=True), "seed=2"]
    cfg = compose(job)
    assert run_name(cfg, {"experiment": "bspf_demo"}, job) == aggregate.seeded_name(name, 2)
    assert cfg.budget.keep_ratio == 0.7


@pytest.mark.slow
def test_sweep_runs_an_override_row_and_the_table_finds_its_seeds(tmp_path, results_dir, capsys, monkeypatch):
    """End to end: vitexp-sweep runs the row's seeds under its name with its overrides; the table
    fills the row from them; the same command then launches nothing."""
    from vitexp.commands.sweep import main

    monkeypatch.chdir(tmp_path)  # Hydra's multirun/ folder
    spec = _spec_file(tmp_path)
    assert main([str(spec), "logger=none"]) == 0, capsys.readouterr().err[-3000:]
    runs = list(iter_runs(results_dir))
    name = "bspf_demo+budget.keep_ratio=0.7"
    assert sorted(r["experiment"] for r in runs) == [f"{name}+seed=0", f"{name}+seed=1"]
    assert {r["config"]["budget"]["keep_ratio"] for r in runs} == {0.7}
    (row,) = tables.fill(tables.load_spec(spec), runs)
    assert row["cells"]["gmacs"]["n"] == 2 and row["experiment"] == name
    capsys.readouterr()
    assert main([str(spec), "--dry-run", "logger=none"]) == 0
    again = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert again["would_launch"] == {} and len(again["skipped"]["flops"]) == 2
