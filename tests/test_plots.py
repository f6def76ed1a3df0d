"""The table plots (vitexp/report/plots.py) drawn from a constructed ledger: hollow paper markers and
filled measured ones, error bars from seeds, cost-only and accuracy-only rows in strips beside their
axis, one axis per dataset, a style of its own per row (the family's hue, a shade and marker per
row), sweeps joined by a line, a row's seeds in the legend when fewer than asked.
tests/test_plot_styles.py draws every table's plot."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import pytest
from conftest import recorded
from matplotlib.colors import to_rgba

from vitexp.config import rows
from vitexp.report import plots, tables

SPEC = {
    "name": "plots_fixture",
    "title": "Plot fixture",
    "columns": [
        {"key": "top1", "label": "Top-1", "unit": "%", "digits": 1},
        {"key": "gmacs", "label": "GMACs", "unit": "GMACs", "digits": 3},
    ],
    "plot": {"x": "gmacs", "y": "top1"},
    "rows": [
        {"label": "micro baseline", "experiment": "demo", "paper": {}},
        {
            "label": "micro BSPF, seeds",
            "experiment": "fmnist_bspf_vit_micro",
            "seeds": [0, 1, 2],
            "paper": {},
        },
        {"label": "DeiT-S cost only", "experiment": "bspf_deit_small", "paper": {}},
        {
            "label": "EViT 0.7",
            "experiment": "evit_deit_small",
            "overrides": ["budget.keep_ratio=0.7"],
            "name": "evit_deit_small_keep07",
            "paper": {
                "top1": {"value": 79.5, "source": "EViT README"},
                "gmacs": {"value": 3.0, "source": "BSPF-ViT Table 1"},
            },
        },
        {
            "label": "EViT 0.6",
            "experiment": "evit_deit_small",
            "overrides": ["budget.keep_ratio=0.6"],
            "name": "evit_deit_small_keep06",
            "paper": {
                "top1": {"value": 78.9, "source": "EViT README"},
                "gmacs": {"value": 2.6, "source": "BSPF-ViT Table 1"},
            },
        },
        {
            "label": "ToMe r13",
            "experiment": "tome_deit_small",
            "name": "tome_deit_small_r13",
            "paper": {"top1": {"value": 79.4, "source": "ToMe"}},
        },
        {
            "label": "MCTF",
            "cited": True,
            "family": "MCTF",
            "backbone": "deit_small",
            "dataset": "imagenet",
            "paper": {"top1": {"value": 80.1, "source": "MCTF"}, "gmacs": {"value": 2.6, "source": "MCTF"}},
        },
    ],
}
SEEDED_TOP1 = {0: 80.0, 1: 82.0, 2: 84.0}  # sample std 2.0


def _run(i, experiment, metrics, seed=None):
    return {
        "run_id": f"r{i}",
        "experiment": experiment,
        "status": "completed",
        "kind": "train",
        "config": {"seed": seed} if seed is not None else {},
        "metrics": metrics,
    }


def _figure():
    runs = [
        _run(0, "demo", {"top1": 95.0, "gmacs": 0.0226}),
        *(
            _run(1 + s, f"fmnist_bspf_vit_micro+seed={s}", {"top1": t, "gmacs": 0.012}, seed=s)
            for s, t in SEEDED_TOP1.items()
        ),
        _run(5, "bspf_deit_small", {"gmacs": 2.39}),
        _run(6, "evit_deit_small_keep07", {"top1": 79.0, "gmacs": 3.03}),
        _run(7, "evit_deit_small_keep06", {"top1": 78.0, "gmacs": 2.62}),
    ]
    return plots.draw(SPEC, tables.fill(SPEC, recorded(SPEC, runs)))


@pytest.fixture
def artists():
    fig = _figure()
    yield {line.get_gid(): (ax, line) for ax in fig.axes for line in ax.lines if line.get_gid()}, fig
    plt.close(fig)


def test_paper_values_are_hollow_and_measured_values_filled(artists):
    by_gid, _ = artists
    for label in ("EViT 0.7", "EViT 0.6", "MCTF"):
        assert to_rgba(by_gid[f"paper:{label}"][1].get_markerfacecolor())[3] == 0.0, label
    for label in ("micro baseline", "micro BSPF, seeds", "EViT 0.7"):
        line = by_gid[f"vitexp:{label}"][1]
        assert to_rgba(line.get_markerfacecolor())[3] == 1.0, label
        assert to_rgba(line.get_markerfacecolor()) == to_rgba(line.get_markeredgecolor())


def test_error_bars_where_seeds_give_a_std(artists):
    by_gid, fig = artists
    bars = {c.lines[0].get_gid(): c for ax in fig.axes for c in ax.containers}
    seeded = bars["vitexp:micro BSPF, seeds"]
    assert seeded.has_yerr
    (vertical,) = [seg for bars in seeded.lines[2] for seg in bars.get_segments() if seg[0][0] == seg[1][0]]
    assert [y for _, y in vertical] == pytest.approx([82.0 - 2.0, 82.0 + 2.0])  # mean ± 1 sample std
    assert not bars["vitexp:micro baseline"].has_yerr and not bars["vitexp:EViT 0.7"].has_yerr


def test_a_row_with_fewer_seeds_than_asked_says_so_in_the_legend():
    """A seeded row plotted from 1 of its 3 seeds is named "... (1 of 3 seeds)"; with all three,
    or unseeded, by its label alone."""

    def legend(seeds):
        runs = [
            _run(0, "demo", {"top1": 95.0, "gmacs": 0.0226}),
            *(
                _run(
                    1 + s, f"fmnist_bspf_vit_micro+seed={s}", {"top1": SEEDED_TOP1[s], "gmacs": 0.012}, seed=s
                )
                for s in seeds
            ),
        ]
        fig = plots.draw(SPEC, tables.fill(SPEC, recorded(SPEC, runs)))
        (box,) = [ax.get_legend() for ax in fig.axes if ax.get_legend()]
        texts = [t.get_text().replace("\n", " ") for t in box.get_texts()]
        plt.close(fig)
        return texts

    partial, full = legend([1]), legend([0, 1, 2])
    assert "micro BSPF, seeds (1 of 3 seeds)" in partial and "micro baseline" in partial
    assert "micro BSPF, seeds" in full and not any("of 3 seeds" in t for t in full)
    assert "micro BSPF, seeds (2 of 3 seeds)" in legend([0, 2])


def test_rows_with_one_value_are_in_strips_beside_their_axis(artists):
    """A cost without accuracy: at its cost in a strip under the axis (sharing its cost axis, no
    accuracy scale); a paper accuracy without cost: at its accuracy in a strip left of it, hollow."""
    by_gid, fig = artists
    assert "vitexp:DeiT-S cost only" not in by_gid
    main, _ = by_gid["paper:MCTF"]
    strip, tick = by_gid["tick-vitexp:DeiT-S cost only"]
    assert strip is not main and strip.get_shared_x_axes().joined(strip, main) and not len(strip.get_yticks())
    assert list(tick.get_xdata()) == [2.39] and strip.get_ylabel() == "cost only"
    assert strip.get_position().y1 <= main.get_position().y0  # under the axis
    assert tick.get_marker() != "none" and to_rgba(tick.get_markerfacecolor())[3] == 1.0
    strip, accuracy = by_gid["ytick-paper:ToMe r13"]
    assert strip is not main and strip.get_shared_y_axes().joined(strip, main) and not len(strip.get_xticks())
    assert list(accuracy.get_ydata()) == [79.4] and strip.get_position().x1 <= main.get_position().x0
    assert to_rgba(accuracy.get_markerfacecolor())[3] == 0.0
    assert "Top-1 (%)" == strip.get_ylabel() and main.get_ylabel() == ""  # the strip carries the scale
    (other,) = [ax for ax in fig.axes if ax.get_title() == "Fashion-MNIST"]
    assert not [
        ax for ax in fig.axes if ax.get_shared_x_axes().joined(ax, other) and ax is not other
    ]  # no strip


def test_one_axis_per_dataset_and_a_style_per_row_in_its_familys_hue(artists):
    by_gid, fig = artists
    titles = [ax.get_title() for ax in fig.axes if ax.get_title()]  # strips have none
    assert titles == ["digits (scikit-learn)", "Fashion-MNIST", "ImageNet-1K"]
    panel = {}  # axis -> its panel's title: a strip's is that of the titled axis it shares a scale with
    for ax in fig.axes:
        panel[ax] = next(
            p.get_title()
            for p in fig.axes
            if p.get_title()
            and (p is ax or p.get_shared_x_axes().joined(p, ax) or p.get_shared_y_axes().joined(p, ax))
        )
    axis_of = {gid.split(":", 1)[1]: panel[ax] for gid, (ax, _) in by_gid.items()}
    assert (
        axis_of["micro baseline"] == "digits (scikit-learn)"
        and axis_of["micro BSPF, seeds"] == "Fashion-MNIST"
    )
    assert {axis_of[k] for k in ("DeiT-S cost only", "EViT 0.7", "MCTF", "ToMe r13")} == {"ImageNet-1K"}
    colour = {gid: to_rgba(line.get_markeredgecolor()) for gid, (_, line) in by_gid.items()}
    marker = {gid: line.get_marker() for gid, (_, line) in by_gid.items() if not gid.startswith("sweep")}
    # the first row of a family has the family's hue; the next one a shade of it and another marker
    assert colour["vitexp:EViT 0.7"] == colour["paper:EViT 0.7"] == to_rgba(plots.FAMILY_COLOURS["EViT"])
    assert (
        colour["paper:EViT 0.6"] != colour["paper:EViT 0.7"]
        and marker["paper:EViT 0.6"] != marker["paper:EViT 0.7"]
    )
    assert colour["vitexp:micro BSPF, seeds"] == to_rgba(plots.FAMILY_COLOURS["BSPF-ViT"])
    assert (colour["tick-vitexp:DeiT-S cost only"], marker["tick-vitexp:DeiT-S cost only"]) != (
        colour["vitexp:micro BSPF, seeds"],
        marker["vitexp:micro BSPF, seeds"],
    )  # BSPF-ViT twice: two styles
    assert len({colour["paper:MCTF"], colour["vitexp:EViT 0.7"], colour["vitexp:micro baseline"]}) == 3


def test_rows_of_one_base_that_differ_only_in_budget_overrides_are_one_sweep():
    """Table 7's keep ratios are rows of one base experiment with budget.keep_ratio overrides (and
    the base itself at 0.5): one sweep; rows that also differ in another override are not in it."""
    assert plots.sweeps(tables.load_spec("bspf_table7")["rows"]) == ["sweep 1"] * 7
    base = {"label": "b", "experiment": "bspf_deit_small"}
    other = {**base, "overrides": ["method.symmetric=true", "budget.keep_ratio=0.3"]}
    assert plots.sweeps([base, other]) == [None, None]


def test_a_sweep_is_joined_by_a_line_and_the_legend_stays_short(artists):
    by_gid, fig = artists
    (name,) = {g.split(":", 1)[1] for g in by_gid if g.startswith("sweep-")}
    _, measured = by_gid[f"sweep-vitexp:{name}"]
    assert list(zip(measured.get_xdata(), measured.get_ydata())) == [(2.62, 78.0), (3.03, 79.0)]
    assert measured.get_linestyle() == "-" and by_gid[f"sweep-paper:{name}"][1].get_linestyle() == "--"
    (legend,) = [ax.get_legend() for ax in fig.axes if ax.get_legend()]
    labels = [t.get_text() for t in legend.get_texts()]
    assert [row["label"] for row in SPEC["rows"]] == labels[: len(SPEC["rows"])]  # every row, by name
    assert {"paper", "vitexp (measured) ± 1 std over seeds"} <= set(labels)
    assert len(labels) <= len(SPEC["rows"]) + 5


def test_a_table_of_costs_alone_is_never_an_empty_frame():
    spec = tables.load_spec("bspf_table7")
    runs = [_run(i, rows.row_name(row), {"gmacs": 2.0 + 0.25 * i}) for i, row in enumerate(spec["rows"])]
    fig = plots.draw(spec, tables.fill(spec, recorded(spec, runs)))
    (ax,) = fig.axes
    ticks = [line for line in ax.lines if (line.get_gid() or "").startswith("tick-vitexp:")]
    assert len(ticks) == len(spec["rows"]) == 7
    assert [t.get_text() for t in ax.texts] == [row["label"] for row in spec["rows"]]  # ticks named
    assert 1.5 < ax.get_xlim()[0] < 2.0 and 3.5 < ax.get_xlim()[1] < 4.0  # the costs' range, not from 0
    assert "not run" in ax.get_title()  # no measured accuracy: the panel says so
    plt.close(fig)


def test_a_rows_overrides_set_its_family():
    """A grid row's overrides change its experiment's method or selection, and so its colour."""
    from vitexp.report.plots import row_identity

    assert row_identity({"experiment": "saper_micro"})["family"] == "SAPER"
    assert (
        row_identity({"experiment": "saper_micro", "overrides": ["method=probe", "budget=none"]})["family"]
        == "baseline"
    )
    picked = row_identity(
        {"experiment": "saper_micro", "overrides": ["method=saper_kd", "method.selection=random"]}
    )
    assert picked == {"family": "heads: random", "backbone": "dinov2_micro", "dataset": "digits"}


def test_panels_split_an_axis_and_a_panel_less_row_is_on_each():
    """SAPER's probe and k-NN accuracies are not comparable: the spec's ``panel`` puts them on
    separate axes of one dataset; a row without a panel (here the pretrained model, its panel
    taken away) is on both."""
    spec = tables.load_spec("fmnist_saper_table1")
    assert spec["rows"][0]["panel"] == "fine-tune (linear probe)"
    del spec["rows"][0]["panel"]
    unseeded = [("seeds" in row and row["seeds"] is None) for row in spec["rows"]]
    runs = [
        _run(
            i,
            tables.row_name(row) if once else f"{tables.row_name(row)}+seed=0",
            {"top1": 50.0 + i, "gflops": 0.006 + i / 1e4},
            seed=None if once else 0,
        )
        for i, (row, once) in enumerate(zip(spec["rows"], unseeded))
    ]
    fig = plots.draw(spec, tables.fill(spec, recorded(spec, runs)))
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == ["Fashion-MNIST: fine-tune (linear probe)", "Fashion-MNIST: distill (k-NN)"]
    drawn = {
        ax.get_title(): {
            line.get_gid().split(":", 1)[1]
            for line in ax.lines
            if (line.get_gid() or "").startswith("vitexp:")
        }
        for ax in fig.axes
    }
    probe, knn = drawn[titles[0]], drawn[titles[1]]
    pretrained = spec["rows"][0]["label"]
    assert pretrained in probe and pretrained in knn
    assert "unpruned, linear probe (16 heads)" in probe and "unpruned, linear probe (16 heads)" not in knn
    assert "SAPER distill (k-NN), k = 6" in knn and "SAPER distill (k-NN), k = 6" not in probe
    assert len(probe) + len(knn) == len(spec["rows"]) + 1  # every row once, the pretrained one twice
    plt.close(fig)
