"""Provenance of the papers' numbers in the table specs (sweeps/*.yaml): every paper value names
where it was read; a value obtained by arithmetic is marked derived, carries its formula and is
rendered with a mark and a footnote (vitexp/tables.py)."""
from __future__ import annotations

import re

import csv
import io

import pytest
import yaml

from vitexp import CONF_DIR, SWEEPS_DIR, tables
from vitexp.provenance import evaluate_formula, provenance_errors

SPECS = sorted(p.stem for p in SWEEPS_DIR.glob("*.yaml"))

#: values the papers give only as a gain over a baseline: (spec, experiment, column, formula)
KNOWN_DERIVED = [
    ("bspf_table1", "bspf_deit_tiny", "top1", "72.2 + 1.3"),
    ("bspf_table1", "bspf_deit_small", "top1", "79.8 + 2.0"),
    ("bspf_table2", "bspf_t2t_vit_14", "top1", "81.5 + 0.9"),
    ("bspf_table2", "bspf_lvvit_s", "top1", "83.3 + 0.8"),
]


def _raw(name: str) -> dict:
    return yaml.safe_load((SWEEPS_DIR / f"{name}.yaml").read_text())


@pytest.mark.parametrize("name", SPECS)
def test_every_paper_value_names_its_source_and_derived_ones_their_formula(name):
    spec = _raw(name)
    for row in spec["rows"]:
        for key, cell in (row.get("paper") or {}).items():
            assert str(cell.get("source") or "").strip(), (row["label"], key)
            if cell.get("derived"):
                assert evaluate_formula(cell["formula"]) == pytest.approx(cell["value"], abs=1e-9), row["label"]
    assert provenance_errors(spec) == []
    tables.load_spec(name)  # the loader enforces the same rules


@pytest.mark.parametrize("name,experiment,key,formula", KNOWN_DERIVED)
def test_gains_turned_into_values_are_marked_derived(name, experiment, key, formula):
    cells = [r["paper"][key] for r in _raw(name)["rows"] if r.get("experiment") == experiment and key in r.get("paper", {})]
    assert cells, f"{name}: no paper {key} for {experiment}"
    for cell in cells:
        assert cell.get("derived") is True and cell.get("formula") == formula


def test_evit_values_name_where_each_was_read():
    """EViT's README gives top-1 per keep rate but no GMACs: those are read from BSPF-ViT Table 1."""
    rows = [r for r in _raw("bspf_table1")["rows"] if r["label"].startswith("EViT")]
    assert len(rows) == 3 and all(r.get("experiment") for r in rows)  # runnable rows, not cited ones
    for row in rows:
        assert row["paper"]["top1"]["source"].startswith("EViT README") and "BSPF" not in row["paper"]["top1"]["source"]
        assert row["paper"]["gmacs"]["source"].startswith("BSPF-ViT Table 1")


@pytest.mark.parametrize("cell,complaint", [
    ({"value": 73.5}, "no source"),
    ({"value": 73.5, "source": "  "}, "no source"),
    ({"value": 73.5, "source": "BSPF-ViT abstract", "derived": True}, "without a formula"),
    ({"value": 73.5, "source": "BSPF-ViT abstract", "derived": True, "formula": "72.2 + 1.7"}, "not 73.5"),
    ({"value": 82.4, "source": "BSPF-ViT Table 2 (81.5 + 0.9)"}, "mark it derived"),
])
def test_the_loader_refuses_a_value_without_provenance(tmp_path, cell, complaint):
    spec = {"title": "t", "columns": [{"key": "top1", "label": "Top-1"}],
            "rows": [{"label": "BSPF row", "experiment": "demo", "paper": {"top1": cell}}]}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(ValueError, match=complaint) as err:
        tables.load_spec(path)
    assert "BSPF row" in str(err.value)


def test_derived_values_and_notes_are_marked_in_every_rendering(tmp_path):
    spec = {"name": "prov", "title": "Provenance fixture", "plot": {"x": "gmacs", "y": "top1"},
            "notes": ["Prune layers fitted to the paper's GMACs."],
            "columns": [{"key": "top1", "label": "Top-1", "digits": 1}, {"key": "gmacs", "label": "GMACs", "digits": 2}],
            "rows": [{"label": "BSPF", "experiment": "x", "paper": {
                "top1": {"value": 73.5, "source": "BSPF-ViT abstract", "derived": True, "formula": "72.2 + 1.3"},
                "gmacs": {"value": 0.6, "source": "BSPF-ViT Table 1"}}}]}
    rows = tables.fill(spec, [])
    md = tables.render_markdown(spec, rows)
    md = re.sub(r" {2,}", " ", md)  # tabulate pads the cells of a column to one width
    assert "| BSPF | not run | 73.5† | not run | 0.6 |" in md
    assert "† BSPF, Top-1: 73.5 = 72.2 + 1.3, obtained by arithmetic from BSPF-ViT abstract." in md
    assert "- Prune layers fitted to the paper's GMACs." in md
    tex = tables.render_latex(spec, rows)
    assert r"73.5\textsuperscript{\dag}" in tex and "72.2 + 1.3" in tex and "Prune layers fitted" in tex
    line = next(csv.DictReader(io.StringIO(tables.render_csv(spec, rows))))
    assert line["top1_paper"] == "73.5" and line["top1_paper_formula"] == "72.2 + 1.3"
    assert line["gmacs_paper_formula"] == ""
    written = tables.write_table(spec, [], tmp_path)
    assert set(written) == {"md", "tex", "csv", "png"}


RECIPES = sorted(p.stem for p in (CONF_DIR / "recipe").glob("*.yaml"))


def _header(recipe: str) -> list[str]:
    lines = (CONF_DIR / "recipe" / f"{recipe}.yaml").read_text().splitlines()
    return [line[1:].strip() for line in lines[:next(i for i, line in enumerate(lines) if not line.startswith("#"))]]


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_names_its_source_or_says_it_is_vitexps_choice(recipe):
    source = " ".join(_header(recipe)).partition("Source:")[2]
    assert source.strip(), f"conf/recipe/{recipe}.yaml: no 'Source:' in its header comment"
    assert any(word in source for word in ("paper", "README", "repository", "reference code", "vitexp's choice"))


def test_deit_finetune_claims_no_schedule_the_papers_share():
    header = " ".join(_header("deit_finetune"))
    assert "DynamicViT, EViT and" not in header and "vitexp's choice" in header
    for fact in ("300 epochs", "lr 2e-5", "wd 1e-6", "no warm-up", "not published"):
        assert fact in header, fact
