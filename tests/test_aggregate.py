"""Seeds in tables: mean ± sample std (n), the paired difference to a baseline row, rows with fewer
seeds than asked, and vitexp-sweep's plan that launches only the missing (row, seed) pairs."""

from __future__ import annotations

import csv
import io
import math
import re

import pytest
from conftest import config_of
from ledger_records import iter_runs

from vitexp.data.datamodules import DATA_ORDER
from vitexp.ledger import Ledger, LedgerEntry
from vitexp.report import aggregate, tables

SPEC = {
    "name": "seeded",
    "title": "Seeded fixture",
    "seeds": [0, 1, 2],
    "columns": [
        {"key": "top1", "label": "Top-1", "unit": "%", "digits": 2, "paired": True},
        {"key": "gmacs", "label": "GMACs", "unit": "GMACs", "digits": 3},
    ],
    "plot": {"x": "gmacs", "y": "top1"},
    "rows": [
        {"label": "Pretrained", "experiment": "pre", "seeds": None},
        {"label": "Baseline", "experiment": "base"},
        {"label": "Method", "experiment": "meth", "baseline": "base"},
    ],
}

# Constructed by hand: baseline 90.0, 91.0, 89.5 (seeds 0, 1, 2); method 90.5, 91.2 (seed 2 failed).
BASE = {0: 90.0, 1: 91.0, 2: 89.5}
METH = {0: 90.5, 1: 91.2}


def _run(results_dir, name, seed, metrics, started=None, fail=False, order=DATA_ORDER):
    """A train run; ``order=None``: one from the sampler that drew ``seed + epoch`` (no data_order)."""
    entry = LedgerEntry(name, "train", config_of(name, seed), results_dir).start()
    if started:
        entry.record["started"] = started
    if fail:
        entry.fail(RuntimeError("killed"))
    else:
        entry.finish(metrics, {"data_order": order} if order else {})
        return entry.run_id


@pytest.fixture
def seeded_ledger(results_dir):
    _run(results_dir, "pre", 0, {"top1": 88.8, "gmacs": 0.02})
    for seed, v in BASE.items():
        _run(results_dir, aggregate.seeded_name("base", seed), seed, {"top1": v, "gmacs": 0.0201})
    _run(
        results_dir, "meth+seed=0", 0, {"top1": 10.0, "gmacs": 0.01}, started="2000-01-01T00:00:00+00:00"
    )  # older
    _run(results_dir, "meth+seed=0", 0, {"top1": METH[0], "gmacs": 0.0101})  # newer: started now
    _run(
        results_dir, "meth", 1, {"top1": METH[1], "gmacs": 0.0101}
    )  # by hand: `experiment=meth seed=1` named meth
    _run(results_dir, "meth+seed=2", 2, {}, fail=True)
    _run(results_dir, "meth+seed=7", 7, {"top1": 0.0, "gmacs": 0.0101})  # a seed the spec does not ask for
    return results_dir


def test_mean_sample_std_and_paired_difference(seeded_ledger):
    rows = {r["label"]: r for r in tables.fill(SPEC, list(iter_runs(seeded_ledger)))}
    base, meth = rows["Baseline"]["cells"]["top1"], rows["Method"]["cells"]["top1"]
    assert base["value"] == pytest.approx(sum(BASE.values()) / 3)
    # sample std (ddof=1): sqrt(((-1/6)^2 + (5/6)^2 + (-2/3)^2) / 2) = sqrt(7/12)
    assert base["std"] == pytest.approx(math.sqrt(7 / 12)) and base["n"] == 3 and base["expected"] == 3
    assert meth["value"] == pytest.approx(90.85) and meth["std"] == pytest.approx(0.35 * math.sqrt(2))
    assert meth["n"] == 2 and meth["seeds"] == {0: 90.5, 1: 91.2}
    diff = rows["Method"]["paired"]["top1"]  # d = (0.5, 0.2): mean 0.35, std 0.15 * sqrt(2)
    assert diff["mean"] == pytest.approx(0.35) and diff["std"] == pytest.approx(0.15 * math.sqrt(2))
    assert diff["n"] == 2 and diff["seeds"] == [0, 1]
    assert (
        rows["Pretrained"]["cells"]["top1"]["value"] == 88.8
        and "n" not in rows["Pretrained"]["cells"]["top1"]
    )


def test_rendered_cells_say_n_and_missing_seeds(seeded_ledger, tmp_path):
    runs = list(iter_runs(seeded_ledger))
    md = tables.render_markdown(SPEC, tables.fill(SPEC, runs))
    md = re.sub(r" {2,}", " ", md)  # tabulate pads the cells of a column to one width
    # GMACs, the same in every seed, without "± 0.000"; a value that varies keeps its std
    assert "| Baseline | 90.17 ± 0.76 (3) | — | 0.020 (3) | — | — |" in md
    assert (
        "| Method | 90.85 ± 0.49 (2 of 3 seeds) | — | 0.010 (2 of 3 seeds) | — | +0.35 ± 0.21 (2 of 3"
        " seeds) |" in md
    )
    assert "not independent" not in md  # every seeded run drew its own orders
    assert "| Pretrained | 88.80 | — | 0.020 | — | — |" in md
    assert "Δ Top-1 vs baseline" in md.splitlines()[2]
    written = tables.write_table(SPEC, runs, tmp_path / "tables")
    rows = {
        r["row"]: r for r in csv.DictReader(io.StringIO((tmp_path / "tables" / "seeded.csv").read_text()))
    }
    assert rows["Method"]["top1_n"] == "2" and rows["Method"]["top1_seeds_asked"] == "3"
    assert float(rows["Method"]["top1_delta_mean"]) == pytest.approx(0.35)
    assert r"$\pm$" in (tmp_path / "tables" / "seeded.tex").read_text() and "png" in written


def test_baseline_must_be_a_seeded_row():
    spec = {**SPEC, "rows": [*SPEC["rows"][:2], {"label": "M", "experiment": "m", "baseline": "pre"}]}
    with pytest.raises(ValueError, match="baseline 'pre'.*seeded rows: \\['base', 'm'\\]"):
        tables.fill(spec, [])


def test_malformed_seeds_fail_when_the_spec_loads(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(
        "title: t\ncolumns: [{key: top1, label: T}]\nrows: [{label: a, experiment: demo, seeds: 3}]\n"
    )
    with pytest.raises(ValueError, match="seeds must be a non-empty list of integers"):
        tables.load_spec(path)


def test_sweep_plan_launches_only_missing_row_seed_pairs(results_dir):
    from vitexp.commands.sweep import plan

    spec = {
        "name": "s",
        "seeds": [0, 1, 2],
        "rows": [
            {"label": "pre", "experiment": "demo", "seeds": None},
            {"label": "chunk", "experiment": "chunk_demo"},
            {"label": "bspf", "experiment": "bspf_demo", "seeds": [0]},
        ],
    }
    _run(results_dir, "chunk_demo+seed=1", 1, {"top1": 1.0})
    _run(results_dir, "chunk_demo+seed=2", 2, {}, fail=True)  # failed: relaunched
    todo = plan(spec, None, False, results_dir)["train"]
    assert todo["launch"] == ["demo", "chunk_demo+seed=0", "chunk_demo+seed=2", "bspf_demo+seed=0"]
    assert todo["skip"] == ["chunk_demo+seed=1"]
    assert todo["seeds"] == {"chunk_demo": [0, 2], "bspf_demo": [0]}
    forced = plan(spec, None, True, results_dir)["train"]
    assert forced["seeds"]["chunk_demo"] == [0, 1, 2] and forced["skip"] == []


def test_sweep_reruns_a_shared_start_whose_weights_are_not_on_this_machine(results_dir, tmp_path):
    from vitexp.commands.sweep import plan

    spec = {
        "name": "s",
        "seeds": [0],
        "rows": [
            {"label": "pre", "experiment": "demo", "seeds": None},
            {"label": "ft", "experiment": "chunk_demo", "weights": "run:demo"},
        ],
    }
    weights = tmp_path / "weights.pth"
    LedgerEntry("demo", "train", config_of("demo", 0), results_dir).start().finish(
        {"top1": 1.0}, artifacts={"weights": str(weights)}
    )  # a committed ledger, weights elsewhere
    assert plan(spec, None, False, results_dir)["train"]["launch"] == ["demo", "chunk_demo+seed=0"]
    weights.write_bytes(b"weights")
    todo = plan(spec, None, False, results_dir)["train"]
    assert todo["launch"] == ["chunk_demo+seed=0"] and todo["skip"] == ["demo"]
    unseeded = {**spec, "seeds": None}  # not a shared start: a completed run is enough
    weights.unlink()
    LedgerEntry("demo", "train", config_of("demo"), results_dir).start().finish(  # the experiment's own seed
        {"top1": 1.0}, artifacts={"weights": str(weights)}
    )
    assert plan(unseeded, None, False, results_dir)["train"]["skip"] == ["demo"]


def test_paired_cell_before_and_without_common_seeds(results_dir):
    _run(results_dir, "base+seed=0", 0, {"top1": 90.0})
    rows = {r["label"]: r for r in tables.fill(SPEC, list(iter_runs(results_dir)))}
    assert aggregate.paired_text(rows["Method"], SPEC["columns"][0]) == "not run"
    _run(results_dir, "meth+seed=1", 1, {"top1": 91.0})
    rows = {r["label"]: r for r in tables.fill(SPEC, list(iter_runs(results_dir)))}
    assert aggregate.paired_text(rows["Method"], SPEC["columns"][0]) == "no common seed"
    assert aggregate.paired_text(rows["Baseline"], SPEC["columns"][0]) == "—"


def test_the_sweeps_seed_override_names_runs_as_the_tables_expect():
    from vitexp.config.composition import compose, run_name

    cfg = compose(["experiment=chunk_demo", "seed=1"])
    choices = {"experiment": "chunk_demo", "backbone": "vit_micro", "method": "chunk", "data": "digits"}
    assert run_name(cfg, choices, ["experiment=chunk_demo", "seed=1"]) == aggregate.seeded_name(
        "chunk_demo", 1
    )


def test_seeds_from_the_overlapping_sampler_are_flagged_and_trained_again(results_dir):
    """A seed >= 1 trained by the ``seed + epoch`` sampler is named under the table and launched again;
    seed 0 (the same orders under both samplers) and a run recording data_order are not, and the
    rerun replaces the old value in the cell."""
    from vitexp.commands.sweep import plan

    spec = {
        "name": "s",
        "title": "t",
        "seeds": [0, 1, 2],
        "columns": SPEC["columns"],
        "rows": [{"label": "chunk", "experiment": "chunk_demo"}],
    }
    _run(results_dir, "chunk_demo+seed=0", 0, {"top1": 90.0}, order=None)
    old = _run(
        results_dir, "chunk_demo+seed=1", 1, {"top1": 50.0}, order=None, started="2000-01-01T00:00:00+00:00"
    )
    _run(results_dir, "chunk_demo+seed=2", 2, {"top1": 92.0})
    todo = plan(spec, None, False, results_dir)["train"]
    assert todo["seeds"] == {"chunk_demo": [1]} and todo["skip"] == ["chunk_demo+seed=0", "chunk_demo+seed=2"]
    md = tables.render_markdown(spec, tables.fill(spec, list(iter_runs(results_dir))))
    assert "1 of the seeded runs" in md and f"`{old}`" in md.split("not independent")[1]
    _run(results_dir, "chunk_demo+seed=1", 1, {"top1": 91.0})  # started now: newer than the 2000 run
    assert plan(spec, None, False, results_dir)["train"]["launch"] == []
    rows = tables.fill(spec, list(iter_runs(results_dir)))
    assert rows[0]["cells"]["top1"]["value"] == pytest.approx(91.0) and rows[0]["overlapping"] == []
    assert "not independent" not in tables.render_markdown(spec, rows)


def _ft(results_dir, name, seed, start, started):
    """A completed fine-tuning of ``seed`` that loaded ``backbone.pretrained=start``."""
    entry = LedgerEntry(
        name, "train", config_of(name, seed, {"backbone": {"pretrained": start}}), results_dir
    ).start()
    entry.record["started"] = started
    entry.finish({"top1": 90.0 + seed}, {"data_order": DATA_ORDER})
    return entry.run_id


def _start(results_dir, tmp_path, started, finished):
    """A completed run of the shared start ``demo`` with its weights file on this machine."""
    weights = tmp_path / f"w-{started[:4]}.pth"
    weights.write_bytes(b"weights")
    entry = LedgerEntry("demo", "train", config_of("demo", 0), results_dir).start()
    entry.record["started"] = started
    entry.finish({"top1": 1.0}, artifacts={"weights": str(weights)})
    entry.record["finished"] = finished
    entry._write()
    return entry.run_id


def test_seeds_fine_tuned_from_another_run_of_the_shared_start_train_again(results_dir, tmp_path):
    """A row never mixes two starts: a seed that loaded an older run of its shared start (pinned, or
    ``run:<experiment>`` resolved by time) is named under the table and launched again."""
    from vitexp.commands.sweep import plan

    spec = {
        "name": "s",
        "title": "t",
        "seeds": [0, 1, 2],
        "columns": SPEC["columns"],
        "rows": [
            {"label": "pre", "experiment": "demo", "seeds": None},
            {"label": "ft", "experiment": "chunk_demo", "weights": "run:demo"},
        ],
    }
    old = _start(results_dir, tmp_path, "2001-01-01T00:00:00+00:00", "2001-01-01T01:00:00+00:00")
    new = _start(results_dir, tmp_path, "2002-01-01T00:00:00+00:00", "2002-01-01T01:00:00+00:00")
    by_time = _ft(
        results_dir, "chunk_demo+seed=0", 0, "run:demo", "2001-06-01T00:00:00+00:00"
    )  # loaded `old`
    _ft(results_dir, "chunk_demo+seed=1", 1, f"run:{new}", "2002-06-01T00:00:00+00:00")
    _ft(results_dir, "chunk_demo+seed=2", 2, "run:demo", "2002-06-01T00:00:00+00:00")  # loaded `new`
    runs = list(iter_runs(results_dir))
    ledger = Ledger.of(runs)
    assert [ledger.start_of(r) for r in runs if r["experiment"] != "demo"] == [old, new, new]
    todo = plan(spec, None, False, results_dir)["train"]
    assert todo["seeds"] == {"chunk_demo": [0]} and "demo" in todo["skip"]
    md = tables.render_markdown(spec, tables.fill(spec, runs))
    assert (
        "1 of the seeded runs fine-tuned another run" in md and f"`{by_time}`" in md.split("another run")[1]
    )
    for weights in tmp_path.glob("w-2002*"):  # the start's weights are gone: it and all its seeds train again
        weights.unlink()
    todo = plan(spec, None, False, results_dir)["train"]
    assert todo["launch"][0] == "demo" and todo["seeds"] == {"chunk_demo": [0, 1, 2]}


def test_only_trained_ledger_seeds_from_the_old_sampler_count_as_overlapping():
    base = {
        "kind": "train",
        "status": "completed",
        "config": {"seed": 1},
        "protocol": {},
        "metrics": {"steps": 40},
    }
    assert aggregate.overlapping_order(base)
    assert not aggregate.overlapping_order({**base, "config": {"seed": 0}})  # seed 0: the same orders
    assert not aggregate.overlapping_order({**base, "protocol": {"data_order": DATA_ORDER}})
    assert not aggregate.overlapping_order({**base, "metrics": {"steps": 0}})  # k-NN only: drew no order
    assert not aggregate.overlapping_order({k: v for k, v in base.items() if k != "protocol"})  # a W&B record
    assert not aggregate.overlapping_order({**base, "status": "running"})
