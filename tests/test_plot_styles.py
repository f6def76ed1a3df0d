"""Every table's plot (each spec in sweeps/ with a ``plot:``) tells its rows apart: drawn from a
constructed ledger in which every row has values of its own, no two rows share a colour and
marker, the legend names every row, each accuracy scale carries its unit, and a control is grey and
hollow; drawn from the committed ledger (results/), no row's marker lies on another row's, and no
marker of a row with only a cost or only an accuracy lies inside an axis of cost against accuracy
(vitexp/plots.py, vitexp/dodge.py)."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import pytest
from matplotlib.colors import to_rgba

from vitexp import PROJECT_ROOT, SWEEPS_DIR, aggregate, dodge, plots, tables
from vitexp.ledger import Ledger

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
        fig.draw_without_rendering()
        percent = spec["columns"][[c["key"] for c in spec["columns"]].index(yk)].get("unit", "").startswith("%")
        for ax in fig.axes:  # an axis or strip that shows the accuracy scale names its unit
            if percent and ax.get_yticklabels():
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


#: Two rows' marker centres closer than this (pixels at the plots' 120 dpi; two thirds of a 7-point
#: marker, 11.7 px wide) overlap: one hides most of the other.
MIN_PX = 8.0
#: Artists of a row's marker: measured, paper, cost only, accuracy only.
MARKER_GIDS = ("vitexp:", "paper:", "tick-vitexp:", "tick-paper:", "ytick-vitexp:", "ytick-paper:")
#: Artists of a row with one value: its place on the page must not read as a value of the other.
ONE_VALUE_GIDS = ("tick-", "ytick-")


@pytest.fixture(scope="module")
def committed_ledger():
    return Ledger.load(PROJECT_ROOT / "results")


def marker_centres(fig) -> list[tuple[int, str, str, tuple[float, float]]]:
    """(axis, row label, gid, centre in display pixels) of every row marker drawn, read from the
    artists (their transforms include any offset on the page)."""
    fig.draw_without_rendering()
    out = []
    for i, ax in enumerate(fig.axes):
        for line in ax.lines:
            gid = line.get_gid() or ""
            if gid.startswith(MARKER_GIDS):
                x, y = line.get_transform().transform(line.get_xydata()[0])
                out.append((i, gid.split(":", 1)[1], gid, (float(x), float(y))))
    return out


@pytest.mark.parametrize("name", PLOTTED)
def test_no_row_hides_under_another_in_the_committed_plot(name, committed_ledger):
    spec = tables.load_spec(name)
    rows = tables.fill(spec, committed_ledger)
    fig = plots.draw(spec, rows, tables.footnotes(spec, rows))
    try:
        centres = marker_centres(fig)
        hidden = [f"{ga} and {gb}: {((a[0] - b[0]) ** 2 + (a[1] - b[1]) ** 2) ** 0.5:.1f} px"
                  for k, (ia, la, ga, a) in enumerate(centres) for ib, lb, gb, b in centres[k + 1:]
                  if ia == ib and la != lb and (a[0] - b[0]) ** 2 + (a[1] - b[1]) ** 2 < MIN_PX ** 2]
        assert not hidden, f"{name}: markers of different rows closer than {MIN_PX} px: {hidden}"
        # an axis with both scales (cost and accuracy ticks) is where a place reads as (cost, accuracy);
        # a strip or an axis of costs alone lacks one of them. A centre on its edge counts as inside.
        areas = [ax.bbox.padded(MIN_PX / 2) for ax in fig.axes if len(ax.get_xticks()) and len(ax.get_yticks())]
        inside = [f"{gid} at ({x:.0f}, {y:.0f}) px" for _, _, gid, (x, y) in centres
                  if gid.startswith(ONE_VALUE_GIDS) and any(area.contains(x, y) for area in areas)]
        assert not inside, f"{name}: markers of rows with one value inside an axis of cost against accuracy: {inside}"
        for ax in fig.axes:  # error bars move with their marker: the same point lands on the same pixel
            for bars in ax.containers:
                if hasattr(bars, "has_yerr"):
                    line, xy = bars.lines[0], bars.lines[0].get_xydata()[0]
                    for part in (*bars.lines[1], *bars.lines[2]):
                        assert (part.get_transform().transform(xy) == line.get_transform().transform(xy)).all(), \
                            f"{name}: {line.get_gid()}'s error bars drawn apart from its marker"
    finally:
        plt.close(fig)


def test_dodge_keeps_the_first_and_moves_the_next_by_a_gap():
    """A point moves sideways (right, then left), a cost-only marker up; a row's own markers stay."""
    gap = dodge.GAP
    moved = dodge.offsets([("a", "point", (0.0, 0.0)), ("b", "point", (1.0, 0.0)), ("c", "point", (0.0, 1.0)),
                     ("a", "point", (0.0, 0.0)), ("d", "xtick", (50.0, 0.0)), ("e", "xtick", (51.0, 0.0))])
    assert moved == [(0.0, 0.0), (gap, 0.0), (-gap, 0.0), (0.0, 0.0), (0.0, 0.0), (0.0, gap)]
