"""Every table's plot (each spec in sweeps/ with a ``plot:``) tells its rows apart: drawn from a
constructed ledger in which every row has values of its own, no two rows share a colour and
marker, the legend names every row, each accuracy scale carries its unit, and a control is grey and
hollow; drawn from the committed ledger (results/), no row's marker lies on another row's, and no
marker of a row with only a cost or only an accuracy lies inside an axis of cost against accuracy
(vitexp/report/plots.py, vitexp/report/dodge.py)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import pytest
from conftest import recorded
from matplotlib.colors import to_rgba

from vitexp import PROJECT_ROOT, SWEEPS_DIR
from vitexp.config import rows as vrows
from vitexp.ledger import Ledger
from vitexp.report import aggregate, dodge, plots, tables
from vitexp.report.plot_styles import MIN_DELTA_E, ciede2000, delta_e

PLOTTED = sorted(
    p.stem for p in SWEEPS_DIR.glob("*.yaml") if "plot" in (tables.yaml.safe_load(p.read_text()) or {})
)


def _runs(spec: dict) -> list[dict]:
    """One completed run per row (per seed for a seeded row), every row with its own x and y."""
    xk, yk = spec["plot"]["x"], spec["plot"]["y"]
    runs = []
    for i, row in enumerate(spec["rows"]):
        name = tables.row_name(row)
        if not name:
            continue
        seeds = vrows.row_seeds(spec, row)
        for seed in seeds or [None]:
            metrics = {xk: 1.0 + i / 10, yk: 50.0 + i + (seed or 0) / 10}
            runs.append(
                {
                    "run_id": f"r{i}-{seed}",
                    "experiment": name if seed is None else aggregate.seeded_name(name, seed),
                    "status": "completed",
                    "kind": "train",
                    "config": {} if seed is None else {"seed": seed},
                    "metrics": metrics,
                }
            )
    return runs


def styles_of(fig) -> dict[str, set[tuple]]:
    """{row label: its (colour, marker) on the axes}, from the measured points' artists."""
    out: dict[str, set[tuple]] = {}
    for ax in fig.axes:
        for line in ax.lines:
            gid = line.get_gid() or ""
            if gid.startswith(("vitexp:", "tick-vitexp:", "ytick-vitexp:")):
                out.setdefault(gid.split(":", 1)[1], set()).add(
                    (to_rgba(line.get_markeredgecolor()), line.get_marker())
                )
    return out


def plot_axes(fig) -> dict:
    """Each axes of the figure -> the index of its plot axis: a strip belongs to the axis whose cost
    or accuracy scale it shares."""
    group = {}
    for ax in fig.axes:
        group[ax] = next(
            i
            for i, other in enumerate(fig.axes)
            if other is ax
            or other.get_shared_x_axes().joined(ax, other)
            or other.get_shared_y_axes().joined(ax, other)
        )
    return group


#: Markers one outline on an axis: a hexagon turned by 30 degrees.
OUTLINE = {"H": "h"}


def confusable(fig, values: dict[str, tuple]) -> list[str]:
    """Pairs of rows with different values on one plot axis (its strips included) whose markers
    have one outline and colours closer than :data:`MIN_DELTA_E` (CIEDE2000), from the artists of
    every marker drawn (measured, paper, cost only, accuracy only)."""
    group, styles = plot_axes(fig), {}
    for ax in fig.axes:
        for line in ax.lines:
            gid = line.get_gid() or ""
            if gid.startswith(MARKER_GIDS):
                styles.setdefault(group[ax], {}).setdefault(gid.split(":", 1)[1], set()).add(
                    (to_rgba(line.get_markeredgecolor()), OUTLINE.get(line.get_marker(), line.get_marker()))
                )
    found = []
    for axis, by_row in styles.items():
        drawn = [(label, colour, marker) for label, pairs in by_row.items() for colour, marker in pairs]
        for k, (la, ca, ma) in enumerate(drawn):
            for lb, cb, mb in drawn[k + 1 :]:
                if (
                    la != lb
                    and ma == mb
                    and values.get(la) != values.get(lb)
                    and delta_e(ca, cb) < MIN_DELTA_E
                ):
                    found.append(f"axis {axis}: {la!r} and {lb!r}, marker {ma!r}, ΔE00 {delta_e(ca, cb):.1f}")
    return found


def values_of(rows: list[dict], xk: str, yk: str) -> dict[str, tuple]:
    return {r["label"]: (r["cells"][xk]["value"], r["cells"][yk]["value"]) for r in rows}


@pytest.mark.parametrize("name", PLOTTED)
def test_no_two_rows_with_different_values_share_a_style(name):
    spec = tables.load_spec(name)
    filled = tables.fill(spec, recorded(spec, _runs(spec)))
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
            assert other == label or values[other] == values[label], (
                f"{name}: rows {other!r} and {label!r} have different values but one style {style}"
            )
        close = confusable(fig, values)
        assert not close, (
            f"{name}: rows on one axis with one marker and colours closer than ΔE00 {MIN_DELTA_E}: {close}"
        )
        legend = " ".join(
            t.get_text().replace("\n", " ")
            for ax in fig.axes
            if ax.get_legend()
            for t in ax.get_legend().get_texts()
        )
        for label in styles:
            assert label in legend, f"{name}: the legend does not name {label!r}"
        fig.draw_without_rendering()
        percent = (
            spec["columns"][[c["key"] for c in spec["columns"]].index(yk)].get("unit", "").startswith("%")
        )
        for ax in fig.axes:  # an axis or strip that shows the accuracy scale names its unit
            if percent and ax.get_yticklabels():
                assert "(%)" in ax.get_ylabel(), f"{name}: {ax.get_ylabel()!r} has no unit"
    finally:
        plt.close(fig)


@pytest.mark.parametrize(
    "name", [n for n in PLOTTED if any(r.get("control") for r in tables.load_spec(n)["rows"])]
)
def test_a_control_is_grey_and_hollow(name):
    spec = tables.load_spec(name)
    fig = plots.draw(spec, tables.fill(spec, recorded(spec, _runs(spec))))
    try:
        controls = {r["label"] for r in spec["rows"] if r.get("control")}
        lines = {
            line.get_gid().split(":", 1)[1]: line
            for ax in fig.axes
            for line in ax.lines
            if (line.get_gid() or "").startswith("vitexp:")
        }
        for label, line in lines.items():
            r, g, b, _ = to_rgba(line.get_markeredgecolor())
            grey = abs(r - g) < 1e-6 and abs(g - b) < 1e-6
            hollow = to_rgba(line.get_markerfacecolor())[3] == 0.0
            assert (grey and hollow) == (label in controls), (name, label)
    finally:
        plt.close(fig)


#: CIEDE2000 reference pairs (Sharma, Wu & Dalal 2005, Table 1: pairs 1, 7, 11, 17-20, 25, 34; pair
#: 12 lies on the mean hue's discontinuity, where rounding decides the branch).
SHARMA = [
    ((50, 2.6772, -79.7751), (50, 0, -82.7485), 2.0425),
    ((50, 0, 0), (50, -1, 2), 2.3669),
    ((50, 2.49, -0.001), (50, -2.49, 0.0009), 7.1792),
    ((50, 2.5, 0), (73, 25, -18), 27.1492),
    ((50, 2.5, 0), (61, -5, 29), 22.8977),
    ((50, 2.5, 0), (56, -27, -3), 31.9030),
    ((50, 2.5, 0), (58, 24, 15), 19.4535),
    ((60.2574, -34.0099, 36.2677), (60.4626, -34.1751, 39.4387), 1.2644),
    ((22.7233, 20.0904, -46.694), (23.0331, 14.973, -42.5619), 2.0373),
]


def test_ciede2000_matches_the_reference_pairs():
    for lab1, lab2, expected in SHARMA:
        assert ciede2000(lab1, lab2) == pytest.approx(expected, abs=1e-4)
        assert ciede2000(lab2, lab1) == pytest.approx(expected, abs=1e-4)
    assert delta_e("white", "white") == 0.0 and delta_e("black", "white") == pytest.approx(100.0, abs=1e-3)


#: A marker centre this near an axis of cost against accuracy (pixels at the plots' 120 dpi) counts
#: as inside it.
EDGE_PX = 4.0
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


def marker_extent(line):
    """A line's marker as drawn: its path at its size (points) with half its edge width, round its
    centre (display pixels, the offset on the page included)."""
    from matplotlib.markers import MarkerStyle
    from matplotlib.transforms import Affine2D, Bbox

    style = MarkerStyle(line.get_marker())
    px = line.figure.dpi / 72.0
    path = style.get_path().transformed(style.get_transform() + Affine2D().scale(line.get_markersize() * px))
    extent, edge = path.get_extents(), line.get_markeredgewidth() * px / 2
    x, y = line.get_transform().transform(line.get_xydata()[0])
    return Bbox([[x + extent.x0 - edge, y + extent.y0 - edge], [x + extent.x1 + edge, y + extent.y1 + edge]])


def cut_markers(fig) -> list[str]:
    """Row markers that reach past the window of the axes (or strip) they are drawn on."""
    fig.draw_without_rendering()
    out = []
    for ax in fig.axes:
        window = ax.bbox
        for line in ax.lines:
            gid = line.get_gid() or ""
            if gid.startswith(MARKER_GIDS):
                box = marker_extent(line)
                if (
                    box.x0 < window.x0 - 0.5
                    or box.x1 > window.x1 + 0.5
                    or box.y0 < window.y0 - 0.5
                    or box.y1 > window.y1 + 0.5
                ):
                    out.append(
                        f"{gid} at ({box.x0:.0f}..{box.x1:.0f}, {box.y0:.0f}..{box.y1:.0f}) px in "
                        f"({window.x0:.0f}..{window.x1:.0f}, {window.y0:.0f}..{window.y1:.0f})"
                    )
    return out


@pytest.fixture(scope="module")
def committed_plot(committed_ledger):
    """name -> (figure, filled rows) of a table drawn from the committed ledger, drawn once per module."""
    drawn = {}
    limit = plt.rcParams["figure.max_open_warning"]
    plt.rcParams["figure.max_open_warning"] = len(PLOTTED) + 5  # held open for the three tests that read them

    def get(name):
        if name not in drawn:
            spec = tables.load_spec(name)
            rows = tables.fill(spec, committed_ledger)
            drawn[name] = (plots.draw(spec, rows, tables.footnotes(spec, rows)), rows, spec)
        return drawn[name]

    yield get
    for fig, _, _ in drawn.values():
        plt.close(fig)
    plt.rcParams["figure.max_open_warning"] = limit


@pytest.mark.parametrize("name", PLOTTED)
def test_no_row_hides_under_another_in_the_committed_plot(name, committed_plot):
    fig, rows, spec = committed_plot(name)
    centres = marker_centres(fig)
    # dodge sets markers of different rows on one axis at least GAP points apart; the final layout
    # (strips, widened limits) must keep them so (half a pixel for rounding)
    least = dodge.GAP * fig.dpi / 72.0 - 0.5
    hidden = [
        f"{ga} and {gb}: {((a[0] - b[0]) ** 2 + (a[1] - b[1]) ** 2) ** 0.5:.1f} px"
        for k, (ia, la, ga, a) in enumerate(centres)
        for ib, lb, gb, b in centres[k + 1 :]
        if ia == ib and la != lb and (a[0] - b[0]) ** 2 + (a[1] - b[1]) ** 2 < least**2
    ]
    assert not hidden, f"{name}: markers of different rows closer than {least:.1f} px (dodge.GAP): {hidden}"
    # an axis with both scales (cost and accuracy ticks) is where a place reads as (cost, accuracy);
    # a strip or an axis of costs alone lacks one of them. A centre on its edge counts as inside.
    areas = [ax.bbox.padded(EDGE_PX) for ax in fig.axes if len(ax.get_xticks()) and len(ax.get_yticks())]
    inside = [
        f"{gid} at ({x:.0f}, {y:.0f}) px"
        for _, _, gid, (x, y) in centres
        if gid.startswith(ONE_VALUE_GIDS) and any(area.contains(x, y) for area in areas)
    ]
    assert not inside, (
        f"{name}: markers of rows with one value inside an axis of cost against accuracy: {inside}"
    )
    for ax in fig.axes:  # error bars move with their marker: the same point lands on the same pixel
        for bars in ax.containers:
            if hasattr(bars, "has_yerr"):
                line, xy = bars.lines[0], bars.lines[0].get_xydata()[0]
                for part in (*bars.lines[1], *bars.lines[2]):
                    assert (part.get_transform().transform(xy) == line.get_transform().transform(xy)).all(), (
                        f"{name}: {line.get_gid()}'s error bars drawn apart from its marker"
                    )


@pytest.mark.parametrize("name", PLOTTED)
def test_rows_on_one_axis_of_the_committed_plot_are_told_apart(name, committed_plot):
    """As drawn from the committed ledger (the constructed one above has every row; this one has
    the rows' real values, so rows that share a run may share a style)."""
    fig, rows, spec = committed_plot(name)
    close = confusable(fig, values_of(rows, spec["plot"]["x"], spec["plot"]["y"]))
    assert not close, (
        f"{name}: rows on one axis with one marker and colours closer than ΔE00 {MIN_DELTA_E}: {close}"
    )


@pytest.mark.parametrize("name", PLOTTED)
def test_no_marker_is_cut_at_its_axes_edge_in_the_committed_plot(name, committed_plot):
    """Every row marker (measured, paper, in a strip, moved on the page or not) lies whole inside
    the window of its axes: none reaches over a spine, where the axes would cut it."""
    fig, _, _ = committed_plot(name)
    cut = cut_markers(fig)
    assert not cut, f"{name}: markers reaching past their axes' window: {cut}"


def test_dodge_keeps_the_first_and_moves_the_next_by_a_gap():
    """A point moves sideways (right, then left), a cost-only marker up; a row's own markers stay."""
    gap = dodge.GAP
    moved = dodge.offsets(
        [
            ("a", "point", (0.0, 0.0)),
            ("b", "point", (1.0, 0.0)),
            ("c", "point", (0.0, 1.0)),
            ("a", "point", (0.0, 0.0)),
            ("d", "xtick", (50.0, 0.0)),
            ("e", "xtick", (51.0, 0.0)),
        ]
    )
    assert moved == [(0.0, 0.0), (gap, 0.0), (-gap, 0.0), (0.0, 0.0), (0.0, 0.0), (0.0, gap)]


def test_a_plot_says_when_a_marker_was_set_apart_from_its_values():
    """Two rows at one point: the second is moved sideways on the page, and the note under the plot
    says so; rows far apart move nothing and the note is absent."""
    spec = {
        "name": "moved",
        "title": "t",
        "columns": [
            {"key": "top1", "label": "Top-1", "unit": "%", "digits": 2},
            {"key": "gmacs", "label": "GMACs", "digits": 3},
        ],
        "plot": {"x": "gmacs", "y": "top1"},
        "rows": [{"label": "a", "experiment": "demo"}, {"label": "b", "experiment": "bspf_demo"}],
    }

    def texts(top1_b: float) -> list[str]:
        runs = [
            {
                "run_id": n,
                "experiment": n,
                "status": "completed",
                "kind": "train",
                "config": {},
                "metrics": {"gmacs": 0.02, "top1": y},
            }
            for n, y in (("demo", 80.0), ("bspf_demo", top1_b))
        ]
        fig = plots.draw(spec, tables.fill(spec, recorded(spec, runs)))
        try:
            return [" ".join(t.get_text().split()) for t in fig.texts]  # the notes are wrapped
        finally:
            plt.close(fig)

    assert any(dodge.MOVED_NOTE in t for t in texts(80.0))
    assert not any(dodge.MOVED_NOTE in t for t in texts(90.0))


@pytest.mark.parametrize("top1_a", [80.0, None])
def test_a_paper_cost_obtained_by_arithmetic_is_marked_in_the_cost_only_strip(top1_a):
    """A paper cost with no paper accuracy stands in the cost-only strip; derived by a formula, it
    carries the derived mark there as a derived point does in the plane (with and without a measured
    point beside it)."""
    spec = {
        "name": "derived_cost",
        "title": "t",
        "columns": [
            {"key": "top1", "label": "Top-1", "unit": "%", "digits": 2},
            {"key": "gmacs", "label": "GMACs", "digits": 3},
        ],
        "plot": {"x": "gmacs", "y": "top1"},
        "rows": [
            {"label": "a", "experiment": "demo"},
            {
                "label": "b",
                "experiment": "bspf_demo",
                "paper": {"gmacs": {"value": 3.0, "source": "s", "derived": True, "formula": "4.6 - 1.6"}},
            },
        ],
    }
    metrics = {"gmacs": 0.02} if top1_a is None else {"gmacs": 0.02, "top1": top1_a}
    runs = [
        {
            "run_id": "demo",
            "experiment": "demo",
            "status": "completed",
            "kind": "train",
            "config": {},
            "metrics": metrics,
        }
    ]
    fig = plots.draw(spec, tables.fill(spec, recorded(spec, runs)))
    try:
        marks = [t for ax in fig.axes for t in ax.texts if t.get_text() == plots.DERIVED_MARK]
    finally:
        plt.close(fig)
    assert len(marks) == 1


def test_a_marker_moved_and_then_left_in_place_is_clipped_again():
    """separate() unclips a moved marker (it may stand past its axes); called again on a layout
    where the marker need not move, the marker is back where it was drawn, clipped as drawn."""
    fig, ax = plt.subplots()
    try:
        a = dodge.Mark("a", "point", ax.plot([0.5], [0.5], "o", clip_on=True))
        b = dodge.Mark("b", "point", ax.plot([0.5], [0.5], "s", clip_on=True))
        ax.set_xlim(0, 1), ax.set_ylim(0, 1)
        drawn = b.artists[0].get_transform()
        dodge.separate([a, b])
        assert b.moved and not b.artists[0].get_clip_on()
        b.artists[0].set_data([0.9], [0.9])  # far from a now: nothing moves
        dodge.separate([a, b])
        assert not b.moved and b.artists[0].get_clip_on() and b.artists[0].get_transform() == drawn
    finally:
        plt.close(fig)
