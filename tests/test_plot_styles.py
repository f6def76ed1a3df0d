"""Every table's plot (each spec in sweeps/ with a ``plot:``) tells its rows apart: drawn from a
constructed ledger in which every row has values of its own, no two rows share a colour and
marker, the legend names every row, each axis carries its unit, and a control is grey and hollow
(vitexp/plots.py)."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import pytest
from matplotlib.colors import to_rgba

from vitexp import SWEEPS_DIR, aggregate, plots, tables

PLOTTED = sorted(p.stem for p in SWEEPS_DIR.glob("*.yaml") if "plot" in (tables.yaml.safe_load(p.read_text()) or {}))


def _runs(spec: dict) -> list[dict]:
    """One completed run per row (per seed for a seeded row), every row with its own x and y."""
    xk, yk = spec["plot"]["x"], spec["plot"]["y"]
    runs = []
    for i, row in enumerate(spec["rows"]):
        name = tables.row_name(row)
        if not name:
            continue
        seeds = aggregate.row_seeds(spec, row)
        for seed in seeds or [None]:
            metrics = {xk: 1.0 + i / 10, yk: 50.0 + i + (seed or 0) / 10}
            runs.append({"run_id": f"r{i}-{seed}", "experiment": name if seed is None else aggregate.seeded_name(name, seed),
                         "status": "completed", "kind": "train", "config": {} if seed is None else {"seed": seed},
                         "metrics": metrics})
    return runs


def styles_of(fig) -> dict[str, set[tuple]]:
    """{row label: its (colour, marker) on the axes}, from the measured points' artists."""
    out: dict[str, set[tuple]] = {}
    for ax in fig.axes:
        for line in ax.lines:
            gid = line.get_gid() or ""
            if gid.startswith(("vitexp:", "tick-vitexp:", "ytick-vitexp:")):
                out.setdefault(gid.split(":", 1)[1], set()).add((to_rgba(line.get_markeredgecolor()), line.get_marker()))
    return out


def values_of(rows: list[dict], xk: str, yk: str) -> dict[str, tuple]:
    return {r["label"]: (r["cells"][xk]["value"], r["cells"][yk]["value"]) for r in rows}


@pytest.mark.parametrize("name", PLOTTED)
def test_no_two_rows_with_different_values_share_a_style(name):
    spec = tables.load_spec(name)
    filled = tables.fill(spec, _runs(spec))
    fig = plots.draw(spec, filled)
    try:
        xk, yk = spec["plot"]["x"], spec["plot"]["y"]
        styles, values = styles_of(fig), values_of(filled, xk, yk)
        assert styles, f"{name}: no measured point drawn"
        owner: dict[tuple, str] = {}
        for label, drawn in styles.items():
            assert len(drawn) == 1, f"{name}: row {label!r} is drawn in {len(drawn)} styles"
            style = next(iter(drawn))
            other = owner.setdefault(style, label)
            assert other == label or values[other] == values[label], \
                f"{name}: rows {other!r} and {label!r} have different values but one style {style}"
        legend = " ".join(t.get_text().replace("\n", " ") for ax in fig.axes if ax.get_legend()
                          for t in ax.get_legend().get_texts())
        for label in styles:
            assert label in legend, f"{name}: the legend does not name {label!r}"
        for ax in fig.axes:
            if spec["columns"][[c["key"] for c in spec["columns"]].index(yk)].get("unit", "").startswith("%"):
                assert "(%)" in ax.get_ylabel(), f"{name}: {ax.get_ylabel()!r} has no unit"
    finally:
        plt.close(fig)


@pytest.mark.parametrize("name", [n for n in PLOTTED if any(r.get("control") for r in tables.load_spec(n)["rows"])])
def test_a_control_is_grey_and_hollow(name):
    spec = tables.load_spec(name)
    fig = plots.draw(spec, tables.fill(spec, _runs(spec)))
    try:
        controls = {r["label"] for r in spec["rows"] if r.get("control")}
        lines = {line.get_gid().split(":", 1)[1]: line for ax in fig.axes for line in ax.lines
                 if (line.get_gid() or "").startswith("vitexp:")}
        for label, line in lines.items():
            r, g, b, _ = to_rgba(line.get_markeredgecolor())
            grey = abs(r - g) < 1e-6 and abs(g - b) < 1e-6
            hollow = to_rgba(line.get_markerfacecolor())[3] == 0.0
            assert (grey and hollow) == (label in controls), (name, label)
    finally:
        plt.close(fig)
